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
//! * CUDA kernels (fused LRM scores, top-q selection, pack/unpack, the
//!   variable-size grouped GEMM, SwiGLU, router, combine) behind a `cuda`
//!   feature, built by `cargo xtask kernels` — **not implemented yet
//!   (issue #4)**.
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

pub mod cpu;

/// Errors of the kernel layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The crate was built without the `cuda` feature.
    #[error("lrmoe was built without CUDA support (rebuild with --features cuda)")]
    NotCompiledWithCuda,
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
