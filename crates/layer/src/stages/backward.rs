//! The backward in the LRMoE order: scores → select → redistribute → pack
//! and send the kept rows → expert gradients → return `dX` and the owners'
//! gradients.

use std::borrow::Cow;

use pack::ep::{instance_layout, replica_traffic, InstanceLayout};

use crate::backend::{Backend, Buf, Family, Overlap, Rows, Sc, Val, Wts};
use crate::config::{at_least, Experts, MoeConfig};
use crate::plan::{check_split, one_instance_each, DevicePlanner, EpPlan};
use crate::LayerError;

use super::common::{
    block_runs, copy_rows, elems, exchange_rows, exclusive_scan, off_rank, pack_blocks,
    pack_tensor_blocks, packed_parts, permute4, permute_rows, tensor_block, Held, Laps,
};
use super::forward::Saved;
use super::weights::{local_weights, Weights};

/// Gradients and figures of one backward on one rank, in buffers `B`
/// (bf16 bits on the device) and `R` (the router's, f32).
#[derive(Debug, Clone)]
pub struct Grads<B, R> {
    /// Input gradient of this rank's tokens, `T × H`.
    pub dx: B,
    /// Router gradient summed over ranks, `H × E`.
    pub router: R,
    /// This rank's experts' gradients (replicas' summed in): gate and up
    /// `E_l × H × F`, down `E_l × F × H`.
    pub experts: Experts<B>,
    /// Kept pairs this rank's instances processed.
    pub kept_pairs: usize,
    /// Rows this rank's instances computed in the forward of the call (the
    /// forward's split of every routed pair over the instances: a hot
    /// expert's owner with no replica gets all of its rows).
    pub forward_rows: usize,
    /// Kept pairs over all ranks (what the selection kept).
    pub kept_total: usize,
    /// Bytes this rank sent to other ranks in the backward (scores, kept
    /// rows, dX rows, replica gradients; not the router's all-reduce).
    pub bytes_sent: usize,
}

/// [`Grads`] in backend `B`'s buffers.
pub type GradsOf<B> = Grads<Rows<B>, Buf<B, Sc<B>>>;

/// The backward's selection: per row of this source, whether it is kept
/// (`u8` flags, expert-major), the flags over every source's rows in the
/// global order (`None` when every pair is kept), each pair's routing
/// weight times the rule's weight (the unbiased rules), and this source's
/// kept rows per expert (read on the host later).
type Selected<'g, B> = (
    Buf<B, u8>,
    Option<Buf<B, u8>>,
    Option<Buf<B, Sc<B>>>,
    Option<<B as Backend>::Later<'g, u32>>,
);

/// Every pair kept — each expert's quota covers its pairs over every source
/// (full retention, or a budget that does not bind): no score crosses
/// ranks, nothing is selected and every rank already knows the kept counts
/// (the forward's). The local top-q at q = n still checks every score (a
/// non-finite dy is an error, flagged in `err`) and flags every row; every
/// rule's weight is then 1 (priority sampling's threshold is 0).
fn keep_every_row<'g, B: Backend>(
    b: &'g B,
    sv: &Saved<B::F>,
    scores: &Buf<B, Sc<B>>,
    err: &mut Buf<B, u32>,
) -> Result<Selected<'g, B>, LayerError> {
    let own: Vec<u32> = sv.offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let top_q = (lrm_score::Rule::TopQ, 0);
    // SAFETY: src holds one id per expert-major row, as the scores do.
    let (kept, _) = unsafe { b.select(scores, &sv.src, &sv.offsets, &own, top_q, err) }?;
    Ok((kept, None, None, None))
}

/// Every source's `p` values on every rank, rank-major (`p` slots per
/// source, the first `n` its routed rows; the rest zero); `what` names the
/// exchange on the timeline.
fn gather_all<B: Backend, E: crate::backend::Elem>(
    b: &B,
    sv: &Saved<B::F>,
    (vals, what): (Buf<B, E>, &'static str),
    laps: &mut Laps<B::F>,
) -> Result<Buf<B, E>, LayerError> {
    let (rank, world) = (b.rank(), b.world_size());
    let n = sv.rows;
    let p = sv.tokens * sv.cfg.top_k;
    let mut vals = vals;
    if n < p {
        // Every source contributes p slots to the gather; only its first n
        // are routed rows (order.perm never points past them).
        let mut padded = b.zeros::<E>(p)?;
        if n > 0 {
            b.copy(&vals, 0, &mut padded, 0, n)?;
        }
        vals = padded;
    }
    if world == 1 {
        return Ok(vals);
    }
    // Every other rank gets the one buffer whole; their p each land
    // rank-major.
    let sp: Vec<_> = (0..world)
        .map(|d| (0, 0, if d == rank { 0 } else { p }))
        .collect();
    let rp = packed_parts(&vec![p; world], &vec![p; world], rank, 1).1;
    // SAFETY: the exchange writes every other rank's p values, the copy
    // below the own ones.
    let mut fl = b.start(vec![vals], &sp, unsafe { b.uninit(world * p) }?, &rp)?;
    laps.sent(b, what)?;
    let (sends, recv) = B::flight_buffers(&mut fl)?;
    copy_rows(b, &sends[0], 0, recv, rank, (1, p))?;
    Ok(b.finish(fl)?.0)
}

/// Each pair's routing weight times the rule's weight of its row
/// (`w_rows`, one per row of `rows`, which `rows_of` maps this source's
/// expert-major rows into).
fn pair_weights<B: Backend>(
    b: &B,
    sv: &Saved<B::F>,
    w_rows: &Buf<B, Sc<B>>,
    rows_of: Option<&Buf<B, u32>>,
) -> Result<Buf<B, Sc<B>>, LayerError> {
    let (n, p) = (sv.rows, sv.tokens * sv.cfg.top_k);
    // This source's pairs: (global row →) expert-major row → pair.
    // SAFETY: rows_of maps this source's n rows into the rows w_rows
    // holds; dst maps each pair to one of the n rows or DROPPED.
    let w_pair = unsafe {
        match rows_of {
            Some(mine) => b.gather32(&b.gather32(w_rows, mine, n)?, &sv.dst, p)?,
            None => b.gather32(w_rows, &sv.dst, p)?,
        }
    };
    b.mul(B::routed_gates(&sv.routed), &w_pair, p)
}

/// The same per-expert selection on every rank over every source's pairs:
/// the scores all-gathered in the global expert-major order, the plan's
/// rule within each expert's quota, this source's flags and kept counts.
fn select_over_sources<'g, B: Backend>(
    b: &'g B,
    sv: &Saved<B::F>,
    scores: Buf<B, Sc<B>>,
    err: &mut Buf<B, u32>,
    laps: &mut Laps<B::F>,
) -> Result<Selected<'g, B>, LayerError> {
    let (n, e) = (sv.rows, sv.cfg.n_experts);
    let n_all = sv.order.offsets[e] as usize;
    let all = gather_all(b, sv, (scores, "scores"), laps)?;
    laps.lap(b, "scores+gather")?;
    // The same per-expert selection on every rank, over every source's pairs.
    let g_scores = if sv.order.identity {
        all
    } else {
        // SAFETY: order.perm holds n_all indices into the W·p gathered scores.
        unsafe { b.gather32(&all, &sv.order.perm, n_all) }?
    };
    let rule = (sv.plan.rule, sv.plan.seed);
    // SAFETY: order.perm holds one id per row of the global order, which
    // increases with (source, pair) within an expert: the tie rule.
    let (kept_g, weights) = unsafe {
        b.select(
            &g_scores,
            &sv.order.perm,
            &sv.order.offsets,
            &sv.plan.quotas,
            rule,
            err,
        )
    }?;
    let pair_weight = match &weights {
        Some(w) => Some(pair_weights(b, sv, w, Some(&sv.order.mine))?),
        None => None,
    };
    // SAFETY: order.mine maps this source's n rows into the n_all flags.
    let mask = unsafe { b.gather_flags(&kept_g, &sv.order.mine, n) }?;
    let mine_d = b.kept_counts(&sv.order.expert_of_row, &mask, n, e)?;
    // The host needs the kept counts to plan; the router's backward
    // (complete and local) keeps the backend busy meanwhile.
    let mine = b.download_later(&mine_d, e)?;
    Ok((mask, Some(kept_g), pair_weight, Some(mine)))
}

/// Selection per source ([`crate::Selection::PerSourceExpert`], a
/// per-source send budget binds): this source keeps its own cell's quota
/// of each expert over its own pairs; the flags are then all-gathered in
/// the global order, for the owners' masks.
fn select_per_source<'g, B: Backend>(
    b: &'g B,
    sv: &Saved<B::F>,
    (scores, cells): (Buf<B, Sc<B>>, &[u32]),
    err: &mut Buf<B, u32>,
    laps: &mut Laps<B::F>,
) -> Result<Selected<'g, B>, LayerError> {
    let (n, e) = (sv.rows, sv.cfg.n_experts);
    let n_all = sv.order.offsets[e] as usize;
    let rule = (sv.plan.rule, sv.plan.seed);
    // SAFETY: src holds one id per expert-major row, as the scores do.
    let (mask, weights) = unsafe { b.select(&scores, &sv.src, &sv.offsets, cells, rule, err) }?;
    let pair_weight = match &weights {
        Some(w) => Some(pair_weights(b, sv, w, None)?),
        None => None,
    };
    let all = gather_all(b, sv, (mask.clone(), "kept flags"), laps)?;
    let kept_g = if sv.order.identity {
        all
    } else {
        // SAFETY: order.perm holds n_all indices into the W·p gathered flags.
        unsafe { b.gather_flags(&all, &sv.order.perm, n_all) }?
    };
    let mine_d = b.kept_counts(&sv.order.expert_of_row, &mask, n, e)?;
    let mine = b.download_later(&mine_d, e)?;
    Ok((mask, Some(kept_g), pair_weight, Some(mine)))
}

/// The backward's kept set: per row of this source whether it is kept
/// (expert-major), the flags over every source's rows (global order; `None`
/// when every pair is kept), each pair's routing weight times the rule's
/// weight (the unbiased rules), the kept pairs per expert over every source
/// and per (source, expert), and the router's gradients (its sum over ranks
/// not yet started).
struct KeptSet<F: Family> {
    mask: F::Buf<u8>,
    kept_g: Option<F::Buf<u8>>,
    pair_weight: Option<F::Buf<F::S>>,
    /// Kept pairs per expert, over every source.
    global: Vec<u32>,
    /// Kept pairs per source and expert.
    kept: Vec<Vec<u32>>,
    router: F::Buf<F::S>,
    dx_router: F::Buf<F::V>,
    /// This source's rows' scores, when the caller asked for them.
    scores: Option<F::Buf<F::S>>,
}

/// The plan's selection of this source's rows by their scores: every row
/// where every quota covers its expert, per source where the plan has
/// cells, else per expert over every source's rows.
fn select_rows<'g, B: Backend>(
    b: &'g B,
    sv: &Saved<B::F>,
    scores: Buf<B, Sc<B>>,
    err: &mut Buf<B, u32>,
    laps: &mut Laps<B::F>,
) -> Result<Selected<'g, B>, LayerError> {
    // Every pair kept — each expert's quota covers its pairs over every
    // source (full retention, or a budget that does not bind): no score
    // crosses ranks and every rank already knows the kept counts.
    let segments = sv.order.offsets.windows(2);
    let keep_all = sv.plan.cells.is_none()
        && (sv.plan.quotas.iter().zip(segments)).all(|(&q, w)| q >= w[1] - w[0]);
    match &sv.plan.cells {
        _ if keep_all => {
            let selected = keep_every_row(b, sv, &scores, err)?;
            laps.lap(b, "scores+gather")?;
            Ok(selected)
        }
        Some(cells) => {
            let cells = (cells.get(b.rank())).ok_or(LayerError::Config("no cell quotas".into()))?;
            select_per_source(b, sv, (scores, cells), err, laps)
        }
        None => select_over_sources(b, sv, scores, err, laps),
    }
}

/// Backward stage 1: the LRM scores of this source's pairs, the selection
/// within the plan's quotas, and the router's backward (complete and
/// local: it keeps the backend busy while the host waits for the kept
/// counts).
fn score_and_select<B: Backend>(
    b: &B,
    w: &Weights<B::F>,
    sv: &Saved<B::F>,
    dy: &Rows<B>,
    (laps, keep_scores): (&mut Laps<B::F>, bool),
) -> Result<KeptSet<B::F>, LayerError> {
    let (h, k, n) = (sv.cfg.hidden, sv.cfg.top_k, sv.rows);
    let dy_sq = b.row_sq(dy, sv.tokens, h)?;
    let gates = B::routed_gates(&sv.routed);
    // SAFETY: src maps the n expert-major rows to pairs (< p = t · k) and
    // h_sq holds n entries.
    let scores = unsafe { b.scores_from_norms(gates, &dy_sq, &sv.h_sq, &sv.src, n, k) }?;
    let kept_scores = keep_scores.then(|| scores.clone());
    let mut err = b.upload(&[0u32])?;
    let (mask, kept_g, pair_weight, mine) = select_rows(b, sv, scores, &mut err, laps)?;
    let flag = b.download_later(&err, 1)?;
    // SAFETY: row_of_pair maps each of the p pairs to a row of o (the
    // forward's p returned rows).
    let (router, dx_router) = unsafe {
        let (aux, rows) = (sv.aux_dp.as_ref(), &sv.row_of_pair);
        b.router_backward(&sv.routed, aux, &w.router, &sv.x, dy, &sv.o, rows, h)
    }?;
    b.settle()?;
    if b.wait(flag)?[0] != 0 {
        return Err(LayerError::NonFinite(
            "a LRM score of the backward (non-finite dy?)",
        ));
    }
    let mine = match mine {
        Some(m) => Some(b.wait(m)?),
        None => None,
    };
    let (kept, global) = kept_counts(b, sv, mine)?;
    laps.lap(b, "select + router")?;
    Ok(KeptSet {
        mask,
        kept_g,
        pair_weight,
        global,
        kept,
        router,
        dx_router,
        scores: kept_scores,
    })
}

/// The kept pairs per (source, expert) and per expert: the forward's
/// counts when every pair is kept (`mine` is `None`), else every source's
/// own count all-gathered — checked against this rank's count of the
/// global selection where the rule keeps exactly `min(q_e, n_e)` (top-q
/// and priority sampling flag that many rows of expert e's segment when no
/// score is non-finite: their contract, tested against
/// `select_top_reference`).
#[allow(clippy::type_complexity)]
fn kept_counts<B: Backend>(
    b: &B,
    sv: &Saved<B::F>,
    mine: Option<Vec<u32>>,
) -> Result<(Vec<Vec<u32>>, Vec<u32>), LayerError> {
    let sum = |rows: &[Vec<u32>]| {
        rows.iter()
            .fold(vec![0; sv.cfg.n_experts], |a, r| add(a, r))
    };
    let Some(mine) = mine else {
        return Ok((sv.counts_all.clone(), sum(&sv.counts_all)));
    };
    let kept = b.all_gather_counts(&mine)?;
    let global = sum(&kept);
    let exact = matches!(
        sv.plan.rule,
        lrm_score::Rule::TopQ | lrm_score::Rule::Priority
    );
    if exact && sv.plan.cells.is_none() {
        agreed_kept(&sv.plan.quotas, sv.order.offsets.windows(2), &global)?;
    }
    Ok((kept, global))
}

/// `acc + row`, element-wise.
fn add(mut acc: Vec<u32>, row: &[u32]) -> Vec<u32> {
    acc.iter_mut().zip(row).for_each(|(a, &r)| *a += r);
    acc
}

/// Every source's kept pairs per expert (`global`, summed over the
/// all-gathered counts) against this rank's own count of the global
/// selection, `min(q_e, n_e)` per expert.
fn agreed_kept<'a>(
    quotas: &[u32],
    segments: impl Iterator<Item = &'a [u32]>,
    global: &[u32],
) -> Result<(), LayerError> {
    for (ex, ((&q, seg), &sum)) in quotas.iter().zip(segments).zip(global).enumerate() {
        let g = q.min(seg[1] - seg[0]);
        if sum != g {
            return Err(LayerError::Kernel(kernels::KernelError::Comm(format!(
                "ranks disagree on expert {ex}'s kept pairs ({sum} reported, {g} selected here)"
            ))));
        }
    }
    Ok(())
}

/// Backward stage 2: the planner's redistribution of the kept pairs over
/// the existing instances, checked against the kept counts, the instances
/// and the ranks' pair caps, as this rank's layout.
fn redistribute_kept<F: Family>(
    planner: &DevicePlanner,
    sv: &Saved<F>,
    kept: &[Vec<u32>],
    rank: usize,
) -> Result<(InstanceLayout, Vec<u64>), LayerError> {
    let split = planner.backward(&sv.plan, kept)?;
    check_split(&split, kept, &sv.plan.instances)?;
    let loads = split.loads();
    if let Some(caps) = &sv.plan.caps {
        for (r, (&cap, &load)) in caps.iter().zip(&loads).enumerate() {
            if load > cap {
                return Err(LayerError::Config(format!(
                    "the redistribution gives rank {r} {load} pairs, over its cap {cap}"
                )));
            }
        }
    }
    Ok((instance_layout(&split, &sv.local, rank)?, loads))
}

/// This source's kept rows, compacted: each row's kept position (`place`,
/// expert-major), the kept pairs in send order, and their `g·δ` rows.
struct PackedKept<F: Family> {
    place: F::Buf<u32>,
    pair: F::Buf<u32>,
    dk_send: F::Buf<F::V>,
    rows: usize,
}

/// Backward stage 3: the kept rows compacted (expert-major), put in
/// destination order, and their `g·δ` rows gathered (the rule's weight in
/// place of the routing weight where it has one).
fn pack_kept<B: Backend>(
    b: &B,
    sv: &Saved<B::F>,
    ks: &KeptSet<B::F>,
    lay: &InstanceLayout,
    dy: &Rows<B>,
    rank: usize,
) -> Result<PackedKept<B::F>, LayerError> {
    let (h, e, k) = (sv.cfg.hidden, sv.cfg.n_experts, sv.cfg.top_k);
    let kbase = exclusive_scan(&ks.kept[rank]);
    let n_k = kbase[e] as usize;
    let seg = b.upload(&sv.offsets)?;
    // SAFETY: expert_of_row and mask hold n entries; kbase is the prefix
    // sum of this rank's kept counts per expert, counted from the same
    // mask and keys; seg is the rows' own expert partition.
    let (place, kept_rows) = unsafe {
        let keys = &sv.order.expert_of_row;
        b.group(
            keys,
            Some(&ks.mask),
            Some(&seg),
            &kbase[..e],
            sv.rows,
            n_k,
            e,
        )
    }?;
    let kept_rows = permute4(b, kept_rows, &lay.send_order)?;
    // SAFETY: kept_rows holds n_k expert-major rows (< n), src maps rows to
    // pairs (< p = t · k): pair / k is a token of dy and x.
    let pair = unsafe { b.gather32(&sv.src, &kept_rows, n_k) }?;
    let scale = (ks.pair_weight.as_ref()).unwrap_or(B::routed_gates(&sv.routed));
    // SAFETY: as above; the scale holds one weight per pair.
    let dk_send = unsafe { b.gather_rows(dy, &pair, k, Some(scale), n_k, h) }?;
    Ok(PackedKept {
        place,
        pair,
        dk_send,
        rows: n_k,
    })
}

/// Kept rows of an owner: `x`, and their projections `x·W_gate`, `x·W_up`
/// where the forward kept them; borrowed where they are the forward's
/// rows as they are.
type OwnerKept<'a, B> = (
    Cow<'a, Rows<B>>,
    Option<(Cow<'a, Rows<B>>, Cow<'a, Rows<B>>)>,
);

/// An owner's kept `x` rows (and projections, if kept) from its forward
/// rows (expert, source, pair order), masked by its slice of the global
/// selection: the kept rows in the order the sources sent their `g·δ`
/// rows. Taken forward rows are moved where every row is kept, and
/// released here once the kept ones are gathered (before the experts'
/// intermediates and gradients are allocated).
fn owner_kept_rows<'a, B: Backend>(
    b: &B,
    own: Held<'a, B::F>,
    (kept_g, global): (Option<&Buf<B, u8>>, &[u32]),
    (rank, el, n_r, (h, f)): (usize, usize, usize, (usize, usize)),
) -> Result<OwnerKept<'a, B>, LayerError> {
    let (lo, hi) = own.global;
    // Every row when every pair is kept.
    let m = match kept_g {
        None => None,
        Some(kept_g) => {
            // SAFETY: the copy writes all hi - lo flags.
            let mut m = unsafe { b.uninit::<u8>(hi - lo) }?;
            if hi > lo {
                b.copy(kept_g, lo, &mut m, 0, hi - lo)?;
            }
            Some(m)
        }
    };
    let kb = exclusive_scan(&global[rank * el..(rank + 1) * el]);
    if kb[el] as usize != n_r {
        return Err(LayerError::Config(format!(
            "rank {rank} expects {n_r} kept rows, its selection kept {}",
            kb[el]
        )));
    }
    if m.is_none() && own.perm.is_none() && n_r == hi - lo {
        // Every row kept and the rows arrived expert-major (one rank): the
        // grouping below is the identity, so the forward's rows serve as
        // they are (measured: a 0.3 ms copy of 131 072 rows of 2048 per
        // call on the A3B expert shape).
        return Ok(match own {
            Held::Borrowed(own) => (
                Cow::Borrowed(&own.x),
                (own.ab.as_ref()).map(|(a, c)| (Cow::Borrowed(a), Cow::Borrowed(c))),
            ),
            Held::Taken(own) => (
                Cow::Owned(own.x),
                own.ab.map(|(a, c)| (Cow::Owned(a), Cow::Owned(c))),
            ),
        });
    }
    // SAFETY: own.expert and m hold hi - lo entries (this owner's forward
    // rows, expert-major); kb is the prefix sum of the rows this rank's
    // selection flagged in that range per local expert (`global`:
    // min(q_e, n_e), the selection's postcondition), so the writes fill
    // exactly n_r rows; own.perm maps expert-major rows to the rows of
    // own.x (a `pack::ep` layout's permutation).
    unsafe {
        let seg = Some(&own.offsets);
        let (_, rows) = b.group(&own.expert, m.as_ref(), seg, &kb[..el], hi - lo, n_r, el)?;
        let rows = match &own.perm {
            Some(perm) => b.gather32(perm, &rows, n_r)?,
            None => rows,
        };
        // The projections are rows of f values in the order of own.x's.
        let ab = match &own.ab {
            Some((a, c)) => Some((
                Cow::Owned(b.gather_rows(a, &rows, 1, None, n_r, f)?),
                Cow::Owned(b.gather_rows(c, &rows, 1, None, n_r, f)?),
            )),
            None => None,
        };
        let x = b.gather_rows(&own.x, &rows, 1, None, n_r, h)?;
        Ok((Cow::Owned(x), ab))
    }
}

/// The kept rows in flight to their instances: `x` rows (only where a kept
/// pair may change instance: no owner kept its forward rows) and `g·δ`
/// rows.
type KeptFlights<B> = (
    Option<<B as Backend>::Flight<crate::backend::Val<B>>>,
    <B as Backend>::Flight<crate::backend::Val<B>>,
);

/// Backward stage 4, on the source: the kept rows go out.
fn send_kept<B: Backend>(
    b: &B,
    sv: &Saved<B::F>,
    lay: &InstanceLayout,
    (pair, rows, owned): (&Buf<B, u32>, usize, bool),
    dk_send: Rows<B>,
) -> Result<KeptFlights<B>, LayerError> {
    let (h, k) = (sv.cfg.hidden, sv.cfg.top_k);
    let travel = |rows: Rows<B>| exchange_rows(b, rows, (&lay.send, &lay.recv.from), h, true);
    let x_fl = if owned {
        None
    } else {
        // SAFETY: as for the g·δ rows (pack_kept).
        Some(travel(unsafe {
            b.gather_rows(&sv.x, pair, k, None, rows, h)
        }?)?)
    };
    Ok((x_fl, travel(dk_send)?))
}

/// Backward stage 4, on the instance: the kept `x` and `g·δ` rows in
/// instance order (an owner that kept its forward rows takes `x` from
/// them, masked by the selection; borrowed or moved where nothing is
/// masked or moved).
fn receive_kept<'a, B: Backend>(
    b: &B,
    (sv, own): (&Saved<B::F>, Option<Held<'a, B::F>>),
    lay: &InstanceLayout,
    (x_fl, d_fl): KeptFlights<B>,
    selection: (Option<&Buf<B, u8>>, &[u32]),
    (rank, el): (usize, usize),
) -> Result<(OwnerKept<'a, B>, Rows<B>), LayerError> {
    let (h, f, n_r) = (sv.cfg.hidden, sv.cfg.ffn, lay.recv.perm.len);
    let xk = match (x_fl, own) {
        (Some(fl), _) => (
            Cow::Owned(permute_rows(b, b.finish(fl)?.0, &lay.recv.perm, h)?),
            None,
        ),
        (None, Some(own)) => owner_kept_rows(b, own, selection, (rank, el, n_r, (h, f)))?,
        (None, None) => {
            return Err(LayerError::Config(
                "device backward: no x rows (invariant)".into(),
            ))
        }
    };
    let dk = permute_rows(b, b.finish(d_fl)?.0, &lay.recv.perm, h)?;
    Ok((xk, dk))
}

/// Backward stage 5, on an instance: the kept rows' `dX` first (from the
/// forward's projections where the owner kept them), sent back
/// to their sources while the weight gradients are computed; the `dX` rows
/// this source receives and the instances' weight gradients.
#[allow(clippy::type_complexity)]
fn experts_backward<B: Backend>(
    b: &B,
    lay: &InstanceLayout,
    (xk, abk, dk): (&Rows<B>, Option<(&Rows<B>, &Rows<B>)>, &Rows<B>),
    wts: Wts<'_, B>,
    (h, f): (usize, usize),
    laps: &mut Laps<B::F>,
) -> Result<(Rows<B>, Experts<Rows<B>>), LayerError> {
    let (dxk, rest) = b.experts_backward_data(&lay.recv.offsets, xk, abk, dk, wts, (h, f))?;
    laps.lap(b, "experts dX")?;
    let dx_src = if lay.recv.perm.len > 0 {
        permute_rows(b, dxk, &lay.recv.inv, h)?
    } else {
        dxk
    };
    let dx_fl = exchange_rows(b, dx_src, (&lay.recv.from, &lay.send), h, true)?;
    laps.sent(b, "dX back")?;
    let overlap = Overlap::new(b);
    let grads = b.experts_backward_weights(rest, xk, dk)?;
    laps.lap(b, "experts dW")?;
    let dx_rows = b.finish(dx_fl)?.0;
    overlap.end()?;
    laps.lap(b, "a2a dX")?;
    Ok((dx_rows, grads))
}

/// What a backward saw, for the host executor's figures (only when asked
/// for: the device executor never is).
pub(crate) struct Trace<F: Family> {
    /// This source's expert-major rows' LRM scores and kept flags.
    pub(crate) scores: F::Buf<F::S>,
    pub(crate) mask: F::Buf<u8>,
    /// Kept pairs per source and expert.
    pub(crate) kept: Vec<Vec<u32>>,
    /// Kept pairs each rank's instances process.
    pub(crate) loads: Vec<u64>,
    /// Milliseconds of each phase of the call, in order.
    pub(crate) laps: Vec<(&'static str, f64)>,
}

/// The LRMoE backward for `dy` (this rank's tokens, `tokens × hidden`):
/// expert `e` keeps `plan.quotas[e]` pairs over all sources by LRM score
/// (top-q, or the plan's sampling rule); the planner splits the kept pairs
/// over the instances; only kept rows travel and are multiplied. The
/// owner's forward rows are borrowed from `sv` (another backward of it may
/// run) or `own` takes them (released as soon as the kept rows are
/// gathered from them). The device executor's (the host's asks for the
/// trace).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn backward<B: Backend>(
    b: &B,
    w: &Weights<B::F>,
    (sv, own): (&Saved<B::F>, Option<Held<'_, B::F>>),
    dy: &Rows<B>,
    planner: &DevicePlanner,
) -> Result<GradsOf<B>, LayerError> {
    Ok(backward_traced(b, w, (sv, own), dy, planner, false)?.0)
}

/// [`backward`], and with `trace` what it saw ([`Trace`]).
#[allow(clippy::type_complexity)]
pub(crate) fn backward_traced<B: Backend>(
    b: &B,
    w: &Weights<B::F>,
    (sv, own): (&Saved<B::F>, Option<Held<'_, B::F>>),
    dy: &Rows<B>,
    planner: &DevicePlanner,
    trace: bool,
) -> Result<(GradsOf<B>, Option<Trace<B::F>>), LayerError> {
    let cfg = &sv.cfg;
    let (t, h, k) = (sv.tokens, cfg.hidden, cfg.top_k);
    let (rank, el) = (b.rank(), sv.per_rank);
    at_least("dy (tokens × hidden)", t * h, B::len(dy))?;
    let mut laps = Laps::new(b, trace)?;
    let ks = score_and_select(b, w, sv, dy, (&mut laps, trace))?;
    let (lay, loads) = redistribute_kept(planner, sv, &ks.kept, rank)?;
    laps.lap(b, "redistribute")?;
    let pk = pack_kept(b, sv, &ks, &lay, dy, rank)?;
    laps.lap(b, "pack")?;
    // Stage 4: kept rows travel; the router gradient's sum over ranks
    // follows beside them.
    let owned = own.is_some();
    let flights = send_kept(b, sv, &lay, (&pk.pair, pk.rows, owned), pk.dk_send)?;
    laps.sent(b, "kept rows out")?;
    let router_fl = b.start_sum(ks.router)?;
    laps.sent(b, "router sum")?;
    let selection = (ks.kept_g.as_ref(), &ks.global[..]);
    let ((xk, abk), dk) = receive_kept(b, (sv, own), &lay, flights, selection, (rank, el))?;
    laps.lap(b, "a2a kept rows")?;
    let wts = local_weights::<B>(w, &sv.weights);
    let abk = abk.as_ref().map(|(a, c)| (&**a, &**c));
    let dims = (h, cfg.ffn);
    let (dx_rows, grads) = experts_backward(b, &lay, (&xk, abk, &dk), wts, dims, &mut laps)?;
    drop((xk, dk));
    // Stage 6, on the source: scatter-add the kept pairs' dX into the tokens.
    let kinv = b.expand(&lay.send_inv)?;
    // SAFETY: dst maps pairs to expert-major rows (< n) or DROPPED, place
    // maps those to kept positions (< n_k) or DROPPED, kinv is a
    // permutation of the n_k kept rows: row is a row of dx_rows or DROPPED
    // for every pair. One pass: the router's dX plus every kept pair's row
    // of its token.
    let dx = unsafe {
        let row = b.gather32(&kinv, &b.gather32(&pk.place, &sv.dst, t * k)?, t * k)?;
        b.combine_rows(&dx_rows, &row, None, Some(&ks.dx_router), (t, h, k))
    }?;
    let router = b.finish(router_fl)?.0;
    laps.lap(b, "scatter")?;
    let (experts, g_bytes) = owner_gradients(b, cfg, &sv.plan, &sv.local, el, grads)?;
    b.settle()?;
    laps.lap(b, "replica grads")?;
    laps.print(b, "backward")?;
    let kept_total = ks.kept.iter().flatten().map(|&c| c as usize).sum();
    let traced = match (trace, ks.scores) {
        (true, Some(scores)) => Some(Trace {
            scores,
            mask: ks.mask,
            kept: ks.kept,
            loads,
            laps: laps.intervals(b)?,
        }),
        _ => None,
    };
    let bytes_sent = sent_bytes(sv, &lay, (rank, b.world_size()), owned) + g_bytes;
    let g = Grads {
        dx,
        router,
        experts,
        kept_pairs: lay.recv.perm.len,
        forward_rows: (sv.plan.forward.loads().get(rank)).map_or(0, |&r| r as usize),
        kept_total,
        bytes_sent,
    };
    Ok((g, traced))
}

/// Bytes this rank sends to others in a backward: scores, kept `x` rows
/// where they travel, `g·δ` rows, `dX` replies.
fn sent_bytes<F: Family>(
    sv: &Saved<F>,
    lay: &InstanceLayout,
    (rank, world): (usize, usize),
    owned: bool,
) -> usize {
    let (t, h, k) = (sv.tokens, sv.cfg.hidden, sv.cfg.top_k);
    let (v, sc) = (std::mem::size_of::<F::V>(), std::mem::size_of::<F::S>());
    let x_rows = if owned { 0 } else { off_rank(&lay.send, rank) };
    let rows = off_rank(&lay.send, rank) + x_rows + off_rank(&lay.recv.from, rank);
    t * k * sc * (world - 1) + rows * h * v
}

/// This rank's own experts' gradients from those of its instances
/// (`local` order): replicas' gradients go to their owners (one
/// all-to-all of the three tensors) and are added there.
fn owner_gradients<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    plan: &EpPlan,
    local: &[Vec<usize>],
    el: usize,
    grads: Experts<Rows<B>>,
) -> Result<(Experts<Rows<B>>, usize), LayerError> {
    let rank = b.rank();
    let hf = cfg.hidden * cfg.ffn;
    if one_instance_each(&plan.instances) {
        return Ok((grads, 0));
    }
    let traffic = replica_traffic(&plan.instances, local, rank, el);
    let below = traffic.below;
    // Replica gradients go back the way the weights came, the three
    // tensors in one exchange (each owner's blocks of each in turn).
    let (out_blocks, send, recv, from_blocks) = (
        &traffic.grads_out,
        &traffic.weights_recv,
        &traffic.weights_send,
        &traffic.grads_in,
    );
    let tensors = [&grads.gate, &grads.up, &grads.down];
    let packed = pack_tensor_blocks(b, &tensors, out_blocks, send, hf)?;
    let got = b.exchange(packed, &elems(send, 3 * hf), &elems(recv, 3 * hf))?;
    let starts = exclusive_scan(recv);
    let owners_sum = |t: usize| -> Result<Rows<B>, LayerError> {
        // This rank's block of the instance gradients, plus each replica's
        // gradient of it, in the order received.
        let mut own = pack_blocks(b, tensors[t], &(below..below + el).collect::<Vec<_>>(), hf)?;
        let moves =
            (from_blocks.iter().enumerate()).map(|(j, &blk)| (tensor_block(&starts, 3, t, j), blk));
        for (from, to, n) in block_runs(moves) {
            b.add_into(&mut own, to * hf, &got, from * hf, n * hf)?;
        }
        Ok(own)
    };
    let summed = Experts {
        gate: owners_sum(0)?,
        up: owners_sum(1)?,
        down: owners_sum(2)?,
    };
    Ok((
        summed,
        out_blocks.len() * 3 * hf * std::mem::size_of::<Val<B>>(),
    ))
}
