//! The device executor's collectives over a [`DeviceComm`]: all-to-alls of
//! rows (NCCL, or device to device between in-process ranks), sums over
//! ranks, and the exchange overlap guard.

use kernels::gpu::{CudaSlice, Gpu, Mark, SumPart};
use kernels::KernelError;

use crate::LayerError;

use super::DeviceComm;
use crate::stages::common::exclusive_scan;

impl DeviceComm<'_> {
    /// Every rank's bytes, rank order.
    pub(super) fn all_gather_host(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, KernelError> {
        match self {
            Self::Local => Ok(vec![local.to_vec()]),
            Self::Nccl(c) => c.all_gather_host(local),
            Self::Staged(t) => t.all_gather_bytes(local).map_err(staged),
        }
    }

    /// Every rank's `u32` counts, rank order, each `n` long.
    pub(super) fn all_gather_counts(&self, mine: &[u32]) -> Result<Vec<Vec<u32>>, LayerError> {
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
    pub(super) fn exchange<T: kernels::gpu::DeviceRepr + bytemuck::Pod + Default>(
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
    pub(super) fn start<T: kernels::gpu::DeviceRepr + bytemuck::Pod + Default>(
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
    pub(super) fn mark(&self) -> Result<Option<Mark>, KernelError> {
        match self {
            Self::Local | Self::Staged(_) => Ok(None),
            #[cfg(feature = "nccl")]
            Self::Nccl(c) => Ok(Some(c.mark()?)),
            #[cfg(not(feature = "nccl"))]
            Self::Nccl(_) => Err(KernelError::NotCompiledWithNccl),
        }
    }

    /// Starts the sum of `buf` over ranks beside the compute stream.
    pub(super) fn start_sum(
        &self,
        gpu: &Gpu,
        buf: CudaSlice<f32>,
    ) -> Result<Flight<f32>, KernelError> {
        match self {
            Self::Local => Ok(Flight::Here(buf, Vec::new())),
            Self::Staged(t) => {
                let mut buf = buf;
                if let Some(summed) = sum_in_process(gpu, *t, std::slice::from_mut(&mut buf)) {
                    summed?;
                    return Ok(Flight::Here(buf, Vec::new()));
                }
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
    pub(super) fn settle(&self) -> Result<(), KernelError> {
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
pub(super) fn bytes_of<T>(n: usize) -> u64 {
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
pub(super) fn in_process<T: kernels::gpu::DeviceRepr>(
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
pub(super) fn staged(e: crate::TransportError) -> KernelError {
    match e {
        crate::TransportError::Timeout { rank, timeout_ms } => {
            KernelError::CommTimeout { rank, timeout_ms }
        }
        other => KernelError::Comm(other.to_string()),
    }
}

/// An exchange started by `DeviceComm::start` (the device backend's
/// exchange in flight).
pub enum Flight<T> {
    /// One rank, or collectives the host waited for: the receive buffer
    /// and the send buffers, done.
    Here(CudaSlice<T>, Vec<CudaSlice<T>>),
    /// On the communicator's stream.
    #[cfg(feature = "nccl")]
    Away(kernels::comm::InFlight<T>),
}

impl<T> Flight<T> {
    /// The rows going out (one rank: the rows handed through).
    pub(super) fn outgoing(&self) -> Result<&CudaSlice<T>, KernelError> {
        let sent = match self {
            Self::Here(r, s) => s.first().or(Some(r)),
            #[cfg(feature = "nccl")]
            Self::Away(f) => f.sends().first(),
        };
        sent.ok_or_else(|| KernelError::Comm("an exchange without a send buffer".into()))
    }
    #[allow(clippy::type_complexity)]
    pub(super) fn buffers_mut(
        &mut self,
    ) -> Result<(&[CudaSlice<T>], &mut CudaSlice<T>), KernelError> {
        match self {
            Self::Here(r, s) => Ok((s, r)),
            #[cfg(feature = "nccl")]
            Self::Away(f) => f.buffers_mut(),
        }
    }
    /// Orders the compute stream after the exchange; the receive buffer
    /// and the send buffers.
    pub(super) fn finish(self) -> Result<(CudaSlice<T>, Vec<CudaSlice<T>>), KernelError> {
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
    let mut bufs = bufs;
    if let DeviceComm::Staged(t) = comm {
        if let Some(summed) = sum_in_process(gpu, t, &mut bufs) {
            summed?;
            return Ok(bufs);
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
/// where they do not share memory), in place: every rank publishes its
/// buffers' addresses (one swap, recorded as one sum of all their bytes, as
/// NCCL runs the sums in one group); each rank sums its share of every
/// buffer ([`share`]) over the ranks in rank order from zero — the
/// host-staged sum's order, so the same bits — into its own buffer, and
/// once every rank has, copies the other shares from their summing ranks
/// (a reduce-scatter and an all-gather, device to device: each rank reads
/// about twice its buffers, not once per rank; one kernel launch each, for
/// all buffers, through the peers' addresses). Every rank reads only
/// shares nobody writes at the time, and waits until every rank has read
/// before its buffers are handed back.
pub(super) fn sum_in_process(
    gpu: &Gpu,
    t: &dyn crate::Transport,
    bufs: &mut [CudaSlice<f32>],
) -> Option<Result<(), KernelError>> {
    let (world, me) = (t.world_size(), t.rank());
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
    let at = |addr: u64, off: usize| addr + bytes_of::<f32>(off);
    let sum = |all: Vec<Vec<u64>>, bufs: &mut [CudaSlice<f32>]| -> Result<(), KernelError> {
        if all.len() != world || all.iter().any(|a| a.len() != bufs.len()) {
            return Err(KernelError::Comm(
                "buffer addresses of another shape from a peer".into(),
            ));
        }
        t.bookkeeping(true).map_err(staged)?;
        let mine = bufs
            .iter()
            .map(|b| gpu.address(b, 0))
            .collect::<Result<Vec<u64>, KernelError>>()?;
        // This rank's share of every sum, in place in its own buffer (the
        // peers read other shares of it meanwhile): one launch for all.
        let sums: Vec<SumPart> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let (off, n) = share(b.len(), world, me);
                let srcs = all.iter().map(|peer| at(peer[i], off)).collect();
                SumPart {
                    dst: at(mine[i], off),
                    srcs,
                    n,
                }
            })
            .collect();
        // SAFETY: every rank's buffer `i` holds the same length (the ranks
        // run the same model) and stays allocated until the last fence;
        // share `me` of every buffer is written by this rank only, and read
        // by nobody else, until the fence below.
        unsafe { gpu.sum_parts(&sums, true) }?;
        gpu.sync()?;
        t.fence().map_err(staged)?;
        // The other shares, summed by their ranks: one launch for all.
        let copies: Vec<SumPart> = bufs
            .iter()
            .enumerate()
            .flat_map(|(i, b)| {
                let (all, mine) = (&all, &mine);
                (0..world).filter(|&q| q != me).map(move |q| {
                    let (off, n) = share(b.len(), world, q);
                    SumPart {
                        dst: at(mine[i], off),
                        srcs: vec![at(all[q][i], off)],
                        n,
                    }
                })
            })
            .collect();
        // SAFETY: rank `q`'s share `q` is final (the fence above) and
        // nobody writes it again before the fence below; this rank's
        // shares other than its own are read by nobody.
        unsafe { gpu.sum_parts(&copies, false) }?;
        gpu.sync()?;
        t.bookkeeping(false).map_err(staged)?;
        t.fence().map_err(staged)?;
        Ok(())
    };
    Some(all.map_err(staged).and_then(|all| sum(all, bufs)))
}

/// Rank `rank`'s share of `len` elements among `world` ranks: (first
/// element, count), contiguous, in rank order, the first `len % world`
/// ranks one longer.
pub(super) fn share(len: usize, world: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (len / world, len % world);
    (
        rank * base + rank.min(extra),
        base + usize::from(rank < extra),
    )
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
pub(super) fn comm_sms(comm: DeviceComm<'_>) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn shares_tile_the_buffer_in_rank_order() {
        for len in [0, 1, 5, 16, 17, 1000] {
            for world in 1..=9 {
                let mut next = 0;
                for r in 0..world {
                    let (off, n) = share(len, world, r);
                    assert_eq!(off, next, "len {len}, world {world}, rank {r}");
                    assert!(n == len / world || n == len / world + 1);
                    next = off + n;
                }
                assert_eq!(next, len);
            }
        }
    }
}
