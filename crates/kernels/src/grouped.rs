//! The expert math of a layer as bf16 grouped operations on host slices,
//! with two implementations: the CUDA kernels ([`crate::gpu::Gpu`]) and
//! their CPU twins ([`CpuTwins`]).
//!
//! The `layer` crate composes an expert backend from these three operations
//! (grouped GEMM in its three variants, SwiGLU and its backward), so the
//! composition is tested in CI through the twins, and each GPU operation is
//! tested on the device against its twin. Rows and weights are bf16 bits;
//! GEMMs accumulate in f32 and round their output to bf16 (the twins round
//! exactly as the kernels do).

use crate::cpu::{
    f32_to_bf16_bits, grouped_gemm_reference, swiglu_backward_bf16_reference,
    swiglu_bf16_reference, GemmVariant,
};
use crate::gpu::Gpu;
use crate::KernelError;

/// bf16 grouped operations on host slices (see the module doc).
pub trait GroupedOps: Send + Sync {
    /// The grouped GEMM: see [`GemmVariant`] for the operand shapes;
    /// `offsets` has one entry per group plus one.
    fn grouped_gemm(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        h: usize,
        f: usize,
    ) -> Result<Vec<u16>, KernelError>;
    /// `silu(a) ⊙ b`.
    fn swiglu(&self, a: &[u16], b: &[u16]) -> Result<Vec<u16>, KernelError>;
    /// `(∂/∂a, ∂/∂b)` of `silu(a) ⊙ b` given its output gradient.
    fn swiglu_backward(
        &self,
        a: &[u16],
        b: &[u16],
        dh: &[u16],
    ) -> Result<(Vec<u16>, Vec<u16>), KernelError>;
    /// A name for logs and errors.
    fn name(&self) -> &'static str;
}

/// The CPU twins of the CUDA kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTwins;

impl GroupedOps for CpuTwins {
    fn grouped_gemm(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        h: usize,
        f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        Ok(grouped_gemm_reference(variant, offsets, a, b, h, f)?
            .into_iter()
            .map(f32_to_bf16_bits)
            .collect())
    }
    fn swiglu(&self, a: &[u16], b: &[u16]) -> Result<Vec<u16>, KernelError> {
        swiglu_bf16_reference(a, b)
    }
    fn swiglu_backward(
        &self,
        a: &[u16],
        b: &[u16],
        dh: &[u16],
    ) -> Result<(Vec<u16>, Vec<u16>), KernelError> {
        swiglu_backward_bf16_reference(a, b, dh)
    }
    fn name(&self) -> &'static str {
        "cpu twins"
    }
}

impl GroupedOps for Gpu {
    fn grouped_gemm(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        h: usize,
        f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        self.grouped_gemm_bf16(variant, offsets, a, b, h, f)
    }
    fn swiglu(&self, a: &[u16], b: &[u16]) -> Result<Vec<u16>, KernelError> {
        self.swiglu_bf16(a, b)
    }
    fn swiglu_backward(
        &self,
        a: &[u16],
        b: &[u16],
        dh: &[u16],
    ) -> Result<(Vec<u16>, Vec<u16>), KernelError> {
        self.swiglu_backward_bf16(a, b, dh)
    }
    fn name(&self) -> &'static str {
        "cuda"
    }
}
