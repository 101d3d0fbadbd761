//! # kernels — CUDA kernels and their CPU twins (contract only, issue #4)
//!
//! This crate will hold every GPU kernel of the LRMoE pipeline — fused LRM
//! scores, per-expert top-q selection, pack/unpack row movement, the
//! variable-size grouped GEMM (forward, data gradient, weight gradient),
//! SwiGLU, router softmax/top-k and combine — each beside a CPU reference in
//! this crate, loaded through cudarc behind a `cuda` cargo feature, built by
//! `cargo xtask kernels`.
//!
//! **Status:** not implemented yet. Until issue #4 lands, this crate exposes
//! only [`KernelError`] so callers can be written against the final error
//! shape; nothing here launches anything.
//!
//! ## Invariants (to hold once implemented)
//!
//! * Only this crate holds `unsafe` FFI.
//! * With the `cuda` feature off, the same API exists and returns
//!   [`KernelError::NotCompiledWithCuda`], so callers carry no `cfg`.

#![deny(missing_docs)]

/// Errors of the kernel layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The crate was built without the `cuda` feature.
    #[error("lrmoe was built without CUDA support (rebuild with --features cuda)")]
    NotCompiledWithCuda,
}
