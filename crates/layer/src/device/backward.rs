//! The device backward in the LRMoE order: scores → select → redistribute
//! → pack and send the kept rows → expert gradients → return `dX` and the
//! owners' gradients.

use std::borrow::Cow;

use kernels::gpu::{CudaSlice, Gpu};
use kernels::KernelError;
use pack::ep::{instance_layout, replica_traffic, InstanceLayout};

use crate::config::{Experts, MoeConfig};
use crate::plan::{check_split, one_instance_each, DevicePlanner, EpPlan};
use crate::LayerError;

use super::comm::{copy_rows, exchange_rows, packed_parts, Flight, Overlap};
use super::common::{
    elems, exclusive_scan, expand, off_rank, pack_blocks, permute4, permute_rows, Held, Laps, Wts,
};
use super::forward::DeviceSaved;
use super::weights::{local_weights, DeviceWeights};
use super::{DeviceComm, DeviceGrads};

/// The backward's selection: per row of this source, whether it is kept
/// (`u8` flags, expert-major), the flags over every source's rows in the
/// global order, each pair's routing weight times the rule's weight
/// (priority sampling), and this source's kept rows per expert (read on the
/// host later).
pub(super) type Selected<'g> = (
    CudaSlice<u8>,
    Option<CudaSlice<u8>>,
    Option<CudaSlice<f32>>,
    Option<kernels::gpu::Download<'g, u32>>,
);

/// Every pair kept — each expert's quota covers its pairs over every source
/// (full retention, or a budget that does not bind): no score crosses
/// ranks, nothing is selected and every rank already knows the kept counts
/// (the forward's). The local top-q at q = n still checks every score (a
/// non-finite dy is an error, flagged in `err`) and flags every row; every
/// rule's weight is then 1 (priority sampling's threshold is 0).
pub(super) fn keep_every_row<'g>(
    gpu: &'g Gpu,
    sv: &DeviceSaved,
    scores: &CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
) -> Result<Selected<'g>, LayerError> {
    let (n, e) = (sv.rows, sv.cfg.n_experts);
    let own: Vec<u32> = sv.offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let (seg, quotas) = (gpu.upload(&sv.offsets)?, gpu.upload(&own)?);
    // SAFETY: the selection writes a flag for every row.
    let mut kept = unsafe { gpu.uninit::<u8>(n) }?;
    // SAFETY: offsets are this source's E + 1 ascending expert offsets
    // ending at n, the length of the scores, ids (src) and flags;
    // quotas holds E.
    unsafe { gpu.launch_select(scores, &sv.src, &seg, &quotas, &mut kept, err, e) }?;
    Ok((kept, None, None, None))
}

/// Every source's scores on every rank, rank-major (`p` slots per source,
/// the first `n` its routed rows).
pub(super) fn gather_scores(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    sv: &DeviceSaved,
    scores: CudaSlice<f32>,
    laps: &mut Laps,
) -> Result<CudaSlice<f32>, LayerError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let n = sv.rows;
    let p = sv.tokens * sv.cfg.top_k;
    let mut scores = scores;
    if n < p {
        // Every source contributes p slots to the gather; only its first n
        // are routed rows (order.perm never points past them).
        let mut padded = gpu.zeros::<f32>(p)?;
        if n > 0 {
            gpu.copy(&scores.slice(0..n), &mut padded.slice_mut(0..n))?;
        }
        scores = padded;
    }
    let all = if world == 1 {
        scores
    } else {
        // Every other rank gets the one buffer whole; their p each land
        // rank-major.
        let sp: Vec<_> = (0..world)
            .map(|d| (0, 0, if d == rank { 0 } else { p }))
            .collect();
        let rp = packed_parts(&vec![p; world], &vec![p; world], rank, 1).1;
        // SAFETY: the exchange writes every other rank's p scores, the
        // copy below the own ones.
        let mut fl = comm.start(
            gpu,
            vec![scores],
            &sp,
            unsafe { gpu.uninit(world * p) }?,
            &rp,
        )?;
        laps.sent(gpu, comm, "scores")?;
        let (sends, recv) = fl.buffers_mut()?;
        copy_rows(gpu, &sends[0], 0, recv, rank, (1, p))?;
        fl.finish()?.0
    };
    Ok(all)
}

/// The same per-expert selection on every rank over every source's pairs:
/// the scores all-gathered in the global expert-major order, top-q by score
/// or priority sampling (top-q by key, weights from the threshold: the key
/// kept at q + 1 but not at q), this source's flags and kept counts.
pub(super) fn select_over_sources<'g>(
    gpu: &'g Gpu,
    comm: DeviceComm<'_>,
    sv: &DeviceSaved,
    scores: CudaSlice<f32>,
    err: &mut CudaSlice<u32>,
    laps: &mut Laps,
) -> Result<Selected<'g>, LayerError> {
    let (n, e) = (sv.rows, sv.cfg.n_experts);
    let p = sv.tokens * sv.cfg.top_k;
    let n_g = sv.order.offsets[e] as usize;
    let all = gather_scores(gpu, comm, sv, scores, laps)?;
    laps.lap(gpu, "scores+gather")?;
    // The same per-expert selection on every rank, over every source's pairs.
    let n_all = n_g;
    let g_scores = if sv.order.identity {
        all
    } else {
        // SAFETY: order.perm holds n_g indices into the W·p gathered scores.
        unsafe { gpu.gather32(&all, &sv.order.perm, n_all) }?
    };
    let qd = gpu.upload(&sv.plan.quotas)?;
    let god = gpu.upload(&sv.order.offsets)?;
    // Top-q by score, or priority sampling: top-q by key, weights from the
    // threshold (the key kept at q + 1 but not at q).
    let keys = match sv.plan.priority_seed {
        Some(seed) => Some(gpu.priority_keys_dev(&g_scores, &sv.order.perm, seed, n_all)?),
        None => None,
    };
    let by = keys.as_ref().unwrap_or(&g_scores);
    let mut select = |quotas: &CudaSlice<u32>| -> Result<CudaSlice<u8>, LayerError> {
        // SAFETY: the selection writes a flag for every row.
        let mut kept = unsafe { gpu.uninit::<u8>(n_all) }?;
        // SAFETY: order.offsets has E + 1 ascending entries ending at n_g, the
        // length of the scores, ids and flags; quotas holds E.
        unsafe { gpu.launch_select(by, &sv.order.perm, &god, quotas, &mut kept, &mut *err, e) }?;
        Ok(kept)
    };
    let kept_g = select(&qd)?;
    let pair_weight = match &keys {
        Some(rho) => {
            let more: Vec<u32> = sv.plan.quotas.iter().map(|q| q.saturating_add(1)).collect();
            let kept_g1 = select(&gpu.upload(&more)?)?;
            // SAFETY: order.offsets partitions the n_g rows every buffer holds.
            let wt = unsafe {
                gpu.priority_weights_dev(rho, &g_scores, (&kept_g, &kept_g1), &god, n_all, e)
            }?;
            // This source's pairs: global row → expert-major row → pair.
            // SAFETY: order.mine maps this source's n rows into the n_g global
            // rows; dst maps each pair to one of the p rows.
            let w_pair = unsafe {
                let w_rows = gpu.gather32(&wt, &sv.order.mine, n)?;
                gpu.gather32(&w_rows, &sv.dst, p)
            }?;
            Some(gpu.mul_f32_dev(&sv.routed.gates, &w_pair, p)?)
        }
        None => None,
    };
    // SAFETY: order.mine maps this source's n rows into the n_g flags.
    let mask = unsafe { gpu.gather_u8_dev(&kept_g, &sv.order.mine, n) }?;
    let mine_d = gpu.kept_counts_dev(&sv.order.expert_of_row, &mask, n, e)?;
    // The host needs the kept counts to plan; the router's backward
    // (complete and local) keeps the device busy meanwhile.
    let mine = gpu.download_later(&mine_d, e)?;
    Ok((mask, Some(kept_g), pair_weight, Some(mine)))
}

/// The backward's kept set: per row of this source whether it is kept
/// (expert-major), the flags over every source's rows (global order; `None`
/// when every pair is kept), each pair's routing weight times the rule's
/// weight (priority sampling), the kept pairs per expert over every source
/// and per (source, expert), and the router's gradients (its sum over ranks
/// not yet started).
pub(super) struct KeptSet {
    pub(super) mask: CudaSlice<u8>,
    pub(super) kept_g: Option<CudaSlice<u8>>,
    pub(super) pair_weight: Option<CudaSlice<f32>>,
    /// `min(q_e, n_e)` per expert, over every source.
    pub(super) global: Vec<u32>,
    /// Kept pairs per source and expert.
    pub(super) kept: Vec<Vec<u32>>,
    pub(super) router: CudaSlice<f32>,
    pub(super) dx_router: CudaSlice<u16>,
}

/// Backward stage 1: the LRM scores of this source's pairs, the selection
/// within the plan's quotas, and the router's backward (complete and
/// local: it keeps the device busy while the host waits for the kept
/// counts).
pub(super) fn score_and_select(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &DeviceSaved,
    dy: &CudaSlice<u16>,
    laps: &mut Laps,
) -> Result<KeptSet, LayerError> {
    let (h, k, n) = (sv.cfg.hidden, sv.cfg.top_k, sv.rows);
    let dy_sq = gpu.row_sq(dy, sv.tokens, h)?;
    // SAFETY: src maps the p expert-major rows to pairs (< p = t · k) and
    // h_sq holds p entries.
    let scores =
        unsafe { gpu.scores_from_norms(&sv.routed.gates, &dy_sq, &sv.h_sq, &sv.src, n, k) }?;
    let mut err = gpu.upload(&[0u32])?;
    // The selection flags exactly min(q_e, n_e) rows of expert e's segment
    // (its contract, device-tested against `select_top_reference`) when no
    // score is non-finite (checked below): the kept pairs per expert.
    let segments = sv.order.offsets.windows(2);
    let global: Vec<u32> = (sv.plan.quotas.iter().zip(segments.clone()))
        .map(|(&q, w)| q.min(w[1] - w[0]))
        .collect();
    // Every pair kept — each expert's quota covers its pairs over every
    // source (full retention, or a budget that does not bind): no score
    // crosses ranks and every rank already knows the kept counts.
    let keep_all = (sv.plan.quotas.iter().zip(segments)).all(|(&q, w)| q >= w[1] - w[0]);
    let (mask, kept_g, pair_weight, mine) = if keep_all {
        let selected = keep_every_row(gpu, sv, &scores, &mut err)?;
        laps.lap(gpu, "scores+gather")?;
        selected
    } else {
        select_over_sources(gpu, comm, sv, scores, &mut err, laps)?
    };
    let flag = gpu.download_later(&err, 1)?;
    // SAFETY: row_of_pair maps each of the p pairs to a row of o (the
    // forward's p returned rows).
    let (router, dx_router) = unsafe {
        gpu.router_backward(
            &sv.routed,
            sv.aux_dp.as_ref(),
            &w.router,
            &sv.x,
            dy,
            &sv.o,
            &sv.row_of_pair,
            h,
        )
    }?;
    comm.settle()?;
    if flag.wait()?[0] != 0 {
        return Err(LayerError::NonFinite(
            "a LRM score of the device backward (non-finite dy?)",
        ));
    }
    let kept = match mine {
        None => sv.counts_all.clone(),
        Some(mine) => agreed_kept(comm, &mine.wait()?, &global)?,
    };
    laps.lap(gpu, "select + router")?;
    Ok(KeptSet {
        mask,
        kept_g,
        pair_weight,
        global,
        kept,
        router,
        dx_router,
    })
}

/// Every source's kept pairs per expert, all-gathered, and checked against
/// this rank's own count of the global selection (`global`).
pub(super) fn agreed_kept(
    comm: DeviceComm<'_>,
    mine: &[u32],
    global: &[u32],
) -> Result<Vec<Vec<u32>>, LayerError> {
    let kept = comm.all_gather_counts(mine)?;
    for (ex, &g) in global.iter().enumerate() {
        let sum: u64 = kept.iter().map(|row| u64::from(row[ex])).sum();
        if sum != u64::from(g) {
            return Err(LayerError::Kernel(KernelError::Comm(format!(
                "ranks disagree on expert {ex}'s kept pairs ({sum} reported, {g} selected here)"
            ))));
        }
    }
    Ok(kept)
}

/// Backward stage 2: the planner's redistribution of the kept pairs over
/// the existing instances, checked against the kept counts, the instances
/// and the ranks' pair caps, as this rank's layout.
pub(super) fn redistribute_kept(
    planner: &DevicePlanner,
    sv: &DeviceSaved,
    kept: &[Vec<u32>],
    rank: usize,
) -> Result<InstanceLayout, LayerError> {
    let split = planner.backward(&sv.plan, kept)?;
    check_split(&split, kept, &sv.plan.instances)?;
    if let Some(caps) = &sv.plan.caps {
        for (r, &cap) in caps.iter().enumerate() {
            let load: u64 = split.iter().flatten().map(|c| u64::from(c[r])).sum();
            if load > cap {
                return Err(LayerError::Config(format!(
                    "the redistribution gives rank {r} {load} pairs, over its cap {cap}"
                )));
            }
        }
    }
    Ok(instance_layout(&split, &sv.local, rank)?)
}

/// This source's kept rows, compacted: each row's kept position (`place`,
/// expert-major), the kept pairs in send order, and their `g·δ` rows.
pub(super) struct PackedKept {
    pub(super) place: CudaSlice<u32>,
    pub(super) pair: CudaSlice<u32>,
    pub(super) dk_send: CudaSlice<u16>,
    pub(super) rows: usize,
}

/// Backward stage 3: the kept rows compacted (expert-major), put in
/// destination order, and their `g·δ` rows gathered (the rule's weight in
/// place of the routing weight where it has one).
pub(super) fn pack_kept(
    gpu: &Gpu,
    sv: &DeviceSaved,
    ks: &KeptSet,
    lay: &InstanceLayout,
    dy: &CudaSlice<u16>,
    rank: usize,
) -> Result<PackedKept, LayerError> {
    let (h, e, k) = (sv.cfg.hidden, sv.cfg.n_experts, sv.cfg.top_k);
    let kbase = exclusive_scan(&ks.kept[rank]);
    let n_k = kbase[e] as usize;
    let seg = gpu.upload(&sv.offsets)?;
    // SAFETY: expert_of_row and mask hold n entries; kbase is the prefix
    // sum of this rank's kept counts per expert, counted from the same
    // mask and keys; seg is the rows' own expert partition.
    let (place, kept_rows) = unsafe {
        gpu.group(
            &sv.order.expert_of_row,
            Some(&ks.mask),
            Some(&seg),
            &kbase[..e],
            sv.rows,
            n_k,
            e,
        )
    }?;
    let kept_rows = permute4(gpu, kept_rows, &lay.send_order)?;
    // SAFETY: kept_rows holds n_k expert-major rows (< n), src maps rows to
    // pairs (< p = t · k): pair / k is a token of dy and x.
    let pair = unsafe { gpu.gather32(&sv.src, &kept_rows, n_k) }?;
    let scale = ks.pair_weight.as_ref().unwrap_or(&sv.routed.gates);
    // SAFETY: as above; the scale holds one weight per pair.
    let dk_send = unsafe { gpu.gather_scaled(dy, &pair, k, Some(scale), n_k, h) }?;
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
pub(super) type OwnerKept<'a> = (
    Cow<'a, CudaSlice<u16>>,
    Option<(Cow<'a, CudaSlice<u16>>, Cow<'a, CudaSlice<u16>>)>,
);

/// An owner's kept `x` rows (and projections, if kept) from its forward
/// rows (expert, source, pair order), masked by its slice of the global
/// selection: the kept rows in the order the sources sent their `g·δ`
/// rows. Taken forward rows are moved where every row is kept, and
/// released here once the kept ones are gathered (before the experts'
/// intermediates and gradients are allocated).
pub(super) fn owner_kept_rows<'a>(
    gpu: &Gpu,
    own: Held<'a>,
    (kept_g, global): (Option<&CudaSlice<u8>>, &[u32]),
    (rank, el, n_r, (h, f)): (usize, usize, usize, (usize, usize)),
) -> Result<OwnerKept<'a>, LayerError> {
    let (lo, hi) = own.global;
    // Every row when every pair is kept.
    let m = match kept_g {
        None => None,
        Some(kept_g) => {
            // SAFETY: the copy writes all hi - lo flags.
            let mut m = unsafe { gpu.uninit::<u8>(hi - lo) }?;
            if hi > lo {
                let v = kept_g.slice(lo..hi);
                let mut to = m.slice_mut(0..hi - lo);
                gpu.copy(&v, &mut to)?;
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
                (own.ab.as_ref()).map(|(a, b)| (Cow::Borrowed(a), Cow::Borrowed(b))),
            ),
            Held::Taken(own) => (
                Cow::Owned(own.x),
                own.ab.map(|(a, b)| (Cow::Owned(a), Cow::Owned(b))),
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
        let (_, rows) = gpu.group(
            &own.expert,
            m.as_ref(),
            Some(&own.offsets),
            &kb[..el],
            hi - lo,
            n_r,
            el,
        )?;
        let rows = match &own.perm {
            Some(perm) => gpu.gather32(perm, &rows, n_r)?,
            None => rows,
        };
        // The projections are rows of f values in the order of own.x's.
        let ab = match &own.ab {
            Some((a, b)) => Some((
                Cow::Owned(gpu.gather_scaled(a, &rows, 1, None, n_r, f)?),
                Cow::Owned(gpu.gather_scaled(b, &rows, 1, None, n_r, f)?),
            )),
            None => None,
        };
        let x = gpu.gather_scaled(&own.x, &rows, 1, None, n_r, h)?;
        Ok((Cow::Owned(x), ab))
    }
}

/// The kept rows in flight to their instances: `x` rows (only where a kept
/// pair may change instance: no owner kept its forward rows) and `g·δ`
/// rows.
pub(super) type KeptFlights = (Option<Flight<u16>>, Flight<u16>);

/// Backward stage 4, on the source: the kept rows go out.
pub(super) fn send_kept(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    sv: &DeviceSaved,
    lay: &InstanceLayout,
    (pair, rows, owned): (&CudaSlice<u32>, usize, bool),
    dk_send: CudaSlice<u16>,
) -> Result<KeptFlights, LayerError> {
    let (h, k) = (sv.cfg.hidden, sv.cfg.top_k);
    let travel =
        |rows: CudaSlice<u16>| exchange_rows(gpu, comm, rows, (&lay.send, &lay.recv.from), h, true);
    let x_fl = if owned {
        None
    } else {
        // SAFETY: as for the g·δ rows (pack_kept).
        Some(travel(unsafe {
            gpu.gather_scaled(&sv.x, pair, k, None, rows, h)
        }?)?)
    };
    Ok((x_fl, travel(dk_send)?))
}

/// Backward stage 4, on the instance: the kept `x` and `g·δ` rows in
/// instance order (an owner that kept its forward rows takes `x` from
/// them, masked by the selection; borrowed or moved where nothing is
/// masked or moved).
pub(super) fn receive_kept<'a>(
    gpu: &Gpu,
    (sv, own): (&DeviceSaved, Option<Held<'a>>),
    lay: &InstanceLayout,
    (x_fl, d_fl): KeptFlights,
    selection: (Option<&CudaSlice<u8>>, &[u32]),
    (rank, el): (usize, usize),
) -> Result<(OwnerKept<'a>, CudaSlice<u16>), LayerError> {
    let (h, f, n_r) = (sv.cfg.hidden, sv.cfg.ffn, lay.recv.perm.len);
    let xk = match (x_fl, own) {
        (Some(fl), _) => (
            Cow::Owned(permute_rows(gpu, fl.finish()?.0, &lay.recv.perm, h)?),
            None,
        ),
        (None, Some(own)) => owner_kept_rows(gpu, own, selection, (rank, el, n_r, (h, f)))?,
        (None, None) => {
            return Err(LayerError::Config(
                "device backward: no x rows (invariant)".into(),
            ))
        }
    };
    let dk = permute_rows(gpu, d_fl.finish()?.0, &lay.recv.perm, h)?;
    Ok((xk, dk))
}

/// Backward stage 5, on an instance: the kept rows' `dX` first (from the
/// forward's projections where the owner kept them), sent back
/// to their sources while the weight gradients are computed; the `dX` rows
/// this source receives and the instances' weight gradients.
#[allow(clippy::type_complexity)]
pub(super) fn experts_backward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    lay: &InstanceLayout,
    (xk, abk, dk): (
        &CudaSlice<u16>,
        Option<(&CudaSlice<u16>, &CudaSlice<u16>)>,
        &CudaSlice<u16>,
    ),
    wts: Wts<'_>,
    (h, f): (usize, usize),
    laps: &mut Laps,
) -> Result<(CudaSlice<u16>, Experts<CudaSlice<u16>>), LayerError> {
    let (dxk, rest) = match abk {
        Some(ab) => {
            gpu.experts_backward_data_from(&lay.recv.offsets, ab, dk, wts.into_tuple(), (h, f))?
        }
        None => gpu.experts_backward_data(&lay.recv.offsets, xk, dk, wts.into_tuple(), (h, f))?,
    };
    laps.lap(gpu, "experts dX")?;
    let dx_src = if lay.recv.perm.len > 0 {
        permute_rows(gpu, dxk, &lay.recv.inv, h)?
    } else {
        dxk
    };
    let dx_fl = exchange_rows(gpu, comm, dx_src, (&lay.recv.from, &lay.send), h, true)?;
    laps.sent(gpu, comm, "dX back")?;
    let overlap = Overlap::new(gpu, comm);
    let (gate, up, down) = gpu.experts_backward_weights(rest, xk, dk)?;
    let grads = Experts { gate, up, down };
    laps.lap(gpu, "experts dW")?;
    let dx_rows = dx_fl.finish()?.0;
    drop(overlap);
    laps.lap(gpu, "a2a dX")?;
    Ok((dx_rows, grads))
}

/// The LRMoE backward for `dy` (this rank's tokens, `tokens × hidden`):
/// expert `e` keeps `plan.quotas[e]` pairs over all sources by LRM score
/// (top-q, or priority sampling with the plan's seed); the planner splits
/// the kept pairs over the instances; only kept rows travel and are
/// multiplied. `sv` stays whole: the backward may run again on it.
pub fn backward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &DeviceSaved,
    dy: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceGrads, LayerError> {
    let own = sv.owned_rows.as_ref().map(Held::Borrowed);
    backward_of(gpu, comm, w, (sv, own), dy, planner)
}

/// [`backward`], releasing the owner's forward rows (`hidden` values per
/// routed pair, the largest part of `sv`) as soon as the kept rows are
/// gathered from them, as autograd frees a saved tensor once its backward
/// has read it: at `r < 1` the backward's peak holds only the kept rows.
/// Equal results. Another backward of the same `sv` still runs (it takes
/// its `x` rows from the input, as a call with replicas does); on several
/// ranks every rank must call the same one of the two.
pub fn backward_releasing(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &mut DeviceSaved,
    dy: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceGrads, LayerError> {
    let own = sv.owned_rows.take().map(|r| Held::Taken(Box::new(r)));
    backward_of(gpu, comm, w, (sv, own), dy, planner)
}

fn backward_of(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    (sv, own): (&DeviceSaved, Option<Held<'_>>),
    dy: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceGrads, LayerError> {
    let cfg = &sv.cfg;
    let (t, h, k) = (sv.tokens, cfg.hidden, cfg.top_k);
    let (rank, world, el) = (comm.rank(), comm.world_size(), sv.per_rank);
    if dy.len() < t * h {
        return Err(LayerError::Shape {
            what: "dy (tokens × hidden)".into(),
            expected: t * h,
            got: dy.len(),
        });
    }
    let mut laps = Laps::new(gpu)?;
    let ks = score_and_select(gpu, comm, w, sv, dy, &mut laps)?;
    let lay = redistribute_kept(planner, sv, &ks.kept, rank)?;
    laps.lap(gpu, "redistribute")?;
    let pk = pack_kept(gpu, sv, &ks, &lay, dy, rank)?;
    laps.lap(gpu, "pack")?;
    // Stage 4: kept rows travel; the router gradient's sum over ranks
    // follows on the communicator's stream.
    let owned = own.is_some();
    let flights = send_kept(gpu, comm, sv, &lay, (&pk.pair, pk.rows, owned), pk.dk_send)?;
    laps.sent(gpu, comm, "kept rows out")?;
    let router_fl = comm.start_sum(gpu, ks.router)?;
    laps.sent(gpu, comm, "router sum")?;
    let selection = (ks.kept_g.as_ref(), &ks.global[..]);
    let ((xk, abk), dk) = receive_kept(gpu, (sv, own), &lay, flights, selection, (rank, el))?;
    laps.lap(gpu, "a2a kept rows")?;
    let wts = local_weights(w, &sv.weights);
    let abk = abk.as_ref().map(|(a, b)| (&**a, &**b));
    let (dx_rows, grads) = experts_backward(
        gpu,
        comm,
        &lay,
        (&xk, abk, &dk),
        wts,
        (h, cfg.ffn),
        &mut laps,
    )?;
    // Stage 6, on the source: scatter-add the kept pairs' dX into the tokens.
    let kinv = expand(gpu, &lay.send_inv)?;
    // SAFETY: dst maps pairs to expert-major rows (< n) or DROPPED, place
    // maps those to kept positions (< n_k) or DROPPED, kinv is a
    // permutation of the n_k kept rows: row is a row of dx_rows or DROPPED
    // for every pair. One pass: the router's dX plus every kept pair's row
    // of its token.
    let dx = unsafe {
        let row = gpu.gather32(&kinv, &gpu.gather32(&pk.place, &sv.dst, t * k)?, t * k)?;
        gpu.combine_rows(&dx_rows, &row, None, Some(&ks.dx_router), (t, h, k))
    }?;
    let router = router_fl.finish()?.0;
    laps.lap(gpu, "scatter")?;
    let (experts, g_bytes) = owner_gradients(gpu, comm, cfg, &sv.plan, &sv.local, el, grads)?;
    comm.settle()?;
    laps.lap(gpu, "replica grads")?;
    laps.print("backward", rank)?;
    let x_rows = if owned { 0 } else { off_rank(&lay.send, rank) };
    let rows = off_rank(&lay.send, rank) + x_rows + off_rank(&lay.recv.from, rank);
    Ok(DeviceGrads {
        dx,
        router,
        experts,
        kept_pairs: lay.recv.perm.len,
        kept_total: ks.kept.iter().flatten().map(|&c| c as usize).sum(),
        bytes_sent: t * k * 4 * (world - 1) + rows * h * 2 + g_bytes,
    })
}

/// This rank's own experts' gradients from those of its instances
/// (`local` order): replicas' gradients go to their owners (one
/// all-to-all per tensor) and are added there.
#[allow(clippy::type_complexity)]
pub(super) fn owner_gradients(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    plan: &EpPlan,
    local: &[Vec<usize>],
    el: usize,
    grads: Experts<CudaSlice<u16>>,
) -> Result<(Experts<CudaSlice<u16>>, usize), LayerError> {
    let rank = comm.rank();
    let hf = cfg.hidden * cfg.ffn;
    if one_instance_each(&plan.instances) {
        return Ok((grads, 0));
    }
    let traffic = replica_traffic(&plan.instances, local, rank, el);
    let below = traffic.below;
    // Replica gradients go back the way the weights came.
    let (out_blocks, send, recv, from_blocks) = (
        &traffic.grads_out,
        &traffic.weights_recv,
        &traffic.weights_send,
        &traffic.grads_in,
    );
    let owners_sum = |g: &CudaSlice<u16>| -> Result<CudaSlice<u16>, LayerError> {
        let packed = pack_blocks(gpu, g, out_blocks, hf)?;
        let got = comm.exchange(gpu, packed, &elems(send, hf), &elems(recv, hf))?;
        // This rank's block of the instance gradients.
        let mut own = pack_blocks(gpu, g, &(below..below + el).collect::<Vec<_>>(), hf)?;
        for (i, &b) in from_blocks.iter().enumerate() {
            let sum = {
                let a = own.slice(b * hf..(b + 1) * hf);
                let c = got.slice(i * hf..(i + 1) * hf);
                gpu.add_views(&a, &c)?
            };
            let mut to = own.slice_mut(b * hf..(b + 1) * hf);
            gpu.copy(&sum.slice(0..hf), &mut to)?;
        }
        Ok(own)
    };
    let summed = Experts {
        gate: owners_sum(&grads.gate)?,
        up: owners_sum(&grads.up)?,
        down: owners_sum(&grads.down)?,
    };
    Ok((summed, out_blocks.len() * 3 * hf * 2))
}
