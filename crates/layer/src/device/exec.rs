//! The device executor proper (feature `cuda`); see the module doc.

use std::borrow::Cow;

use kernels::cpu::{fan_in_scaled, random_bf16};
use kernels::gpu::{CudaSlice, Gpu, Mark, Routed};
use kernels::KernelError;
use pack::ep::{
    experts_per_rank, global_order, instance_layout, local_experts, replica_traffic,
    InstanceLayout, Runs,
};

use crate::config::{Experts, MoeConfig};
use crate::plan::{
    check_device_shape, check_plan, check_split, one_instance_each, DevicePlanner, EpPlan,
};
use crate::LayerError;

use super::{DeviceComm, DeviceGrads, HostForward, HostGrads};

impl DeviceComm<'_> {
    /// Every rank's bytes, rank order.
    fn all_gather_host(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, KernelError> {
        match self {
            Self::Local => Ok(vec![local.to_vec()]),
            Self::Nccl(c) => c.all_gather_host(local),
            Self::Staged(t) => t.all_gather_bytes(local).map_err(staged),
        }
    }

    /// Every rank's `u32` counts, rank order, each `n` long.
    fn all_gather_counts(&self, mine: &[u32]) -> Result<Vec<Vec<u32>>, LayerError> {
        let bytes: Vec<u8> = mine.iter().flat_map(|c| c.to_le_bytes()).collect();
        let all: Vec<Vec<u32>> = self
            .all_gather_host(&bytes)?
            .into_iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect();
        if all.len() != self.world_size() || all.iter().any(|c| c.len() != mine.len()) {
            return Err(LayerError::Kernel(KernelError::Comm(
                "counts of another shape from a peer".into(),
            )));
        }
        Ok(all)
    }

    /// An all-to-all of the compute stream's `send` (`send_counts` elements
    /// to each rank, `recv_counts` from each): the compute stream is
    /// drained first, the communicator's after. One rank: `send` itself.
    fn exchange<T: kernels::gpu::DeviceRepr + bytemuck::Pod + Default>(
        &self,
        gpu: &Gpu,
        send: CudaSlice<T>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<CudaSlice<T>, KernelError> {
        match self {
            Self::Local => Ok(send),
            Self::Staged(t) => {
                let total: usize = send_counts.iter().sum();
                let soff = exclusive_scan(send_counts);
                let offers = send_counts
                    .iter()
                    .zip(&soff)
                    .map(|(&n, &off)| Ok((gpu.address(&send, off)?, bytes_of::<T>(n))))
                    .collect::<Result<Vec<_>, KernelError>>()?;
                let roff = exclusive_scan(recv_counts);
                let parts: Vec<(usize, usize)> = roff
                    .iter()
                    .zip(recv_counts)
                    .map(|(&o, &n)| (o, n))
                    .collect();
                // SAFETY: every element is written by a copy below (its
                // source's part) or the buffer is refused.
                let mut recv = unsafe { gpu.uninit::<T>(roff[recv_counts.len()]) }?;
                if let Some(done) = in_process(*t, gpu, &offers, &mut recv, &parts, true) {
                    done?;
                    return Ok(recv);
                }
                drop(recv);
                let host = gpu.download_range(&send, 0, total)?;
                let (got, counts) =
                    crate::transport::all_to_all(*t, &host, send_counts).map_err(staged)?;
                if counts != recv_counts {
                    return Err(KernelError::Comm(format!(
                        "rank {}: received {counts:?} elements, the plan says {recv_counts:?}",
                        t.rank()
                    )));
                }
                gpu.upload(&got)
            }
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => {
                let total: usize = recv_counts.iter().sum();
                // SAFETY: the all-to-all writes every element.
                let mut recv = unsafe { gpu.uninit::<T>(total) }?;
                gpu.sync()?;
                c.all_to_all_v(&send, send_counts, &mut recv, recv_counts)?;
                c.synchronize()?;
                Ok(recv)
            }
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => {
                let _ = (gpu, send_counts, recv_counts);
                Err(KernelError::NotCompiledWithNccl)
            }
        }
    }

    /// Starts an exchange beside the compute stream (the host does not
    /// wait): `sends[b][off .. off + n]` to rank `d` for `send_parts[d] =
    /// (b, off, n)`, `recv_parts[s] = (off, n)` into `recv` from rank `s`;
    /// the message to self never travels (its counts are zero: the caller
    /// moves those rows itself). One rank: nothing to do.
    fn start<T: kernels::gpu::DeviceRepr + bytemuck::Pod + Default>(
        &self,
        gpu: &Gpu,
        sends: Vec<CudaSlice<T>>,
        send_parts: &[(usize, usize, usize)],
        recv: CudaSlice<T>,
        recv_parts: &[(usize, usize)],
    ) -> Result<Flight<T>, KernelError> {
        match self {
            Self::Local => Ok(Flight::Here(recv, sends)),
            Self::Staged(t) => {
                let (rank, world) = (t.rank(), t.world_size());
                if send_parts.len() != world || recv_parts.len() != world {
                    return Err(KernelError::Shape {
                        what: "all-to-all parts (one per rank)",
                        expected: world,
                        got: send_parts.len().min(recv_parts.len()),
                    });
                }
                let mut offers = Vec::with_capacity(world);
                for (d, &(b, off, n)) in send_parts.iter().enumerate() {
                    offers.push(if n > 0 && d != rank {
                        let buf = sends.get(b).ok_or(KernelError::Shape {
                            what: "all-to-all send buffer",
                            expected: b + 1,
                            got: sends.len(),
                        })?;
                        (gpu.address(buf, off)?, bytes_of::<T>(n))
                    } else {
                        (0, 0)
                    });
                }
                let mut recv = recv;
                if let Some(done) = in_process(*t, gpu, &offers, &mut recv, recv_parts, false) {
                    done?;
                    return Ok(Flight::Here(recv, sends));
                }
                let mut host = Vec::new();
                let mut counts = Vec::with_capacity(world);
                for (d, &(b, off, n)) in send_parts.iter().enumerate() {
                    if n > 0 && d != rank {
                        let buf = sends.get(b).ok_or(KernelError::Shape {
                            what: "all-to-all send buffer",
                            expected: b + 1,
                            got: sends.len(),
                        })?;
                        host.extend(gpu.download_range(buf, off, n)?);
                    }
                    counts.push(if d == rank { 0 } else { n });
                }
                let (got, got_counts) =
                    crate::transport::all_to_all(*t, &host, &counts).map_err(staged)?;
                let mut at = 0;
                for (s, (&(off, n), &c)) in recv_parts.iter().zip(&got_counts).enumerate() {
                    let want = if s == rank { 0 } else { n };
                    if c != want {
                        return Err(KernelError::Comm(format!(
                            "rank {rank}: {c} elements from rank {s}, the plan says {want}"
                        )));
                    }
                    gpu.upload_range(&got[at..at + c], &mut recv, off)?;
                    at += c;
                }
                Ok(Flight::Here(recv, sends))
            }
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => Ok(Flight::Away(
                c.start_all_to_all(gpu, sends, send_parts, recv, recv_parts)?,
            )),
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => {
                let _ = (gpu, send_parts, recv_parts);
                Err(KernelError::NotCompiledWithNccl)
            }
        }
    }

    /// A timed mark on the communicator's stream (none on one rank).
    fn mark(&self) -> Result<Option<Mark>, KernelError> {
        match self {
            Self::Local | Self::Staged(_) => Ok(None),
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => Ok(Some(c.mark()?)),
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => Err(KernelError::NotCompiledWithNccl),
        }
    }

    /// Starts the sum of `buf` over ranks beside the compute stream.
    fn start_sum(&self, gpu: &Gpu, buf: CudaSlice<f32>) -> Result<Flight<f32>, KernelError> {
        match self {
            Self::Local => Ok(Flight::Here(buf, Vec::new())),
            Self::Staged(t) => {
                if let Some(summed) = sum_in_process(gpu, *t, std::slice::from_ref(&buf)) {
                    let sum = summed?.pop().ok_or_else(|| {
                        KernelError::Comm("the sum over ranks went missing".into())
                    })?;
                    return Ok(Flight::Here(sum, Vec::new()));
                }
                let mut buf = buf;
                let mut host = gpu.download_range(&buf, 0, buf.len())?;
                t.all_reduce_sum_f32(&mut host).map_err(staged)?;
                gpu.upload_range(&host, &mut buf, 0)?;
                Ok(Flight::Here(buf, Vec::new()))
            }
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => Ok(Flight::Away(c.start_all_reduce_sum_f32(gpu, buf)?)),
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => {
                let _ = (gpu, buf);
                Err(KernelError::NotCompiledWithNccl)
            }
        }
    }

    /// Waits (with the communicator's deadline) for every collective
    /// started so far: called before the host waits on the compute stream,
    /// which may be ordered after them, so a dead peer ends in an error,
    /// never a hang.
    fn settle(&self) -> Result<(), KernelError> {
        match self {
            // The staged collectives are done when they return.
            Self::Local | Self::Staged(_) => Ok(()),
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => c.synchronize(),
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => Err(KernelError::NotCompiledWithNccl),
        }
    }
}

/// Bytes of `n` elements of `T`.
fn bytes_of<T>(n: usize) -> u64 {
    (n * std::mem::size_of::<T>()) as u64
}

/// An exchange between in-process ranks sharing this GPU (`None` where the
/// transport's ranks do not share memory): the compute stream is drained,
/// every rank publishes its parts' device addresses (`offers[d]`: address
/// and bytes for rank `d`; the swap is recorded as the exchange), copies
/// the parts addressed to it into `recv` at `recv_parts[s] = (off, n)`
/// device to device, and waits until every rank has copied before any
/// send buffer may change. The message to self travels too when `self_too`
/// (an exchange of whole buffers); otherwise the caller moves it and
/// offers nothing to itself.
fn in_process<T: kernels::gpu::DeviceRepr>(
    t: &dyn crate::Transport,
    gpu: &Gpu,
    offers: &[(u64, u64)],
    recv: &mut CudaSlice<T>,
    recv_parts: &[(usize, usize)],
    self_too: bool,
) -> Option<Result<(), KernelError>> {
    let rank = t.rank();
    let copy = |got: Vec<(u64, u64)>, recv: &mut CudaSlice<T>| -> Result<(), KernelError> {
        t.bookkeeping(true).map_err(staged)?;
        for (s, (&(addr, bytes), &(off, n))) in got.iter().zip(recv_parts).enumerate() {
            let want = if s == rank && !self_too { 0 } else { n };
            if bytes != bytes_of::<T>(want) {
                return Err(KernelError::Comm(format!(
                    "rank {rank}: {bytes} bytes from rank {s}, the plan says {}",
                    bytes_of::<T>(want)
                )));
            }
            if want > 0 {
                // SAFETY: the source published a live part of `bytes`
                // bytes (checked above) and waits at the fence below
                // before it may write or free it; this rank waits for its
                // stream before that fence.
                unsafe { gpu.copy_from_address(addr, recv, off, want) }?;
            }
        }
        gpu.sync()?;
        t.bookkeeping(false).map_err(staged)
    };
    if let Err(e) = gpu.sync() {
        return Some(Err(e));
    }
    let got = t.swap_offers(offers)?;
    Some(
        got.map_err(staged)
            .and_then(|got| copy(got, recv))
            .and_then(|()| t.fence().map_err(staged)),
    )
}

/// A host transport's error as the device operations report it.
fn staged(e: crate::TransportError) -> KernelError {
    match e {
        crate::TransportError::Timeout { rank, timeout_ms } => {
            KernelError::CommTimeout { rank, timeout_ms }
        }
        other => KernelError::Comm(other.to_string()),
    }
}

/// An exchange started by [`DeviceComm::start`].
enum Flight<T> {
    /// One rank: the buffers, untouched.
    Here(CudaSlice<T>, Vec<CudaSlice<T>>),
    #[cfg(feature = "nccl")]
    Away(kernels::comm::InFlight<T>),
}

impl<T> Flight<T> {
    /// The rows going out (one rank: the rows handed through).
    fn outgoing(&self) -> Result<&CudaSlice<T>, KernelError> {
        let sent = match self {
            Self::Here(r, s) => s.first().or(Some(r)),
            #[cfg(feature = "nccl")]
            Self::Away(f) => f.sends().first(),
        };
        sent.ok_or_else(|| KernelError::Comm("an exchange without a send buffer".into()))
    }
    #[allow(clippy::type_complexity)]
    fn buffers_mut(&mut self) -> Result<(&[CudaSlice<T>], &mut CudaSlice<T>), KernelError> {
        match self {
            Self::Here(r, s) => Ok((s, r)),
            #[cfg(feature = "nccl")]
            Self::Away(f) => f.buffers_mut(),
        }
    }
    fn recv_mut(&mut self) -> Result<&mut CudaSlice<T>, KernelError> {
        Ok(self.buffers_mut()?.1)
    }
    /// Orders the compute stream after the exchange; the receive buffer
    /// and the send buffers.
    fn finish(self) -> Result<(CudaSlice<T>, Vec<CudaSlice<T>>), KernelError> {
        match self {
            Self::Here(r, s) => Ok((r, s)),
            #[cfg(feature = "nccl")]
            Self::Away(f) => f.finish(),
        }
    }
}

/// Sums every buffer over the ranks, in place: the sums start on the
/// communicator's stream after the work enqueued on the compute stream so
/// far, and the compute stream is ordered after them (the host does not
/// wait). One rank: the buffers themselves. The device-resident model's
/// data-parallel gradients.
pub fn sum_over_ranks(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    bufs: Vec<CudaSlice<f32>>,
) -> Result<Vec<CudaSlice<f32>>, LayerError> {
    if let DeviceComm::Staged(t) = comm {
        if let Some(summed) = sum_in_process(gpu, t, &bufs) {
            return Ok(summed?);
        }
    }
    let flights = bufs
        .into_iter()
        .map(|b| comm.start_sum(gpu, b))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(flights
        .into_iter()
        .map(|f| f.finish().map(|(b, _)| b))
        .collect::<Result<Vec<_>, _>>()?)
}

/// [`sum_over_ranks`] between in-process ranks sharing this GPU (`None`
/// where they do not share memory): every rank publishes its buffers'
/// addresses (one swap, recorded as one sum of all their bytes, as NCCL
/// runs the sums in one group), then sums every buffer over the ranks in
/// rank order from zero, device to device — the host-staged sum's order,
/// so the same bits — and waits until every rank has read every buffer
/// before handing the sums back.
fn sum_in_process(
    gpu: &Gpu,
    t: &dyn crate::Transport,
    bufs: &[CudaSlice<f32>],
) -> Option<Result<Vec<CudaSlice<f32>>, KernelError>> {
    let world = t.world_size();
    let addresses = match bufs
        .iter()
        .map(|b| gpu.address(b, 0))
        .collect::<Result<Vec<u64>, KernelError>>()
    {
        Ok(a) => a,
        Err(e) => return Some(Err(e)),
    };
    let bytes: u64 = bufs.iter().map(|b| bytes_of::<f32>(b.len())).sum();
    if let Err(e) = gpu.sync() {
        return Some(Err(e));
    }
    let all = t.swap_sum_addresses(&addresses, bytes)?;
    let sum = |all: Vec<Vec<u64>>| -> Result<Vec<CudaSlice<f32>>, KernelError> {
        if all.len() != world || all.iter().any(|a| a.len() != bufs.len()) {
            return Err(KernelError::Comm(
                "buffer addresses of another shape from a peer".into(),
            ));
        }
        t.bookkeeping(true).map_err(staged)?;
        let mut sums = Vec::with_capacity(bufs.len());
        for (i, b) in bufs.iter().enumerate() {
            let n = b.len();
            let mut acc = gpu.zeros::<f32>(n)?;
            // SAFETY: overwritten by each copy below before it is read.
            let mut part = unsafe { gpu.uninit::<f32>(n) }?;
            for peer in &all {
                // SAFETY: every rank's buffer `i` holds `n` f32 (the ranks
                // run the same model) and stays untouched until the fence.
                unsafe { gpu.copy_from_address(peer[i], &mut part, 0, n) }?;
                gpu.add_f32(&mut acc, &part, n)?;
            }
            sums.push(acc);
        }
        gpu.sync()?;
        t.bookkeeping(false).map_err(staged)?;
        t.fence().map_err(staged)?;
        Ok(sums)
    };
    Some(all.map_err(staged).and_then(sum))
}

/// Waits, with the communicator's deadline, for every collective started
/// so far: call it before the host waits on the compute stream after
/// [`sum_over_ranks`], so a dead peer ends in an error, never a hang. One
/// rank: nothing to wait for.
pub fn settle(comm: DeviceComm<'_>) -> Result<(), LayerError> {
    Ok(comm.settle()?)
}

/// SMs the experts' GEMMs leave to an exchange running beside them on
/// several ranks: `LRMOE_COMM_SMS` (read once per process), else 16 (NCCL's send/receive kernels
/// must find free SMs, or they wait for the persistent GEMM to end).
fn comm_sms(comm: DeviceComm<'_>) -> u32 {
    // One rank or staged collectives: nothing runs beside the GEMMs.
    if !matches!(comm, DeviceComm::Nccl(_)) || comm.world_size() == 1 {
        return 0;
    }
    static SMS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        std::env::var("LRMOE_COMM_SMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16)
    })
}

/// Keeps [`comm_sms`] SMs out of the GEMMs while it lives.
struct Overlap<'a>(&'a Gpu);

impl<'a> Overlap<'a> {
    fn new(gpu: &'a Gpu, comm: DeviceComm<'_>) -> Self {
        gpu.set_gemm_sm_reserve(comm_sms(comm));
        Self(gpu)
    }
}

impl Drop for Overlap<'_> {
    fn drop(&mut self) {
        self.0.set_gemm_sm_reserve(0);
    }
}

/// The parts of an exchange of rows of `width` from one packed buffer
/// (`send[d]` rows to rank `d`, consecutive) into one packed buffer
/// (`recv[s]` rows from rank `s`, consecutive), the own rank's message
/// left out of both (its region of the receive buffer is the caller's).
#[allow(clippy::type_complexity)]
fn packed_parts(
    send: &[usize],
    recv: &[usize],
    rank: usize,
    width: usize,
) -> (Vec<(usize, usize, usize)>, Vec<(usize, usize)>) {
    let (so, ro) = (exclusive_scan(send), exclusive_scan(recv));
    let sp = (0..send.len())
        .map(|d| {
            let n = if d == rank { 0 } else { send[d] * width };
            (0, so[d] * width, n)
        })
        .collect();
    let rp = (0..recv.len())
        .map(|s| {
            let n = if s == rank { 0 } else { recv[s] * width };
            (ro[s] * width, n)
        })
        .collect();
    (sp, rp)
}

/// Starts an exchange of the packed rows `send` (`send_rows[d]` rows of
/// `width` to rank `d`) into a fresh packed buffer (`recv_rows[s]` rows from
/// rank `s`); the own rows are copied on the compute stream when
/// `copy_own` (else their region stays unwritten). One rank: every row is
/// its own, and `send` is handed through as the received rows.
fn exchange_rows<T: kernels::gpu::DeviceRepr + bytemuck::Pod + Default>(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    send: CudaSlice<T>,
    (send_rows, recv_rows): (&[usize], &[usize]),
    width: usize,
    copy_own: bool,
) -> Result<Flight<T>, LayerError> {
    if comm.world_size() == 1 {
        return Ok(Flight::Here(send, Vec::new()));
    }
    let rank = comm.rank();
    let (sp, rp) = packed_parts(send_rows, recv_rows, rank, width);
    let total: usize = recv_rows.iter().sum();
    // SAFETY: the exchange writes every other rank's region and the copy
    // below the own one; without `copy_own` the caller reads no row of it.
    let recv = unsafe { gpu.uninit::<T>(total * width) }?;
    let mut fl = comm.start(gpu, vec![send], &sp, recv, &rp)?;
    if copy_own {
        let (a, b) = (
            exclusive_scan(send_rows)[rank],
            exclusive_scan(recv_rows)[rank],
        );
        let (sends, recv) = fl.buffers_mut()?;
        copy_rows(gpu, &sends[0], a, recv, b, (send_rows[rank], width))?;
    }
    Ok(fl)
}

/// Copies `rows` rows of `width` from row `a` of `from` to row `b` of `to`
/// (the message to self of an exchange).
fn copy_rows<T: kernels::gpu::DeviceRepr>(
    gpu: &Gpu,
    from: &CudaSlice<T>,
    a: usize,
    to: &mut CudaSlice<T>,
    b: usize,
    (rows, width): (usize, usize),
) -> Result<(), LayerError> {
    if rows == 0 {
        return Ok(());
    }
    check_at_least("rows to copy", (a + rows) * width, from.len())?;
    check_at_least("rows to copy into", (b + rows) * width, to.len())?;
    let v = from.slice(a * width..(a + rows) * width);
    let mut t = to.slice_mut(b * width..(b + rows) * width);
    gpu.copy(&v, &mut t)?;
    Ok(())
}

/// One rank's weights on its device, bf16: the router `H × E` (every rank
/// holds it) and the rank's own experts, `E_l × H × F` (gate, up) and
/// `E_l × F × H` (down).
pub struct DeviceWeights {
    router: CudaSlice<u16>,
    /// A constant added to the router logits of each expert (the forced
    /// hot-expert workload), if any.
    bias: Option<CudaSlice<f32>>,
    /// The balancing bias added to the router probabilities for the top-k
    /// choice only (`CallConfig::expert_bias`), if any.
    sel_bias: Option<CudaSlice<f32>>,
    experts: Experts<CudaSlice<u16>>,
}

/// The weights of this rank's instances in one call (its own experts and
/// the replicas it received), in the order of its local expert list.
type LocalWeights = Experts<CudaSlice<u16>>;

/// Forward state kept for the backward: the source's routing, outputs and
/// norms, and, in calls without replicas, the owner's forward rows.
pub struct DeviceSaved {
    cfg: MoeConfig,
    tokens: usize,
    /// This source's pairs that reached an expert (all `tokens · k` unless
    /// the capacity factor dropped some), in expert-major rows.
    rows: usize,
    per_rank: usize,
    x: CudaSlice<u16>,
    routed: Routed,
    /// Pair → this source's expert-major row (`DROPPED` for a pair the
    /// capacity dropped), and row → pair.
    dst: CudaSlice<u32>,
    src: CudaSlice<u32>,
    /// Pair → row of `o` (send order).
    row_of_pair: CudaSlice<u32>,
    /// Output rows of this source's pairs, send order (and a zero row for
    /// dropped pairs).
    o: CudaSlice<u16>,
    /// `‖h‖²` of this source's pairs, expert-major.
    h_sq: CudaSlice<f32>,
    /// This source's expert offsets (`E + 1`).
    offsets: Vec<u32>,
    /// The global expert-major order of the backward's selection.
    order: SelectionOrder,
    counts_all: Vec<Vec<u32>>,
    plan: EpPlan,
    local: Vec<Vec<usize>>,
    weights: Option<LocalWeights>,
    /// Without replicas in the call, this rank's forward rows as an owner
    /// (as they arrived), each expert-major row's local expert and the
    /// group offsets:
    /// the backward's kept pairs cannot move, so their `x` rows are taken
    /// from here instead of travelling again.
    owned_rows: Option<OwnedRows>,
    /// Layer output for this rank's tokens, `T × H`.
    pub y: CudaSlice<u16>,
    /// Bytes this rank sent to other ranks in the forward's all-to-alls
    /// (rows, their outputs and norms, replica weights).
    pub bytes_sent: usize,
    /// This rank's auxiliary balancing loss (0 when off) and its gradient
    /// with respect to every router probability, one per expert.
    pub aux_loss: f64,
    aux_dp: Option<CudaSlice<f32>>,
}

impl DeviceSaved {
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

/// The projections `x·W_gate`, `x·W_up` of expert rows (`rows × F` each).
type Projections = (CudaSlice<u16>, CudaSlice<u16>);

/// An owner's forward rows kept for the backward (calls without replicas).
struct OwnedRows {
    /// The rows as they arrived (source-major).
    x: CudaSlice<u16>,
    /// Their projections in the same order, when the call keeps them
    /// ([`DevicePlanner::keep_projections`], one rank).
    ab: Option<Projections>,
    /// Expert-major row → arrival row (`None`: the identity).
    perm: Option<CudaSlice<u32>>,
    expert: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    /// This rank's experts' range in the global expert-major order.
    global: (usize, usize),
}

/// The timeline of one call, logged when `LRMOE_EP_PROFILE=1`: a timed
/// mark on the compute stream after each phase, and for each exchange the
/// compute stream's mark where it was started and the communicator
/// stream's mark where it ended. Nothing is synchronised until the log, so
/// overlapping phases show as overlapping intervals (device ms from the
/// call's start); beside each compute mark, the host's ms from the call's
/// start when it enqueued the mark (a host far ahead of the device is
/// never waited on; a device mark close behind the host's is a device
/// that waited for the host).
struct Laps {
    start: Option<Mark>,
    host0: std::time::Instant,
    compute: Vec<(&'static str, Mark, f64)>,
    comm: Vec<(&'static str, Mark, Mark)>,
}

impl Laps {
    fn new(gpu: &Gpu) -> Result<Self, KernelError> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("LRMOE_EP_PROFILE").as_deref() == Ok("1"));
        Ok(Self {
            start: if on { Some(gpu.mark()?) } else { None },
            host0: std::time::Instant::now(),
            compute: Vec::new(),
            comm: Vec::new(),
        })
    }
    fn lap(&mut self, gpu: &Gpu, name: &'static str) -> Result<(), KernelError> {
        if self.start.is_some() {
            let host = self.host0.elapsed().as_secs_f64() * 1e3;
            self.compute.push((name, gpu.mark()?, host));
        }
        Ok(())
    }
    /// An exchange `name` was just started.
    fn sent(
        &mut self,
        gpu: &Gpu,
        comm: DeviceComm<'_>,
        name: &'static str,
    ) -> Result<(), KernelError> {
        if self.start.is_some() {
            if let Some(end) = comm.mark()? {
                self.comm.push((name, gpu.mark()?, end));
            }
        }
        Ok(())
    }
    fn print(&self, what: &str, rank: usize) -> Result<(), KernelError> {
        let Some(t0) = &self.start else {
            return Ok(());
        };
        let mut parts = Vec::new();
        let mut at = 0.0;
        for (n, m, host) in &self.compute {
            let t = m.ms_since(t0)?;
            parts.push(format!("{n} {at:.2}-{t:.2} (host {host:.2})"));
            at = t;
        }
        let mut comm = Vec::new();
        for (n, a, b) in &self.comm {
            comm.push(format!("{n} {:.2}-{:.2}", a.ms_since(t0)?, b.ms_since(t0)?));
        }
        tracing::info!(
            rank,
            phase = what,
            "EP timeline (device ms): compute: {}; comm: {}",
            parts.join(", "),
            comm.join(", ")
        );
        Ok(())
    }
}

fn world_of(comm: DeviceComm<'_>, cfg: &MoeConfig) -> Result<(usize, usize, usize), LayerError> {
    check_device_shape(cfg)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    Ok((rank, world, experts_per_rank(cfg.n_experts, world)?))
}

fn elems(rows: &[usize], width: usize) -> Vec<usize> {
    rows.iter().map(|r| r * width).collect()
}

/// Rows this rank sends to other ranks under `send` counts.
fn off_rank(send: &[usize], rank: usize) -> usize {
    send.iter().sum::<usize>() - send[rank]
}

/// Starts of consecutive parts of `counts` (`len + 1` entries, from 0).
fn exclusive_scan<T: Copy + Default + std::ops::Add<Output = T>>(counts: &[T]) -> Vec<T> {
    let mut v = Vec::with_capacity(counts.len() + 1);
    let mut s = T::default();
    v.push(s);
    for &c in counts {
        s = s + c;
        v.push(s);
    }
    v
}

/// A `pack::ep` map expanded on the device (only its runs cross).
fn expand(gpu: &Gpu, map: &Runs) -> Result<CudaSlice<u32>, LayerError> {
    Ok(gpu.expand_runs_dev(&map.flat(), map.step, map.len)?)
}

fn check_len(what: &str, expected: usize, got: usize) -> Result<(), LayerError> {
    if expected == got {
        Ok(())
    } else {
        Err(LayerError::Shape {
            what: what.into(),
            expected,
            got,
        })
    }
}

/// `rows[perm[j]]` for the `perm.len()` rows of `width` of `rows`; the
/// buffer itself when `perm` is the identity (one rank's layouts). Every
/// `perm` here is a `pack::ep` layout's (`recv.perm`, `recv.inv`,
/// `send_inv`, `send_order`): a permutation of `0..perm.len()`, which
/// `pack` proptests, so only the row count is checked here.
fn permute_rows(
    gpu: &Gpu,
    rows: CudaSlice<u16>,
    perm: &Runs,
    width: usize,
) -> Result<CudaSlice<u16>, LayerError> {
    if perm.is_identity() {
        return Ok(rows);
    }
    let n = perm.len;
    check_at_least("rows to permute", n * width, rows.len())?;
    let pd = expand(gpu, perm)?;
    // SAFETY: perm is a permutation of 0..n (a `pack::ep` layout) and rows
    // holds n rows (checked above).
    Ok(unsafe { gpu.gather_scaled(&rows, &pd, 1, None, n, width) }?)
}

/// `vals[perm[j]]` (4-byte values); the buffer itself for the identity.
/// `perm` as in [`permute_rows`].
fn permute4<T: kernels::gpu::DeviceRepr + kernels::gpu::ValidAsZeroBits>(
    gpu: &Gpu,
    vals: CudaSlice<T>,
    perm: &Runs,
) -> Result<CudaSlice<T>, LayerError> {
    if perm.is_identity() {
        return Ok(vals);
    }
    check_at_least("values to permute", perm.len, vals.len())?;
    let pd = expand(gpu, perm)?;
    // SAFETY: perm is a permutation of 0..perm.len (a `pack::ep` layout)
    // over as many values (checked above).
    Ok(unsafe { gpu.gather32(&vals, &pd, perm.len) }?)
}

fn check_at_least(what: &str, expected: usize, got: usize) -> Result<(), LayerError> {
    if got >= expected {
        Ok(())
    } else {
        Err(LayerError::Shape {
            what: what.into(),
            expected,
            got,
        })
    }
}

/// Uploads one rank's weights (bf16 bits): the full router and the
/// rank's block of experts.
pub fn weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: &[u16],
    (gate, up, down): (&[u16], &[u16], &[u16]),
) -> Result<DeviceWeights, LayerError> {
    let (_, _, el) = world_of(comm, cfg)?;
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    check_len("router", h * e, router.len())?;
    check_len("gate (this rank's experts)", el * h * f, gate.len())?;
    check_len("up (this rank's experts)", el * h * f, up.len())?;
    check_len("down (this rank's experts)", el * f * h, down.len())?;
    Ok(DeviceWeights {
        router: gpu.upload(router)?,
        bias: None,
        sel_bias: None,
        experts: Experts {
            gate: gpu.upload(gate)?,
            up: gpu.upload(up)?,
            down: gpu.upload(down)?,
        },
    })
}

/// Weights whose buffers another library owns (the Python package's
/// torch parameters), borrowed for one call ([`borrow_weights`]):
/// dropping them frees nothing but the biases set on them.
pub struct BorrowedWeights(std::mem::ManuallyDrop<DeviceWeights>);

impl std::ops::Deref for BorrowedWeights {
    type Target = DeviceWeights;
    fn deref(&self) -> &DeviceWeights {
        &self.0
    }
}

impl std::ops::DerefMut for BorrowedWeights {
    fn deref_mut(&mut self) -> &mut DeviceWeights {
        &mut self.0
    }
}

impl Drop for BorrowedWeights {
    fn drop(&mut self) {
        // SAFETY: taken once, here.
        let w = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        // The borrowed buffers go back to their owner unfreed; the biases
        // are this crate's.
        let (gate, up, down) = w.experts.into_tuple();
        for b in [w.router, gate, up, down] {
            let _ = b.leak();
        }
        drop((w.bias, w.sel_bias));
    }
}

/// One rank's weights in device buffers another library owns, by address
/// (bf16): the router `H × E` and the rank's experts' gate, up
/// (`E_l × H × F`) and down (`E_l × F × H`). No copy is made.
///
/// # Safety
///
/// Each address is a live allocation of `gpu`'s context holding at least
/// the stated number of bf16 values, alive and written by no one else while
/// the returned weights, or work queued on them, are in use.
pub unsafe fn borrow_weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    router: u64,
    (gate, up, down): (u64, u64, u64),
) -> Result<BorrowedWeights, LayerError> {
    let (_, _, el) = world_of(comm, cfg)?;
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    // SAFETY: the caller's contract, per buffer.
    let take = |p: u64, n: usize| unsafe { gpu.borrow::<u16>(p, n) };
    // Every address checked before any buffer leaves its guard.
    let (router, gate, up, down) = (
        take(router, h * e)?,
        take(gate, el * h * f)?,
        take(up, el * h * f)?,
        take(down, el * f * h)?,
    );
    Ok(BorrowedWeights(std::mem::ManuallyDrop::new(
        DeviceWeights {
            router: router.into_inner(),
            bias: None,
            sel_bias: None,
            experts: Experts {
                gate: gate.into_inner(),
                up: up.into_inner(),
                down: down.into_inner(),
            },
        },
    )))
}

impl DeviceWeights {
    /// Zeroed weights of this rank (the router and its block of experts),
    /// for a device-resident optimizer to write in place
    /// ([`DeviceWeights::buffers_mut`]).
    pub fn zeros(gpu: &Gpu, comm: DeviceComm<'_>, cfg: &MoeConfig) -> Result<Self, LayerError> {
        let (_, _, el) = world_of(comm, cfg)?;
        let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
        Ok(Self {
            router: gpu.zeros::<u16>(h * e)?,
            bias: None,
            sel_bias: None,
            experts: Experts {
                gate: gpu.zeros::<u16>(el * h * f)?,
                up: gpu.zeros::<u16>(el * h * f)?,
                down: gpu.zeros::<u16>(el * f * h)?,
            },
        })
    }

    /// The bf16 router (`H × E`) and this rank's experts' gate, up
    /// (`E_l × H × F`) and down (`E_l × F × H`), writable in place.
    pub fn buffers_mut(&mut self) -> [&mut CudaSlice<u16>; 4] {
        [
            &mut self.router,
            &mut self.experts.gate,
            &mut self.experts.up,
            &mut self.experts.down,
        ]
    }
}

/// Adds `bias[e]` to every token's router logit of expert `e` (one finite
/// value per expert; a constant, so every gradient formula holds): the
/// forced hot-expert workload of `CallConfig::hot_experts`.
pub fn set_logit_bias(
    gpu: &Gpu,
    cfg: &MoeConfig,
    w: &mut DeviceWeights,
    bias: &[f32],
) -> Result<(), LayerError> {
    w.bias = Some(per_expert(gpu, cfg, bias, "router logit bias")?);
    Ok(())
}

/// Adds `bias[e]` to expert `e`'s router probability for the top-k choice
/// only (one finite value per expert; the gates stay unbiased): the
/// auxiliary-loss-free balancing bias of `CallConfig::expert_bias`.
pub fn set_selection_bias(
    gpu: &Gpu,
    cfg: &MoeConfig,
    w: &mut DeviceWeights,
    bias: &[f32],
) -> Result<(), LayerError> {
    w.sel_bias = Some(per_expert(gpu, cfg, bias, "expert selection bias")?);
    Ok(())
}

/// One finite value per expert, uploaded.
fn per_expert(
    gpu: &Gpu,
    cfg: &MoeConfig,
    v: &[f32],
    what: &'static str,
) -> Result<CudaSlice<f32>, LayerError> {
    check_len(&format!("{what} (one per expert)"), cfg.n_experts, v.len())?;
    if v.iter().any(|b| !b.is_finite()) {
        return Err(LayerError::NonFinite(what));
    }
    Ok(gpu.upload(v)?)
}

/// `n` consecutive blocks of `width` elements of `src`, starting at the
/// listed block indices, packed into one buffer (device copies).
fn pack_blocks(
    gpu: &Gpu,
    src: &CudaSlice<u16>,
    blocks: &[usize],
    width: usize,
) -> Result<CudaSlice<u16>, LayerError> {
    // SAFETY: every block of the output is written by the copies below.
    let mut out = unsafe { gpu.uninit::<u16>(blocks.len() * width) }?;
    for (i, &b) in blocks.iter().enumerate() {
        if (b + 1) * width > src.len() {
            return Err(LayerError::Config("a weight block past its tensor".into()));
        }
        let from = src.slice(b * width..(b + 1) * width);
        let mut to = out.slice_mut(i * width..(i + 1) * width);
        gpu.copy(&from, &mut to)?;
    }
    Ok(out)
}

/// The weights of this rank's instances for `plan`: owners send every
/// replicated expert's weights to the replicas' ranks (one all-to-all per
/// tensor); `None` where this rank holds only its own block (no plan yet,
/// or one instance per expert).
fn replica_weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    w: &DeviceWeights,
    plan: Option<&EpPlan>,
    local: &[Vec<usize>],
    el: usize,
) -> Result<(Option<LocalWeights>, usize), LayerError> {
    let rank = comm.rank();
    let Some(plan) = plan.filter(|plan| !one_instance_each(&plan.instances)) else {
        return Ok((None, 0));
    };
    let hf = cfg.hidden * cfg.ffn;
    let traffic = replica_traffic(&plan.instances, local, rank, el);
    let mut got = Vec::with_capacity(3);
    for t in [&w.experts.gate, &w.experts.up, &w.experts.down] {
        let packed = pack_blocks(gpu, t, &traffic.weights_out, hf)?;
        got.push(comm.exchange(
            gpu,
            packed,
            &elems(&traffic.weights_send, hf),
            &elems(&traffic.weights_recv, hf),
        )?);
    }
    let bytes = traffic.weights_out.len() * 3 * hf * 2;
    let n_in: usize = traffic.weights_recv.iter().sum();
    if n_in == 0 {
        return Ok((None, bytes));
    }
    // This rank's instances, ascending: replicas below its block, its
    // block, replicas above.
    let below = traffic.below;
    let nl = local[rank].len();
    let build = |own: &CudaSlice<u16>, rep: &CudaSlice<u16>| {
        // SAFETY: the three copies below write all nl blocks.
        let mut t = unsafe { gpu.uninit::<u16>(nl * hf) }?;
        let parts = [
            (rep, 0, below, 0),
            (own, 0, el, below),
            (rep, below, n_in, below + el),
        ];
        for (from, a, b, at) in parts {
            if b > a {
                let v = from.slice(a * hf..b * hf);
                let mut to = t.slice_mut(at * hf..(at + b - a) * hf);
                gpu.copy(&v, &mut to)?;
            }
        }
        Ok::<_, LayerError>(t)
    };
    Ok((
        Some(LocalWeights {
            gate: build(&w.experts.gate, &got[0])?,
            up: build(&w.experts.up, &got[1])?,
            down: build(&w.experts.down, &got[2])?,
        }),
        bytes,
    ))
}

/// The router's output on this rank's tokens (GEMM, biases, softmax,
/// top-k, counts) and the auxiliary loss's terms.
fn route_rows(
    gpu: &Gpu,
    cfg: &MoeConfig,
    w: &DeviceWeights,
    x: &CudaSlice<u16>,
    planner: &DevicePlanner,
    world: usize,
) -> Result<(Routed, f64, Option<CudaSlice<f32>>), LayerError> {
    let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.top_k);
    let routed = gpu.route(
        &w.router,
        x,
        w.bias.as_ref(),
        w.sel_bias.as_ref(),
        (x.len() / h, h, e, k),
        cfg.renormalize,
    )?;
    let (aux_loss, aux_dp) = aux_terms(gpu, planner.aux_loss_coeff(), &routed, world)?;
    Ok((routed, aux_loss, aux_dp))
}

/// This source's `p` pairs grouped by expert (stable, pair order), and
/// under a capacity factor (the baseline) only each expert's first
/// `crate::router::expert_capacity` pairs: the others reach no expert, in
/// the forward or the backward.
fn group_and_cap(
    gpu: &Gpu,
    routed: &Routed,
    capacity_factor: Option<f64>,
    p: usize,
    e: usize,
) -> Result<Capped, LayerError> {
    let base = exclusive_scan(&routed.counts);
    // SAFETY: idx holds p experts below e (route's output); base is the
    // prefix sum of route's own counts of those experts.
    let (dst, src) = unsafe { gpu.group(&routed.idx, None, None, &base[..e], p, p, e) }?;
    match crate::router::expert_capacity(capacity_factor, p, e)? {
        Some(cap) if routed.counts.iter().any(|&c| c as usize > cap) => {
            cap_rows(gpu, &routed.counts, cap, &src, &dst, p)
        }
        _ => Ok(Capped {
            counts: routed.counts.clone(),
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
    /// The whole plan, when the call has replica slots (otherwise the
    /// controller runs while the experts compute).
    early: Option<EpPlan>,
    /// Without replica slots: every expert's rows to its owner.
    owner_split: Vec<Vec<Vec<u32>>>,
    /// Each rank's instances.
    local: Vec<Vec<usize>>,
    /// This source's layout of the split.
    lay: InstanceLayout,
}

/// Everyone's counts, then the split every rank follows. Without replica
/// slots (alike on every rank) the split is the routed counts, each
/// expert's to its owner: the rows go out now and the controller (the
/// backward's quotas) runs on the host while the experts compute.
fn forward_plan(
    comm: DeviceComm<'_>,
    planner: &DevicePlanner,
    counts: &[u32],
    (rank, world, el): (usize, usize, usize),
) -> Result<ForwardPlan, LayerError> {
    let counts_all = comm.all_gather_counts(counts)?;
    let early = if planner.owners_only() {
        None
    } else {
        let plan = planner.forward(&counts_all)?;
        check_plan(&plan, &counts_all, el)?;
        Some(plan)
    };
    let owner_split = match &early {
        Some(_) => Vec::new(),
        None => crate::plan::owners_split(&counts_all, |e| e / el, world)?,
    };
    let (split, local) = match &early {
        Some(plan) => (&plan.forward, local_experts(&plan.instances, world)),
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

/// Each source's expert outputs and `‖h‖²` back to it (the own ones
/// copied), in the layout the source sent its rows in: `(o, ‖h‖²)` of this
/// source's `n` rows.
#[allow(clippy::type_complexity)]
fn return_outputs(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    mut outs: Vec<Option<(CudaSlice<u16>, CudaSlice<f32>)>>,
    lay: &InstanceLayout,
    (rank, world, n, h): (usize, usize, usize, usize),
    laps: &mut Laps,
) -> Result<(CudaSlice<u16>, CudaSlice<f32>), LayerError> {
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
        let (o_buf, h_buf) = unsafe { (gpu.uninit::<u16>(n * h)?, gpu.uninit::<f32>(n)?) };
        let mut fo = comm.start(gpu, o_sends, &op, o_buf, &orp)?;
        let mut fh = comm.start(gpu, h_sends, &hp, h_buf, &hrp)?;
        laps.sent(gpu, comm, "o, |h|^2 back")?;
        copy_rows(
            gpu,
            &own.0,
            0,
            fo.recv_mut()?,
            soff[rank],
            (lay.send[rank], h),
        )?;
        copy_rows(
            gpu,
            &own.1,
            0,
            fh.recv_mut()?,
            soff[rank],
            (lay.send[rank], 1),
        )?;
        (fo.finish()?.0, fh.finish()?.0)
    })
}

/// The source's pairs combined: each pair's row of the returned outputs
/// (pairs dropped by the capacity point at an extra zero row: their output,
/// and their router gradient term, are zero), the rows' `‖h‖²` in this
/// source's grouped order, and `y = Σ_k g · o`.
#[allow(clippy::type_complexity)]
fn combine_pairs(
    gpu: &Gpu,
    (dst, dst_fwd): (&CudaSlice<u32>, Option<&CudaSlice<u32>>),
    lay: &InstanceLayout,
    (o, hsq_send): (CudaSlice<u16>, CudaSlice<f32>),
    routed: &Routed,
    (tokens, h, k, n): (usize, usize, usize, usize),
) -> Result<
    (
        CudaSlice<u32>,
        CudaSlice<u16>,
        CudaSlice<f32>,
        CudaSlice<u16>,
    ),
    LayerError,
> {
    let p = tokens * k;
    let (row_of_pair, o) = match dst_fwd {
        None => {
            let send_inv = expand(gpu, &lay.send_inv)?;
            // SAFETY: dst maps every pair to its grouped row (< n = p, no
            // drops); send_inv is a permutation of 0..n.
            (unsafe { gpu.gather32(&send_inv, dst, p) }?, o)
        }
        Some(dst_fwd) => {
            let mut ext = lay.send_inv.clone();
            ext.push(n as u32, 1);
            let send_inv = expand(gpu, &ext)?;
            let mut o_ext = gpu.zeros::<u16>((n + 1) * h)?;
            if n > 0 {
                gpu.copy(&o.slice(0..n * h), &mut o_ext.slice_mut(0..n * h))?;
            }
            // SAFETY: dst_fwd maps every pair to a grouped row (< n) or to
            // n; ext maps 0..n onto the n rows of o and n to the zero row.
            (unsafe { gpu.gather32(&send_inv, dst_fwd, p) }?, o_ext)
        }
    };
    let h_sq = permute4(gpu, hsq_send, &lay.send_inv)?;
    // SAFETY: row_of_pair holds p rows of o (n rows came back, plus the
    // zero row when pairs were dropped).
    let y =
        unsafe { gpu.combine_rows(&o, &row_of_pair, Some(&routed.gates), None, (tokens, h, k)) }?;
    Ok((row_of_pair, o, h_sq, y))
}

/// An owner's forward rows kept for the backward (calls without
/// replicas): the rows as they arrived, their expert-major permutation, each
/// row's expert, and this rank's experts' range `experts` in the global
/// expert-major order.
fn owned_rows(
    gpu: &Gpu,
    lay: &InstanceLayout,
    (xr, ab): (CudaSlice<u16>, Option<Projections>),
    goffsets: &[u32],
    (rank, el): (usize, usize),
) -> Result<OwnedRows, LayerError> {
    let experts = rank * el..(rank + 1) * el;
    let key = Runs::segments(lay.recv.per_expert.iter().map(|&c| c as usize));
    Ok(OwnedRows {
        x: xr,
        ab,
        perm: if lay.recv.perm.is_identity() {
            None
        } else {
            Some(expand(gpu, &lay.recv.perm)?)
        },
        expert: expand(gpu, &key)?,
        offsets: gpu.upload(&lay.recv.offsets)?,
        global: (
            goffsets[experts.start] as usize,
            goffsets[experts.end] as usize,
        ),
    })
}

/// The backward's selection: per row of this source, whether it is kept
/// (`u8` flags, expert-major), the flags over every source's rows in the
/// global order, each pair's routing weight times the rule's weight
/// (priority sampling), and this source's kept rows per expert (read on the
/// host later).
type Selected<'g> = (
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
fn keep_every_row<'g>(
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
fn gather_scores(
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
fn select_over_sources<'g>(
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

/// The forward's rows of this source in destination order: each grouped
/// row's token of `x` (`n` rows of `h`; a pair's token is `pair / k`).
fn rows_to_send(
    gpu: &Gpu,
    x: &CudaSlice<u16>,
    src: &CudaSlice<u32>,
    send_order: &Runs,
    (n, k, h): (usize, usize, usize),
) -> Result<CudaSlice<u16>, LayerError> {
    let reordered;
    let pair_of_send = if send_order.is_identity() {
        src
    } else {
        let send_order = expand(gpu, send_order)?;
        // SAFETY: send_order is a permutation of the n grouped rows.
        reordered = unsafe { gpu.gather32(src, &send_order, n) }?;
        &reordered
    };
    // SAFETY: every pair id is below p = tokens · k, so pair / k is a token.
    Ok(unsafe { gpu.gather_scaled(x, pair_of_send, k, None, n, h) }?)
}

/// The controller's plan when no replica slot exists (computed while the
/// experts run): it must keep every pair with its owner.
fn late_plan(
    planner: &DevicePlanner,
    counts_all: &[Vec<u32>],
    owner_split: &[Vec<Vec<u32>>],
    el: usize,
) -> Result<EpPlan, LayerError> {
    let plan = planner.forward(counts_all)?;
    check_plan(&plan, counts_all, el)?;
    if plan.forward != owner_split {
        return Err(LayerError::Config(
            "the controller placed replicas though the planner has no replica slots".into(),
        ));
    }
    Ok(plan)
}

/// The three expert weight tensors an instance computes with.
type Wts<'a> = Experts<&'a CudaSlice<u16>>;

/// Forward stage: each source's rows through this rank's instances, in
/// the instance-major order they came in (no regrouping) — its own rows
/// while the others travel (and `meanwhile` runs on the host), then every
/// other source's. Returns the outputs and `‖h‖²` per source, the rows
/// received, the own rows' projections when `keep` asks for them, and
/// `meanwhile`'s answer.
#[allow(clippy::type_complexity)]
fn experts_forward<R>(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    fl: Flight<u16>,
    lay: &InstanceLayout,
    (wts, h, f, keep): (Wts<'_>, usize, usize, bool),
    laps: &mut Laps,
    meanwhile: impl FnOnce() -> Result<R, LayerError>,
) -> Result<
    (
        Vec<Option<(CudaSlice<u16>, CudaSlice<f32>)>>,
        CudaSlice<u16>,
        Option<Projections>,
        R,
    ),
    LayerError,
> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (soff, roff) = (exclusive_scan(&lay.send), exclusive_scan(&lay.recv.from));
    let mut outs: Vec<Option<(CudaSlice<u16>, CudaSlice<f32>)>> =
        (0..world).map(|_| None).collect();
    let mut kept_ab = None;
    let overlap = Overlap::new(gpu, comm);
    {
        let xs = fl.outgoing()?;
        let (a, m) = (soff[rank] * h, lay.send[rank] * h);
        check_at_least("rows to this rank", a + m, xs.len())?;
        let chunks = &lay.recv.chunks[rank];
        let rows = xs.slice(a..a + m);
        outs[rank] = Some(if keep {
            let (o, h_sq, ab) =
                gpu.experts_forward_keep(chunks, &rows, wts.into_tuple(), (h, f))?;
            kept_ab = Some(ab);
            (o, h_sq)
        } else {
            gpu.experts_forward_dev(chunks, &rows, wts.into_tuple(), (h, f))?
        });
    }
    let answer = meanwhile()?;
    laps.lap(gpu, "experts (own rows)")?;
    // One rank: its rows are the ones it sent itself.
    let xr = fl.finish()?.0;
    drop(overlap);
    for s in (0..world).filter(|&s| s != rank && lay.recv.from[s] > 0) {
        let (a, m) = (roff[s] * h, lay.recv.from[s] * h);
        check_at_least("rows from a source", a + m, xr.len())?;
        outs[s] = Some(gpu.experts_forward_dev(
            &lay.recv.chunks[s],
            &xr.slice(a..a + m),
            wts.into_tuple(),
            (h, f),
        )?);
    }
    Ok((outs, xr, kept_ab, answer))
}

/// The global expert-major order the backward's selection runs in, on the
/// device.
struct SelectionOrder {
    /// Global expert-major order (expert, source, pair) → position in the
    /// all-gathered scores. It also serves as the selection's ids: within
    /// an expert it increases with (source, pair), the tie rule.
    perm: CudaSlice<u32>,
    /// Whether `perm` is the identity.
    identity: bool,
    /// This source's rows' global positions.
    mine: CudaSlice<u32>,
    /// The global expert offsets (`E + 1`).
    offsets: Vec<u32>,
    /// The expert of each of this source's expert-major rows.
    expert_of_row: CudaSlice<u32>,
}

fn selection_order(
    gpu: &Gpu,
    counts_all: &[Vec<u32>],
    counts: &[u32],
    rank: usize,
    p: usize,
) -> Result<SelectionOrder, LayerError> {
    let pack::ep::GlobalOrder {
        perm,
        mine,
        offsets,
        ..
    } = global_order(counts_all, rank, p)?;
    let expert_of_row = Runs::segments(counts.iter().map(|&c| c as usize));
    Ok(SelectionOrder {
        identity: perm.is_identity(),
        perm: expand(gpu, &perm)?,
        mine: expand(gpu, &mine)?,
        offsets,
        expert_of_row: expand(gpu, &expert_of_row)?,
    })
}

/// The tokens in `x` (`tokens × hidden`); a length that is not a whole
/// number of rows is an error.
fn tokens_of(x: &CudaSlice<u16>, h: usize) -> Result<usize, LayerError> {
    if x.len() % h != 0 && x.len() > 1 {
        return Err(LayerError::Shape {
            what: "x (tokens × hidden)".into(),
            expected: x.len() / h * h,
            got: x.len(),
        });
    }
    Ok(x.len() / h)
}

/// The forward on this rank's tokens `x` (`tokens × hidden`, bf16 on the
/// device); every rank calls it with the same layer, the same tokens per
/// rank and a planner that answers alike on every rank.
pub fn forward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    w: &DeviceWeights,
    x: &CudaSlice<u16>,
    planner: &DevicePlanner,
) -> Result<DeviceSaved, LayerError> {
    let (rank, world, el) = world_of(comm, cfg)?;
    let (h, f, e, k) = (cfg.hidden, cfg.ffn, cfg.n_experts, cfg.top_k);
    let tokens = tokens_of(x, h)?;
    let p = tokens * k;
    let mut laps = Laps::new(gpu)?;
    let (routed, aux_loss, aux_dp) = route_rows(gpu, cfg, w, x, planner, world)?;
    laps.lap(gpu, "route")?;
    let capped = group_and_cap(gpu, &routed, planner.capacity_factor(), p, e)?;
    let Capped { counts, src, .. } = &capped;
    // Rows reaching an expert (p without dropping), grouped by expert.
    let base = exclusive_scan(counts);
    let n = base[e] as usize;
    let fp = forward_plan(comm, planner, counts, (rank, world, el))?;
    let (counts_all, local, lay) = (fp.counts_all, fp.local, fp.lay);
    laps.lap(gpu, "counts+plan")?;
    let (weights, w_bytes) = replica_weights(gpu, comm, cfg, w, fp.early.as_ref(), &local, el)?;
    laps.lap(gpu, "replica weights")?;
    let xs = rows_to_send(gpu, x, src, &lay.send_order, (n, k, h))?;
    laps.lap(gpu, "pack x")?;
    let wts = local_weights(w, &weights);
    // Without replicas (decided from the plan, so alike on every rank)
    // owners keep their forward rows (source-major) for the backward.
    let keep_rows = (fp.early.as_ref()).is_none_or(|plan| one_instance_each(&plan.instances));
    let fl = exchange_rows(gpu, comm, xs, (&lay.send, &lay.recv.from), h, keep_rows)?;
    laps.sent(gpu, comm, "x out")?;
    // The controller, while the experts compute (owners only).
    let controller = || match fp.early {
        Some(plan) => Ok(plan),
        None => late_plan(planner, &counts_all, &fp.owner_split, el),
    };
    // Projections are kept on one rank only, where its own rows are every
    // row it holds, in the order the backward reads them.
    let keep_ab = keep_rows && world == 1 && planner.keep_projections();
    let (outs, xr, ab, plan) = experts_forward(
        gpu,
        comm,
        fl,
        &lay,
        (wts, h, f, keep_ab),
        &mut laps,
        controller,
    )?;
    laps.lap(gpu, "a2a x + experts")?;
    // Each source's outputs and norms go back; the own ones are copied.
    let returned = return_outputs(gpu, comm, outs, &lay, (rank, world, n, h), &mut laps)?;
    laps.lap(gpu, "a2a o")?;
    let maps = (&capped.dst, capped.dst_fwd.as_ref());
    let (row_of_pair, o, h_sq, y) =
        combine_pairs(gpu, maps, &lay, returned, &routed, (tokens, h, k, n))?;
    laps.lap(gpu, "combine")?;
    let order = selection_order(gpu, &counts_all, counts, rank, p)?;
    let owned_rows = (keep_rows
        .then(|| owned_rows(gpu, &lay, (xr, ab), &order.offsets, (rank, el))))
    .transpose()?;
    comm.settle()?;
    laps.print("forward", rank)?;
    let sent_rows = off_rank(&lay.send, rank) + off_rank(&lay.recv.from, rank);
    Ok(DeviceSaved {
        cfg: *cfg,
        tokens,
        rows: n,
        per_rank: el,
        x: x.clone(),
        routed,
        dst: capped.dst,
        src: capped.src,
        row_of_pair,
        o,
        h_sq,
        offsets: base,
        order,
        counts_all,
        plan,
        local,
        weights,
        owned_rows,
        y,
        bytes_sent: sent_rows * h * 2 + off_rank(&lay.recv.from, rank) * 4 + w_bytes,
        aux_loss,
        aux_dp,
    })
}

/// The auxiliary loss and its per-expert probability gradient on the
/// device (`crate::router::aux_loss_terms`, `P_e` by a column mean on the
/// GPU); `(0, None)` when off.
fn aux_terms(
    gpu: &Gpu,
    alpha: f64,
    r: &Routed,
    world: usize,
) -> Result<(f64, Option<CudaSlice<f32>>), LayerError> {
    let counts: Vec<u64> = r.counts.iter().map(|&c| u64::from(c)).collect();
    let (loss, dp) = crate::router::aux_loss_terms(alpha, &counts, r.tokens, world, || {
        let mean_p = gpu.download(&gpu.col_mean(&r.probs, r.tokens, r.experts)?, r.experts)?;
        Ok(mean_p.into_iter().map(f64::from).collect())
    })?;
    if dp.is_empty() {
        return Ok((0.0, None));
    }
    let dp: Vec<f32> = dp.into_iter().map(|v| v as f32).collect();
    Ok((loss, Some(gpu.upload(&dp)?)))
}

/// The rows that reach an expert under a capacity, and their index maps.
struct Capped {
    /// Rows per expert.
    counts: Vec<u32>,
    /// Row → pair.
    src: CudaSlice<u32>,
    /// Pair → row, or `DROPPED`.
    dst: CudaSlice<u32>,
    /// Pair → row, or the row count for a dropped pair (the forward's
    /// zero output row); `None` when nothing was dropped.
    dst_fwd: Option<CudaSlice<u32>>,
}

/// Keeps the first `cap` rows of each expert (rows grouped by expert in
/// pair order, so the first `cap` pairs of each expert): the host builds
/// the row maps from the counts, the device composes them with the
/// grouping.
fn cap_rows(
    gpu: &Gpu,
    routed: &[u32],
    cap: usize,
    src: &CudaSlice<u32>,
    dst: &CudaSlice<u32>,
    p: usize,
) -> Result<Capped, LayerError> {
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
    let (keep, place, place_fwd) = (
        gpu.upload(&keep)?,
        gpu.upload(&place)?,
        gpu.upload(&place_fwd)?,
    );
    // SAFETY: keep holds n rows below p (the grouped rows src maps); dst
    // maps every pair to one of the p grouped rows, which place and
    // place_fwd (p entries each) map on.
    unsafe {
        Ok(Capped {
            counts,
            src: gpu.gather32(src, &keep, n)?,
            dst: gpu.gather32(&place, dst, p)?,
            dst_fwd: Some(gpu.gather32(&place_fwd, dst, p)?),
        })
    }
}

/// The backward's kept set: per row of this source whether it is kept
/// (expert-major), the flags over every source's rows (global order; `None`
/// when every pair is kept), each pair's routing weight times the rule's
/// weight (priority sampling), the kept pairs per expert over every source
/// and per (source, expert), and the router's gradients (its sum over ranks
/// not yet started).
struct KeptSet {
    mask: CudaSlice<u8>,
    kept_g: Option<CudaSlice<u8>>,
    pair_weight: Option<CudaSlice<f32>>,
    /// `min(q_e, n_e)` per expert, over every source.
    global: Vec<u32>,
    /// Kept pairs per source and expert.
    kept: Vec<Vec<u32>>,
    router: CudaSlice<f32>,
    dx_router: CudaSlice<u16>,
}

/// Backward stage 1: the LRM scores of this source's pairs, the selection
/// within the plan's quotas, and the router's backward (complete and
/// local: it keeps the device busy while the host waits for the kept
/// counts).
fn score_and_select(
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
fn agreed_kept(
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
fn redistribute_kept(
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
struct PackedKept {
    place: CudaSlice<u32>,
    pair: CudaSlice<u32>,
    dk_send: CudaSlice<u16>,
    rows: usize,
}

/// Backward stage 3: the kept rows compacted (expert-major), put in
/// destination order, and their `g·δ` rows gathered (the rule's weight in
/// place of the routing weight where it has one).
fn pack_kept(
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
type OwnerKept<'a> = (
    Cow<'a, CudaSlice<u16>>,
    Option<(Cow<'a, CudaSlice<u16>>, Cow<'a, CudaSlice<u16>>)>,
);

/// An owner's kept `x` rows (and projections, if kept) from its forward
/// rows (expert, source, pair order), masked by its slice of the global
/// selection: the kept rows in the order the sources sent their `g·δ`
/// rows.
fn owner_kept_rows<'a>(
    gpu: &Gpu,
    own: &'a OwnedRows,
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
        let ab = (own.ab.as_ref()).map(|(a, b)| (Cow::Borrowed(a), Cow::Borrowed(b)));
        return Ok((Cow::Borrowed(&own.x), ab));
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
type KeptFlights = (Option<Flight<u16>>, Flight<u16>);

/// Backward stage 4, on the source: the kept rows go out.
fn send_kept(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    sv: &DeviceSaved,
    lay: &InstanceLayout,
    (pair, rows): (&CudaSlice<u32>, usize),
    dk_send: CudaSlice<u16>,
) -> Result<KeptFlights, LayerError> {
    let (h, k) = (sv.cfg.hidden, sv.cfg.top_k);
    let travel =
        |rows: CudaSlice<u16>| exchange_rows(gpu, comm, rows, (&lay.send, &lay.recv.from), h, true);
    let x_fl = match sv.owned_rows {
        Some(_) => None,
        // SAFETY: as for the g·δ rows (pack_kept).
        None => Some(travel(unsafe {
            gpu.gather_scaled(&sv.x, pair, k, None, rows, h)
        }?)?),
    };
    Ok((x_fl, travel(dk_send)?))
}

/// Backward stage 4, on the instance: the kept `x` and `g·δ` rows in
/// instance order (an owner that kept its forward rows takes `x` from
/// them, masked by the selection; borrowed where nothing is masked or
/// moved).
fn receive_kept<'a>(
    gpu: &Gpu,
    sv: &'a DeviceSaved,
    lay: &InstanceLayout,
    (x_fl, d_fl): KeptFlights,
    selection: (Option<&CudaSlice<u8>>, &[u32]),
    (rank, el): (usize, usize),
) -> Result<(OwnerKept<'a>, CudaSlice<u16>), LayerError> {
    let (h, f, n_r) = (sv.cfg.hidden, sv.cfg.ffn, lay.recv.perm.len);
    let xk = match (x_fl, &sv.owned_rows) {
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
fn experts_backward(
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
) -> Result<
    (
        CudaSlice<u16>,
        (CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>),
    ),
    LayerError,
> {
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
    let grads = gpu.experts_backward_weights(rest, xk, dk)?;
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
/// multiplied.
pub fn backward(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    w: &DeviceWeights,
    sv: &DeviceSaved,
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
    let flights = send_kept(gpu, comm, sv, &lay, (&pk.pair, pk.rows), pk.dk_send)?;
    laps.sent(gpu, comm, "kept rows out")?;
    let router_fl = comm.start_sum(gpu, ks.router)?;
    laps.sent(gpu, comm, "router sum")?;
    let selection = (ks.kept_g.as_ref(), &ks.global[..]);
    let ((xk, abk), dk) = receive_kept(gpu, sv, &lay, flights, selection, (rank, el))?;
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
    let ((gate, up, down), g_bytes) =
        owner_gradients(gpu, comm, cfg, &sv.plan, &sv.local, el, grads)?;
    comm.settle()?;
    laps.lap(gpu, "replica grads")?;
    laps.print("backward", rank)?;
    let x_rows = if sv.owned_rows.is_some() {
        0
    } else {
        off_rank(&lay.send, rank)
    };
    let rows = off_rank(&lay.send, rank) + x_rows + off_rank(&lay.recv.from, rank);
    Ok(DeviceGrads {
        dx,
        router,
        gate,
        up,
        down,
        kept_pairs: lay.recv.perm.len,
        kept_total: ks.kept.iter().flatten().map(|&c| c as usize).sum(),
        bytes_sent: t * k * 4 * (world - 1) + rows * h * 2 + g_bytes,
    })
}

/// The expert weights this rank's instances compute with: the replica
/// copies it received, or its own block.
fn local_weights<'a>(w: &'a DeviceWeights, received: &'a Option<LocalWeights>) -> Wts<'a> {
    match received {
        Some(lw) => lw.as_ref(),
        None => w.experts.as_ref(),
    }
}

/// This rank's own experts' gradients from those of its instances
/// (`local` order): replicas' gradients go to their owners (one
/// all-to-all per tensor) and are added there.
#[allow(clippy::type_complexity)]
fn owner_gradients(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
    plan: &EpPlan,
    local: &[Vec<usize>],
    el: usize,
    (gg, gu, gd): (CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>),
) -> Result<((CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), usize), LayerError> {
    let rank = comm.rank();
    let hf = cfg.hidden * cfg.ffn;
    if one_instance_each(&plan.instances) {
        return Ok(((gg, gu, gd), 0));
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
    let mut out = Vec::with_capacity(3);
    for g in [&gg, &gu, &gd] {
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
        out.push(own);
    }
    let down = out.pop();
    let up = out.pop();
    let gate = out.pop();
    match (gate, up, down) {
        (Some(a), Some(b), Some(c)) => Ok(((a, b, c), out_blocks.len() * 3 * hf * 2)),
        _ => Err(LayerError::Config(
            "owner_gradients: three tensors expected".into(),
        )),
    }
}

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
    check_len("dy", fwd.tokens * cfg.hidden, dy.len())?;
    let dyd = gpu.upload(dy)?;
    let g = backward(gpu, comm, w, sv, &dyd, planner)?;
    let (t, h, e) = (fwd.tokens, cfg.hidden, cfg.n_experts);
    let ew = sv.per_rank * h * cfg.ffn;
    Ok(HostGrads {
        dx: gpu.download(&g.dx, t * h)?,
        router: gpu.download(&g.router, h * e)?,
        gate: gpu.download(&g.gate, ew)?,
        up: gpu.download(&g.up, ew)?,
        down: gpu.download(&g.down, ew)?,
        kept_pairs: g.kept_pairs,
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This rank's random weights of the benchmarks (fan-in scaled bf16; the
/// router the same on every rank, each rank's experts its own).
pub fn random_weights(
    gpu: &Gpu,
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
) -> Result<DeviceWeights, LayerError> {
    let (_, _, el) = world_of(comm, cfg)?;
    let (h, f, e, r) = (cfg.hidden, cfg.ffn, cfg.n_experts, comm.rank() as u64);
    let scale = fan_in_scaled;
    weights(
        gpu,
        comm,
        cfg,
        &scale(random_bf16(h * e, 31), h),
        (
            &scale(random_bf16(el * h * f, 32 + 8 * r), h),
            &scale(random_bf16(el * h * f, 33 + 8 * r), h),
            &scale(random_bf16(el * f * h, 34 + 8 * r), f),
        ),
    )
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
    let (_, _, el) = world_of(comm, cfg)?;
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
