//! The host executor's entry points: the layer's stages
//! ([`crate::stages`]) on the host backend ([`crate::host::Host`]), with
//! the whole layer's parameters in and out and the call's figures.

use kernels::cpu::Real;
use quota::Placement;
use serde::Serialize;

use crate::backend::Scalar;
use crate::config::{shape, MoeConfig, MoeParams};
use crate::host::{Host, HostBuf, HostSaved, HostWeights};
use crate::plan::{CallConfig, CallPlan, DevicePlanner};
use crate::stages::backward::Trace;
use crate::transport::{all_gather, Transport};
use crate::LayerError;

/// What the forward keeps for the backward (on this rank): the stages'
/// saved state, this rank's weights and the call's planner.
pub struct Saved<T: Real + Scalar> {
    sv: HostSaved<T>,
    w: HostWeights<T>,
    planner: DevicePlanner,
    /// The call's plan.
    pub plan: CallPlan,
}

impl<T: Real + Scalar> std::fmt::Debug for Saved<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saved")
            .field("tokens", &self.sv.tokens)
            .field("plan", &self.plan)
            .finish()
    }
}

impl<T: Real + Scalar> Saved<T> {
    /// Expert of each of this rank's pairs (`token · top_k + slot`).
    pub fn expert_of_pair(&self) -> &[u32] {
        &self.sv.routed.idx
    }
    /// Pairs that reached each expert in this call, summed over the ranks
    /// (a capacity factor's dropped pairs not counted).
    pub fn expert_load(&self) -> Vec<u64> {
        self.sv.expert_load()
    }
    /// Routing weight of each pair.
    pub fn gate(&self) -> &[T] {
        &self.sv.routed.gates
    }
    /// This rank's auxiliary load-balancing loss `α · E · Σ_e f_e · P_e`
    /// on its own tokens (0 when [`CallConfig::aux_loss_coeff`] is 0). The
    /// backward's gradients are those of the mean of it over ranks, the
    /// way the model's loss is the mean over ranks' tokens: add it to this
    /// rank's loss.
    pub fn aux_loss(&self) -> f64 {
        self.sv.aux_loss
    }
}

/// Wall time per backward stage, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimes {
    /// Router gradient (the stages run it beside the selection: counted
    /// in `select`, 0 here).
    pub router: f64,
    /// LRM scores (and their all-gather).
    pub score: f64,
    /// Selection within the quotas, and the router's gradient.
    pub select: f64,
    /// Redistribution solve and broadcast.
    pub redistribute: f64,
    /// Compaction plans, gathers and scatters.
    pub pack: f64,
    /// All-to-all exchanges.
    pub exchange: f64,
    /// Expert GEMMs and SwiGLU.
    pub gemm: f64,
    /// Replica gradients summed into their owners.
    pub reduce: f64,
}

/// Figures of one backward on one rank.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BackwardStats {
    /// Routed pairs of this rank.
    pub routed_pairs: usize,
    /// Kept pairs of this rank.
    pub kept_pairs: usize,
    /// Kept mask of this rank's pairs.
    pub kept: Vec<bool>,
    /// LRM score of each of this rank's pairs.
    pub scores: Vec<f32>,
    /// Pairs processed per rank after redistribution (same on every rank).
    pub pairs_per_rank: Vec<u64>,
    /// Routed pairs per expert over every rank (the call's expert load,
    /// after capacity dropping).
    pub expert_load: Vec<u64>,
    /// The most bytes of this rank's backend buffers the backward held at
    /// once above those live when it started (packed, received and
    /// regrouped rows, scores and flags, `dX`, the gradients; the
    /// transport's own copies and the GEMMs' scratch excluded).
    pub buffer_bytes: u64,
    /// The forward's token buffers of the same call on this rank: the rows
    /// its instances computed, in and out (`2 × rows × hidden` values of
    /// the executor's rows). With no replica a hot expert's owner computes
    /// every one of its rows here, however few the backward keeps.
    pub forward_buffer_bytes: u64,
    /// The rows this rank's instances computed in that forward.
    pub forward_rows: usize,
    /// Bytes this rank sent to other ranks in the backward's exchanges:
    /// scores, kept rows, `dX` replies, replica gradients (not the router
    /// gradient's sum nor the experts' gradients gathered for the model).
    pub bytes_sent: u64,
    /// Stage times.
    pub times: StageTimes,
}

/// Runs the layer forward on this rank's tokens `x` (`n_tokens × hidden`).
/// `placement` gives the experts' owners: contiguous blocks of
/// `n_experts / ranks` (the call's replicas come from the controller).
pub fn forward<T: Real + Scalar, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    placement: &Placement,
    x: &[T],
) -> Result<(Vec<T>, Saved<T>), LayerError> {
    check_forward_inputs(cfg, placement, x, comm.world_size())?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let w = crate::host::rank_weights(cfg, bwd, params, (rank, world))?;
    let planner = DevicePlanner::host(*cfg, bwd.clone())?.for_values::<T>();
    let b = Host::<T>::with_experts(comm, bwd.experts.clone());
    let sv = crate::stages::forward::forward(&b, cfg, &w, &HostBuf::from(x.to_vec()), &planner)?;
    let plan = planner
        .take_last_plan()
        .ok_or_else(|| LayerError::Config("the forward made no plan".into()))?;
    Ok((
        sv.y.to_vec(),
        Saved {
            sv,
            w,
            planner,
            plan,
        },
    ))
}

/// The forward's inputs against the layer's shape: widths, the
/// placement's experts (owned in contiguous blocks, no standing replica),
/// finite values. The parameters are `host::rank_weights`'s to check.
fn check_forward_inputs<T: Real>(
    cfg: &MoeConfig,
    placement: &Placement,
    x: &[T],
    world: usize,
) -> Result<(), LayerError> {
    cfg.validate()?;
    let hd = cfg.hidden;
    if x.len() % hd != 0 {
        return Err(LayerError::Shape {
            what: "x".into(),
            expected: (x.len() / hd + 1) * hd,
            got: x.len(),
        });
    }
    let el = pack::ep::experts_per_rank(cfg.n_experts, world)?;
    let blocks = (placement.owner.len() == cfg.n_experts)
        && placement
            .owner
            .iter()
            .enumerate()
            .all(|(e, &o)| o == e / el);
    if !blocks || !placement.replicas.is_empty() {
        return Err(LayerError::Config(format!(
            "the layer's experts are owned in contiguous blocks of {el} per rank, \
             expert e by rank e / {el}, with no standing replica (got owners {:?}, {} replicas)",
            placement.owner,
            placement.replicas.len()
        )));
    }
    if x.iter().any(|v| !v.is_finite()) {
        return Err(LayerError::NonFinite("layer input"));
    }
    Ok(())
}

/// Runs the LRMoE backward for output gradient `dy` (`n_tokens × hidden`).
/// Returns this rank's input gradient, the gradients of every weight summed
/// over all ranks (identical on every rank), and this rank's figures.
/// `bwd` must be the forward's call settings; its expert backend runs the
/// backward's GEMMs.
pub fn backward<T: Real + Scalar, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    saved: &Saved<T>,
    dy: &[T],
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), LayerError> {
    let n_tok = saved.sv.tokens;
    shape("dy", n_tok * cfg.hidden, dy.len())?;
    params.validate(cfg)?;
    if dy.iter().any(|v| !v.is_finite()) {
        return Err(LayerError::NonFinite("output gradient"));
    }
    let b = Host::<T>::with_experts(comm, bwd.experts.clone());
    let own = (saved.sv.owned_rows.as_ref()).map(crate::stages::common::Held::Borrowed);
    let base = crate::host::meter_start();
    let dy = HostBuf::from(dy.to_vec());
    let (g, trace) = crate::stages::backward::backward_traced(
        &b,
        &saved.w,
        (&saved.sv, own),
        &dy,
        &saved.planner,
        true,
    )?;
    let peak = crate::host::meter_peak_since(base);
    let trace = trace.ok_or_else(|| LayerError::Config("the backward left no trace".into()))?;
    let grads = whole_layer(comm, cfg, g.router.into_vec(), &g.experts)?;
    let stats = stats_of(
        saved,
        trace,
        (g.bytes_sent as u64, peak, g.forward_rows),
        comm.rank(),
    );
    Ok((g.dx.into_vec(), grads, stats))
}

/// The whole layer's gradients on every rank: the router's (summed over
/// ranks already) and every rank's block of experts, all-gathered.
fn whole_layer<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    router: Vec<T>,
    own: &crate::config::Experts<HostBuf<T>>,
) -> Result<MoeParams<T>, LayerError> {
    let (h, f) = (cfg.hidden, cfg.ffn);
    let mut grads = MoeParams {
        router,
        experts: Vec::with_capacity(cfg.n_experts),
    };
    let flat: Vec<T> = [&own.gate, &own.up, &own.down]
        .into_iter()
        .flat_map(|v| v.iter().copied())
        .collect();
    for block in all_gather(comm, &flat)? {
        let el = block.len() / (3 * h * f);
        let (gate, rest) = block.split_at(el * h * f);
        let (up, down) = rest.split_at(el * h * f);
        for i in 0..el {
            let part = |v: &[T]| v[i * h * f..(i + 1) * h * f].to_vec();
            grads.experts.push(crate::config::Experts {
                gate: part(gate),
                up: part(up),
                down: part(down),
            });
        }
    }
    grads.validate(cfg)?;
    Ok(grads)
}

/// A backward's figures from its trace.
fn stats_of<T: Real + Scalar>(
    saved: &Saved<T>,
    trace: Trace<crate::host::HostMem<T>>,
    (bytes_sent, peak, forward_rows): (u64, u64, usize),
    rank: usize,
) -> BackwardStats {
    let sv = &saved.sv;
    let n_pairs = sv.tokens * sv.cfg.top_k;
    let (mut kept, mut scores) = (vec![false; n_pairs], vec![0f32; n_pairs]);
    for (row, &pair) in sv.src.iter().enumerate().take(sv.rows) {
        kept[pair as usize] = trace.mask[row] != 0;
        scores[pair as usize] = trace.scores[row].wide() as f32;
    }
    let mut times = StageTimes::default();
    for (name, ms) in trace.laps {
        let s = ms / 1e3;
        match name {
            "scores+gather" => times.score += s,
            "select + router" => times.select += s,
            "redistribute" => times.redistribute += s,
            "pack" | "scatter" => times.pack += s,
            "a2a kept rows" | "a2a dX" => times.exchange += s,
            "experts dX" | "experts dW" => times.gemm += s,
            _ => times.reduce += s,
        }
    }
    BackwardStats {
        routed_pairs: n_pairs,
        kept_pairs: trace.kept[rank].iter().map(|&c| c as usize).sum(),
        kept,
        scores,
        pairs_per_rank: trace.loads,
        expert_load: sv.expert_load(),
        buffer_bytes: peak,
        // An `x` row in and an `o` row out per row, in the layer's values.
        forward_buffer_bytes: (2 * forward_rows * sv.cfg.hidden * std::mem::size_of::<T>()) as u64,
        forward_rows,
        bytes_sent,
        times,
    }
}
