//! # kernels — compute kernels and their twins
//!
//! Every dense operation the LRMoE pipeline runs lives here, so the layer
//! above never touches raw pointers:
//!
//! * [`cpu`] — the CPU backend: the [`cpu::Real`] element trait (`f32`,
//!   `f64`), a shape-checked row-major GEMM over the `gemm` crate
//!   ([`cpu::matmul`], with transposes and accumulation), and the SwiGLU
//!   activation and its derivative. These are also the references the GPU
//!   kernels will be tested against.
//! * [`gpu`] — CUDA kernels from `kernels/lrmoe.cu` (embedded fatbin) and
//!   the CUTLASS 4.2 sm90 grouped GEMM from `kernels/lib/grouped_gemm.cu`
//!   (embedded shared library, written to a content-named temporary file
//!   by `gpu::write_content_named` — safe for threads and processes opening
//!   devices at once — and opened with dlopen), built by
//!   `cargo xtask kernels` (pinned nvcc and CUTLASS in [`artifacts`]) and
//!   loaded through cudarc behind the `cuda` feature: fused LRM scores,
//!   per-expert top-q selection, pack (row gather) and unpack (row scatter
//!   with zero fill), SwiGLU forward/backward, router softmax + top-k,
//!   combine, byte gather and kept-row counts, and the variable-size
//!   grouped GEMM (forward, data gradient,
//!   weight gradient; group sizes read on the device). Each has a CPU twin in
//!   [`cpu`] and a device test. `gpu/imp/ops.rs` exposes them on device
//!   buffers (`Gpu::route`, `group`, `gather_scaled`, `experts_forward_dev`,
//!   `experts_backward_dev` and its data / weight halves — the data half
//!   also on projections the forward kept, `experts_forward_keep` /
//!   `experts_backward_data_from` — `combine_rows`,
//!   `router_backward`, `col_mean`, …; `download_later` for counts read
//!   while the device runs on, `mark` for event timelines,
//!   `set_gemm_sm_reserve` for SMs left to a collective) for the
//!   `layer` crate's device executor (`layer::device`), which composes
//!   them into the MoE layer on one GPU or expert-parallel over
//!   [`comm::NcclComm`]. `Gpu::borrow` sees another library's device memory
//!   (a PyTorch tensor) as a buffer that is never freed here, and
//!   `Gpu::wait_for_stream` / `Gpu::stream_waits` order this GPU's stream
//!   against that library's stream by events (the Python package's CUDA
//!   path). `Gpu::gemm_dev`'s one-group GEMMs run on cuBLAS (the grouped kernels
//!   with `LRMOE_DENSE_GEMM=cutlass` or without libcublas), in cuBLAS's own
//!   workspace unless `LRMOE_CUBLAS_WORKSPACE_MIB` gives it one.
//! * [`dense`] — CPU twins of the dense transformer kernels
//!   (`kernels/dense.cu`, its own fatbin): embedding and its scatter-add,
//!   RMSNorm forward/backward (f32 residual or bf16 head rows; the
//!   residual's widths a block per row, the forward copying its input in
//!   the same pass on request, `Gpu::rmsnorm_keeping`), the
//!   token ↔ head layout with RoPE, causal softmax forward/backward, fused
//!   cross-entropy (two passes a row; `gpu::XentLaunch`: many rows in
//!   flight, or one a SM with L2 cache hints, the default), gradient squared norms and the fused AdamW update
//!   (clip read on the device; `Gpu::adamw_streams`, its loads and stores
//!   alone, the benchmark's ceiling for it), many sums or copies through device
//!   addresses in one launch (`sum_parts_reference`, `Gpu::sum_parts`: the
//!   in-process ranks' reduce-scatter and all-gather), and fused causal grouped-query attention
//!   (FlashAttention-2's forward and backward, twins in f64; the backward
//!   stores dS for its dQ while that fits `gpu::ATTN_DS_MAX_BYTES`,
//!   `gpu::AttnDq`, and recomputes it past that). `Gpu` runs
//!   them on device buffers (`gpu/imp/dense.rs`); attention runs fused, or
//!   materialised as the grouped GEMM with one group per (sequence,
//!   key/value head) and the causal softmax kernels. Where the shape allows
//!   (head width 64 or 128, sequences of whole 128-row tiles) the fused
//!   forward and backward run through CUTLASS's Hopper FMHA instead
//!   (`kernels/lib/attention.cu` → `liblrmoe_attention.so`, opened as the
//!   grouped GEMM is; `gpu::AttnFwd`, `gpu::AttnDq::Cutlass`), and the
//!   backward at head widths ≥ 64 through cuDNN's fused SDPA backward where
//!   the machine has `libcudnn.so.9` (`kernels/lib/cudnn_attention.cu`,
//!   `gpu::AttnDq::Cudnn`, `gpu::cudnn_candidates`), all tested against
//!   the same twins.
//! * [`grouped`] — the experts' math as bf16 grouped operations on host
//!   slices (grouped GEMM, SwiGLU and its backward, and the experts'
//!   forward and backward composed of them), implemented by the CPU twins
//!   and by the GPU (the composites as one device-resident chain), so the
//!   `layer` crate's use of them is tested in CI through the twins.
//! * [`comm`] — NCCL collectives between processes, one GPU each (feature
//!   `nccl`): variable all-to-all of any element type, all-gather,
//!   all-reduce, every wait with a deadline; `start_all_to_all` /
//!   `start_all_reduce_sum_f32` run beside a [`gpu::Gpu`]'s compute stream,
//!   ordered by CUDA events (`comm::InFlight`), never by the host.
//!
//! ## Invariants
//!
//! * `unsafe` here wraps FFI and launches; device operations that read
//!   through device index buffers are `unsafe fn` with a `# Safety`
//!   contract the caller (the layer's device executor) upholds, the rest
//!   check lengths and are safe.
//! * No layer, quota, replica or redistribution rule lives here: the
//!   crate runs operations on buffers it is given (`lrm-score` gives the
//!   CPU twin of the priority keys its random draw).
//! * Zero-size dimensions are ordinary inputs: an `m × 0` times `0 × n`
//!   product is zeros (or leaves the accumulator as it was).
//! * With the `cuda` feature off the GPU API returns
//!   [`KernelError::NotCompiledWithCuda`], so callers carry no `cfg`.

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod artifacts;
pub mod comm;
pub mod cpu;
pub mod dense;
pub mod gpu;
pub mod grouped;
pub mod limits;

/// Errors of the kernel layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The crate was built without the `cuda` feature.
    #[error("lrmoe was built without CUDA support (rebuild with --features cuda)")]
    NotCompiledWithCuda,
    /// The crate was built without the `nccl` feature.
    #[error("lrmoe was built without NCCL support (rebuild with --features nccl)")]
    NotCompiledWithNccl,
    /// A CUDA driver call or launch failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An NCCL call failed, or NCCL is missing.
    #[error("{0}")]
    Comm(String),
    /// Peers did not complete a collective within the timeout; the
    /// communicator was aborted.
    #[error("rank {rank}: peers did not complete the collective within {timeout_ms} ms (a peer died or hangs); the communicator was aborted")]
    CommTimeout {
        /// The waiting rank.
        rank: usize,
        /// The configured timeout.
        timeout_ms: u64,
    },
    /// A launch setting out of its kernel's range.
    #[error("{0}")]
    Launch(String),
    /// A buffer's length does not match the declared shape.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which operand.
        what: &'static str,
        /// Length implied by the shape.
        expected: usize,
        /// Length given.
        got: usize,
    },
}
