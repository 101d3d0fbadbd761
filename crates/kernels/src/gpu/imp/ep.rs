//! The MoE layer with expert parallelism on device buffers: W ranks, one
//! GPU each, NCCL between them (features `cuda` + `nccl`). Experts are owned
//! in contiguous blocks; a call's [`EpPlan`] (from the caller's
//! [`EpPlanner`], the layer crate's controller) may add replicas, and says
//! how every routed pair, then every kept pair, is split over the
//! instances (see `pack::ep::instance_layout` for the index plans).
//!
//! Forward (complete): route locally, group pairs by expert, all-gather the
//! routed counts, plan; owners send the weights of replicated experts to
//! the replicas' ranks; rows go to their instances (destination-major, one
//! all-to-all), are regrouped by local instance, and the grouped GEMMs run;
//! outputs and the squared norms `‖h‖²` of the down projection's inputs go
//! back, and the source combines. In a call with replicas, instances keep
//! nothing per pair (a kept pair may be computed on another instance in the
//! backward); without replicas the owners keep their forward rows, since
//! kept pairs cannot move, and the backward sends only `g·δ` rows.
//!
//! LRMoE backward: the router gradient is complete and local (each source
//! kept its pairs' outputs), then summed over ranks. Each source forms its
//! pairs' LRM scores `g²·‖δ‖²·‖h‖²`; the scores are all-gathered and every
//! rank makes the same per-expert top-q selection over every source's pairs
//! (ties to the lower source, then the lower pair). The kept counts per
//! (source, expert) go to the planner's redistribution; sources pack only
//! the kept `[x | g·δ]` rows (no padding; `g·δ` only without replicas)
//! destination-major, instances
//! regroup them, recompute the hidden activations and run the backward
//! GEMMs on the kept rows, `dX` rows come back and are scatter-added;
//! replica gradients are summed into their owners'. Bytes on the wire and
//! GEMM rows shrink with the kept fraction.
//!
//! Host synchronisations: the routed counts and the plan (forward); in the
//! backward the selection's error flag and the kept counts per expert (one
//! small all-gather) for the redistribution. Work on the compute stream and
//! the communicator's stream is ordered by synchronising the stream that
//! wrote a buffer before the other reads it.

use cudarc::driver::CudaSlice;

use super::super::cuda;
use super::{exclusive_scan, fan_in_scaled};
use crate::comm::NcclComm;
use crate::cpu::GemmVariant;
use crate::gpu::{check_plan, check_split, EpPlan, EpPlanner, Gpu, MoeShape};
use crate::KernelError;
use pack::ep::{experts_per_rank, instance_layout, local_experts, InstanceLayout};

/// One rank's weights on its device, bf16: the router `H × E` (every rank
/// holds it) and the rank's own experts, `E_l × H × F` (gate, up) and
/// `E_l × F × H` (down).
pub struct EpWeights {
    router: CudaSlice<u16>,
    /// A constant added to the router logits of each expert (the forced
    /// hot-expert workload), if any.
    bias: Option<CudaSlice<f32>>,
    experts: usize,
    gate: CudaSlice<u16>,
    up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// The weights of this rank's instances in one call (its own experts and
/// the replicas it received), in the order of its local expert list.
struct LocalWeights {
    gate: CudaSlice<u16>,
    up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// Forward state kept for the backward: the source's routing, outputs and
/// norms, and, in calls without replicas, the owner's forward rows.
pub struct EpSaved {
    s: MoeShape,
    per_rank: usize,
    x: CudaSlice<u16>,
    probs: CudaSlice<f32>,
    idx: CudaSlice<u32>,
    gates: CudaSlice<f32>,
    /// Pair → this source's expert-major row, and back.
    dst: CudaSlice<u32>,
    src: CudaSlice<u32>,
    /// Pair → row of `o` (send order).
    row_of_pair: CudaSlice<u32>,
    /// Output rows of this source's pairs, send order.
    o: CudaSlice<u16>,
    /// `‖h‖²` of this source's pairs, expert-major.
    h_sq: CudaSlice<f32>,
    /// Expert of each expert-major row, and the expert offsets (`E + 1`).
    expert_of_row: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    /// Global expert-major order (expert, source, pair) → position in the
    /// all-gathered scores; this source's rows' global positions; the
    /// global expert offsets. `gperm` also serves as the selection's ids:
    /// within an expert it increases with (source, pair), the tie rule.
    gperm: CudaSlice<u32>,
    gidx: CudaSlice<u32>,
    goffsets: CudaSlice<u32>,
    counts_all: Vec<Vec<u32>>,
    plan: EpPlan,
    local: Vec<Vec<usize>>,
    weights: Option<LocalWeights>,
    /// Without replicas in the call, this rank's forward rows as an owner
    /// (instance-major), each row's local expert and the group offsets:
    /// the backward's kept pairs cannot move, so their `x` rows are taken
    /// from here instead of travelling again.
    owned_rows: Option<OwnedRows>,
    /// Layer output for this rank's tokens, `T × H`.
    pub y: CudaSlice<u16>,
    /// Bytes this rank sent to other ranks in the forward's all-to-alls
    /// (rows, their outputs and norms, replica weights).
    pub bytes_sent: usize,
}

impl EpSaved {
    /// Every source's routed pairs per global expert, `[world][experts]`.
    pub fn routed_counts(&self) -> &[Vec<u32>] {
        &self.counts_all
    }
    /// This call's plan.
    pub fn plan(&self) -> &EpPlan {
        &self.plan
    }
}

/// An owner's forward rows kept for the backward (calls without replicas).
struct OwnedRows {
    x: CudaSlice<u16>,
    expert: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    /// This rank's experts' range in the global expert-major order.
    global: (usize, usize),
}

/// Gradients and figures of one backward on one rank.
pub struct EpBackward {
    /// Input gradient of this rank's tokens, `T × H`.
    pub dx: CudaSlice<u16>,
    /// Router gradient summed over ranks, `H × E`, f32.
    pub router: CudaSlice<f32>,
    /// This rank's experts' gradients (replicas' summed in): gate, up
    /// `E_l × H × F`, down `E_l × F × H`.
    pub gate: CudaSlice<u16>,
    /// See `gate`.
    pub up: CudaSlice<u16>,
    /// See `gate`.
    pub down: CudaSlice<u16>,
    /// Kept pairs this rank's instances processed.
    pub kept_pairs: usize,
    /// Kept pairs over all ranks (what the selection kept).
    pub kept_total: usize,
    /// Bytes this rank sent to other ranks in the backward (scores, kept
    /// rows, dX rows, replica gradients; not the router's all-reduce).
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

fn elems(rows: &[usize], width: usize) -> Vec<usize> {
    rows.iter().map(|r| r * width).collect()
}

/// Rows this rank sends to other ranks under `send` counts.
fn off_rank(send: &[usize], rank: usize) -> usize {
    send.iter().sum::<usize>() - send[rank]
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
            bias: None,
            experts: e,
            gate: self.upload(gate)?,
            up: self.upload(up)?,
            down: self.upload(down)?,
        })
    }

    /// Adds `bias[e]` to every token's router logit of expert `e` (one
    /// finite value per expert; a constant, so every gradient formula
    /// holds): the forced hot-expert workload of the layer crate's
    /// `CallConfig::hot_experts`.
    pub fn ep_logit_bias(&self, w: &mut EpWeights, bias: &[f32]) -> Result<(), KernelError> {
        super::super::check("router logit bias (one per expert)", w.experts, bias.len())?;
        if bias.iter().any(|b| !b.is_finite()) {
            return Err(KernelError::Plan(
                "a router logit bias is not finite".into(),
            ));
        }
        w.bias = Some(self.upload(bias)?);
        Ok(())
    }

    /// Group offsets as the grouped GEMM takes them (i32, on the device).
    fn group_offsets(&self, offsets: &[u32]) -> Result<CudaSlice<i32>, KernelError> {
        self.upload(&offsets.iter().map(|&v| v as i32).collect::<Vec<_>>())
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
        // SAFETY: uninitialised output; the all-to-all writes every element.
        let mut recv = unsafe { self.uninit::<T>(total) }?;
        self.sync()?;
        comm.all_to_all_v(send, send_counts, &mut recv, recv_counts)?;
        comm.synchronize()?;
        Ok(recv)
    }

    /// `n` consecutive blocks of `width` elements of `src`, starting at the
    /// listed block indices, packed into one buffer (device copies).
    fn pack_blocks(
        &self,
        src: &CudaSlice<u16>,
        blocks: &[usize],
        width: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: every block of the output is written by the copies below.
        let mut out = unsafe { self.uninit::<u16>(blocks.len() * width) }?;
        for (i, &b) in blocks.iter().enumerate() {
            let from = src.slice(b * width..(b + 1) * width);
            let mut to = out.slice_mut(i * width..(i + 1) * width);
            self.stream.memcpy_dtod(&from, &mut to).map_err(cuda)?;
        }
        Ok(out)
    }

    /// The weights of this rank's instances for `plan`: owners send every
    /// replicated expert's weights to the replicas' ranks (one all-to-all
    /// per tensor); `None` where this rank holds only its own block.
    #[allow(clippy::too_many_arguments)]
    fn replica_weights(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        w: &EpWeights,
        plan: &EpPlan,
        local: &[Vec<usize>],
        el: usize,
    ) -> Result<(Option<LocalWeights>, usize), KernelError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        if plan.instances.iter().all(|i| i.len() == 1) {
            return Ok((None, 0));
        }
        let hf = s.hidden * s.ffn;
        // Sends: for each destination, this rank's experts replicated there.
        let mut out_blocks = Vec::new();
        let mut send = vec![0usize; world];
        for (d, sd) in send.iter_mut().enumerate() {
            for e in rank * el..(rank + 1) * el {
                if d != rank && plan.instances[e][1..].contains(&d) {
                    out_blocks.push(e - rank * el);
                    *sd += 1;
                }
            }
        }
        // Receives: from each owner, its experts replicated here.
        let mut recv = vec![0usize; world];
        let mut below = 0usize;
        for &e in &local[rank] {
            let o = e / el;
            if o != rank {
                recv[o] += 1;
                if o < rank {
                    below += 1;
                }
            }
        }
        let n_in: usize = recv.iter().sum();
        let mut got = Vec::with_capacity(3);
        for t in [&w.gate, &w.up, &w.down] {
            let packed = self.pack_blocks(t, &out_blocks, hf)?;
            got.push(self.exchange(comm, &packed, &elems(&send, hf), &elems(&recv, hf))?);
        }
        let bytes = out_blocks.len() * 3 * hf * 2;
        if n_in == 0 {
            return Ok((None, bytes));
        }
        // This rank's instances, ascending: replicas below its block, its
        // block, replicas above.
        let nl = local[rank].len();
        let build = |own: &CudaSlice<u16>, rep: &CudaSlice<u16>| {
            // SAFETY: the three copies below write all nl blocks.
            let mut t = unsafe { self.uninit::<u16>(nl * hf) }?;
            let parts = [
                (rep, 0, below, 0),
                (own, 0, el, below),
                (rep, below, n_in, below + el),
            ];
            for (from, a, b, at) in parts {
                if b > a {
                    let v = from.slice(a * hf..b * hf);
                    let mut to = t.slice_mut(at * hf..(at + b - a) * hf);
                    self.stream.memcpy_dtod(&v, &mut to).map_err(cuda)?;
                }
            }
            Ok::<_, KernelError>(t)
        };
        Ok((
            Some(LocalWeights {
                gate: build(&w.gate, &got[0])?,
                up: build(&w.up, &got[1])?,
                down: build(&w.down, &got[2])?,
            }),
            bytes,
        ))
    }

    /// The forward on this rank's tokens `x` (`T × H`, bf16 on the device);
    /// every rank calls it with the same shape (`tokens` per rank) and a
    /// planner that answers alike on every rank.
    pub fn ep_forward(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        w: &EpWeights,
        x: &CudaSlice<u16>,
        planner: &dyn EpPlanner,
    ) -> Result<EpSaved, KernelError> {
        let (rank, world, el) = world_of(comm, s)?;
        let (h, f, e, k) = (s.hidden, s.ffn, s.experts, s.top_k);
        let p = s.pairs();
        super::super::check("x", s.tokens * h, x.len())?;
        let mut laps = Laps::new();
        let (probs, idx, gates, counts) = self.route(s, &w.router, x, w.bias.as_ref())?;
        laps.lap(self, "route")?;
        let base = exclusive_scan(&counts);
        let (dst, src) = self.group(&idx, None, None, &base[..e], p, p, e)?;
        // Everyone's counts, then the plan every rank follows.
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
        if counts_all.len() != world || counts_all.iter().any(|c| c.len() != e) {
            return Err(KernelError::Comm("routed counts of another shape".into()));
        }
        let plan = planner.forward(&counts_all)?;
        check_plan(&plan, &counts_all, el)?;
        let local = local_experts(&plan.instances, world);
        let lay = instance_layout(&plan.forward, &local, rank)?;
        laps.lap(self, "counts+plan")?;
        let (weights, w_bytes) = self.replica_weights(comm, s, w, &plan, &local, el)?;
        laps.lap(self, "replica weights")?;
        // Source: rows destination-major.
        let send_order = self.upload(&lay.send_order)?;
        let pair_of_send = self.gather32(&src, &send_order, p)?;
        let xs = self.gather_scaled(x, &pair_of_send, k, None, p, h)?;
        let xr_src = self.exchange(comm, &xs, &elems(&lay.send, h), &elems(&lay.recv.from, h))?;
        laps.lap(self, "a2a x")?;
        // Instance: regroup, experts, ungroup.
        let n_r = lay.recv.perm.len();
        let (gate_l, up_l, down_l) = match &weights {
            Some(lw) => (&lw.gate, &lw.up, &lw.down),
            None => (&w.gate, &w.up, &w.down),
        };
        let inv = self.upload(&lay.recv.inv)?;
        // Without replicas (decided from the plan, so alike on every rank)
        // owners keep their forward rows for the backward.
        let keep_rows = plan.instances.iter().all(|i| i.len() == 1);
        let mut kept_xr = None;
        let (or_src, hsq_src) = if n_r > 0 {
            let perm = self.upload(&lay.recv.perm)?;
            let xr = self.gather_scaled(&xr_src, &perm, 1, None, n_r, h)?;
            let od = self.group_offsets(&lay.recv.offsets)?;
            let nl = local[rank].len();
            let (_, _, hh) = self.experts_hidden(&od, nl, n_r, &xr, gate_l, up_l, h, f)?;
            let or = self.gemm(GemmVariant::Forward, &od, nl, &hh, down_l, n_r * h, f, h)?;
            let h_sq = self.row_sq(&hh, n_r, f)?;
            if keep_rows {
                kept_xr = Some(xr);
            }
            (
                self.gather_scaled(&or, &inv, 1, None, n_r, h)?,
                self.gather32(&h_sq, &inv, n_r)?,
            )
        } else {
            // SAFETY: zero rows: nothing is read.
            unsafe { (self.uninit::<u16>(0)?, self.uninit::<f32>(0)?) }
        };
        laps.lap(self, "regroup+experts")?;
        let o = self.exchange(
            comm,
            &or_src,
            &elems(&lay.recv.from, h),
            &elems(&lay.send, h),
        )?;
        let hsq_send = self.exchange(comm, &hsq_src, &lay.recv.from, &lay.send)?;
        laps.lap(self, "a2a o")?;
        let send_inv = self.upload(&lay.send_inv)?;
        let row_of_pair = self.gather32(&send_inv, &dst, p)?;
        let h_sq = self.gather32(&hsq_send, &send_inv, p)?;
        let y = self.combine_dev(&o, &row_of_pair, Some(&gates), s)?;
        laps.lap(self, "combine")?;
        // The global expert-major order the backward's selection runs in.
        let (gperm, gidx, goffsets) = global_order(&counts_all, rank, p);
        let (expert_of_row, _) = pack::ep::segments(counts.iter().map(|&c| c as usize));
        let kept_xr = match (keep_rows, kept_xr) {
            (true, None) => {
                // SAFETY: zero rows (this owner received none): nothing is read.
                Some(unsafe { self.uninit::<u16>(0) }?)
            }
            (_, k) => k,
        };
        let owned_rows = match kept_xr {
            Some(xr) => {
                let (key, _) = pack::ep::segments(lay.recv.per_expert.iter().map(|&c| c as usize));
                Some(OwnedRows {
                    x: xr,
                    expert: self.upload(&key)?,
                    offsets: self.upload(&lay.recv.offsets)?,
                    global: (
                        goffsets[rank * el] as usize,
                        goffsets[(rank + 1) * el] as usize,
                    ),
                })
            }
            None => None,
        };
        laps.print("forward", rank);
        let sent_rows = off_rank(&lay.send, rank) + off_rank(&lay.recv.from, rank);
        Ok(EpSaved {
            s: *s,
            per_rank: el,
            x: x.clone(),
            probs,
            idx,
            gates,
            dst,
            src,
            row_of_pair,
            o,
            h_sq,
            expert_of_row: self.upload(&expert_of_row)?,
            offsets: self.upload(&base)?,
            gperm: self.upload(&gperm)?,
            gidx: self.upload(&gidx)?,
            goffsets: self.upload(&goffsets)?,
            counts_all,
            plan,
            local,
            weights,
            owned_rows,
            y,
            bytes_sent: sent_rows * h * 2 + off_rank(&lay.recv.from, rank) * 4 + w_bytes,
        })
    }

    /// The LRMoE backward for `dy` (this rank's tokens, `T × H`): expert `e`
    /// keeps its `plan.quotas[e]` best pairs over all sources by LRM score;
    /// the planner splits the kept pairs over the instances; only kept rows
    /// travel and are multiplied.
    pub fn ep_backward(
        &self,
        comm: &NcclComm,
        w: &EpWeights,
        sv: &EpSaved,
        dy: &CudaSlice<u16>,
        planner: &dyn EpPlanner,
    ) -> Result<EpBackward, KernelError> {
        let s = &sv.s;
        let (t, h, f, e, k) = (s.tokens, s.hidden, s.ffn, s.experts, s.top_k);
        let (rank, world, el) = (comm.rank(), comm.world_size(), sv.per_rank);
        let p = s.pairs();
        super::super::check("dy", t * h, dy.len())?;
        let mut laps = Laps::new();
        // Router: complete and local, then summed over ranks (f32).
        let (g_router, dx_router) = self.router_backward(
            s,
            &w.router,
            &sv.x,
            dy,
            &sv.o,
            &sv.row_of_pair,
            (&sv.probs, &sv.idx, &sv.gates),
        )?;
        // SAFETY: uninitialised output; the conversion below writes it all.
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
        // Scores of this source's pairs (expert-major), all-gathered.
        let dy_sq = self.row_sq(dy, t, h)?;
        let scores = self.scores_from_norms(&sv.gates, &dy_sq, &sv.h_sq, &sv.src, p, k)?;
        // SAFETY: the all-gather writes all W·P entries.
        let mut all = unsafe { self.uninit::<f32>(world * p) }?;
        self.sync()?;
        comm.all_reduce_sum_f32(&mut router)?;
        comm.all_gather(&scores, &mut all)?;
        comm.synchronize()?;
        laps.lap(self, "scores+gather")?;
        // The same per-expert top-q on every rank, over every source's pairs.
        let n_all = world * p;
        let g_scores = self.gather32(&all, &sv.gperm, n_all)?;
        let qd = self.upload(&sv.plan.quotas)?;
        // Top-q by score, or priority sampling: top-q by key, weights from
        // the threshold (the key kept at q + 1 but not at q).
        let keys = match sv.plan.priority_seed {
            Some(seed) => Some(self.priority_keys_dev(&g_scores, &sv.gperm, seed, n_all)?),
            None => None,
        };
        let by = keys.as_ref().unwrap_or(&g_scores);
        let mut err = self.stream.clone_htod(&[0u32]).map_err(cuda)?;
        let mut select = |quotas: &CudaSlice<u32>| -> Result<CudaSlice<u8>, KernelError> {
            // SAFETY: the selection writes a flag for every row.
            let mut kept = unsafe { self.uninit::<u8>(n_all) }?;
            self.launch_select(by, &sv.gperm, &sv.goffsets, quotas, &mut kept, &mut err, e)?;
            Ok(kept)
        };
        let kept_g = select(&qd)?;
        let pair_weight = match &keys {
            Some(rho) => {
                let more: Vec<u32> = sv.plan.quotas.iter().map(|q| q.saturating_add(1)).collect();
                let kept_g1 = select(&self.upload(&more)?)?;
                let w = self.priority_weights_dev(
                    rho,
                    &g_scores,
                    (&kept_g, &kept_g1),
                    &sv.goffsets,
                    n_all,
                    e,
                )?;
                // This source's pairs: global row → expert-major row → pair.
                let w_rows = self.gather32(&w, &sv.gidx, p)?;
                let w_pair = self.gather32(&w_rows, &sv.dst, p)?;
                Some(self.mul_f32_dev(&sv.gates, &w_pair, p)?)
            }
            None => None,
        };
        let mask = self.gather_u8_dev(&kept_g, &sv.gidx, p)?;
        let mine = self.kept_counts_dev(&sv.expert_of_row, &mask, p, e)?;
        let flag_and_counts = (self.download(&err, 1)?[0], self.download(&mine, e)?);
        if flag_and_counts.0 != 0 {
            return Err(KernelError::Cuda(
                "ep_backward: a LRM score is NaN or infinite (non-finite dy?)".into(),
            ));
        }
        let bytes: Vec<u8> = flag_and_counts
            .1
            .iter()
            .flat_map(|c| c.to_le_bytes())
            .collect();
        let kept: Vec<Vec<u32>> = comm
            .all_gather_host(&bytes)?
            .into_iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect();
        laps.lap(self, "select")?;
        // Redistribution of the kept pairs over the instances.
        let split = planner.backward(&sv.plan, &kept)?;
        check_split(&split, &kept, &sv.plan.instances)?;
        if let Some(caps) = &sv.plan.caps {
            for (r, &cap) in caps.iter().enumerate() {
                let load: u64 = split.iter().flatten().map(|c| u64::from(c[r])).sum();
                if load > cap {
                    return Err(KernelError::Plan(format!(
                        "the redistribution gives rank {r} {load} pairs, over its cap {cap}"
                    )));
                }
            }
        }
        let lay: InstanceLayout = instance_layout(&split, &sv.local, rank)?;
        laps.lap(self, "redistribute")?;
        // Source: kept rows (expert-major, compacted), then destination-major.
        let kbase = exclusive_scan(&kept[rank]);
        let n_k = kbase[e] as usize;
        let (place, kept_rows) = self.group(
            &sv.expert_of_row,
            Some(&mask),
            Some(&sv.offsets),
            &kbase[..e],
            p,
            n_k,
            e,
        )?;
        let korder = self.upload(&lay.send_order)?;
        let pair = self.gather32(&sv.src, &self.gather32(&kept_rows, &korder, n_k)?, n_k)?;
        let dk_send = self.gather_scaled(
            dy,
            &pair,
            k,
            Some(pair_weight.as_ref().unwrap_or(&sv.gates)),
            n_k,
            h,
        )?;
        laps.lap(self, "pack")?;
        let (send, from) = (elems(&lay.send, h), elems(&lay.recv.from, h));
        // x rows travel only where a kept pair may change instance.
        let x_recv = match sv.owned_rows {
            Some(_) => None,
            None => {
                let xk_send = self.gather_scaled(&sv.x, &pair, k, None, n_k, h)?;
                Some(self.exchange(comm, &xk_send, &send, &from)?)
            }
        };
        let d_recv = self.exchange(comm, &dk_send, &send, &from)?;
        laps.lap(self, "a2a kept rows")?;
        // Instance: regroup, backward GEMMs on the kept rows.
        let n_r = lay.recv.perm.len();
        let nl = sv.local[rank].len();
        let (gate_l, up_l, down_l) = match &sv.weights {
            Some(lw) => (&lw.gate, &lw.up, &lw.down),
            None => (&w.gate, &w.up, &w.down),
        };
        let perm = self.upload(&lay.recv.perm)?;
        let xk = match (&x_recv, &sv.owned_rows) {
            (Some(xs), _) => self.gather_scaled(xs, &perm, 1, None, n_r, h)?,
            (None, Some(own)) => {
                // This owner's forward rows (expert, source, pair order),
                // masked by its slice of the global selection: the kept
                // rows in the order the sources sent their g·δ rows.
                let (lo, hi) = own.global;
                // SAFETY: the copy writes all hi - lo flags.
                let mut m = unsafe { self.uninit::<u8>(hi - lo) }?;
                if hi > lo {
                    let v = kept_g.slice(lo..hi);
                    let mut to = m.slice_mut(0..hi - lo);
                    self.stream.memcpy_dtod(&v, &mut to).map_err(cuda)?;
                }
                let kb: Vec<u32> = (rank * el..(rank + 1) * el)
                    .map(|ex| kept.iter().map(|row| row[ex]).sum())
                    .collect();
                let kb = exclusive_scan(&kb);
                let (_, rows) = self.group(
                    &own.expert,
                    Some(&m),
                    Some(&own.offsets),
                    &kb[..el],
                    hi - lo,
                    n_r,
                    el,
                )?;
                self.gather_scaled(&own.x, &rows, 1, None, n_r, h)?
            }
            (None, None) => {
                return Err(KernelError::Cuda(
                    "ep_backward: no x rows (invariant)".into(),
                ))
            }
        };
        let dk = self.gather_scaled(&d_recv, &perm, 1, None, n_r, h)?;
        let od = self.group_offsets(&lay.recv.offsets)?;
        let (dxk, gg, gu, gd) =
            self.experts_backward_dev(&od, nl, n_r, &xk, &dk, (gate_l, up_l, down_l), h, f)?;
        laps.lap(self, "experts bwd")?;
        let inv = self.upload(&lay.recv.inv)?;
        let dx_src = self.gather_scaled(&dxk, &inv, 1, None, n_r, h)?;
        let dx_rows = self.exchange(comm, &dx_src, &from, &send)?;
        laps.lap(self, "a2a dX")?;
        // Source: scatter-add the kept pairs' dX into the tokens.
        let kinv = self.upload(&lay.send_inv)?;
        let row = self.gather32(&kinv, &self.gather32(&place, &sv.dst, p)?, p)?;
        let dx_experts = self.combine_dev(&dx_rows, &row, None, s)?;
        let dx = self.add(&dx_router, &dx_experts, t * h)?;
        laps.lap(self, "scatter")?;
        let ((gate, up, down), g_bytes) =
            self.owner_gradients(comm, s, &sv.local, el, (gg, gu, gd))?;
        self.sync()?;
        laps.lap(self, "replica grads")?;
        laps.print("backward", rank);
        let x_rows = if sv.owned_rows.is_some() {
            0
        } else {
            off_rank(&lay.send, rank)
        };
        let rows = off_rank(&lay.send, rank) + x_rows + off_rank(&lay.recv.from, rank);
        Ok(EpBackward {
            dx,
            router,
            gate,
            up,
            down,
            kept_pairs: n_r,
            kept_total: kept.iter().flatten().map(|&c| c as usize).sum(),
            bytes_sent: p * 4 * (world - 1) + rows * h * 2 + g_bytes,
        })
    }

    /// This rank's own experts' gradients from those of its instances
    /// (`local` order): replicas' gradients go to their owners (one
    /// all-to-all per tensor) and are added there.
    #[allow(clippy::type_complexity)]
    fn owner_gradients(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        local: &[Vec<usize>],
        el: usize,
        (gg, gu, gd): (CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>),
    ) -> Result<((CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), usize), KernelError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let hf = s.hidden * s.ffn;
        let any_replica = local
            .iter()
            .enumerate()
            .any(|(r, l)| l.iter().any(|&e| e / el != r));
        if !any_replica {
            return Ok(((gg, gu, gd), 0));
        }
        let mine = &local[rank];
        let below = mine.iter().filter(|&&e| e / el < rank).count();
        // Sends: replica gradients to their owners, ascending expert.
        let mut out_blocks = Vec::new();
        let mut send = vec![0usize; world];
        for (i, &e) in mine.iter().enumerate() {
            if e / el != rank {
                out_blocks.push(i);
                send[e / el] += 1;
            }
        }
        // Receives: from each rank, the replicas of this rank's experts it
        // hosted, ascending expert.
        let mut recv = vec![0usize; world];
        let mut from_blocks = Vec::new();
        for (r, l) in local.iter().enumerate() {
            for &e in l {
                if r != rank && e / el == rank {
                    recv[r] += 1;
                    from_blocks.push(e - rank * el);
                }
            }
        }
        let mut out = Vec::with_capacity(3);
        for g in [&gg, &gu, &gd] {
            let packed = self.pack_blocks(g, &out_blocks, hf)?;
            let got = self.exchange(comm, &packed, &elems(&send, hf), &elems(&recv, hf))?;
            // This rank's block of the instance gradients.
            let mut own = self.pack_blocks(g, &(below..below + el).collect::<Vec<_>>(), hf)?;
            for (i, &b) in from_blocks.iter().enumerate() {
                let sum = {
                    let a = own.slice(b * hf..(b + 1) * hf);
                    let c = got.slice(i * hf..(i + 1) * hf);
                    self.add_views(&a, &c, hf)?
                };
                let mut to = own.slice_mut(b * hf..(b + 1) * hf);
                self.stream.memcpy_dtod(&sum, &mut to).map_err(cuda)?;
            }
            out.push(own);
        }
        let down = out.pop();
        let up = out.pop();
        let gate = out.pop();
        match (gate, up, down) {
            (Some(a), Some(b), Some(c)) => Ok(((a, b, c), out_blocks.len() * 3 * hf * 2)),
            _ => Err(KernelError::Cuda(
                "owner_gradients: three tensors expected".into(),
            )),
        }
    }

    /// `a + b` of two bf16 views of `n` elements, into a new buffer.
    fn add_views(
        &self,
        a: &cudarc::driver::CudaView<'_, u16>,
        b: &cudarc::driver::CudaView<'_, u16>,
        n: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        use cudarc::driver::PushKernelArg;
        // SAFETY: the kernel writes all n elements.
        let mut out = unsafe { self.uninit::<u16>(n) }?;
        let n_i = n as i64;
        let mut l = self.stream.launch_builder(&self.f_add);
        l.arg(a).arg(b).arg(&mut out).arg(&n_i);
        // SAFETY: (u16*, u16*, u16*, long long); a, b and out hold n; out
        // aliases neither input.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(out)
    }
}

/// The global expert-major order of every source's pairs (expert, then
/// source, then the source's expert-major order): for each global position
/// the index into the all-gathered scores (`s·P + row`), this source's
/// rows' global positions, and the global expert offsets.
fn global_order(counts_all: &[Vec<u32>], rank: usize, p: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let world = counts_all.len();
    let experts = counts_all.first().map_or(0, Vec::len);
    let bases: Vec<Vec<u32>> = counts_all.iter().map(|c| exclusive_scan(c)).collect();
    let mut gperm = Vec::with_capacity(world * p);
    let mut gidx = vec![0u32; bases[rank][experts] as usize];
    let mut goffsets = Vec::with_capacity(experts + 1);
    for e in 0..experts {
        goffsets.push(gperm.len() as u32);
        for s in 0..world {
            let (lo, n) = (bases[s][e], counts_all[s][e]);
            if s == rank {
                let at = gperm.len() as u32;
                for i in 0..n {
                    gidx[(lo + i) as usize] = at + i;
                }
            }
            let off = (s * p) as u32;
            gperm.extend(off + lo..off + lo + n);
        }
    }
    goffsets.push(gperm.len() as u32);
    (gperm, gidx, goffsets)
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
    /// Kept pairs this rank's instances processed.
    pub kept_pairs: usize,
    /// Kept pairs over all ranks.
    pub kept_total: usize,
    /// Bytes sent to other ranks: forward, backward.
    pub bytes_sent: (usize, usize),
}

/// One row of the EP layer benchmark (this rank's view).
#[derive(Debug, Clone, Copy)]
pub struct EpBenchRow {
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
    /// before it (bytes, by `cuMemGetInfo` after trimming the pool).
    pub peak_bytes: u64,
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
        planner: &dyn EpPlanner,
    ) -> Result<EpHostResult, KernelError> {
        super::super::check("dy", s.tokens * s.hidden, dy.len())?;
        let fwd = self.ep_forward_host(comm, s, router, experts, x, None, planner)?;
        let g = self.ep_backward_host(comm, &fwd, dy, planner)?;
        Ok(EpHostResult {
            y: fwd.y,
            dx: g.dx,
            router: g.router,
            gate: g.gate,
            up: g.up,
            down: g.down,
            kept_pairs: g.kept_pairs,
            kept_total: g.kept_total,
            bytes_sent: (fwd.bytes_sent, g.bytes_sent),
        })
    }

    /// The forward from host data (bf16 bits): this rank's router copy, its
    /// experts' block and its tokens in, this rank's output, every source's
    /// routed counts and the call's plan out; the device state stays for
    /// [`Gpu::ep_backward_host`]. Weights are uploaded each call;
    /// `router_bias` (one per expert) is [`Gpu::ep_logit_bias`].
    #[allow(clippy::too_many_arguments)]
    pub fn ep_forward_host(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        router: &[u16],
        experts: (&[u16], &[u16], &[u16]),
        x: &[u16],
        router_bias: Option<&[f32]>,
        planner: &dyn EpPlanner,
    ) -> Result<crate::gpu::EpHostForward, KernelError> {
        let mut w = self.ep_weights(comm, s, router, experts)?;
        if let Some(b) = router_bias {
            self.ep_logit_bias(&mut w, b)?;
        }
        super::super::check("x", s.tokens * s.hidden, x.len())?;
        let xd = self.upload(x)?;
        let sv = self.ep_forward(comm, s, &w, &xd, planner)?;
        let y = self.download(&sv.y, s.tokens * s.hidden)?;
        Ok(crate::gpu::EpHostForward::new(y, *s, w, sv))
    }

    /// The LRMoE backward of a host-driven forward (the same planner's
    /// redistribution), gradients copied back.
    pub fn ep_backward_host(
        &self,
        comm: &NcclComm,
        fwd: &crate::gpu::EpHostForward,
        dy: &[u16],
        planner: &dyn EpPlanner,
    ) -> Result<crate::gpu::EpHostGrads, KernelError> {
        let (w, sv) = fwd.state();
        let s = &fwd.shape;
        super::super::check("dy", s.tokens * s.hidden, dy.len())?;
        let dyd = self.upload(dy)?;
        let g = self.ep_backward(comm, w, sv, &dyd, planner)?;
        let (t, h, e) = (s.tokens, s.hidden, s.experts);
        let ew = sv.per_rank * h * s.ffn;
        Ok(crate::gpu::EpHostGrads {
            dx: self.download(&g.dx, t * h)?,
            router: self.download(&g.router, h * e)?,
            gate: self.download(&g.gate, ew)?,
            up: self.download(&g.up, ew)?,
            down: self.download(&g.down, ew)?,
            kept_pairs: g.kept_pairs,
            kept_total: g.kept_total,
            bytes_sent: g.bytes_sent,
        })
    }

    /// Times the EP layer on random data (`iters` calls after 2 warm-ups,
    /// median wall time, every rank in step), one row per `(label,
    /// planner)`. `hot` is added to the router logits of rank 0's experts
    /// (the PyTorch peer's `--hot`: rank 0 receives most pairs).
    pub fn bench_ep(
        &self,
        comm: &NcclComm,
        s: &MoeShape,
        planners: &[(f64, &dyn EpPlanner)],
        hot: f32,
        iters: usize,
    ) -> Result<Vec<EpBenchRow>, KernelError> {
        let (_, _, el) = world_of(comm, s)?;
        let (t, h, f, e, r) = (s.tokens, s.hidden, s.ffn, s.experts, comm.rank() as u64);
        let scale = fan_in_scaled;
        let mut w = self.ep_weights(
            comm,
            s,
            &scale(super::super::random_bf16(h * e, 31), h),
            (
                &scale(super::super::random_bf16(el * h * f, 32 + 8 * r), h),
                &scale(super::super::random_bf16(el * h * f, 33 + 8 * r), h),
                &scale(super::super::random_bf16(el * f * h, 34 + 8 * r), f),
            ),
        )?;
        if hot != 0.0 {
            let bias: Vec<f32> = (0..e).map(|i| if i < el { hot } else { 0.0 }).collect();
            self.ep_logit_bias(&mut w, &bias)?;
        }
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
        let mut rows = Vec::new();
        for &(label, planner) in planners {
            self.sync()?;
            self.trim_pool()?;
            let before = super::used_bytes()?;
            let sv = self.ep_forward(comm, s, &w, &x, planner)?;
            let last = self.ep_backward(comm, &w, &sv, &dy, planner)?;
            self.sync()?;
            let peak = super::used_bytes()?.saturating_sub(before);
            drop(last);
            drop(sv);
            let fwd = timed(&mut || self.ep_forward(comm, s, &w, &x, planner).map(|_| ()))?;
            let sv = self.ep_forward(comm, s, &w, &x, planner)?;
            let last = self.ep_backward(comm, &w, &sv, &dy, planner)?;
            let ms = timed(&mut || self.ep_backward(comm, &w, &sv, &dy, planner).map(|_| ()))?;
            rows.push(EpBenchRow {
                retention: label,
                forward_ms: fwd,
                backward_ms: ms,
                kept_pairs: last.kept_pairs,
                kept_total: last.kept_total,
                bytes_sent: last.bytes_sent,
                peak_bytes: peak,
            });
        }
        Ok(rows)
    }
}
