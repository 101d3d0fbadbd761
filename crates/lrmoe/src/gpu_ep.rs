//! The model's MoE layers through the device expert-parallel executor
//! (`lrmoe launch --nproc N -- train --device cuda --executor device`).
//!
//! Each launched rank runs its MoE layer calls on its GPU with
//! `kernels::gpu::Gpu::ep_forward_host` / `ep_backward_host`: router,
//! top-k, an NCCL all-to-all of the rows to their experts' owners (experts
//! in contiguous blocks), grouped SwiGLU GEMMs, the rows back and combined
//! — every pair computed. The plan comes from the layer crate
//! (`layer::DevicePlanner`: the host executor's `plan_call` on every
//! source's routed counts — replicas of the hottest experts when
//! `replica_slots_per_rank > 0`, per-expert selection, the controller under
//! budgets — and `redistribute`'s exact solver spreading the forward's
//! pairs and the backward's kept pairs over the instances), so the backward
//! keeps each expert's best `q_e` pairs over all sources, exchanges and
//! multiplies only those on the instances the plan names, and the router
//! gradient stays complete. Only counts cross to the host for the plan.
//! The forced hot-expert workload is a router logit bias on the device.
//!
//! The model keeps f32 master weights and AdamW on the host: the router and
//! this rank's experts are uploaded as bf16 each call, and the owners'
//! expert gradients are all-gathered so every rank holds every expert's
//! gradient (as the host layer does).
//!
//! Not on this executor: per-source send budgets (per-source selection)
//! and the capacity-factor baseline (refused with a one-line error).

use kernels::cpu::{from_bf16, to_bf16, Real};
use kernels::gpu::{EpHostForward, Gpu};
use layer::transport::all_gather;
use layer::{BackwardStats, CallConfig, CallPlan, ExpertWeights, MoeConfig, MoeParams, Transport};

use crate::model::ModelError;

/// This rank's GPU and its NCCL communicator.
#[derive(Clone, Copy)]
pub struct EpDevice<'a> {
    /// The GPU (`LOCAL_RANK`).
    pub gpu: &'a Gpu,
    /// The launched group's communicator.
    pub comm: &'a kernels::comm::NcclComm,
}

impl std::fmt::Debug for EpDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EpDevice")
    }
}

/// The device executor's settings check (`layer::check_device_call`; per-
/// source send budgets are refused by the plan).
pub fn check(cfg: &MoeConfig, call: &CallConfig) -> Result<(), ModelError> {
    layer::check_device_call(call)?;
    cfg.device_shape(0).check()?;
    Ok(())
}

/// What the forward keeps for the backward.
#[derive(Debug)]
pub struct EpSavedHost {
    fwd: EpHostForward,
    call: CallConfig,
    /// The plan of this call (identical on every rank).
    pub plan: CallPlan,
}

/// This rank's block of experts: `[lo, hi)`.
fn block(cfg: &MoeConfig, rank: usize, world: usize) -> (usize, usize) {
    let el = cfg.n_experts / world.max(1);
    (rank * el, (rank + 1) * el)
}

/// Forward of one MoE layer through the device EP executor; `x` is this
/// rank's `tokens × hidden`.
pub fn forward<T: Real>(
    dev: EpDevice<'_>,
    cfg: &MoeConfig,
    call: &CallConfig,
    p: &MoeParams<T>,
    x: &[T],
) -> Result<(Vec<T>, EpSavedHost), ModelError> {
    check(cfg, call)?;
    let (rank, world) = (dev.comm.rank(), dev.comm.world_size());
    if cfg.n_experts % world != 0 {
        return Err(ModelError::Config(format!(
            "the device EP executor owns experts in equal blocks: {} experts on {world} ranks",
            cfg.n_experts
        )));
    }
    let (lo, hi) = block(cfg, rank, world);
    let cat = |sel: fn(&ExpertWeights<T>) -> &Vec<T>| -> Vec<u16> {
        p.experts[lo..hi]
            .iter()
            .flat_map(|e| to_bf16(sel(e)))
            .collect()
    };
    let s = cfg.device_shape(x.len() / cfg.hidden);
    let planner = layer::DevicePlanner::new(*cfg, call.clone())?;
    let bias: Option<Vec<f32>> = (call.hot_experts > 0 && call.hot_bias != 0.0).then(|| {
        (0..cfg.n_experts)
            .map(|e| {
                if e < call.hot_experts {
                    call.hot_bias as f32
                } else {
                    0.0
                }
            })
            .collect()
    });
    let fwd = dev.gpu.ep_forward_host(
        dev.comm,
        &s,
        &to_bf16(&p.router),
        (&cat(|e| &e.gate), &cat(|e| &e.up), &cat(|e| &e.down)),
        &to_bf16(x),
        bias.as_deref(),
        &planner,
    )?;
    let plan = match planner.take_last_plan() {
        Some(p) => p,
        None => layer::device_plan_call(cfg, call, &fwd.counts)?,
    };
    let y = from_bf16(&fwd.y);
    if y.iter().any(|v: &T| !v.is_finite()) {
        return Err(ModelError::NonFinite("device EP MoE output"));
    }
    Ok((
        y,
        EpSavedHost {
            fwd,
            call: call.clone(),
            plan,
        },
    ))
}

/// LRMoE backward of one MoE layer through the device EP executor: the
/// plan's per-expert quotas, the kept pairs redistributed over the call's
/// instances, replica gradients summed into their owners'. `comm` is the model's transport (the same
/// ranks), used to all-gather the owners' expert gradients.
pub fn backward<T: Real, X: Transport>(
    dev: EpDevice<'_>,
    comm: &X,
    cfg: &MoeConfig,
    saved: &EpSavedHost,
    dy: &[T],
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), ModelError> {
    let planner = layer::DevicePlanner::new(*cfg, saved.call.clone())?;
    let clock = std::time::Instant::now();
    let g = dev
        .gpu
        .ep_backward_host(dev.comm, &saved.fwd, &to_bf16(dy), &planner)?;
    let (h, f) = (cfg.hidden, cfg.ffn);
    // Every rank gets every owner's expert gradients (f32, owner order).
    let mine: Vec<f32> = [&g.gate, &g.up, &g.down]
        .iter()
        .flat_map(|v| from_bf16::<f32>(v))
        .collect();
    let all = all_gather(comm, &mine)?;
    let el = cfg.n_experts / comm.world_size().max(1);
    let mut experts = Vec::with_capacity(cfg.n_experts);
    for owner in &all {
        let (gate, rest) = owner.split_at(el * h * f);
        let (up, down) = rest.split_at(el * h * f);
        for e in 0..el {
            let t = |v: &[f32], n: usize| -> Vec<T> {
                v[e * n..(e + 1) * n]
                    .iter()
                    .map(|&x| T::of(f64::from(x)))
                    .collect()
            };
            experts.push(ExpertWeights {
                gate: t(gate, h * f),
                up: t(up, h * f),
                down: t(down, f * h),
            });
        }
    }
    let grads = MoeParams {
        router: g.router.iter().map(|&x| T::of(f64::from(x))).collect(),
        experts,
    };
    let figures = crate::gpu_moe::DeviceFigures {
        routed_pairs: saved.fwd.shape.pairs(),
        kept_pairs: g.kept_pairs,
        buffer_bytes: (g.kept_pairs * 2 * h * 2) as u64,
        bytes_sent: g.bytes_sent as u64,
        seconds: clock.elapsed().as_secs_f64(),
    };
    crate::gpu_moe::device_backward_result(&g.dx, grads, &figures, "device EP MoE input gradient")
}
