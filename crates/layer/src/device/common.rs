//! Small helpers every part of the device executor uses: shapes, scans,
//! row permutations, run expansion, per-expert blocks, the phase clock.

use kernels::gpu::{CudaSlice, Gpu, Mark};
use kernels::KernelError;
use pack::ep::{experts_per_rank, Runs};

use crate::config::{at_least, shape};
use crate::config::{Experts, MoeConfig};
use crate::plan::check_device_shape;
use crate::LayerError;

use super::DeviceComm;

/// The projections `x·W_gate`, `x·W_up` of expert rows (`rows × F` each).
pub(super) type Projections = (CudaSlice<u16>, CudaSlice<u16>);

/// An owner's forward rows kept for the backward (calls without replicas).
pub(super) struct OwnedRows {
    /// The rows as they arrived (source-major).
    pub(super) x: CudaSlice<u16>,
    /// Their projections in the same order, when the call keeps them
    /// ([`DevicePlanner::keep_projections`], one rank).
    pub(super) ab: Option<Projections>,
    /// Expert-major row → arrival row (`None`: the identity).
    pub(super) perm: Option<CudaSlice<u32>>,
    pub(super) expert: CudaSlice<u32>,
    pub(super) offsets: CudaSlice<u32>,
    /// This rank's experts' range in the global expert-major order.
    pub(super) global: (usize, usize),
}

/// An owner's forward rows as the backward holds them: borrowed from the
/// saved state (which stays whole, for another backward of the same
/// forward), or taken from it (released as soon as the kept rows are
/// gathered from them, as autograd frees a saved tensor once its backward
/// has read it).
pub(super) enum Held<'a> {
    Borrowed(&'a OwnedRows),
    Taken(Box<OwnedRows>),
}

impl std::ops::Deref for Held<'_> {
    type Target = OwnedRows;
    fn deref(&self) -> &OwnedRows {
        match self {
            Held::Borrowed(r) => r,
            Held::Taken(r) => r,
        }
    }
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
pub(super) struct Laps {
    pub(super) start: Option<Mark>,
    pub(super) host0: std::time::Instant,
    pub(super) compute: Vec<(&'static str, Mark, f64)>,
    pub(super) comm: Vec<(&'static str, Mark, Mark)>,
}

impl Laps {
    pub(super) fn new(gpu: &Gpu) -> Result<Self, KernelError> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("LRMOE_EP_PROFILE").as_deref() == Ok("1"));
        Ok(Self {
            start: if on { Some(gpu.mark()?) } else { None },
            host0: std::time::Instant::now(),
            compute: Vec::new(),
            comm: Vec::new(),
        })
    }
    pub(super) fn lap(&mut self, gpu: &Gpu, name: &'static str) -> Result<(), KernelError> {
        if self.start.is_some() {
            let host = self.host0.elapsed().as_secs_f64() * 1e3;
            self.compute.push((name, gpu.mark()?, host));
        }
        Ok(())
    }
    /// An exchange `name` was just started.
    pub(super) fn sent(
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
    pub(super) fn print(&self, what: &str, rank: usize) -> Result<(), KernelError> {
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

pub(super) fn world_of(
    comm: DeviceComm<'_>,
    cfg: &MoeConfig,
) -> Result<(usize, usize, usize), LayerError> {
    check_device_shape(cfg)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    Ok((rank, world, experts_per_rank(cfg.n_experts, world)?))
}

pub(super) fn elems(rows: &[usize], width: usize) -> Vec<usize> {
    rows.iter().map(|r| r * width).collect()
}

/// Rows this rank sends to other ranks under `send` counts.
pub(super) fn off_rank(send: &[usize], rank: usize) -> usize {
    send.iter().sum::<usize>() - send[rank]
}

/// Starts of consecutive parts of `counts` (`len + 1` entries, from 0).
pub(super) fn exclusive_scan<T: Copy + Default + std::ops::Add<Output = T>>(
    counts: &[T],
) -> Vec<T> {
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
pub(super) fn expand(gpu: &Gpu, map: &Runs) -> Result<CudaSlice<u32>, LayerError> {
    Ok(gpu.expand_runs_dev(&map.flat(), map.step, map.len)?)
}

/// `rows[perm[j]]` for the `perm.len()` rows of `width` of `rows`; the
/// buffer itself when `perm` is the identity (one rank's layouts). Every
/// `perm` here is a `pack::ep` layout's (`recv.perm`, `recv.inv`,
/// `send_inv`, `send_order`): a permutation of `0..perm.len()`, which
/// `pack` proptests, so only the row count is checked here.
pub(super) fn permute_rows(
    gpu: &Gpu,
    rows: CudaSlice<u16>,
    perm: &Runs,
    width: usize,
) -> Result<CudaSlice<u16>, LayerError> {
    if perm.is_identity() {
        return Ok(rows);
    }
    let n = perm.len;
    at_least("rows to permute", n * width, rows.len())?;
    let pd = expand(gpu, perm)?;
    // SAFETY: perm is a permutation of 0..n (a `pack::ep` layout) and rows
    // holds n rows (checked above).
    Ok(unsafe { gpu.gather_scaled(&rows, &pd, 1, None, n, width) }?)
}

/// `vals[perm[j]]` (4-byte values); the buffer itself for the identity.
/// `perm` as in [`permute_rows`].
pub(super) fn permute4<T: kernels::gpu::DeviceRepr + kernels::gpu::ValidAsZeroBits>(
    gpu: &Gpu,
    vals: CudaSlice<T>,
    perm: &Runs,
) -> Result<CudaSlice<T>, LayerError> {
    if perm.is_identity() {
        return Ok(vals);
    }
    at_least("values to permute", perm.len, vals.len())?;
    let pd = expand(gpu, perm)?;
    // SAFETY: perm is a permutation of 0..perm.len (a `pack::ep` layout)
    // over as many values (checked above).
    Ok(unsafe { gpu.gather32(&vals, &pd, perm.len) }?)
}

/// One finite value per expert, uploaded.
pub(super) fn per_expert(
    gpu: &Gpu,
    cfg: &MoeConfig,
    v: &[f32],
    what: &'static str,
) -> Result<CudaSlice<f32>, LayerError> {
    shape(format!("{what} (one per expert)"), cfg.n_experts, v.len())?;
    if v.iter().any(|b| !b.is_finite()) {
        return Err(LayerError::NonFinite(what));
    }
    Ok(gpu.upload(v)?)
}

/// `n` consecutive blocks of `width` elements of `src`, starting at the
/// listed block indices, packed into one buffer (device copies).
pub(super) fn pack_blocks(
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

/// The three expert weight tensors an instance computes with.
pub(super) type Wts<'a> = Experts<&'a CudaSlice<u16>>;
