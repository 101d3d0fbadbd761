//! The MoE layer with expert parallelism on device buffers: W ranks, one
//! GPU each, NCCL between them (features `cuda` + `nccl`). Experts are owned
//! in contiguous blocks (see `pack::ep` for the index plans).
//!
//! Forward (complete): route locally, group pairs by expert (= by owner),
//! all-gather the routed counts, all-to-all the rows to their owners,
//! regroup expert-major, grouped GEMMs, send the outputs back, combine.
//!
//! LRMoE backward: the router gradient is complete and local (each source
//! kept its pairs' outputs), then summed over ranks. Each source sends one
//! f32 per pair (`g²·‖δ‖²`); each owner forms the LRM scores with its saved
//! `‖h‖²`, keeps `round(r · n_e)` pairs per expert by top-q selection over
//! every source's pairs, and returns the mask. Sources pack only the kept
//! `g·δ` rows (no padding) into the all-to-all; owners run the grouped GEMMs
//! on the kept rows and return their `dX` rows, which the sources
//! scatter-add. Bytes on the wire and GEMM rows shrink with `r`.
//!
//! Host synchronisations: the routed counts (forward); in the backward the
//! error flag of the selection and the kept rows per source and per
//! destination (W numbers each) — the kept-row plans themselves are built on
//! the device. Work on the compute stream and the communicator's stream is
//! ordered by synchronising the stream that wrote a buffer before the other
//! reads it.

use cudarc::driver::CudaSlice;

use super::super::cuda;
use super::{exclusive_scan, fan_in_scaled};
use crate::comm::NcclComm;
use crate::cpu::GemmVariant;
use crate::gpu::{Gpu, MoeShape, QuotaPlan};
use crate::KernelError;
use pack::ep::{block_rows, experts_per_rank, owner_layout, segments, OwnerLayout};

/// One rank's weights on its device, bf16: the router `H × E` (every rank
/// holds it) and the rank's own experts, `E_l × H × F` (gate, up) and
/// `E_l × F × H` (down).
pub struct EpWeights {
    router: CudaSlice<u16>,
    gate: CudaSlice<u16>,
    up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// Forward state kept for the backward.
pub struct EpSaved {
    s: MoeShape,
    per_rank: usize,
    // Source side: this rank's tokens.
    x: CudaSlice<u16>,
    probs: CudaSlice<f32>,
    idx: CudaSlice<u32>,
    gates: CudaSlice<f32>,
    dst: CudaSlice<u32>,
    src: CudaSlice<u32>,
    send: Vec<usize>,
    o: CudaSlice<u16>,
    // Owner side: the rows of this rank's experts, expert-major.
    layout: OwnerLayout,
    counts_all: Vec<Vec<u32>>,
    ix: EpIndex,
    xr: CudaSlice<u16>,
    h_sq: CudaSlice<f32>,
    /// Layer output for this rank's tokens, `T × H`.
    pub y: CudaSlice<u16>,
    /// Bytes this rank sent to other ranks in the forward's all-to-alls.
    pub bytes_sent: usize,
}

impl EpSaved {
    /// Every source's routed pairs per global expert, `[world][experts]`:
    /// what a plan needs for this call's quotas (identical on every rank).
    pub fn routed_counts(&self) -> &[Vec<u32>] {
        &self.counts_all
    }
}

/// Device index arrays the backward builds its kept-row plans from (with
/// the `group_by_expert`, `gather_32`, `gather_u8` and `kept_counts`
/// kernels, so no per-pair mask crosses to the host).
struct EpIndex {
    /// Expert-major row → source-major row, and back.
    perm: CudaSlice<u32>,
    inv: CudaSlice<u32>,
    /// `0..n_r` (selection ids: ties break in expert-major order).
    ids: CudaSlice<u32>,
    /// `max(pairs, n_r)` ones (unit gates and norms for the score kernel).
    ones: CudaSlice<f32>,
    /// Expert-major offsets per local expert and each row's local expert.
    offsets_r: CudaSlice<u32>,
    expert_of_row: CudaSlice<u32>,
    /// Source-major offsets per source and each row's source.
    src_offsets: CudaSlice<u32>,
    row_source: CudaSlice<u32>,
    /// This rank's grouped rows: offsets per destination and each row's.
    send_offsets: CudaSlice<u32>,
    dest_of_row: CudaSlice<u32>,
}

/// Gradients and figures of one backward on one rank.
pub struct EpBackward {
    /// Input gradient of this rank's tokens, `T × H`.
    pub dx: CudaSlice<u16>,
    /// Router gradient summed over ranks, `H × E`, f32.
    pub router: CudaSlice<f32>,
    /// This rank's experts' gradients: gate, up `E_l × H × F`, down `E_l × F × H`.
    pub gate: CudaSlice<u16>,
    /// See `gate`.
    pub up: CudaSlice<u16>,
    /// See `gate`.
    pub down: CudaSlice<u16>,
    /// Pairs this rank's experts kept (over all sources).
    pub kept_pairs: usize,
    /// Bytes this rank sent to other ranks in the backward's all-to-alls
    /// (scores' inputs, masks, kept rows, dX rows; not the router's all-reduce).
    pub bytes_sent: usize,
}

/// Per-phase wall times of one call, printed when `LRMOE_EP_PROFILE=1`
/// (each lap synchronises the compute stream, so profiling slows the call).
struct Laps {
    on: bool,
    at: std::time::Instant,
    laps: Vec<(&'static str, f64)>,
}

impl Laps {
    fn new() -> Self {
        Self {
            on: std::env::var("LRMOE_EP_PROFILE").as_deref() == Ok("1"),
            at: std::time::Instant::now(),
            laps: Vec::new(),
        }
    }
    fn lap(&mut self, gpu: &Gpu, name: &'static str) -> Result<(), KernelError> {
        if self.on {
            gpu.sync()?;
            let now = std::time::Instant::now();
            self.laps.push((name, (now - self.at).as_secs_f64() * 1e3));
            self.at = now;
        }
        Ok(())
    }
    fn print(&self, what: &str, rank: usize) {
        if self.on {
            let parts: Vec<String> = self
                .laps
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.2}"))
                .collect();
            tracing::info!(rank, phase = what, "EP profile (ms): {}", parts.join(", "));
        }
    }
}

fn world_of(comm: &NcclComm, s: &MoeShape) -> Result<(usize, usize, usize), KernelError> {
    s.check()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    Ok((rank, world, experts_per_rank(s.experts, world)?))
}

impl Gpu {
    /// Uploads one rank's weights (bf16 bits): the full router and the
    /// rank's block of experts.
    pub fn ep_weights(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        router: &[u16],
        (gate, up, down): (&[u16], &[u16], &[u16]),
    ) -> Result<EpWeights, KernelError> {
        let (_, _, el) = world_of(comm, s)?;
        let (h, f, e) = (s.hidden, s.ffn, s.experts);
        super::super::check("router", h * e, router.len())?;
        super::super::check("gate (this rank's experts)", el * h * f, gate.len())?;
        super::super::check("up (this rank's experts)", el * h * f, up.len())?;
        super::super::check("down (this rank's experts)", el * f * h, down.len())?;
        Ok(EpWeights {
            router: self.upload(router)?,
            gate: self.upload(gate)?,
            up: self.upload(up)?,
            down: self.upload(down)?,
        })
    }

    /// Uploads the index arrays of one call's layout (see [`EpIndex`]).
    fn ep_index(&self, l: &OwnerLayout, send: &[usize], p: usize) -> Result<EpIndex, KernelError> {
        let n_r = l.perm.len();
        let (expert_of_row, _) = segments(l.per_expert.iter().map(|&c| c as usize));
        let (row_source, src_offsets) = segments(l.from.iter().copied());
        let (dest_of_row, send_offsets) = segments(send.iter().copied());
        Ok(EpIndex {
            perm: self.upload(&l.perm)?,
            inv: self.upload(&l.inv)?,
            ids: self.upload(&(0..n_r as u32).collect::<Vec<_>>())?,
            ones: self.upload(&vec![1f32; p.max(n_r)])?,
            offsets_r: self.upload(&l.offsets)?,
            expert_of_row: self.upload(&expert_of_row)?,
            src_offsets: self.upload(&src_offsets)?,
            row_source: self.upload(&row_source)?,
            send_offsets: self.upload(&send_offsets)?,
            dest_of_row: self.upload(&dest_of_row)?,
        })
    }

    fn sync(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(cuda)
    }

    /// An all-to-all between the compute stream's buffers: the compute
    /// stream is drained first, the communicator's after.
    fn exchange<T: cudarc::driver::DeviceRepr>(
        &self,
        comm: &NcclComm,
        send: &CudaSlice<T>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<CudaSlice<T>, KernelError> {
        let total: usize = recv_counts.iter().sum();
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut recv = unsafe { self.uninit::<T>(total) }?;
        self.sync()?;
        comm.all_to_all_v(send, send_counts, &mut recv, recv_counts)?;
        comm.synchronize()?;
        Ok(recv)
    }

    /// The forward on this rank's tokens `x` (`T × H`, bf16 on the device);
    /// every rank calls it with the same shape (`tokens` per rank).
    pub fn ep_forward(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        w: &EpWeights,
        x: &CudaSlice<u16>,
    ) -> Result<EpSaved, KernelError> {
        let (rank, _, el) = world_of(comm, s)?;
        let (h, f, e, k) = (s.hidden, s.ffn, s.experts, s.top_k);
        let p = s.pairs();
        super::super::check("x", s.tokens * h, x.len())?;
        let mut laps = Laps::new();
        let (probs, idx, gates, counts) = self.route(s, &w.router, x)?;
        laps.lap(self, "route")?;
        let base = exclusive_scan(&counts);
        let (dst, src) = self.group(&idx, None, None, &base[..e], p, p, e)?;
        let xs = self.gather_scaled(x, &src, k, None, p, h)?;
        laps.lap(self, "group+gather")?;
        // Everyone's counts: what each owner receives, and from whom.
        let bytes: Vec<u8> = counts.iter().flat_map(|c| c.to_le_bytes()).collect();
        let counts_all: Vec<Vec<u32>> = comm
            .all_gather_host(&bytes)?
            .into_iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect();
        let send = block_rows(&counts, el);
        let layout = owner_layout(&counts_all, rank, el)?;
        laps.lap(self, "counts+layout")?;
        let elems = |rows: &[usize]| rows.iter().map(|r| r * h).collect::<Vec<_>>();
        let xr_src = self.exchange(comm, &xs, &elems(&send), &elems(&layout.from))?;
        laps.lap(self, "a2a x")?;
        let n_r = layout.perm.len();
        let ix = self.ep_index(&layout, &send, p)?;
        let xr = self.gather_scaled(&xr_src, &ix.perm, 1, None, n_r, h)?;
        let offsets: Vec<i32> = layout.offsets.iter().map(|&v| v as i32).collect();
        let od = self.upload(&offsets)?;
        let (_, _, hh) = self.experts_hidden(&od, el, n_r, &xr, &w.gate, &w.up, h, f)?;
        let or = self.gemm(GemmVariant::Forward, &od, el, &hh, &w.down, n_r * h, f, h)?;
        let h_sq = self.row_sq(&hh, n_r, f)?;
        laps.lap(self, "regroup+experts")?;
        let or_src = self.gather_scaled(&or, &ix.inv, 1, None, n_r, h)?;
        laps.lap(self, "ungroup")?;
        let o = self.exchange(comm, &or_src, &elems(&layout.from), &elems(&send))?;
        laps.lap(self, "a2a o")?;
        let y = self.combine_dev(&o, &dst, Some(&gates), s)?;
        laps.lap(self, "combine")?;
        laps.print("forward", rank);
        let sent_rows = send.iter().sum::<usize>() - send[rank] + n_r - layout.from[rank];
        Ok(EpSaved {
            s: *s,
            per_rank: el,
            x: x.clone(),
            probs,
            idx,
            gates,
            dst,
            src,
            send,
            o,
            layout,
            counts_all,
            ix,
            xr,
            h_sq,
            y,
            bytes_sent: sent_rows * h * 2,
        })
    }

    /// The LRMoE backward for `dy` (this rank's tokens, `T × H`): expert `e`
    /// keeps its `quotas[e]` best pairs over all sources by LRM score (the
    /// caller's plan, e.g. `layer::device_quotas` from
    /// [`EpSaved::routed_counts`]; one entry per global expert, more than
    /// routed keeps all); only kept rows travel and are multiplied.
    pub fn ep_backward(
        &self,
        comm: &NcclComm,
        w: &EpWeights,
        sv: &EpSaved,
        dy: &CudaSlice<u16>,
        quotas: &[u32],
    ) -> Result<EpBackward, KernelError> {
        let s = &sv.s;
        let (t, h, f, e, k) = (s.tokens, s.hidden, s.ffn, s.experts, s.top_k);
        let (rank, el) = (comm.rank(), sv.per_rank);
        let p = s.pairs();
        super::super::check("dy", t * h, dy.len())?;
        super::super::check("quotas (one per expert)", e, quotas.len())?;
        let quotas = &quotas[rank * el..(rank + 1) * el];
        let mut laps = Laps::new();
        // Router: complete and local, then summed over ranks (f32).
        let (g_router, dx_router) = self.router_backward(
            s,
            &w.router,
            &sv.x,
            dy,
            &sv.o,
            &sv.dst,
            (&sv.probs, &sv.idx, &sv.gates),
        )?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut router = unsafe { self.uninit::<f32>(h * e) }?;
        {
            let n = (h * e) as i64;
            let mut l = self.stream.launch_builder(&self.f_to_f32);
            use cudarc::driver::PushKernelArg;
            l.arg(&g_router).arg(&mut router).arg(&n);
            // SAFETY: (u16*, f32*, long long); both hold H·E.
            unsafe { l.launch(self.elementwise_config(h * e)) }.map_err(cuda)?;
        }
        laps.lap(self, "router")?;
        // g²·‖δ‖² of each pair, in send order, to the owners.
        let dy_sq = self.row_sq(dy, t, h)?;
        let dsq = self.scores_from_norms(&sv.gates, &dy_sq, &sv.ix.ones, &sv.src, p, k)?;
        self.sync()?;
        comm.all_reduce_sum_f32(&mut router)?;
        let dsq_src = self.exchange(comm, &dsq, &sv.send, &sv.layout.from)?;
        laps.lap(self, "norms+a2a")?;
        // Owner: scores expert-major, top-q per expert.
        let (n_r, world, ix) = (sv.layout.perm.len(), comm.world_size(), &sv.ix);
        let dsq_r = self.gather32(&dsq_src, &ix.perm, n_r)?;
        let scores = self.scores_from_norms(&ix.ones, &dsq_r, &sv.h_sq, &ix.ids, n_r, 1)?;
        let qd = self.upload(quotas)?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut kept = unsafe { self.uninit::<u8>(n_r) }?;
        let mut err = self.stream.clone_htod(&[0u32]).map_err(cuda)?;
        self.launch_select(
            &scores,
            &ix.ids,
            &ix.offsets_r,
            &qd,
            &mut kept,
            &mut err,
            el,
        )?;
        if self.download(&err, 1)?[0] != 0 {
            return Err(KernelError::Cuda(
                "ep_backward: a LRM score is NaN or infinite (non-finite dy?)".into(),
            ));
        }
        laps.lap(self, "scores+select")?;
        // Owner's plan, on the device: kept rows expert-major (q → j), the
        // mask in source-major order, kept rows per source (the one small
        // download), and both directions between kept row q and its place
        // in the received δ buffer (source-major, kept only).
        let kq: Vec<u32> = quotas
            .iter()
            .zip(&sv.layout.per_expert)
            .map(|(&q, &n)| q.min(n))
            .collect();
        let kbase = exclusive_scan(&kq);
        let kept_pairs = kbase[el] as usize;
        let (dst_r, x_rows) = self.group(
            &ix.expert_of_row,
            Some(&kept),
            Some(&ix.offsets_r),
            &kbase[..el],
            n_r,
            kept_pairs,
            el,
        )?;
        let mask_src = self.gather_u8_dev(&kept, &ix.inv, n_r)?;
        let from_k = self.kept_counts_dev(&ix.row_source, &mask_src, n_r, world)?;
        let from_k: Vec<usize> = self
            .download(&from_k, world)?
            .into_iter()
            .map(|c| c as usize)
            .collect();
        let fbase = exclusive_scan(&from_k.iter().map(|&c| c as u32).collect::<Vec<_>>());
        let (dst_s, src_s) = self.group(
            &ix.row_source,
            Some(&mask_src),
            Some(&ix.src_offsets),
            &fbase[..world],
            n_r,
            kept_pairs,
            world,
        )?;
        let d_rows = self.gather32(
            &dst_s,
            &self.gather32(&ix.perm, &x_rows, kept_pairs)?,
            kept_pairs,
        )?;
        let back = self.gather32(
            &dst_r,
            &self.gather32(&ix.inv, &src_s, kept_pairs)?,
            kept_pairs,
        )?;
        laps.lap(self, "owner plan")?;
        // The mask back to the sources, which pack their kept g·δ rows.
        let mask = self.exchange(comm, &mask_src, &sv.layout.from, &sv.send)?;
        laps.lap(self, "a2a mask")?;
        let to_k = self.kept_counts_dev(&ix.dest_of_row, &mask, p, world)?;
        let to_k: Vec<usize> = self
            .download(&to_k, world)?
            .into_iter()
            .map(|c| c as usize)
            .collect();
        let tbase = exclusive_scan(&to_k.iter().map(|&c| c as u32).collect::<Vec<_>>());
        let n_k = tbase[world] as usize;
        let (place, rows) = self.group(
            &ix.dest_of_row,
            Some(&mask),
            Some(&ix.send_offsets),
            &tbase[..world],
            p,
            n_k,
            world,
        )?;
        laps.lap(self, "source plan")?;
        let pair_of_kept = self.gather32(&sv.src, &rows, n_k)?;
        let dok = self.gather_scaled(dy, &pair_of_kept, k, Some(&sv.gates), n_k, h)?;
        let elems = |rows: &[usize]| rows.iter().map(|r| r * h).collect::<Vec<_>>();
        laps.lap(self, "pack")?;
        let d_recv = self.exchange(comm, &dok, &elems(&to_k), &elems(&from_k))?;
        laps.lap(self, "a2a kept rows")?;
        // Owner: grouped GEMMs on the kept rows, expert-major.
        let xk = self.gather_scaled(&sv.xr, &x_rows, 1, None, kept_pairs, h)?;
        let dk = self.gather_scaled(&d_recv, &d_rows, 1, None, kept_pairs, h)?;
        let od = self.upload(&kbase.iter().map(|&v| v as i32).collect::<Vec<_>>())?;
        let (dxk, gate, up, down) = self.experts_backward_dev(
            &od,
            el,
            kept_pairs,
            &xk,
            &dk,
            (&w.gate, &w.up, &w.down),
            h,
            f,
        )?;
        laps.lap(self, "experts bwd")?;
        let dx_src = self.gather_scaled(&dxk, &back, 1, None, kept_pairs, h)?;
        let dx_rows = self.exchange(comm, &dx_src, &elems(&from_k), &elems(&to_k))?;
        laps.lap(self, "a2a dX")?;
        // Source: scatter-add the kept pairs' dX into the tokens.
        let row_k = self.gather32(&place, &sv.dst, p)?;
        let dx_experts = self.combine_dev(&dx_rows, &row_k, None, s)?;
        let dx = self.add(&dx_router, &dx_experts, t * h)?;
        // Scores' inputs (4 B a pair) out, masks (1 B a pair) back, kept
        // g·δ rows out and their dX rows back.
        let scalars = (p - sv.send[rank]) * 4 + (n_r - sv.layout.from[rank]);
        let rows = (n_k - to_k[rank]) + (kept_pairs - from_k[rank]);
        self.sync()?;
        laps.lap(self, "scatter")?;
        laps.print("backward", rank);
        Ok(EpBackward {
            dx,
            router,
            gate,
            up,
            down,
            kept_pairs,
            bytes_sent: scalars + rows * h * 2,
        })
    }
}

/// Host copies of one EP forward + backward on one rank.
#[derive(Debug, Clone)]
pub struct EpHostResult {
    /// Output of this rank's tokens (bf16 bits).
    pub y: Vec<u16>,
    /// Input gradient of this rank's tokens.
    pub dx: Vec<u16>,
    /// Router gradient summed over ranks (f32).
    pub router: Vec<f32>,
    /// This rank's experts' gradients (bf16 bits).
    pub gate: Vec<u16>,
    /// See `gate`.
    pub up: Vec<u16>,
    /// See `gate`.
    pub down: Vec<u16>,
    /// Pairs this rank's experts kept.
    pub kept_pairs: usize,
    /// Bytes sent to other ranks: forward, backward.
    pub bytes_sent: (usize, usize),
}

/// One row of the EP layer benchmark (this rank's view).
#[derive(Debug, Clone, Copy)]
pub struct EpBenchRow {
    /// Retention.
    pub retention: f64,
    /// Median backward wall time, ms (host round trips included).
    pub backward_ms: f64,
    /// Pairs this rank's experts kept.
    pub kept_pairs: usize,
    /// Bytes this rank sent in the backward's all-to-alls.
    pub bytes_sent: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Gpu {
    /// Forward and LRMoE backward from host data (bf16 bits), copied back:
    /// `x`, `dy` this rank's tokens, `experts` this rank's block.
    #[allow(clippy::too_many_arguments)]
    pub fn ep_host(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        router: &[u16],
        experts: (&[u16], &[u16], &[u16]),
        x: &[u16],
        dy: &[u16],
        plan: QuotaPlan<'_>,
    ) -> Result<EpHostResult, KernelError> {
        super::super::check("dy", s.tokens * s.hidden, dy.len())?;
        let fwd = self.ep_forward_host(comm, s, router, experts, x)?;
        let quotas = plan(&fwd.counts)?;
        let g = self.ep_backward_host(comm, &fwd, dy, &quotas)?;
        Ok(EpHostResult {
            y: fwd.y,
            dx: g.dx,
            router: g.router,
            gate: g.gate,
            up: g.up,
            down: g.down,
            kept_pairs: g.kept_pairs,
            bytes_sent: (fwd.bytes_sent, g.bytes_sent),
        })
    }

    /// The forward from host data (bf16 bits): this rank's router copy, its
    /// experts' block and its tokens in, this rank's output and every
    /// source's routed counts out; the device state stays for
    /// [`Gpu::ep_backward_host`]. Weights are uploaded each call.
    pub fn ep_forward_host(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        router: &[u16],
        experts: (&[u16], &[u16], &[u16]),
        x: &[u16],
    ) -> Result<crate::gpu::EpHostForward, KernelError> {
        let w = self.ep_weights(comm, s, router, experts)?;
        super::super::check("x", s.tokens * s.hidden, x.len())?;
        let xd = self.upload(x)?;
        let sv = self.ep_forward(comm, s, &w, &xd)?;
        let y = self.download(&sv.y, s.tokens * s.hidden)?;
        Ok(crate::gpu::EpHostForward::new(y, *s, w, sv))
    }

    /// The LRMoE backward of a host-driven forward with per-expert `quotas`
    /// (one per global expert, the caller's plan), gradients copied back.
    pub fn ep_backward_host(
        &self,
        comm: &NcclComm,
        fwd: &crate::gpu::EpHostForward,
        dy: &[u16],
        quotas: &[u32],
    ) -> Result<crate::gpu::EpHostGrads, KernelError> {
        let (w, sv) = fwd.state();
        let s = &fwd.shape;
        super::super::check("dy", s.tokens * s.hidden, dy.len())?;
        let dyd = self.upload(dy)?;
        let g = self.ep_backward(comm, w, sv, &dyd, quotas)?;
        let (t, h, e) = (s.tokens, s.hidden, s.experts);
        let ew = sv.per_rank * h * s.ffn;
        Ok(crate::gpu::EpHostGrads {
            dx: self.download(&g.dx, t * h)?,
            router: self.download(&g.router, h * e)?,
            gate: self.download(&g.gate, ew)?,
            up: self.download(&g.up, ew)?,
            down: self.download(&g.down, ew)?,
            kept_pairs: g.kept_pairs,
            bytes_sent: g.bytes_sent,
        })
    }

    /// Times the EP layer on random data (`iters` calls after 2 warm-ups,
    /// median wall time, every rank in step): returns the forward's median
    /// ms and one row per `(label, plan)`, the label a retention.
    pub fn bench_ep(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        plans: &[(f64, QuotaPlan<'_>)],
        iters: usize,
    ) -> Result<(f64, Vec<EpBenchRow>), KernelError> {
        let (_, _, el) = world_of(comm, s)?;
        let (t, h, f, e, r) = (s.tokens, s.hidden, s.ffn, s.experts, comm.rank() as u64);
        let scale = fan_in_scaled;
        let w = self.ep_weights(
            comm,
            s,
            &scale(super::super::random_bf16(h * e, 31), h),
            (
                &scale(super::super::random_bf16(el * h * f, 32 + 8 * r), h),
                &scale(super::super::random_bf16(el * h * f, 33 + 8 * r), h),
                &scale(super::super::random_bf16(el * f * h, 34 + 8 * r), f),
            ),
        )?;
        let x = self.upload(&super::super::random_bf16(t * h, 35 + 8 * r))?;
        let dy = self.upload(&super::super::random_bf16(t * h, 36 + 8 * r))?;
        let timed = |f: &mut dyn FnMut() -> Result<(), KernelError>| -> Result<f64, KernelError> {
            let mut v = Vec::with_capacity(iters);
            for i in 0..iters + 2 {
                self.sync()?;
                let start = std::time::Instant::now();
                f()?;
                self.sync()?;
                if i >= 2 {
                    v.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok(median(v))
        };
        let fwd = timed(&mut || self.ep_forward(comm, s, &w, &x).map(|_| ()))?;
        let sv = self.ep_forward(comm, s, &w, &x)?;
        let mut rows = Vec::new();
        for &(ret, plan) in plans {
            let quotas = plan(sv.routed_counts())?;
            let last = self.ep_backward(comm, &w, &sv, &dy, &quotas)?;
            let ms = timed(&mut || self.ep_backward(comm, &w, &sv, &dy, &quotas).map(|_| ()))?;
            rows.push(EpBenchRow {
                retention: ret,
                backward_ms: ms,
                kept_pairs: last.kept_pairs,
                bytes_sent: last.bytes_sent,
            });
        }
        Ok((fwd, rows))
    }
}
