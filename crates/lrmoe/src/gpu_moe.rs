//! The model's MoE layers on one GPU (`lrmoe train --device cuda`).
//!
//! Each MoE layer call uploads the layer's weights and input as bf16 (the
//! model keeps f32 master weights and AdamW state on the host), runs the
//! CUDA layer (`kernels::gpu::Gpu::moe_forward_host`: router, top-k,
//! grouped SwiGLU experts, combine — every pair computed), and brings the
//! output back. The controller plans the call from the routed counts the
//! forward returns (`layer::plan_call`, the CPU layer's own planner, with
//! one rank), and the backward runs the GPU's LRMoE backward with those
//! per-expert quotas (scores, top-q selection, compaction, grouped GEMMs on
//! kept rows), returning bf16 gradients that become f32 again here.
//!
//! Not here: the dense transformer parts (attention, norms, embeddings, LM
//! head) stay on the CPU; expert parallelism across GPUs (one GPU, EP = 1);
//! the capacity-factor baseline and the forced hot-expert bias (the GPU
//! router has neither — both are refused with an error).

use kernels::cpu::{from_bf16, to_bf16, Real};
use kernels::gpu::{Gpu, MoeHostForward};
use layer::{BackwardStats, CallConfig, CallPlan, ExpertWeights, MoeConfig, MoeParams};
use quota::Placement;

use crate::model::ModelError;

/// Refuses what the GPU layer cannot run, before any work.
pub fn check(cfg: &MoeConfig, call: &CallConfig) -> Result<(), ModelError> {
    layer::check_device_call(call)?;
    if call.hot_experts > 0 && call.hot_bias != 0.0 {
        return Err(ModelError::Config(
            "the forced hot-expert bias has no GPU path (train it with --device cpu)".into(),
        ));
    }
    cfg.device_shape(0).check()?;
    Ok(())
}

/// What the GPU forward keeps for the backward.
#[derive(Debug)]
pub struct GpuSaved {
    fwd: MoeHostForward,
    /// The controller's plan for this call (one rank).
    pub plan: CallPlan,
    /// Priority sampling's seed for this call (`None`: top-q).
    priority_seed: Option<u64>,
}

/// Forward of one MoE layer on the GPU; `x` is `tokens × hidden`.
pub fn forward<T: Real>(
    gpu: &Gpu,
    cfg: &MoeConfig,
    call: &CallConfig,
    p: &MoeParams<T>,
    x: &[T],
) -> Result<(Vec<T>, GpuSaved), ModelError> {
    check(cfg, call)?;
    let s = cfg.device_shape(x.len() / cfg.hidden);
    let cat = |sel: fn(&ExpertWeights<T>) -> &Vec<T>| -> Vec<u16> {
        p.experts.iter().flat_map(|e| to_bf16(sel(e))).collect()
    };
    let fwd = gpu.moe_forward_host(
        &s,
        &to_bf16(&p.router),
        &cat(|e| &e.gate),
        &cat(|e| &e.up),
        &cat(|e| &e.down),
        &to_bf16(x),
    )?;
    let routed = vec![fwd.counts.iter().map(|&c| u64::from(c)).collect()];
    let placement = Placement {
        owner: vec![0; cfg.n_experts],
        replicas: vec![],
    };
    let plan = layer::plan_call::<f32>(cfg, call, routed, &placement)?;
    let y = from_bf16(&fwd.y);
    if y.iter().any(|v: &T| !v.is_finite()) {
        return Err(ModelError::NonFinite("GPU MoE output"));
    }
    let priority_seed = plan.priority_seed(call);
    Ok((
        y,
        GpuSaved {
            fwd,
            plan,
            priority_seed,
        },
    ))
}

/// LRMoE backward of one MoE layer on the GPU with the plan's quotas.
pub fn backward<T: Real>(
    gpu: &Gpu,
    cfg: &MoeConfig,
    saved: &GpuSaved,
    dy: &[T],
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), ModelError> {
    // One GPU holds every source's pairs: its per-expert selection is the
    // host layer's `Selection::PerExpert`.
    let quotas = saved.plan.device_quotas();
    let clock = std::time::Instant::now();
    let g = gpu.moe_backward_host(&saved.fwd, &to_bf16(dy), &quotas, saved.priority_seed)?;
    let (h, f) = (cfg.hidden, cfg.ffn);
    let grads = MoeParams {
        router: from_bf16(&g.router),
        experts: (0..cfg.n_experts)
            .map(|e| ExpertWeights {
                gate: from_bf16(&g.gate[e * h * f..(e + 1) * h * f]),
                up: from_bf16(&g.up[e * h * f..(e + 1) * h * f]),
                down: from_bf16(&g.down[e * f * h..(e + 1) * f * h]),
            })
            .collect(),
    };
    let routed: usize = saved.fwd.counts.iter().map(|&c| c as usize).sum();
    let figures = DeviceFigures {
        routed_pairs: routed,
        kept_pairs: g.kept_pairs,
        buffer_bytes: g.kept_row_bytes,
        bytes_sent: 0,
        seconds: clock.elapsed().as_secs_f64(),
    };
    device_backward_result(&g.dx, grads, &figures, "GPU MoE input gradient")
}

/// What a device backward reports about one call on this rank.
pub(crate) struct DeviceFigures {
    pub routed_pairs: usize,
    pub kept_pairs: usize,
    pub buffer_bytes: u64,
    pub bytes_sent: u64,
    pub seconds: f64,
}

/// A device backward's input gradient (bf16 bits) as `T`, checked finite,
/// with its gradients and figures in the host layer's form.
pub(crate) fn device_backward_result<T: Real>(
    dx_bits: &[u16],
    grads: MoeParams<T>,
    f: &DeviceFigures,
    what: &'static str,
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), ModelError> {
    let dx = from_bf16(dx_bits);
    if dx.iter().any(|v: &T| !v.is_finite()) {
        return Err(ModelError::NonFinite(what));
    }
    let stats = BackwardStats {
        routed_pairs: f.routed_pairs,
        kept_pairs: f.kept_pairs,
        kept: vec![],
        scores: vec![],
        pairs_per_rank: vec![f.kept_pairs as u64],
        buffer_bytes: f.buffer_bytes,
        bytes_sent: f.bytes_sent,
        times: layer::StageTimes {
            gemm: f.seconds,
            ..layer::StageTimes::default()
        },
    };
    Ok((dx, grads, stats))
}
