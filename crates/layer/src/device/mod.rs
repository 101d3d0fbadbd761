//! The device executor (feature `cuda`): the layer on device buffers, one
//! GPU per rank, NCCL between ranks (feature `nccl`). One GPU is EP = 1 of
//! the same executor ([`DeviceComm::Local`]): no collective runs, the
//! exchanges hand their buffers through, and index gathers that would be
//! identities are skipped. `kernels` provides the device operations
//! (`kernels::gpu::Gpu`), this module composes them with the plan
//! ([`crate::DevicePlanner`]) and the index layouts (`pack::ep`).
//!
//! Experts are owned in contiguous blocks; a call's [`EpPlan`] may add
//! replicas and says how every routed pair, then every kept pair, is split
//! over the instances (see `pack::ep::instance_layout`).
//!
//! Forward (complete): route locally, group pairs by expert, all-gather the
//! routed counts, plan; owners send the weights of replicated experts to
//! the replicas' ranks; rows go to their instances (destination-major, one
//! all-to-all) while each rank runs its experts on its own rows; each
//! other source's rows are multiplied as they arrived (instance-major per
//! source, `pack::ep::OwnerLayout::chunks`, no regrouping); outputs and the
//! squared norms `‖h‖²` of the down projection's inputs go back, and the
//! source combines. In a call with replicas, instances keep
//! nothing per pair (a kept pair may be computed on another instance in the
//! backward); without replicas the owners keep their forward rows, since
//! kept pairs cannot move, and the backward sends only `g·δ` rows.
//! `backward` leaves that saved state whole (another backward may run on
//! it); `backward_releasing` frees the owner's forward rows as soon as
//! the kept rows are gathered from them, as autograd frees saved tensors
//! (the device trainer and the Python module call it).
//!
//! LRMoE backward: the router gradient is complete and local (each source
//! kept its pairs' outputs; it runs while the host plans), then summed over
//! ranks beside the kept rows' exchange. Each source forms its
//! pairs' LRM scores `g²·‖δ‖²·‖h‖²`; unless every quota covers all of its
//! expert's pairs (then every pair is kept: the scores are only checked
//! for non-finite values, nothing crosses ranks and the kept counts are the
//! forward's), the scores are all-gathered and every
//! rank makes the same per-expert selection over every source's pairs (the
//! crate doc's `Selection::PerExpert`; ties to the lower source, then the
//! lower pair). The kept counts per (source, expert) go to the planner's
//! redistribution; sources pack only the kept `[x | g·δ]` rows (no padding;
//! `g·δ` only without replicas) destination-major, instances regroup them,
//! recompute the hidden activations (or, one rank without replicas and
//! `CallConfig::keep_projections`, read the projections the owner kept
//! from the forward) and run the backward GEMMs on the kept
//! rows — the data gradients first, so the `dX` rows travel back while the
//! weight gradients are computed — and `dX` is scatter-added; replica gradients are
//! summed into their owners'. Bytes on the wire and GEMM rows shrink with
//! the kept fraction.
//!
//! Host synchronisations: the routed counts and the plan (forward); in the
//! backward the selection's error flag and the kept counts per expert (one
//! small all-gather, read through pinned memory while the device runs the
//! router's backward) for the redistribution. Exchanges run on the
//! communicator's stream beside the compute stream, ordered by CUDA events
//! (`kernels::comm::InFlight`), never by the host; the message to self
//! never travels (a device copy). While an exchange runs beside them the
//! grouped GEMMs leave `LRMOE_COMM_SMS` SMs (default 16) free for NCCL's
//! kernels. Before the host waits on the compute stream it waits on the
//! communicator with its deadline, so a dead peer is an error, not a
//! hang. `LRMOE_EP_PROFILE=1` logs each call's timeline (CUDA events on
//! both streams, no synchronisation).
//!
//! Every index buffer handed to an `unsafe` device operation here is built
//! by `pack::ep` (permutations of the rows they index, proptested), by the
//! device operations themselves (whose output ranges `kernels` states), or
//! from counts this rank computed from the same flags it groups by.

use kernels::comm::NcclComm;

use crate::plan::EpPlan;
use crate::Transport;
#[cfg(not(feature = "cuda"))]
use crate::{DevicePlanner, LayerError, MoeConfig};

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod calls;
#[cfg(feature = "cuda")]
mod clock;
#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
mod host;
#[cfg(feature = "cuda")]
mod weights;
#[cfg(feature = "cuda")]
pub use {backend::*, calls::*, clock::*, comm::*, host::*, weights::*};

pub use crate::stages::Grads;

/// How this rank reaches the others: alone (one GPU, EP = 1), through an
/// NCCL communicator, or through any host [`Transport`].
#[derive(Clone, Copy)]
pub enum DeviceComm<'a> {
    /// One rank: collectives are identities.
    Local,
    /// A launched group's communicator.
    Nccl(&'a NcclComm),
    /// Collectives over a host [`Transport`], every collective waited for
    /// by the host (no overlap): in-process ranks sharing one GPU
    /// ([`crate::run_local`], [`crate::run_local_timed`]) run the
    /// multi-rank executor — every exchange, replica and sum of the NCCL
    /// path's plan — where only one GPU is at hand, moving rows and sums
    /// device to device ([`Transport::swap_offers`]); other transports
    /// stage device buffers through host memory (the same bits). For
    /// tests, for debugging a plan, and for the N-GPU simulation. Results
    /// equal the NCCL path's up to the order of the f32 sums.
    Staged(&'a dyn Transport),
}

impl std::fmt::Debug for DeviceComm<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local => f.write_str("DeviceComm::Local"),
            Self::Nccl(c) => write!(
                f,
                "DeviceComm::Nccl(rank {} of {})",
                c.rank(),
                c.world_size()
            ),
            Self::Staged(t) => write!(
                f,
                "DeviceComm::Staged(rank {} of {})",
                t.rank(),
                t.world_size()
            ),
        }
    }
}

impl DeviceComm<'_> {
    /// This rank.
    pub fn rank(&self) -> usize {
        match self {
            Self::Local => 0,
            Self::Nccl(c) => c.rank(),
            Self::Staged(t) => t.rank(),
        }
    }

    /// Timed in-process ranks (`crate::run_local_timed`): the phase the
    /// work from here on belongs to (see [`crate::timeline`]). Elsewhere
    /// nothing.
    pub fn phase(&self, name: &str) -> Result<(), crate::LayerError> {
        if let Self::Staged(t) = self {
            t.phase(name)?;
        }
        Ok(())
    }

    /// Timed in-process ranks: the work since the last part is part
    /// `name` of the current phase (see [`crate::timeline`]). Elsewhere
    /// nothing.
    pub fn part(&self, name: &str) -> Result<(), crate::LayerError> {
        if let Self::Staged(t) = self {
            t.part(name)?;
        }
        Ok(())
    }

    /// Timed in-process ranks: the exchange started beside the work since
    /// it is waited for here (see [`crate::Transport::joined`]). Elsewhere
    /// nothing.
    pub fn joined(&self) -> Result<(), crate::LayerError> {
        if let Self::Staged(t) = self {
            t.joined()?;
        }
        Ok(())
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        match self {
            Self::Local => 1,
            Self::Nccl(c) => c.world_size(),
            Self::Staged(t) => t.world_size(),
        }
    }
}

/// An expert-parallel forward on this rank's GPU driven from the host
/// ([`forward_host`]): this rank's output and every source's routed counts
/// copied back, the device state (weights, saved rows) kept for
/// [`backward_host`].
pub struct HostForward {
    /// Output of this rank's tokens, `T × H` (bf16 bits).
    pub y: Vec<u16>,
    /// Every source's routed pairs per global expert, `[world][experts]`.
    pub counts: Vec<Vec<u32>>,
    /// The call's plan (replicas, the forward's split, quotas).
    pub plan: EpPlan,
    /// Bytes this rank sent in the forward's all-to-alls.
    pub bytes_sent: usize,
    /// Tokens of this rank.
    pub tokens: usize,
    /// This rank's auxiliary balancing loss (0 when off).
    pub aux_loss: f64,
    #[cfg(feature = "cuda")]
    pub(crate) state: Box<(weights::DeviceWeights, calls::DeviceSaved)>,
}

impl std::fmt::Debug for HostForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostForward")
            .field("tokens", &self.tokens)
            .field("counts", &self.counts)
            .finish()
    }
}

/// [`Grads`] copied back to the host.
pub type HostGrads = Grads<Vec<u16>, Vec<f32>>;

/// [`Grads`] on the device.
#[cfg(feature = "cuda")]
pub type DeviceGrads = Grads<kernels::gpu::CudaSlice<u16>, kernels::gpu::CudaSlice<f32>>;

/// Without CUDA the device executor does not exist: the same entry points
/// answer `NotCompiledWithCuda`, so callers carry no `cfg`.
#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
pub fn forward_host(
    _gpu: &kernels::gpu::Gpu,
    _comm: DeviceComm<'_>,
    _cfg: &MoeConfig,
    _router: &[u16],
    _experts: (&[u16], &[u16], &[u16]),
    _x: &[u16],
    _biases: (Option<&[f32]>, Option<&[f32]>),
    _planner: &DevicePlanner,
) -> Result<HostForward, LayerError> {
    Err(LayerError::Kernel(
        kernels::KernelError::NotCompiledWithCuda,
    ))
}

/// See [`forward_host`].
#[cfg(not(feature = "cuda"))]
pub fn backward_host(
    _gpu: &kernels::gpu::Gpu,
    _comm: DeviceComm<'_>,
    _fwd: &HostForward,
    _dy: &[u16],
    _planner: &DevicePlanner,
) -> Result<HostGrads, LayerError> {
    Err(LayerError::Kernel(
        kernels::KernelError::NotCompiledWithCuda,
    ))
}
