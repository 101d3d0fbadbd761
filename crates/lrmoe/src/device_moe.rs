//! The model's MoE layers through the layer crate's device executor
//! (`lrmoe train --device cuda`: one GPU, EP = 1; `lrmoe launch --nproc N
//! -- train --device cuda --executor device`: one GPU per launched rank,
//! NCCL between them).
//!
//! Each MoE layer call runs on the rank's GPU with
//! `layer::device::forward_host` / `backward_host`: router, top-k, the rows
//! sent to their experts' instances (an NCCL all-to-all; with one GPU the
//! exchange hands the buffer through), grouped SwiGLU GEMMs, the rows back
//! and combined — every pair computed. The plan comes from
//! `layer::DevicePlanner` (the host executor's `plan_call` on every
//! source's routed counts — replicas of the hottest experts when
//! `replica_slots_per_rank > 0`, per-expert selection, the controller under
//! budgets — and `redistribute`'s exact solver spreading the forward's
//! pairs and the backward's kept pairs over the instances), so the backward
//! keeps each expert's best `q_e` pairs over all sources (or priority
//! samples them), exchanges and multiplies only those on the instances the
//! plan names, and the router gradient stays complete. Only counts cross to
//! the host for the plan. The forced hot-expert workload is a router logit
//! bias on the device.
//!
//! The model keeps f32 master weights and AdamW on the host: the router and
//! this rank's experts are uploaded as bf16 each call, and the owners'
//! expert gradients are all-gathered so every rank holds every expert's
//! gradient (as the host layer does).
//!
//! Not on this executor: per-source send budgets (per-source selection)
//! and the random and proportional selection rules (each refused with a
//! one-line error). The capacity-factor baseline, the auxiliary balancing
//! loss and the auxiliary-loss-free balancing bias run on the device.

use kernels::cpu::{from_bf16, to_bf16, Real};
use kernels::gpu::Gpu;
use layer::device::{DeviceComm, HostForward};
use layer::transport::all_gather;
use layer::{BackwardStats, CallConfig, CallPlan, ExpertWeights, MoeConfig, MoeParams, Transport};

use crate::model::ModelError;

/// This rank's GPU and how it reaches the other ranks.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRun<'a> {
    /// The GPU (`LOCAL_RANK`, or 0).
    pub gpu: &'a Gpu,
    /// `DeviceComm::Local` on one GPU, the launched group's NCCL
    /// communicator otherwise.
    pub comm: DeviceComm<'a>,
}

/// The device executor's settings check (`layer::check_device_call`,
/// `layer::check_device_shape`; per-source send budgets are refused by the
/// plan).
pub fn check(cfg: &MoeConfig, call: &CallConfig) -> Result<(), ModelError> {
    layer::check_device_call(call)?;
    layer::check_device_shape(cfg)?;
    Ok(())
}

/// What the forward keeps for the backward.
#[derive(Debug)]
pub struct DeviceSavedHost {
    fwd: HostForward,
    call: CallConfig,
    /// The plan of this call (identical on every rank).
    pub plan: CallPlan,
}

impl DeviceSavedHost {
    /// This rank's auxiliary balancing loss of the call (0 when off).
    pub fn aux_loss(&self) -> f64 {
        self.fwd.aux_loss
    }
}

/// Forward of one MoE layer through the device executor; `x` is this
/// rank's `tokens × hidden`.
pub fn forward<T: Real>(
    dev: DeviceRun<'_>,
    cfg: &MoeConfig,
    call: &CallConfig,
    p: &MoeParams<T>,
    x: &[T],
) -> Result<(Vec<T>, DeviceSavedHost), ModelError> {
    check(cfg, call)?;
    let (rank, world) = (dev.comm.rank(), dev.comm.world_size());
    if cfg.n_experts % world != 0 {
        return Err(ModelError::Config(format!(
            "the device executor owns experts in equal blocks: {} experts on {world} ranks",
            cfg.n_experts
        )));
    }
    let el = cfg.n_experts / world;
    let (lo, hi) = (rank * el, (rank + 1) * el);
    let cat = |sel: fn(&ExpertWeights<T>) -> &Vec<T>| -> Vec<u16> {
        p.experts[lo..hi]
            .iter()
            .flat_map(|e| to_bf16(sel(e)))
            .collect()
    };
    let planner = layer::DevicePlanner::new(*cfg, call.clone())?;
    let bias: Option<Vec<f32>> = call
        .logit_bias(cfg.n_experts)?
        .map(|b| b.iter().map(|&v| v as f32).collect());
    let sel_bias: Option<Vec<f32>> = call
        .selection_bias(cfg.n_experts)?
        .map(|b| b.iter().map(|&v| v as f32).collect());
    let fwd = layer::device::forward_host(
        dev.gpu,
        dev.comm,
        cfg,
        &to_bf16(&p.router),
        (&cat(|e| &e.gate), &cat(|e| &e.up), &cat(|e| &e.down)),
        &to_bf16(x),
        (bias.as_deref(), sel_bias.as_deref()),
        &planner,
    )?;
    let plan = match planner.take_last_plan() {
        Some(p) => p,
        None => layer::device_plan_call(cfg, call, &fwd.counts)?,
    };
    let y = from_bf16(&fwd.y);
    if y.iter().any(|v: &T| !v.is_finite()) {
        return Err(ModelError::NonFinite("device MoE output"));
    }
    Ok((
        y,
        DeviceSavedHost {
            fwd,
            call: call.clone(),
            plan,
        },
    ))
}

/// LRMoE backward of one MoE layer through the device executor: the plan's
/// per-expert quotas, the kept pairs redistributed over the call's
/// instances, replica gradients summed into their owners'. `comm` is the
/// model's transport (the same ranks), used to all-gather the owners'
/// expert gradients.
pub fn backward<T: Real, X: Transport>(
    dev: DeviceRun<'_>,
    comm: &X,
    cfg: &MoeConfig,
    saved: &DeviceSavedHost,
    dy: &[T],
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), ModelError> {
    let planner = layer::DevicePlanner::new(*cfg, saved.call.clone())?;
    let clock = std::time::Instant::now();
    let g = layer::device::backward_host(dev.gpu, dev.comm, &saved.fwd, &to_bf16(dy), &planner)?;
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
    let dx = from_bf16(&g.dx);
    if dx.iter().any(|v: &T| !v.is_finite()) {
        return Err(ModelError::NonFinite("device MoE input gradient"));
    }
    let stats = BackwardStats {
        expert_load: (0..cfg.n_experts)
            .map(|e| saved.fwd.counts.iter().map(|c| u64::from(c[e])).sum())
            .collect(),
        routed_pairs: saved.fwd.tokens * cfg.top_k,
        kept_pairs: g.kept_pairs,
        kept: vec![],
        scores: vec![],
        pairs_per_rank: vec![g.kept_pairs as u64],
        buffer_bytes: (g.kept_pairs * 2 * h * 2) as u64,
        bytes_sent: g.bytes_sent as u64,
        times: layer::StageTimes {
            gemm: clock.elapsed().as_secs_f64(),
            ..layer::StageTimes::default()
        },
    };
    Ok((dx, grads, stats))
}
