//! Host-side entry points over the device executor (host rows in and out,
//! for tests and the CLI) and the layer benchmark.

use kernels::cpu::random_bf16;
use kernels::gpu::Gpu;

use crate::config::shape;
use crate::config::{Experts, MoeConfig};
use crate::plan::DevicePlanner;
use crate::LayerError;

use super::backend::Device;
use super::calls::{backward, forward};
use super::weights::{random_weights, set_logit_bias, set_selection_bias, weights};
use super::{DeviceComm, HostForward, HostGrads};
use crate::stages::common::world_of;

/// The forward from host data (bf16 bits): this rank's router copy, its
/// experts' block and its tokens in; this rank's output, every source's
/// routed counts and the call's plan out; the device state stays for
/// [`backward_host`]. Weights are uploaded each call; `router_bias` (one
/// per expert) is [`set_logit_bias`], `selection_bias`
/// [`set_selection_bias`].
#[allow(clippy::too_many_arguments)]
pub fn forward_host(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: &[u16],
    experts: (&[u16], &[u16], &[u16]),
    x: &[u16],
    (router_bias, selection_bias): (Option<&[f32]>, Option<&[f32]>),
    planner: &DevicePlanner,
) -> Result<HostForward, LayerError> {
    let mut w = weights(gpu, comm, cfg, router, experts)?;
    if let Some(b) = router_bias {
        set_logit_bias(gpu, cfg, &mut w, b)?;
    }
    if let Some(b) = selection_bias {
        set_selection_bias(gpu, cfg, &mut w, b)?;
    }
    if x.len() % cfg.hidden != 0 {
        return Err(LayerError::Shape {
            what: "x (tokens × hidden)".into(),
            expected: x.len() / cfg.hidden * cfg.hidden,
            got: x.len(),
        });
    }
    let tokens = x.len() / cfg.hidden;
    let xd = gpu.upload(x)?;
    let sv = forward(gpu, comm, cfg, &w, &xd, planner)?;
    let y = gpu.download(&sv.y, tokens * cfg.hidden)?;
    Ok(HostForward {
        y,
        counts: sv.routed_counts().to_vec(),
        plan: sv.plan().clone(),
        bytes_sent: sv.bytes_sent,
        tokens,
        aux_loss: sv.aux_loss,
        state: Box::new((w, sv)),
    })
}

/// The LRMoE backward of a host-driven forward (the same planner's
/// redistribution), gradients copied back.
pub fn backward_host(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    fwd: &HostForward,
    dy: &[u16],
    planner: &DevicePlanner,
) -> Result<HostGrads, LayerError> {
    let (w, sv) = (&fwd.state.0, &fwd.state.1);
    let cfg = &sv.cfg;
    shape("dy", fwd.tokens * cfg.hidden, dy.len())?;
    let dyd = gpu.upload(dy)?;
    let g = backward(gpu, comm, w, sv, &dyd, planner)?;
    let (t, h, e) = (fwd.tokens, cfg.hidden, cfg.n_experts);
    let ew = sv.per_rank * h * cfg.ffn;
    Ok(HostGrads {
        dx: gpu.download(&g.dx, t * h)?,
        router: gpu.download(&g.router, h * e)?,
        experts: Experts {
            gate: gpu.download(&g.experts.gate, ew)?,
            up: gpu.download(&g.experts.up, ew)?,
            down: gpu.download(&g.experts.down, ew)?,
        },
        kept_pairs: g.kept_pairs,
        forward_rows: g.forward_rows,
        kept_total: g.kept_total,
        bytes_sent: g.bytes_sent,
    })
}

/// Host copies of one forward + backward on one rank.
#[derive(Debug, Clone)]
pub struct HostResult {
    /// Output of this rank's tokens (bf16 bits).
    pub y: Vec<u16>,
    /// The gradients and figures of the backward.
    pub grads: HostGrads,
    /// Bytes sent to other ranks in the forward.
    pub forward_bytes: usize,
}

/// Forward and LRMoE backward from host data (bf16 bits), copied back:
/// `x`, `dy` this rank's tokens, `experts` this rank's block.
#[allow(clippy::too_many_arguments)]
pub fn host_call(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: &[u16],
    experts: (&[u16], &[u16], &[u16]),
    x: &[u16],
    dy: &[u16],
    planner: &DevicePlanner,
) -> Result<HostResult, LayerError> {
    let fwd = forward_host(gpu, comm, cfg, router, experts, x, (None, None), planner)?;
    let grads = backward_host(gpu, comm, &fwd, dy, planner)?;
    Ok(HostResult {
        y: fwd.y,
        grads,
        forward_bytes: fwd.bytes_sent,
    })
}

/// One row of the device layer benchmark (this rank's view).
#[derive(Debug, Clone, Copy)]
pub struct BenchRow {
    /// The caller's label (a retention).
    pub retention: f64,
    /// Median forward wall time, ms (planning and replica weights included).
    pub forward_ms: f64,
    /// Median backward wall time, ms (host round trips included).
    pub backward_ms: f64,
    /// Kept pairs this rank's instances processed.
    pub kept_pairs: usize,
    /// Kept pairs over all ranks.
    pub kept_total: usize,
    /// Bytes this rank sent in the backward.
    pub bytes_sent: usize,
    /// Peak device memory of one forward + backward above what was in use
    /// before it (bytes, by `cuMemGetInfo` after trimming the pool: what
    /// the pool reserved, fragmentation included).
    pub peak_bytes: u64,
    /// The same call's most bytes held at once in buffers (the pool's
    /// high-water mark of memory in use, `Gpu::pool_peak_bytes`).
    pub peak_used_bytes: u64,
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times the layer on random data (`iters` calls after 2 warm-ups, median
/// wall time, every rank in step), one row per `(label, planner)`, for
/// `tokens` tokens per rank. `hot` is added to the router logits of rank
/// 0's experts (the PyTorch peer's `--hot`: rank 0 receives most pairs).
pub fn bench(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    tokens: usize,
    planners: &[(f64, &DevicePlanner)],
    hot: f32,
    iters: usize,
) -> Result<Vec<BenchRow>, LayerError> {
    let (_, _, el) = world_of(&Device::new(gpu, comm), cfg)?;
    let (t, h, e, r) = (tokens, cfg.hidden, cfg.n_experts, comm.rank() as u64);
    let mut w = random_weights(gpu, comm, cfg)?;
    if hot != 0.0 {
        let bias: Vec<f32> = (0..e).map(|i| if i < el { hot } else { 0.0 }).collect();
        set_logit_bias(gpu, cfg, &mut w, &bias)?;
    }
    let x = gpu.upload(&random_bf16(t * h, 35 + 8 * r))?;
    let dy = gpu.upload(&random_bf16(t * h, 36 + 8 * r))?;
    let timed = |f: &mut dyn FnMut() -> Result<(), LayerError>| -> Result<f64, LayerError> {
        let mut v = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            gpu.sync()?;
            let start = std::time::Instant::now();
            f()?;
            gpu.sync()?;
            if i >= 2 {
                v.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(median(v))
    };
    let mut rows = Vec::new();
    for &(label, planner) in planners {
        gpu.trim_pool()?;
        let before = gpu.used_bytes()?;
        let in_use = gpu.pool_reset_peak()?;
        let sv = forward(gpu, comm, cfg, &w, &x, planner)?;
        let last = backward(gpu, comm, &w, &sv, &dy, planner)?;
        gpu.sync()?;
        let peak = gpu.used_bytes()?.saturating_sub(before);
        let peak_used = gpu.pool_peak_bytes()?.saturating_sub(in_use);
        drop(last);
        drop(sv);
        let fwd = timed(&mut || forward(gpu, comm, cfg, &w, &x, planner).map(|_| ()))?;
        let sv = forward(gpu, comm, cfg, &w, &x, planner)?;
        let last = backward(gpu, comm, &w, &sv, &dy, planner)?;
        let ms = timed(&mut || backward(gpu, comm, &w, &sv, &dy, planner).map(|_| ()))?;
        rows.push(BenchRow {
            retention: label,
            forward_ms: fwd,
            backward_ms: ms,
            kept_pairs: last.kept_pairs,
            kept_total: last.kept_total,
            bytes_sent: last.bytes_sent,
            peak_bytes: peak,
            peak_used_bytes: peak_used,
        });
    }
    Ok(rows)
}
