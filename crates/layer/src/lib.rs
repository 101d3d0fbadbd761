//! # layer — the MoE layer with the LRMoE backward
//!
//! A Qwen3-MoE style layer: router linear (`hidden → n_experts`), softmax,
//! top-k (optionally renormalised), SwiGLU experts (`w_gate`, `w_up`:
//! `hidden → ffn`; `w_down`: `ffn → hidden`), output
//! `y_t = Σ_k g_{t,k} · expert_{e_k}(x_t)`. Expert parallelism runs over a
//! [`Transport`]: each rank holds its own tokens; an expert's owner rank and
//! its replicas compute its pairs. On the host generic over `f32`/`f64`
//! ([`Value`]), on the device bf16 (see "One layer, two backends" below).
//! Experts are owned in contiguous blocks: expert `e` by rank `e / (E / W)`.
//!
//! ## Forward ([`forward`]) — always complete
//!
//! 1. Router, softmax, top-k on each rank; routed counts `n[s][e]` are
//!    all-gathered.
//! 2. The controller (`quota`) fixes this call's replicas (by default only
//!    those that repay their traffic at [`CallConfig::link_bytes_per_s`],
//!    [`CallConfig::replica_rule`]) and backward quotas `k[s][e]` from the
//!    counts ([`Retention`]); they hold for the whole call and are stored
//!    in [`Saved`].
//! 3. The replica plan is executed: each owner sends the weights of every
//!    replicated expert to the replica's rank, which computes with that copy
//!    (in this call's forward and backward) — a rank never reads its own
//!    copy of an expert it neither owns nor received.
//! 4. Every routed pair is dispatched (pairs spread over instances by
//!    `redistribute`'s exact solver, the same on every rank), computed, and
//!    its output row `o` and the squared norm `‖h‖²` of the down
//!    projection's input returned to the source, which combines `y`.
//!
//! The source keeps `x`, the router state, `o` and `‖h‖²` per pair. In a
//! call with replicas the instances keep only the replica weights they
//! received: the backward recomputes `a = x·W_gate`, `b = x·W_up`,
//! `h = silu(a)⊙b` for the kept pairs only; without replicas kept pairs
//! cannot move, so owners keep their forward rows and the backward sends
//! only `g·δ` rows.
//!
//! ## Backward ([`backward`]) — in the LRMoE order
//!
//! 1. Quotas: fixed at forward.
//! 2. LRM score per pair for the down projection,
//!    `g² · ‖δ‖² · ‖h‖²` with `δ = ∂L/∂y_t`, no gradient matrix formed.
//! 3. Keep the best pairs within the quotas (`lrm_score::select_top`, see
//!    "Selection" below).
//! 4. Redistribute the kept pairs over the existing instances
//!    (`redistribute`, solved alike on every rank from the all-gathered
//!    kept counts).
//! 5. Pack `[x_t | g·δ_t]` rows of kept pairs into dense per-destination,
//!    per-expert blocks (`pack`), exchange only those, regroup per expert,
//!    run the expert GEMMs (recompute, `dW_down`, `dW_gate`, `dW_up`, `dX`)
//!    on the compacted rows, return `dX` rows and scatter-add them.
//! 6. Gradients: each replica's expert gradients go to the expert's owner and
//!    are summed there, and the router's gradient is summed over ranks
//!    (data parallel); on the host the owners' sums are then all-gathered
//!    (the model around the layer keeps every expert on every rank).
//!
//! ## Selection — one rule for every backend
//!
//! The controller's quota is per expert, `q_e`; [`CallPlan::selection`]
//! says which pairs compete for it:
//!
//! * [`Selection::PerExpert`] (the rule whenever no per-source network
//!   budget binds, which includes `Retention::Full`, `Retention::Ratio`
//!   and memory-only budgets): expert `e` keeps its `q_e` highest-scoring
//!   pairs over *every* source's pairs, ties to the lower (source rank,
//!   pair index). Each source shares one score per candidate pair (4 bytes
//!   beside rows of `2·hidden` values); every rank then makes the same
//!   choice, and the kept counts per (source, expert) go to the
//!   redistribution. This is the paper's rule and the device layers' (an
//!   owner, or one GPU, selects over all the pairs it received), and the
//!   kept set is the best one the quota allows: it does not depend on how
//!   tokens were split over ranks (EP = 1, 2, 4 keep the same pairs).
//! * [`Selection::PerSourceExpert`] (only when a per-source network budget
//!   binds): source `s` keeps its `k[s][e]` best pairs of each expert, the
//!   controller's split of `q_e`. Per-expert selection could take all of
//!   `q_e` from one source and overrun that source's send budget; per-cell
//!   quotas cannot. The price is quality: a source keeps its share even
//!   when another source's dropped pairs score higher.
//!
//! Within the pairs that compete for a quota, [`CallConfig::rule`] picks
//! which are kept ([`lrm_score::Rule`]): the `q` best scores (top-q, the
//! default), `q` at random, or one of the unbiased samplings (inclusion
//! `∝ √score` with weight `1/π`, or priority sampling), whose weights
//! scale the kept pairs' `g·δ` rows, so their expert and input gradients
//! are unbiased estimates of the exact ones. The random rules draw from
//! [`CallConfig::rule_seed`] mixed with the call's routed counts — the
//! same on every rank. The device backend runs top-q and priority
//! sampling, per expert; the host backend every rule and both selections.
//!
//! [`Retention::Surplus`] is the quota policy that trims only the ranks
//! whose load exceeds their fair share of the kept-pair budget.
//!
//! [`CallConfig::aux_loss_coeff`] adds the Switch/GShard auxiliary
//! load-balancing loss `α · E · Σ_e f_e · P_e` on each rank's tokens
//! ([`Saved::aux_loss`]; its router and input gradients are part of
//! [`backward`]'s, finite-difference checked); both backends.
//!
//! [`CallConfig::replica_load`] makes a call's replicas SYMI-like (from the
//! previous call's load, `quota::replicas_by_load`) instead of the
//! controller's; with `redistribute::Solver::Even` the pairs are split
//! evenly over the instances in forward and backward. Both backends.
//!
//! [`CallConfig::expert_bias`] is DeepSeek-V3's auxiliary-loss-free
//! balancing bias: `b_e` is added to expert `e`'s router probability for
//! the top-k choice only, the gates stay the unbiased probabilities (so no
//! gradient changes form); the caller moves it between calls
//! (`b_e += γ · sign(mean load − load_e)`, the `lrmoe` trainer's
//! `moe.expert_bias_rate`). [`BackwardStats::expert_load`] reports the
//! call's routed pairs per expert over all ranks. Both backends.
//!
//! With unlimited sends the controller's flow network has one cell per
//! expert, so every split of `q_e` over sources is placeable within the
//! ranks' pair caps: per-expert selection keeps the memory guarantee.
//!
//! **What a dropped pair loses:** its contribution to its expert's three
//! weight gradients, and its input gradient through that expert (`dX` of the
//! pair is zero). **What it keeps:** the router gradient, which flows from the
//! forward outputs `o` of *every* pair (`∂L/∂g = δ·o`), so routing still
//! learns from dropped pairs. With full retention the result is the exact
//! gradient.
//!
//! Backward buffers (packed rows, received rows, per-expert intermediates,
//! returned `dX`) are sized by the kept pairs, not the routed ones, and
//! each is dropped as soon as the next stage has read it; on the host
//! [`BackwardStats::buffer_bytes`] reports the peak of the backend's
//! buffers live at once per rank (metered as they are made and dropped;
//! `tests/host_memory.rs` holds it to the allocator's measured peak).
//! The forward is not pruned: [`BackwardStats::forward_rows`] are the rows
//! the rank's instances computed in the call's forward (every routed pair
//! lands on one instance), and [`BackwardStats::forward_buffer_bytes`] their
//! `x` and `o` rows.
//!
//! ## Not here
//!
//! No optimizer, no model around the layer (the top crate has them), no
//! kernels (`kernels` has them; the host executor's expert GEMMs can run
//! as bf16 grouped operations through [`ExpertBackend::Bf16`]), no file
//! I/O.
//!
//! ## One layer, two backends
//!
//! The layer's stages are written once ([`stages`]), generic over the
//! [`backend::Backend`] contract — the primitives a call needs (route,
//! count keys, group and gather rows by `pack::ep`'s index maps, grouped
//! GEMMs, scores, selection, combine, row exchanges and sums) with their
//! buffers ([`backend::Family`]). One plan per call ([`DevicePlanner`]:
//! the controller's [`CallPlan`] resolved into an [`EpPlan`] — instances,
//! the forward's split, quotas, caps, the selection rule) is handed to the
//! stages; experts are owned in contiguous blocks of `E / W`. The plan comes
//! in two halves: [`DevicePlanner::routes`] (replicas and the forward's
//! split), which the rows wait for, and [`DevicePlanner::complete`] (the
//! backward's quotas and caps), which runs while the experts compute.
//!
//! * The host backend ([`host::Host`]: CPU rows of `f32`/`f64` over any
//!   [`Transport`], every index checked) runs [`forward`] and
//!   [`backward`], which take the whole layer's [`MoeParams`] and return
//!   its gradients on every rank, with the call's [`BackwardStats`].
//!   Its expert GEMMs run in the layer's precision, or as bf16 grouped
//!   operations ([`ExpertBackend::Bf16`]).
//! * The device backend (`device::Device`, feature `cuda`) runs
//!   `device::forward` and `device::backward` on device buffers: one
//!   GPU is EP = 1 ([`device::DeviceComm::Local`]), several GPUs exchange
//!   over NCCL, and in-process ranks sharing one GPU exchange through any
//!   host [`Transport`] ([`device::DeviceComm::Staged`]: device to device
//!   between the ranks of [`run_local`] and [`run_local_timed`], for tests
//!   and for [`timeline`]'s N-GPU timing: each rank's work timed by CUDA
//!   events on its stream, `device::GpuClock`, split into the layer's
//!   parts, each piece with its host seconds beside, with the most pool
//!   memory the rank held, and where an exchange run beside work is
//!   waited for). It refuses what its
//!   kernels cannot run ([`check_device_call`]: the random and
//!   proportional rules, selection per source; [`check_device_shape`]).
//!   Its weights can be another library's device buffers, borrowed by
//!   address and never freed here (`device::borrow_weights`: the Python
//!   package's CUDA path).
//!
//! [`dist`] has the one network piece: the TCP rendezvous that hands out
//! the NCCL id, and [`NcclTransport`] (one process per GPU; NCCL itself
//! lives in `kernels::comm`).

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod backend;
mod config;
pub mod device;
pub mod dist;
mod experts;
pub mod host;
mod moe;
mod plan;
mod router;
pub mod stages;
pub mod timeline;
pub mod transport;

pub use backend::Value;
pub use config::{ExpertWeights, Experts, MoeConfig, MoeParams};
pub use dist::{DistEnv, DistError, NcclTransport};
pub use experts::ExpertBackend;
pub use moe::{backward, forward, BackwardStats, Saved, StageTimes};
/// The `(source, expert, rank)` counts of [`EpPlan::forward`] and
/// [`DevicePlanner::backward`].
pub use pack::ep::Split;
pub use plan::{
    check_device_call, check_device_shape, check_plan, check_routes, check_split, device_plan_call,
    plan_call, CallConfig, CallPlan, DevicePlanner, EpPlan, EpRoutes, Retention, Selection,
    TileAlign,
};
pub use transport::{run_local, run_local_timed, LocalTransport, Transport, TransportError};

/// Errors of the layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayerError {
    /// The layer configuration cannot work.
    #[error("bad layer config: {0}")]
    Config(String),
    /// A buffer does not match the configuration.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which buffer.
        what: String,
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// A non-finite value reached the layer (e.g. a NaN loss gradient).
    #[error("non-finite value in {0}")]
    NonFinite(&'static str),
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The controller rejected the call.
    #[error("controller: {0}")]
    Quota(quota::QuotaError),
    /// The redistribution failed.
    #[error("redistribute: {0}")]
    Redistribute(redistribute::RedistributeError),
    /// Scoring or selection failed.
    #[error("lrm-score: {0}")]
    Score(lrm_score::ScoreError),
    /// Compaction failed.
    #[error("pack: {0}")]
    Pack(pack::PackError),
    /// A kernel rejected its inputs.
    #[error("kernel: {0}")]
    Kernel(kernels::KernelError),
}

// The variants above say their cause in their message, so it is not also
// chained as `source()` (a reader printing the chain would see it twice).
impl From<quota::QuotaError> for LayerError {
    fn from(e: quota::QuotaError) -> Self {
        LayerError::Quota(e)
    }
}

impl From<redistribute::RedistributeError> for LayerError {
    fn from(e: redistribute::RedistributeError) -> Self {
        LayerError::Redistribute(e)
    }
}

impl From<lrm_score::ScoreError> for LayerError {
    fn from(e: lrm_score::ScoreError) -> Self {
        LayerError::Score(e)
    }
}

impl From<pack::PackError> for LayerError {
    fn from(e: pack::PackError) -> Self {
        LayerError::Pack(e)
    }
}

impl From<kernels::KernelError> for LayerError {
    fn from(e: kernels::KernelError) -> Self {
        LayerError::Kernel(e)
    }
}

#[cfg(test)]
mod tests;
