//! Forward and backward of the MoE layer (see the crate doc).

use std::time::Instant;

use kernels::cpu::{matmul, Op, Real};
use quota::Placement;
use serde::Serialize;

use crate::config::{shape, ExpertWeights, MoeConfig, MoeParams};
use crate::dispatch::{agreed_routes, copy_replicas, exchange_plans, reduce_gradients};
use crate::plan::{plan_call, CallConfig, CallPlan, Selection};
use crate::router::{aux_loss_terms, capacity_mask, softmax_rows, top_k};
use crate::transport::{all_gather, all_to_all, Transport};
use crate::LayerError;

/// What the forward keeps for the backward (on the source rank).
#[derive(Debug, Clone)]
pub struct Saved<T> {
    x: Vec<T>,
    probs: Vec<T>,
    expert_of_pair: Vec<u32>,
    active: Vec<bool>,
    gate: Vec<T>,
    out: Vec<T>,
    h_sq: Vec<T>,
    /// Weights of the experts this rank hosts a replica of in this call,
    /// received from their owners (`None` elsewhere).
    replicas: Vec<Option<ExpertWeights<T>>>,
    /// This rank's auxiliary load-balancing loss, and its gradient with
    /// respect to each token's router probability of each expert (the
    /// same for every token), already divided by the world size.
    aux: f64,
    aux_dp: Vec<f64>,
    /// The call's plan.
    pub plan: CallPlan,
}

impl<T> Saved<T> {
    /// Expert of each of this rank's pairs (`token · top_k + slot`).
    pub fn expert_of_pair(&self) -> &[u32] {
        &self.expert_of_pair
    }
    /// Routing weight of each pair.
    pub fn gate(&self) -> &[T] {
        &self.gate
    }
    /// This rank's auxiliary load-balancing loss `α · E · Σ_e f_e · P_e`
    /// on its own tokens (0 when [`CallConfig::aux_loss_coeff`] is 0). The
    /// backward's gradients are those of the mean of it over ranks, the
    /// way the model's loss is the mean over ranks' tokens: add it to this
    /// rank's loss.
    pub fn aux_loss(&self) -> f64 {
        self.aux
    }
}

/// Wall time per backward stage, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimes {
    /// Router gradient.
    pub router: f64,
    /// LRM scores.
    pub score: f64,
    /// Top-q selection.
    pub select: f64,
    /// Redistribution solve and broadcast.
    pub redistribute: f64,
    /// Compaction plans, gathers and scatters.
    pub pack: f64,
    /// All-to-all exchanges.
    pub exchange: f64,
    /// Expert GEMMs and SwiGLU.
    pub gemm: f64,
    /// Gradient all-reduce.
    pub reduce: f64,
}

/// Figures of one backward on one rank.
#[derive(Debug, Clone, Serialize)]
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
    /// Peak bytes of this rank's pair-sized backward buffers live at once
    /// (packed, received and regrouped rows, `dX` replies, one expert's
    /// intermediates; the transport's own copies excluded).
    pub buffer_bytes: u64,
    /// Bytes this rank sent to other ranks during the backward exchange.
    pub bytes_sent: u64,
    /// Stage times.
    pub times: StageTimes,
}

/// Runs the layer forward on this rank's tokens `x` (`n_tokens × hidden`).
/// `placement` gives the experts' owners (and standing replicas).
pub fn forward<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    placement: &Placement,
    x: &[T],
) -> Result<(Vec<T>, Saved<T>), LayerError> {
    check_forward_inputs(cfg, params, placement, x)?;
    let routed = route(cfg, bwd, params, x, comm.world_size())?;
    // Counts of the pairs that reach an expert, then the call's plan.
    let mut local = vec![0u64; cfg.n_experts];
    for (&e, _) in routed
        .expert_of_pair
        .iter()
        .zip(&routed.active)
        .filter(|(_, &a)| a)
    {
        local[e as usize] += 1;
    }
    let plan = plan_call::<T>(cfg, bwd, all_gather(comm, &local)?, placement)?;
    let replicas = copy_replicas(comm, cfg, &plan.placement, params)?;
    let per_pair = dispatch_and_compute(comm, cfg, bwd, params, &replicas, &plan, &routed, x)?;
    let (y, out, h_sq) = combine(cfg, &routed, &per_pair, x.len() / cfg.hidden);
    let Routed {
        probs,
        expert_of_pair,
        active,
        gate,
        aux,
        aux_dp,
    } = routed;
    Ok((
        y,
        Saved {
            x: x.to_vec(),
            probs,
            expert_of_pair,
            active,
            gate,
            out,
            h_sq,
            replicas,
            aux,
            aux_dp,
            plan,
        },
    ))
}

/// The forward's inputs against the layer's shape: widths, the
/// placement's experts, finite values.
fn check_forward_inputs<T: Real>(
    cfg: &MoeConfig,
    params: &MoeParams<T>,
    placement: &Placement,
    x: &[T],
) -> Result<(), LayerError> {
    cfg.validate()?;
    params.validate(cfg)?;
    let hd = cfg.hidden;
    if x.len() % hd != 0 {
        return Err(LayerError::Shape {
            what: "x".into(),
            expected: (x.len() / hd + 1) * hd,
            got: x.len(),
        });
    }
    if placement.owner.len() != cfg.n_experts {
        return Err(LayerError::Config(format!(
            "placement has {} experts, the layer {}",
            placement.owner.len(),
            cfg.n_experts
        )));
    }
    if x.iter().any(|v| !v.is_finite()) {
        return Err(LayerError::NonFinite("layer input"));
    }
    Ok(())
}

/// This rank's routing: router probabilities, each pair's expert and
/// routing weight, whether it reaches its expert (the capacity factor),
/// and the auxiliary loss's terms.
struct Routed<T> {
    probs: Vec<T>,
    expert_of_pair: Vec<u32>,
    active: Vec<bool>,
    gate: Vec<T>,
    aux: f64,
    aux_dp: Vec<f64>,
}

/// Router GEMM, the logit bias, softmax, top-k (on the balancing-biased
/// probabilities when the call has a bias), the routing weights
/// (renormalised if configured), the auxiliary loss over `world` ranks and
/// the capacity mask.
fn route<T: Real>(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    x: &[T],
    world: usize,
) -> Result<Routed<T>, LayerError> {
    let (hd, e_n, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let n_tok = x.len() / hd;
    let mut probs = vec![T::zero(); n_tok * e_n];
    matmul(
        &mut probs,
        x,
        Op::N,
        &params.router,
        Op::N,
        (n_tok, hd, e_n),
        false,
    )?;
    if let Some(bias) = bwd.logit_bias(e_n)? {
        let b: Vec<T> = bias.iter().map(|&v| T::of(v)).collect();
        for row in probs.chunks_exact_mut(e_n) {
            row.iter_mut().zip(&b).for_each(|(v, &bb)| *v += bb);
        }
    }
    softmax_rows(&mut probs, e_n);
    let sel_bias: Option<Vec<T>> = bwd
        .selection_bias(e_n)?
        .map(|b| b.iter().map(|&v| T::of(v)).collect());
    let mut expert_of_pair = vec![0u32; n_tok * k];
    let mut gate = vec![T::zero(); n_tok * k];
    let mut biased = vec![T::zero(); if sel_bias.is_some() { e_n } else { 0 }];
    for t in 0..n_tok {
        let sel = &mut expert_of_pair[t * k..(t + 1) * k];
        let row = &probs[t * e_n..(t + 1) * e_n];
        match &sel_bias {
            Some(b) => {
                for ((o, &p), &bb) in biased.iter_mut().zip(row).zip(b) {
                    *o = p + bb;
                }
                top_k(&biased, k, sel);
            }
            None => top_k(row, k, sel),
        }
        let g = &mut gate[t * k..(t + 1) * k];
        for (gj, &e) in g.iter_mut().zip(sel.iter()) {
            *gj = probs[t * e_n + e as usize];
        }
        if cfg.renormalize {
            let s: T = g.iter().copied().sum();
            g.iter_mut().for_each(|v| *v = *v / s);
        }
    }
    let mut counts = vec![0u64; e_n];
    for &e in &expert_of_pair {
        counts[e as usize] += 1;
    }
    let (aux, aux_dp) = aux_loss_terms(bwd.aux_loss_coeff, &counts, n_tok, world, || {
        let mut mean_p = vec![0f64; e_n];
        for row in probs.chunks_exact(e_n) {
            for (m, &v) in mean_p.iter_mut().zip(row) {
                *m += v.wide() / n_tok as f64;
            }
        }
        Ok(mean_p)
    })?;
    let active = capacity_mask(bwd.capacity_factor, &expert_of_pair, e_n)?;
    Ok(Routed {
        probs,
        expert_of_pair,
        active,
        gate,
        aux,
        aux_dp,
    })
}

/// Dispatch, experts, return: every pair that reaches its expert goes to
/// an instance (spread by the exact redistribution), the instances compute
/// on rows grouped per expert, and each pair's `[o | ‖h‖²]` row comes back
/// to its source (`[n_pairs × (hidden + 1)]`, zero for dropped pairs).
#[allow(clippy::too_many_arguments)]
fn dispatch_and_compute<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    replicas: &[Option<ExpertWeights<T>>],
    plan: &CallPlan,
    routed: &Routed<T>,
    x: &[T],
) -> Result<Vec<T>, LayerError> {
    let (me, n_ranks) = (comm.rank(), comm.world_size());
    let (hd, e_n, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let weights = |e: usize| replicas[e].as_ref().unwrap_or(&params.experts[e]);
    let problem = redistribute::Problem {
        n_ranks,
        kept: plan.routed.clone(),
        instances: plan.placement.all_instances(),
        base_load: vec![0; n_ranks],
        rank_capacity: None,
    };
    let (routes, _) = agreed_routes(comm, &problem, bwd.forward_solver())?;
    let (send_plan, recv_plan) = exchange_plans(
        me,
        n_ranks,
        e_n,
        &routes,
        &routed.expert_of_pair,
        &routed.active,
    )?;
    let token_rows: Vec<u32> = send_plan.gather.iter().map(|&p| p / k as u32).collect();
    let mut packed = vec![T::zero(); token_rows.len() * hd];
    pack::gather_rows(x, hd, &token_rows, &mut packed)?;
    let counts: Vec<usize> = send_plan.send_counts.iter().map(|c| c * hd).collect();
    let (recv, _) = all_to_all(comm, &packed, &counts)?;

    // Expert compute on grouped rows; results go back as [o | ‖h‖²].
    let w = hd + 1;
    let mut grouped = vec![T::zero(); recv_plan.order.len() * hd];
    pack::gather_rows(&recv, hd, &recv_plan.order, &mut grouped)?;
    let (o, h_sq) = crate::experts::forward(
        &bwd.experts,
        cfg,
        &weights,
        &recv_plan.group_sizes,
        &grouped,
    )?;
    let mut result = vec![T::zero(); recv_plan.order.len() * w];
    for ((dst, or), &hs) in result
        .chunks_exact_mut(w)
        .zip(o.chunks_exact(hd))
        .zip(&h_sq)
    {
        dst[..hd].copy_from_slice(or);
        dst[hd] = hs;
    }
    let back_order = pack::invert(&recv_plan.order, recv_plan.order.len())?;
    let mut reply = vec![T::zero(); result.len()];
    pack::gather_rows(&result, w, &back_order, &mut reply)?;
    let counts: Vec<usize> = recv_plan.recv_counts.iter().map(|c| c * w).collect();
    let (returned, _) = all_to_all(comm, &reply, &counts)?;
    let mut per_pair = vec![T::zero(); routed.expert_of_pair.len() * w];
    pack::unpack_rows(&returned, w, &send_plan.inverse, T::zero(), &mut per_pair)?;
    Ok(per_pair)
}

/// `y_t = Σ_k g_{t,k} · o_{t,k}` over each token's pairs, and the pairs'
/// outputs and `‖h‖²` split out of the returned `[o | ‖h‖²]` rows.
fn combine<T: Real>(
    cfg: &MoeConfig,
    routed: &Routed<T>,
    per_pair: &[T],
    n_tok: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (hd, k) = (cfg.hidden, cfg.top_k);
    let (w, n_pairs) = (hd + 1, routed.expert_of_pair.len());
    let mut y = vec![T::zero(); n_tok * hd];
    let mut out = vec![T::zero(); n_pairs * hd];
    let mut h_sq = vec![T::zero(); n_pairs];
    for p in 0..n_pairs {
        let t = p / k;
        let row = &per_pair[p * w..(p + 1) * w];
        out[p * hd..(p + 1) * hd].copy_from_slice(&row[..hd]);
        h_sq[p] = row[hd];
        let g = routed.gate[p];
        for (yv, &ov) in y[t * hd..(t + 1) * hd].iter_mut().zip(&row[..hd]) {
            *yv += g * ov;
        }
    }
    (y, out, h_sq)
}

/// The kept pairs of this rank (`[n_pairs]`) and the kept pairs of every
/// (source, expert) cell, by the plan's [`Selection`]. Only pairs that
/// reached their expert in the forward are candidates; ties go to the
/// smaller id, the id ordering pairs by source rank, then pair index —
/// the order in which an expert's owner receives them.
#[allow(clippy::type_complexity)]
fn select_kept<T: Real, X: Transport>(
    comm: &X,
    bwd: &CallConfig,
    saved: &Saved<T>,
    scores: &[f32],
) -> Result<(Vec<bool>, Vec<Vec<u64>>, Vec<f32>), LayerError> {
    let (me, n_ranks) = (comm.rank(), comm.world_size());
    let e_n = saved.plan.quotas.len();
    let n_pairs = scores.len();
    let pool = candidate_pool(comm, saved, scores)?;
    let experts: Vec<u32> = pool.iter().map(|c| c.2).collect();
    if let Some(&bad) = experts.iter().find(|&&e| e as usize >= e_n) {
        return Err(LayerError::Config(format!(
            "a candidate names expert {bad} of {e_n}"
        )));
    }
    let ids: Vec<u64> = pool
        .iter()
        .map(|c| (u64::from(c.0) << 32) | u64::from(c.1))
        .collect();
    let pool_scores: Vec<f32> = pool.iter().map(|c| c.3).collect();
    let quotas: Vec<usize> = match saved.plan.selection {
        Selection::PerSourceExpert => saved.plan.kept[me].iter().map(|&q| q as usize).collect(),
        Selection::PerExpert => saved.plan.quotas.iter().map(|&q| q as usize).collect(),
    };
    let mut kept_pool = vec![false; pool.len()];
    let mut weight_pool = vec![0f32; pool.len()];
    lrm_score::select(
        lrm_score::Candidates {
            expert: &experts,
            id: &ids,
            score: &pool_scores,
        },
        &quotas,
        bwd.rule,
        crate::plan::call_seed(bwd.rule_seed, &saved.plan.routed),
        &mut kept_pool,
        &mut weight_pool,
    )?;
    let mut kept = vec![false; n_pairs];
    let mut weight = vec![0f32; n_pairs];
    let mut cells = vec![vec![0u64; e_n]; n_ranks];
    for ((c, &k), &w) in pool.iter().zip(&kept_pool).zip(&weight_pool) {
        if k {
            cells[c.0 as usize][c.2 as usize] += 1;
            if c.0 as usize == me {
                kept[c.1 as usize] = true;
                weight[c.1 as usize] = w;
            }
        }
    }
    if saved.plan.selection == Selection::PerSourceExpert {
        // Each source saw only its own pairs: top-q keeps the plan's cells
        // exactly; a sampling rule may keep fewer, so the counts are shared.
        if bwd.rule == lrm_score::Rule::TopQ {
            cells.clone_from(&saved.plan.kept);
        } else {
            cells = all_gather(comm, &cells[me])?;
        }
    }
    Ok((kept, cells, weight))
}

/// The candidates that compete for this rank's quotas, `(source, pair,
/// expert, score)`: this rank's pairs that reached their expert, or, with
/// per-expert selection, every rank's (one score per candidate crosses
/// ranks, not its rows).
fn candidate_pool<T: Real, X: Transport>(
    comm: &X,
    saved: &Saved<T>,
    scores: &[f32],
) -> Result<Vec<(u32, u32, u32, f32)>, LayerError> {
    let me = comm.rank();
    let candidates: Vec<usize> = (0..scores.len()).filter(|&p| saved.active[p]).collect();
    Ok(match saved.plan.selection {
        Selection::PerSourceExpert => candidates
            .iter()
            .map(|&p| (me as u32, p as u32, saved.expert_of_pair[p], scores[p]))
            .collect(),
        Selection::PerExpert => {
            let local: Vec<u32> = candidates
                .iter()
                .flat_map(|&p| [p as u32, saved.expert_of_pair[p], scores[p].to_bits()])
                .collect();
            all_gather(comm, &local)?
                .iter()
                .enumerate()
                .flat_map(|(s, v)| {
                    v.chunks_exact(3)
                        .map(move |c| (s as u32, c[0], c[1], f32::from_bits(c[2])))
                })
                .collect()
        }
    })
}

/// Elements of pair-sized buffers the host backward holds at its peak, for
/// `sent` packed rows, `received` rows, the largest expert group `largest`
/// and widths `hidden`, `ffn`: the largest of its stages — the dispatch
/// (packed `[x | g·δ]` rows, the received ones as bytes and as values), the
/// regroup (received rows and the GEMM operands `x`, `g·δ`; never above the
/// dispatch), the expert GEMMs (operands, `dX` and one expert's five
/// `ffn`-wide intermediates on the CPU backend), the reply (`dX` and its
/// source order; never above the GEMMs) and the return (the reply, the
/// returned rows as bytes and as values). The transport's own copies inside a collective are not
/// counted (`tests/host_memory.rs` measures the rest).
pub(crate) fn host_backward_peak_rows(
    sent: usize,
    received: usize,
    largest: usize,
    hidden: usize,
    ffn: usize,
) -> u64 {
    let (s, r, l) = (sent as u64, received as u64, largest as u64);
    let (h, f) = (hidden as u64, ffn as u64);
    [
        2 * h * s + 4 * h * r,
        3 * h * r + 5 * f * l,
        h * r + 2 * h * s,
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
}

/// Runs the LRMoE backward for output gradient `dy` (`n_tokens × hidden`).
/// Returns this rank's input gradient, the gradients of every weight summed
/// over all ranks (identical on every rank), and this rank's figures.
pub fn backward<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<T>,
    saved: &Saved<T>,
    dy: &[T],
) -> Result<(Vec<T>, MoeParams<T>, BackwardStats), LayerError> {
    let n_tok = saved.x.len() / cfg.hidden;
    shape("dy", n_tok * cfg.hidden, dy.len())?;
    if dy.iter().any(|v| !v.is_finite()) {
        return Err(LayerError::NonFinite("output gradient"));
    }
    let mut times = StageTimes::default();
    let mut grads = MoeParams::<T>::zeros(cfg);

    let clock = Instant::now();
    let mut dx = router_backward(cfg, params, saved, dy, &mut grads.router)?;
    times.router = clock.elapsed().as_secs_f64();

    let clock = Instant::now();
    let scores = pair_scores(cfg, saved, dy);
    times.score = clock.elapsed().as_secs_f64();

    let clock = Instant::now();
    let (kept, kept_cells, weight) = select_kept(comm, bwd, saved, &scores)?;
    times.select = clock.elapsed().as_secs_f64();

    // Redistribute kept pairs over the existing instances.
    let clock = Instant::now();
    let n_ranks = comm.world_size();
    let problem = redistribute::Problem {
        n_ranks,
        kept: kept_cells,
        instances: saved.plan.placement.all_instances(),
        base_load: vec![0; n_ranks],
        rank_capacity: saved.plan.caps.clone(),
    };
    let (routes, pairs_per_rank) = agreed_routes(comm, &problem, bwd.solver)?;
    times.redistribute = clock.elapsed().as_secs_f64();

    let rows = kept_rows_backward(
        comm,
        (cfg, bwd, params, saved),
        dy,
        (&kept, &weight),
        &routes,
        (&mut grads, &mut dx),
        &mut times,
    )?;

    // Replica gradients summed into their owners, the owners' sums to every
    // rank; the router's all-reduced (data parallel).
    let clock = Instant::now();
    reduce_gradients(comm, cfg, &saved.plan.placement, &mut grads)?;
    times.reduce = clock.elapsed().as_secs_f64();

    let stats = BackwardStats {
        expert_load: (0..cfg.n_experts)
            .map(|e| saved.plan.routed.iter().map(|r| r[e]).sum())
            .collect(),
        routed_pairs: saved.expert_of_pair.len(),
        kept_pairs: rows.sent,
        kept,
        scores,
        pairs_per_rank,
        buffer_bytes: std::mem::size_of::<T>() as u64
            * host_backward_peak_rows(rows.sent, rows.received, rows.largest, cfg.hidden, cfg.ffn),
        bytes_sent: rows.bytes_sent,
        times,
    };
    Ok((dx, grads, stats))
}

/// The router's gradient: every pair's forward output feeds `∂L/∂g`, kept
/// or not, through the top-k (renormalised or not), the auxiliary loss and
/// the softmax; writes `∂L/∂W_router` into `d_router` and returns the
/// router's part of `dX`.
fn router_backward<T: Real>(
    cfg: &MoeConfig,
    params: &MoeParams<T>,
    saved: &Saved<T>,
    dy: &[T],
    d_router: &mut [T],
) -> Result<Vec<T>, LayerError> {
    let (hd, e_n, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let n_tok = saved.x.len() / hd;
    let mut dlogits = vec![T::zero(); n_tok * e_n];
    for t in 0..n_tok {
        let dyt = &dy[t * hd..(t + 1) * hd];
        let dg: Vec<T> = (0..k)
            .map(|j| {
                let o = &saved.out[(t * k + j) * hd..(t * k + j + 1) * hd];
                dyt.iter().zip(o).map(|(&a, &b)| a * b).sum()
            })
            .collect();
        let p = &saved.probs[t * e_n..(t + 1) * e_n];
        let mut dp = vec![T::zero(); e_n];
        let sel = &saved.expert_of_pair[t * k..(t + 1) * k];
        if cfg.renormalize {
            let s: T = sel.iter().map(|&e| p[e as usize]).sum();
            let g = &saved.gate[t * k..(t + 1) * k];
            let dot: T = dg.iter().zip(g).map(|(&a, &b)| a * b).sum();
            for (j, &e) in sel.iter().enumerate() {
                dp[e as usize] = (dg[j] - dot) / s;
            }
        } else {
            for (j, &e) in sel.iter().enumerate() {
                dp[e as usize] = dg[j];
            }
        }
        for (d, &c) in dp.iter_mut().zip(&saved.aux_dp) {
            *d += T::of(c);
        }
        let dot: T = p.iter().zip(&dp).map(|(&a, &b)| a * b).sum();
        for (i, dl) in dlogits[t * e_n..(t + 1) * e_n].iter_mut().enumerate() {
            *dl = p[i] * (dp[i] - dot);
        }
    }
    matmul(
        d_router,
        &saved.x,
        Op::T,
        &dlogits,
        Op::N,
        (hd, n_tok, e_n),
        false,
    )?;
    let mut dx = vec![T::zero(); n_tok * hd];
    matmul(
        &mut dx,
        &dlogits,
        Op::N,
        &params.router,
        Op::T,
        (n_tok, e_n, hd),
        false,
    )?;
    Ok(dx)
}

/// LRM scores `g² · ‖δ‖² · ‖h‖²` of this rank's pairs, without forming any
/// gradient matrix.
fn pair_scores<T: Real>(cfg: &MoeConfig, saved: &Saved<T>, dy: &[T]) -> Vec<f32> {
    let (hd, k) = (cfg.hidden, cfg.top_k);
    let dy_sq: Vec<f64> = dy
        .chunks_exact(hd)
        .map(|r| r.iter().map(|&v| v.wide() * v.wide()).sum())
        .collect();
    (0..saved.expert_of_pair.len())
        .map(|p| {
            let g = saved.gate[p].wide();
            (g * g * dy_sq[p / k] * saved.h_sq[p].wide()) as f32
        })
        .collect()
}

/// What the kept rows' part of a backward moved and held.
struct KeptRows {
    /// Kept pairs this rank sent.
    sent: usize,
    /// Kept pairs this rank's instances received.
    received: usize,
    /// Rows of its largest expert group.
    largest: usize,
    /// Bytes this rank sent in the two exchanges.
    bytes_sent: u64,
}

/// The kept pairs' backward: `[x | g·δ]` rows of the kept pairs packed into
/// dense per-destination, per-expert blocks and exchanged (only those),
/// regrouped per expert straight into the GEMM operands, the expert GEMMs
/// on the compacted rows (gradients into `grads`), and the `dX` rows
/// returned to their sources and added into `dx`. Every pair-sized buffer
/// is dropped as soon as the next stage has read it, so the rank's peak is
/// its largest stage, not the sum.
fn kept_rows_backward<T: Real, X: Transport>(
    comm: &X,
    (cfg, bwd, params, saved): (&MoeConfig, &CallConfig, &MoeParams<T>, &Saved<T>),
    dy: &[T],
    (kept, weight): (&[bool], &[f32]),
    routes: &[redistribute::Route],
    (grads, dx): (&mut MoeParams<T>, &mut [T]),
    times: &mut StageTimes,
) -> Result<KeptRows, LayerError> {
    let (hd, k) = (cfg.hidden, cfg.top_k);
    let clock = Instant::now();
    let (send_plan, recv_plan) = exchange_plans(
        comm.rank(),
        comm.world_size(),
        cfg.n_experts,
        routes,
        &saved.expert_of_pair,
        kept,
    )?;
    let w2 = 2 * hd;
    let (n_sent, n_recv) = (send_plan.packed_rows(), recv_plan.order.len());
    let mut packed = vec![T::zero(); n_sent * w2];
    for (row, &p) in packed.chunks_exact_mut(w2).zip(&send_plan.gather) {
        let (p, t) = (p as usize, p as usize / k);
        row[..hd].copy_from_slice(&saved.x[t * hd..(t + 1) * hd]);
        // The rule's weight (1 for top-q; 1/π for the unbiased rules).
        let g = saved.gate[p] * T::of(f64::from(weight[p]));
        for (d, &v) in row[hd..].iter_mut().zip(&dy[t * hd..(t + 1) * hd]) {
            *d = g * v;
        }
    }
    times.pack += clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    let sent_before = comm.bytes_sent();
    let counts: Vec<usize> = send_plan.send_counts.iter().map(|c| c * w2).collect();
    let (recv, _) = all_to_all(comm, &packed, &counts)?;
    drop(packed);
    times.exchange += clock.elapsed().as_secs_f64();

    let clock = Instant::now();
    let mut xs = vec![T::zero(); n_recv * hd];
    let mut dos = vec![T::zero(); n_recv * hd];
    pack::gather_rows_split(&recv, (hd, hd), &recv_plan.order, &mut xs, &mut dos)?;
    drop(recv);
    times.pack += clock.elapsed().as_secs_f64();

    let clock = Instant::now();
    let largest = recv_plan.group_sizes.iter().copied().max().unwrap_or(0);
    let weights = |e: usize| saved.replicas[e].as_ref().unwrap_or(&params.experts[e]);
    let dx_grouped = crate::experts::backward(
        &bwd.experts,
        cfg,
        &weights,
        &recv_plan.group_sizes,
        &xs,
        &dos,
        grads,
    )?;
    drop((xs, dos));
    times.gemm = clock.elapsed().as_secs_f64();

    let bytes_sent =
        return_dx(comm, hd, k, &send_plan, &recv_plan, dx_grouped, dx, times)? - sent_before;
    Ok(KeptRows {
        sent: n_sent,
        received: n_recv,
        largest,
        bytes_sent,
    })
}

/// The instances' grouped `dX` rows back to their sources, added onto
/// each pair's token row of `dx`; returns the transport's bytes-sent
/// counter after the exchange.
#[allow(clippy::too_many_arguments)]
fn return_dx<T: Real, X: Transport>(
    comm: &X,
    hd: usize,
    k: usize,
    send_plan: &pack::PackPlan,
    recv_plan: &pack::RecvPlan,
    dx_grouped: Vec<T>,
    dx: &mut [T],
    times: &mut StageTimes,
) -> Result<u64, LayerError> {
    let clock = Instant::now();
    let n_recv = recv_plan.order.len();
    let back_order = pack::invert(&recv_plan.order, n_recv)?;
    let mut reply = vec![T::zero(); n_recv * hd];
    pack::gather_rows(&dx_grouped, hd, &back_order, &mut reply)?;
    drop(dx_grouped);
    times.pack += clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    let counts: Vec<usize> = recv_plan.recv_counts.iter().map(|c| c * hd).collect();
    let (returned, _) = all_to_all(comm, &reply, &counts)?;
    drop(reply);
    let sent_after = comm.bytes_sent();
    times.exchange += clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    for (j, &p) in send_plan.gather.iter().enumerate() {
        let t = p as usize / k;
        for (d, &v) in dx[t * hd..(t + 1) * hd]
            .iter_mut()
            .zip(&returned[j * hd..(j + 1) * hd])
        {
            *d += v;
        }
    }
    times.pack += clock.elapsed().as_secs_f64();
    Ok(sent_after)
}
