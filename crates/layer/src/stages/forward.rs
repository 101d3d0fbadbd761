//! The forward: route → plan → dispatch → experts → combine, and the state
//! it keeps for the backward ([`Saved`]).

use pack::ep::{global_order, instance_layout, local_experts, InstanceLayout, Runs, Split};

use crate::backend::{Backend, Buf, Family, Overlap, RoutedOf, Rows, Sc, Scalar, Wts};
use crate::config::at_least;
use crate::config::MoeConfig;
use crate::plan::{
    check_plan, check_quotas, check_routes, one_instance_each, DevicePlanner, EpPlan, EpRoutes,
};
use crate::LayerError;

use super::common::{
    copy_rows, exchange_rows, exclusive_scan, off_rank, packed_parts, permute4, world_of, Laps,
    OwnedRows, Projections,
};
use super::weights::{local_weights, replica_weights, LocalWeights, Weights};

/// Forward state kept for the backward: the source's routing, outputs and
/// norms, and, in calls without replicas, the owner's forward rows.
pub struct Saved<F: Family> {
    pub(crate) cfg: MoeConfig,
    pub(crate) tokens: usize,
    /// This source's pairs that reached an expert (all `tokens · k` unless
    /// the capacity factor dropped some), in expert-major rows.
    pub(crate) rows: usize,
    pub(crate) per_rank: usize,
    pub(crate) x: F::Buf<F::V>,
    pub(crate) routed: F::Routed,
    /// Pair → this source's expert-major row (`DROPPED` for a pair the
    /// capacity dropped), and row → pair.
    pub(crate) dst: F::Buf<u32>,
    pub(crate) src: F::Buf<u32>,
    /// Pair → row of `o` (send order).
    pub(crate) row_of_pair: F::Buf<u32>,
    /// Output rows of this source's pairs, send order (and a zero row for
    /// dropped pairs).
    pub(crate) o: F::Buf<F::V>,
    /// `‖h‖²` of this source's pairs, expert-major.
    pub(crate) h_sq: F::Buf<F::S>,
    /// This source's expert offsets (`E + 1`).
    pub(crate) offsets: Vec<u32>,
    /// The global expert-major order of the backward's selection.
    pub(crate) order: SelectionOrder<F>,
    pub(crate) counts_all: Vec<Vec<u32>>,
    pub(crate) plan: EpPlan,
    pub(crate) local: Vec<Vec<usize>>,
    pub(crate) weights: Option<LocalWeights<F>>,
    /// Without replicas in the call, this rank's forward rows as an owner
    /// (as they arrived), each expert-major row's local expert and the
    /// group offsets:
    /// the backward's kept pairs cannot move, so their `x` rows are taken
    /// from here instead of travelling again.
    pub(crate) owned_rows: Option<OwnedRows<F>>,
    /// Layer output for this rank's tokens, `T × H`.
    pub y: F::Buf<F::V>,
    /// Bytes this rank sent to other ranks in the forward's all-to-alls
    /// (rows, their outputs and norms, replica weights).
    pub bytes_sent: usize,
    /// This rank's auxiliary balancing loss (0 when off) and its gradient
    /// with respect to every router probability, one per expert.
    pub aux_loss: f64,
    pub(crate) aux_dp: Option<F::Buf<F::S>>,
}

impl<F: Family> Saved<F> {
    /// Every source's routed pairs per global expert, `[world][experts]`.
    pub fn routed_counts(&self) -> &[Vec<u32>] {
        &self.counts_all
    }
    /// The call's routed pairs per expert over all sources.
    pub fn expert_load(&self) -> Vec<u64> {
        (0..self.cfg.n_experts)
            .map(|e| self.counts_all.iter().map(|c| u64::from(c[e])).sum())
            .collect()
    }
    /// This call's plan.
    pub fn plan(&self) -> &EpPlan {
        &self.plan
    }
}

/// The router's output on this rank's tokens (GEMM, biases, softmax,
/// top-k, counts) and the auxiliary loss's terms.
#[allow(clippy::type_complexity)]
fn route_rows<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    w: &Weights<B::F>,
    x: &Rows<B>,
    planner: &DevicePlanner,
    world: usize,
) -> Result<(RoutedOf<B>, f64, Option<Buf<B, Sc<B>>>), LayerError> {
    let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let routed = b.route(
        &w.router,
        x,
        w.bias.as_ref(),
        w.sel_bias.as_ref(),
        (B::len(x) / h, h, e, k),
        cfg.renormalize,
    )?;
    let (aux_loss, aux_dp) = aux_terms(b, planner.aux_loss_coeff(), &routed, world)?;
    Ok((routed, aux_loss, aux_dp))
}

/// This source's `p` pairs grouped by expert (stable, pair order), and
/// under a capacity factor (the baseline) only each expert's first
/// `crate::router::expert_capacity` pairs: the others reach no expert, in
/// the forward or the backward.
fn group_and_cap<B: Backend>(
    b: &B,
    routed: &RoutedOf<B>,
    capacity_factor: Option<f64>,
    p: usize,
    e: usize,
) -> Result<Capped<B::F>, LayerError> {
    let counts = B::routed_counts(routed);
    let base = exclusive_scan(counts);
    // SAFETY: the experts are p experts below e (route's output); base is
    // the prefix sum of route's own counts of those experts.
    let (dst, src) =
        unsafe { b.group(B::routed_experts(routed), None, None, &base[..e], p, p, e) }?;
    match crate::router::expert_capacity(capacity_factor, p, e)? {
        Some(cap) if counts.iter().any(|&c| c as usize > cap) => {
            cap_rows(b, counts, cap, &src, &dst, p)
        }
        _ => Ok(Capped {
            counts: counts.to_vec(),
            src,
            dst_fwd: None,
            dst,
        }),
    }
}

/// The forward's plan as far as it is known before the experts run.
struct ForwardPlan {
    /// Every rank's rows per expert.
    counts_all: Vec<Vec<u32>>,
    /// The plan's routes (replicas and the forward's split), when the
    /// call has replica slots; the rest of the controller (the backward's
    /// quotas) runs while the experts compute, and all of it without
    /// replica slots.
    early: Option<EpRoutes>,
    /// Without replica slots: every expert's rows to its owner.
    owner_split: Split,
    /// Each rank's instances.
    local: Vec<Vec<usize>>,
    /// This source's layout of the split.
    lay: InstanceLayout,
}

/// Everyone's counts, then the split every rank follows. Without replica
/// slots (alike on every rank) the split is the routed counts, each
/// expert's to its owner; with them the controller places this call's
/// replicas and splits the rows over the instances. Either way the rows
/// go out next and the rest of the controller (the backward's quotas)
/// runs on the host while the experts compute.
fn forward_plan<B: Backend>(
    b: &B,
    planner: &DevicePlanner,
    counts: &[u32],
    (rank, world, el): (usize, usize, usize),
    laps: &mut Laps<B::F>,
) -> Result<ForwardPlan, LayerError> {
    let counts_all = b.all_gather_counts(counts)?;
    // The grouping's launch and the counts' all-gather apart from the
    // planning (the simulator's parts: where a host-bound step waits).
    laps.lap(b, "group+counts")?;
    let early = if planner.owners_only() {
        None
    } else {
        let routes = planner.routes(&counts_all)?;
        check_routes(&routes.instances, &routes.forward, &counts_all, el)?;
        Some(routes)
    };
    let owner_split = match &early {
        Some(_) => Split::default(),
        None => crate::plan::owners_split(&counts_all, |e| e / el, world)?,
    };
    let (split, local) = match &early {
        Some(routes) => (&routes.forward, local_experts(&routes.instances, world)),
        None => (
            &owner_split,
            (0..world)
                .map(|r| (r * el..(r + 1) * el).collect())
                .collect(),
        ),
    };
    let lay = instance_layout(split, &local, rank)?;
    Ok(ForwardPlan {
        counts_all,
        early,
        owner_split,
        local,
        lay,
    })
}

/// Outputs and `‖h‖²` of the rows one source sent to this rank.
type Outs<B> = (Rows<B>, Buf<B, Sc<B>>);

/// Each source's expert outputs and `‖h‖²` back to it (the own ones
/// copied), in the layout the source sent its rows in: `(o, ‖h‖²)` of this
/// source's `n` rows.
fn return_outputs<B: Backend>(
    b: &B,
    mut outs: Vec<Option<Outs<B>>>,
    lay: &InstanceLayout,
    (n, h): (usize, usize),
    laps: &mut Laps<B::F>,
) -> Result<Outs<B>, LayerError> {
    let (rank, world) = (b.rank(), b.world_size());
    let soff = exclusive_scan(&lay.send);
    let own = outs[rank]
        .take()
        .ok_or(LayerError::Config("no own rows".into()))?;
    Ok(if world == 1 {
        own
    } else {
        let mut o_sends = Vec::new();
        let mut h_sends = Vec::new();
        let (mut op, mut hp) = (Vec::new(), Vec::new());
        for (s, out) in outs.into_iter().enumerate() {
            match out {
                Some((o, q)) if s != rank => {
                    op.push((o_sends.len(), 0, lay.recv.from[s] * h));
                    hp.push((h_sends.len(), 0, lay.recv.from[s]));
                    o_sends.push(o);
                    h_sends.push(q);
                }
                _ => {
                    op.push((0, 0, 0));
                    hp.push((0, 0, 0));
                }
            }
        }
        // Back in the layout this source sent them in.
        let orp = packed_parts(&lay.recv.from, &lay.send, rank, h).1;
        let hrp = packed_parts(&lay.recv.from, &lay.send, rank, 1).1;
        // SAFETY: the exchanges write every other rank's region, the copies
        // the own one.
        let (o_buf, h_buf) = unsafe { (b.uninit(n * h)?, b.uninit::<Sc<B>>(n)?) };
        let mut fo = b.start(o_sends, &op, o_buf, &orp)?;
        let mut fh = b.start(h_sends, &hp, h_buf, &hrp)?;
        laps.sent(b, "o, |h|^2 back")?;
        let at = (soff[rank], lay.send[rank]);
        copy_rows(b, &own.0, 0, B::flight_buffers(&mut fo)?.1, at.0, (at.1, h))?;
        copy_rows(b, &own.1, 0, B::flight_buffers(&mut fh)?.1, at.0, (at.1, 1))?;
        (b.finish(fo)?.0, b.finish(fh)?.0)
    })
}

/// The source's pairs combined: each pair's row of the returned outputs
/// (pairs dropped by the capacity point at an extra zero row: their output,
/// and their router gradient term, are zero), the rows' `‖h‖²` in this
/// source's grouped order, and `y = Σ_k g · o`.
#[allow(clippy::type_complexity)]
fn combine_pairs<B: Backend>(
    b: &B,
    (dst, dst_fwd): (&Buf<B, u32>, Option<&Buf<B, u32>>),
    lay: &InstanceLayout,
    (o, hsq_send): Outs<B>,
    routed: &RoutedOf<B>,
    (tokens, h, k, n): (usize, usize, usize, usize),
) -> Result<(Buf<B, u32>, Rows<B>, Buf<B, Sc<B>>, Rows<B>), LayerError> {
    let p = tokens * k;
    let (row_of_pair, o) = match dst_fwd {
        None => {
            let send_inv = b.expand(&lay.send_inv)?;
            // SAFETY: dst maps every pair to its grouped row (< n = p, no
            // drops); send_inv is a permutation of 0..n.
            (unsafe { b.gather32(&send_inv, dst, p) }?, o)
        }
        Some(dst_fwd) => {
            let mut ext = lay.send_inv.clone();
            ext.push(n as u32, 1);
            let send_inv = b.expand(&ext)?;
            let mut o_ext = b.zeros((n + 1) * h)?;
            if n > 0 {
                b.copy(&o, 0, &mut o_ext, 0, n * h)?;
            }
            // SAFETY: dst_fwd maps every pair to a grouped row (< n) or to
            // n; ext maps 0..n onto the n rows of o and n to the zero row.
            (unsafe { b.gather32(&send_inv, dst_fwd, p) }?, o_ext)
        }
    };
    let h_sq = permute4(b, hsq_send, &lay.send_inv)?;
    let gates = B::routed_gates(routed);
    // SAFETY: row_of_pair holds p rows of o (n rows came back, plus the
    // zero row when pairs were dropped).
    let y = unsafe { b.combine_rows(&o, &row_of_pair, Some(gates), None, (tokens, h, k)) }?;
    Ok((row_of_pair, o, h_sq, y))
}

/// An owner's forward rows kept for the backward (calls without
/// replicas): the rows as they arrived, their expert-major permutation, each
/// row's expert, and this rank's experts' range `experts` in the global
/// expert-major order.
fn owned_rows<B: Backend>(
    b: &B,
    lay: &InstanceLayout,
    (xr, ab): (Rows<B>, Option<Projections<B>>),
    goffsets: &[u32],
    (rank, el): (usize, usize),
) -> Result<OwnedRows<B::F>, LayerError> {
    let experts = rank * el..(rank + 1) * el;
    let key = Runs::segments(lay.recv.per_expert.iter().map(|&c| c as usize));
    Ok(OwnedRows {
        x: xr,
        ab,
        perm: if lay.recv.perm.is_identity() {
            None
        } else {
            Some(b.expand(&lay.recv.perm)?)
        },
        expert: b.expand(&key)?,
        offsets: b.upload(&lay.recv.offsets)?,
        global: (
            goffsets[experts.start] as usize,
            goffsets[experts.end] as usize,
        ),
    })
}

/// The forward's rows of this source in destination order: each grouped
/// row's token of `x` (`n` rows of `h`; a pair's token is `pair / k`).
fn rows_to_send<B: Backend>(
    b: &B,
    x: &Rows<B>,
    src: &Buf<B, u32>,
    send_order: &Runs,
    (n, k, h): (usize, usize, usize),
) -> Result<Rows<B>, LayerError> {
    let reordered;
    let pair_of_send = if send_order.is_identity() {
        src
    } else {
        let send_order = b.expand(send_order)?;
        // SAFETY: send_order is a permutation of the n grouped rows.
        reordered = unsafe { b.gather32(src, &send_order, n) }?;
        &reordered
    };
    // SAFETY: every pair id is below p = tokens · k, so pair / k is a token.
    unsafe { b.gather_rows(x, pair_of_send, k, None, n, h) }
}

/// The controller's plan when no replica slot exists (computed while the
/// experts run): it must keep every pair with its owner.
fn late_plan(
    planner: &DevicePlanner,
    counts_all: &[Vec<u32>],
    owner_split: &Split,
    el: usize,
) -> Result<EpPlan, LayerError> {
    let plan = planner.forward(counts_all)?;
    check_plan(&plan, counts_all, el)?;
    if plan.forward != *owner_split {
        return Err(LayerError::Config(
            "the controller placed replicas though the planner has no replica slots".into(),
        ));
    }
    Ok(plan)
}

/// What the experts' stage hands on: the outputs and `‖h‖²` per source,
/// the rows received, the own rows' projections when asked for, and the
/// answer of the host work run meanwhile.
type ExpertsOut<B, R> = (Vec<Option<Outs<B>>>, Rows<B>, Option<Projections<B>>, R);

/// Forward stage: each source's rows through this rank's instances, in
/// the instance-major order they came in (no regrouping) — its own rows
/// while the others travel (and `meanwhile` runs on the host), then every
/// other source's. Returns the outputs and `‖h‖²` per source, the rows
/// received, the own rows' projections when `keep` asks for them, and
/// `meanwhile`'s answer.
fn experts_forward<B: Backend, R>(
    b: &B,
    fl: B::Flight<crate::backend::Val<B>>,
    lay: &InstanceLayout,
    (wts, h, f, keep): (Wts<'_, B>, usize, usize, bool),
    laps: &mut Laps<B::F>,
    meanwhile: impl FnOnce() -> Result<R, LayerError>,
) -> Result<ExpertsOut<B, R>, LayerError> {
    let (rank, world) = (b.rank(), b.world_size());
    let (soff, roff) = (exclusive_scan(&lay.send), exclusive_scan(&lay.recv.from));
    let mut outs: Vec<Option<Outs<B>>> = (0..world).map(|_| None).collect();
    let overlap = Overlap::new(b);
    let kept_ab = {
        let xs = B::outgoing(&fl)?;
        let (a, m) = (soff[rank] * h, lay.send[rank] * h);
        at_least("rows to this rank", a + m, B::len(xs))?;
        let chunks = &lay.recv.chunks[rank];
        let (o, h_sq, ab) = b.experts_forward(chunks, xs, a..a + m, wts, (h, f), keep)?;
        outs[rank] = Some((o, h_sq));
        ab
    };
    let answer = meanwhile()?;
    laps.lap(b, "experts (own rows)")?;
    // One rank: its rows are the ones it sent itself.
    let xr = b.finish(fl)?.0;
    overlap.end()?;
    for s in (0..world).filter(|&s| s != rank && lay.recv.from[s] > 0) {
        let (a, m) = (roff[s] * h, lay.recv.from[s] * h);
        at_least("rows from a source", a + m, B::len(&xr))?;
        let chunks = &lay.recv.chunks[s];
        let (o, h_sq, _) = b.experts_forward(chunks, &xr, a..a + m, wts, (h, f), false)?;
        outs[s] = Some((o, h_sq));
    }
    Ok((outs, xr, kept_ab, answer))
}

/// The global expert-major order the backward's selection runs in.
pub(crate) struct SelectionOrder<F: Family> {
    /// Global expert-major order (expert, source, pair) → position in the
    /// all-gathered scores. It also serves as the selection's ids: within
    /// an expert it increases with (source, pair), the tie rule.
    pub(crate) perm: F::Buf<u32>,
    /// Whether `perm` is the identity.
    pub(crate) identity: bool,
    /// This source's rows' global positions.
    pub(crate) mine: F::Buf<u32>,
    /// The global expert offsets (`E + 1`).
    pub(crate) offsets: Vec<u32>,
    /// The expert of each of this source's expert-major rows.
    pub(crate) expert_of_row: F::Buf<u32>,
}

fn selection_order<B: Backend>(
    b: &B,
    counts_all: &[Vec<u32>],
    counts: &[u32],
    rank: usize,
    p: usize,
) -> Result<SelectionOrder<B::F>, LayerError> {
    let pack::ep::GlobalOrder {
        perm,
        mine,
        offsets,
        ..
    } = global_order(counts_all, rank, p)?;
    let expert_of_row = Runs::segments(counts.iter().map(|&c| c as usize));
    Ok(SelectionOrder {
        identity: perm.is_identity(),
        perm: b.expand(&perm)?,
        mine: b.expand(&mine)?,
        offsets,
        expert_of_row: b.expand(&expert_of_row)?,
    })
}

/// The tokens in `x` (`tokens × hidden`); a length that is not a whole
/// number of rows is an error.
fn tokens_of(len: usize, h: usize) -> Result<usize, LayerError> {
    if len % h != 0 && len > 1 {
        return Err(LayerError::Shape {
            what: "x (tokens × hidden)".into(),
            expected: len / h * h,
            got: len,
        });
    }
    Ok(len / h)
}

/// The forward on this rank's tokens `x` (`tokens × hidden`); every rank
/// calls it with the same layer, the same tokens per rank and a planner
/// that answers alike on every rank.
pub(crate) fn forward<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    w: &Weights<B::F>,
    x: &Rows<B>,
    planner: &DevicePlanner,
) -> Result<Saved<B::F>, LayerError> {
    let (rank, world, el) = world_of(b, cfg)?;
    let (h, f, k) = (cfg.hidden, cfg.ffn, cfg.top_k);
    let mut laps = Laps::new(b, false)?;
    let d = dispatch(b, cfg, w, x, planner, &mut laps)?;
    let (fp, n, p) = (d.fp, d.offsets[cfg.n_experts] as usize, d.tokens * k);
    // The controller's quotas, while the experts compute (the routes
    // were checked before the rows went out).
    let controller = || match fp.early {
        Some(routes) => {
            let plan = planner.complete(routes)?;
            check_quotas(&plan, world)?;
            Ok(plan)
        }
        None => late_plan(planner, &fp.counts_all, &fp.owner_split, el),
    };
    // Projections are kept on one rank only, where its own rows are every
    // row it holds, in the order the backward reads them.
    let keep_ab = d.keep_rows && world == 1 && planner.keep_projections();
    let wts = local_weights::<B>(w, &d.weights);
    let lay = &fp.lay;
    let (outs, xr, ab, plan) =
        experts_forward(b, d.rows, lay, (wts, h, f, keep_ab), &mut laps, controller)?;
    laps.lap(b, "a2a x + experts")?;
    // Each source's outputs and norms go back; the own ones are copied.
    let returned = return_outputs(b, outs, lay, (n, h), &mut laps)?;
    laps.lap(b, "a2a o")?;
    let maps = (&d.capped.dst, d.capped.dst_fwd.as_ref());
    let (row_of_pair, o, h_sq, y) =
        combine_pairs(b, maps, lay, returned, &d.routed, (d.tokens, h, k, n))?;
    laps.lap(b, "combine")?;
    let order = selection_order(b, &fp.counts_all, &d.capped.counts, rank, p)?;
    let owned_rows = (d.keep_rows)
        .then(|| owned_rows(b, lay, (xr, ab), &order.offsets, (rank, el)))
        .transpose()?;
    b.settle()?;
    laps.print(b, "forward")?;
    let sent_rows = off_rank(&lay.send, rank) + off_rank(&lay.recv.from, rank);
    let bytes_sent = sent_rows * h * 2 + off_rank(&lay.recv.from, rank) * 4 + d.w_bytes;
    Ok(Saved {
        cfg: *cfg,
        tokens: d.tokens,
        rows: n,
        per_rank: el,
        x: x.clone(),
        routed: d.routed,
        dst: d.capped.dst,
        src: d.capped.src,
        row_of_pair,
        o,
        h_sq,
        offsets: d.offsets,
        order,
        counts_all: fp.counts_all,
        plan,
        local: fp.local,
        weights: d.weights,
        owned_rows,
        y,
        bytes_sent,
        aux_loss: d.aux_loss,
        aux_dp: d.aux_dp,
    })
}

/// The forward up to the experts: this source's routing, the plan as far
/// as it is known, the replica weights, and its rows on their way out.
struct Dispatched<B: Backend> {
    tokens: usize,
    routed: RoutedOf<B>,
    aux_loss: f64,
    aux_dp: Option<Buf<B, Sc<B>>>,
    capped: Capped<B::F>,
    /// Expert offsets of this source's rows that reach an expert (`E + 1`).
    offsets: Vec<u32>,
    fp: ForwardPlan,
    weights: Option<LocalWeights<B::F>>,
    w_bytes: usize,
    /// The rows in flight to the experts' instances.
    rows: B::Flight<crate::backend::Val<B>>,
    /// Whether owners keep their forward rows for the backward.
    keep_rows: bool,
}

/// Route → group (and cap) → plan → replica weights → rows out.
fn dispatch<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    w: &Weights<B::F>,
    x: &Rows<B>,
    planner: &DevicePlanner,
    laps: &mut Laps<B::F>,
) -> Result<Dispatched<B>, LayerError> {
    let (rank, world, el) = world_of(b, cfg)?;
    let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let tokens = tokens_of(B::len(x), h)?;
    let (routed, aux_loss, aux_dp) = route_rows(b, cfg, w, x, planner, world)?;
    laps.lap(b, "route")?;
    let capped = group_and_cap(b, &routed, planner.capacity_factor(), tokens * k, e)?;
    // Rows reaching an expert (p without dropping), grouped by expert.
    let offsets = exclusive_scan(&capped.counts);
    let n = offsets[e] as usize;
    let fp = forward_plan(b, planner, &capped.counts, (rank, world, el), laps)?;
    laps.lap(b, "counts+plan")?;
    let instances = fp.early.as_ref().map(|r| &r.instances[..]);
    let (weights, w_bytes) = replica_weights(b, cfg, w, instances, &fp.local, el)?;
    laps.lap(b, "replica weights")?;
    let xs = rows_to_send(b, x, &capped.src, &fp.lay.send_order, (n, k, h))?;
    laps.lap(b, "pack x")?;
    // Without replicas (decided from the plan, so alike on every rank)
    // owners keep their forward rows (source-major) for the backward.
    let keep_rows = instances.is_none_or(one_instance_each);
    let lay = &fp.lay;
    let rows = exchange_rows(b, xs, (&lay.send, &lay.recv.from), h, keep_rows)?;
    laps.sent(b, "x out")?;
    Ok(Dispatched {
        tokens,
        routed,
        aux_loss,
        aux_dp,
        capped,
        offsets,
        fp,
        weights,
        w_bytes,
        rows,
        keep_rows,
    })
}

/// The auxiliary loss and its per-expert probability gradient
/// (`crate::router::aux_loss_terms`, `P_e` by a column mean in the
/// backend); `(0, None)` when off.
#[allow(clippy::type_complexity)]
fn aux_terms<B: Backend>(
    b: &B,
    alpha: f64,
    r: &RoutedOf<B>,
    world: usize,
) -> Result<(f64, Option<Buf<B, Sc<B>>>), LayerError> {
    let counts: Vec<u64> = B::routed_counts(r).iter().map(|&c| u64::from(c)).collect();
    let (tokens, experts) = (B::routed_tokens(r), counts.len());
    let (loss, dp) = crate::router::aux_loss_terms(alpha, &counts, tokens, world, || {
        let mean = b.col_mean(B::routed_probs(r), tokens, experts)?;
        let mean_p = b.download(&mean, experts)?;
        Ok(mean_p.into_iter().map(Scalar::to_f64).collect())
    })?;
    if dp.is_empty() {
        return Ok((0.0, None));
    }
    let dp: Vec<Sc<B>> = dp.into_iter().map(Sc::<B>::from_f64).collect();
    Ok((loss, Some(b.upload(&dp)?)))
}

/// The rows that reach an expert under a capacity, and their index maps.
pub(crate) struct Capped<F: Family> {
    /// Rows per expert.
    pub(crate) counts: Vec<u32>,
    /// Row → pair.
    pub(crate) src: F::Buf<u32>,
    /// Pair → row, or `DROPPED`.
    pub(crate) dst: F::Buf<u32>,
    /// Pair → row, or the row count for a dropped pair (the forward's
    /// zero output row); `None` when nothing was dropped.
    pub(crate) dst_fwd: Option<F::Buf<u32>>,
}

/// Keeps the first `cap` rows of each expert (rows grouped by expert in
/// pair order, so the first `cap` pairs of each expert): the host builds
/// the row maps from the counts, the backend composes them with the
/// grouping.
fn cap_rows<B: Backend>(
    b: &B,
    routed: &[u32],
    cap: usize,
    src: &Buf<B, u32>,
    dst: &Buf<B, u32>,
    p: usize,
) -> Result<Capped<B::F>, LayerError> {
    let counts: Vec<u32> = routed.iter().map(|&c| c.min(cap as u32)).collect();
    let n: usize = counts.iter().map(|&c| c as usize).sum();
    let (mut keep, mut place, mut place_fwd) = (
        Vec::with_capacity(n),
        Vec::with_capacity(p),
        Vec::with_capacity(p),
    );
    let mut row = 0u32;
    for (&c, &kept) in routed.iter().zip(&counts) {
        for i in 0..c {
            if i < kept {
                place.push(keep.len() as u32);
                place_fwd.push(keep.len() as u32);
                keep.push(row);
            } else {
                place.push(kernels::limits::DROPPED);
                place_fwd.push(n as u32);
            }
            row += 1;
        }
    }
    if row as usize != p {
        return Err(LayerError::Config(format!(
            "routed counts add up to {row} pairs, {p} routed"
        )));
    }
    let (keep, place, place_fwd) = (b.upload(&keep)?, b.upload(&place)?, b.upload(&place_fwd)?);
    // SAFETY: keep holds n rows below p (the grouped rows src maps); dst
    // maps every pair to one of the p grouped rows, which place and
    // place_fwd (p entries each) map on.
    unsafe {
        Ok(Capped {
            counts,
            src: b.gather32(src, &keep, n)?,
            dst: b.gather32(&place, dst, p)?,
            dst_fwd: Some(b.gather32(&place_fwd, dst, p)?),
        })
    }
}
