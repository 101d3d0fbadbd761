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
//! * [`gpu`] — CUDA kernels from `kernels/*.cu`, built by
//!   `cargo xtask kernels` (flags and pinned nvcc in [`artifacts`]), embedded
//!   and loaded through cudarc behind the `cuda` feature: fused LRM scores
//!   (bf16 in, f32 out), pack (row gather) and unpack (row scatter with zero
//!   fill). Each has a CPU twin in [`cpu`] (`lrm_scores_reference`,
//!   `gather_rows_reference`, `unpack_rows_reference`) and a device test.
//!   **Not built yet (issue #4):** top-q selection, the variable-size grouped
//!   GEMM, SwiGLU, router and combine kernels, and the layer on the GPU.
//!
//! ## Invariants
//!
//! * Only this crate holds `unsafe` (the `gemm` call, wrapped by a function
//!   that checks every length first).
//! * Zero-size dimensions are ordinary inputs: an `m × 0` times `0 × n`
//!   product is zeros (or leaves the accumulator as it was).
//! * With the `cuda` feature off the GPU API returns
//!   [`KernelError::NotCompiledWithCuda`], so callers carry no `cfg`.

#![deny(missing_docs)]

pub mod artifacts;
pub mod cpu;
pub mod gpu;

/// Errors of the kernel layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The crate was built without the `cuda` feature.
    #[error("lrmoe was built without CUDA support (rebuild with --features cuda)")]
    NotCompiledWithCuda,
    /// A CUDA driver call or launch failed.
    #[error("CUDA: {0}")]
    Cuda(String),
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
