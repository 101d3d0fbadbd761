//! The expert math of a layer as bf16 grouped operations on host slices,
//! with two implementations: the CUDA kernels ([`crate::gpu::Gpu`]) and
//! their CPU twins ([`CpuTwins`]).
//!
//! Three primitive operations (grouped GEMM in its three variants, SwiGLU
//! and its backward) and two composites built from them: the experts'
//! forward ([`GroupedOps::experts_forward`]) and backward
//! ([`GroupedOps::experts_backward`]) on rows grouped by expert. The
//! composites' default bodies compose the primitives ([`compose_forward`],
//! [`compose_backward`]), which is what the twins run and CI tests; the GPU
//! overrides them with one device-resident chain (inputs uploaded once,
//! intermediates never leave the device, results downloaded once), tested
//! on the device against the composed twins. Rows and weights are bf16 bits;
//! GEMMs accumulate in f32 and round their output to bf16 (the twins round
//! exactly as the kernels do).

use crate::cpu::{
    bf16_bits_to_f32, f32_to_bf16_bits, grouped_gemm_reference, swiglu_backward_bf16_reference,
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
    /// [`GroupedOps::grouped_gemm`] added onto `base` (the output's shape):
    /// `base + A·B`, summed in f32 and rounded to bf16 once.
    #[allow(clippy::too_many_arguments)]
    fn grouped_gemm_onto(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        base: &[u16],
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
    /// The experts' forward on rows grouped by expert (`offsets`, one entry
    /// per expert plus one): `o = (silu(x·W_gate) ⊙ x·W_up) · W_down` of
    /// every row, and `‖h‖²` (f32) of every row's down-projection input.
    fn experts_forward(
        &self,
        offsets: &[i32],
        x: &[u16],
        w: &StackedExperts<'_>,
    ) -> Result<(Vec<u16>, Vec<f32>), KernelError> {
        compose_forward(self, offsets, x, w)
    }
    /// The experts' backward on kept rows grouped by expert: `d` holds each
    /// row's output gradient (`g · δ`); returns `dX` of every row and every
    /// expert's weight gradients (zero for experts with no rows).
    fn experts_backward(
        &self,
        offsets: &[i32],
        x: &[u16],
        d: &[u16],
        w: &StackedExperts<'_>,
    ) -> Result<ExpertGrads, KernelError> {
        compose_backward(self, offsets, x, d, w)
    }
}

/// Every expert's weights back to back as bf16 bits: `gate` and `up`
/// `E × H × F`, `down` `E × F × H` (row-major, `x · W`).
#[derive(Debug, Clone, Copy)]
pub struct StackedExperts<'a> {
    /// Hidden size `H`.
    pub hidden: usize,
    /// Expert FFN size `F`.
    pub ffn: usize,
    /// Gate projections.
    pub gate: &'a [u16],
    /// Up projections.
    pub up: &'a [u16],
    /// Down projections.
    pub down: &'a [u16],
}

impl StackedExperts<'_> {
    fn check(&self, offsets: &[i32]) -> Result<(), KernelError> {
        let e = offsets.len().saturating_sub(1);
        let n = e * self.hidden * self.ffn;
        for (what, got) in [
            ("stacked gate weights", self.gate.len()),
            ("stacked up weights", self.up.len()),
            ("stacked down weights", self.down.len()),
        ] {
            if got != n {
                return Err(KernelError::Shape {
                    what,
                    expected: n,
                    got,
                });
            }
        }
        Ok(())
    }
}

/// Gradients of the experts' backward, bf16 bits.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertGrads {
    /// Input gradient of every row, `rows × H`.
    pub dx: Vec<u16>,
    /// Gate gradients `E × H × F`.
    pub gate: Vec<u16>,
    /// Up gradients `E × H × F`.
    pub up: Vec<u16>,
    /// Down gradients `E × F × H`.
    pub down: Vec<u16>,
}

/// [`GroupedOps::experts_forward`] composed of the primitives.
pub fn compose_forward<O: GroupedOps + ?Sized>(
    ops: &O,
    offsets: &[i32],
    x: &[u16],
    w: &StackedExperts<'_>,
) -> Result<(Vec<u16>, Vec<f32>), KernelError> {
    w.check(offsets)?;
    let (hd, f) = (w.hidden, w.ffn);
    let a = ops.grouped_gemm(GemmVariant::Forward, offsets, x, w.gate, hd, f)?;
    let b = ops.grouped_gemm(GemmVariant::Forward, offsets, x, w.up, hd, f)?;
    let h = ops.swiglu(&a, &b)?;
    let o = ops.grouped_gemm(GemmVariant::Forward, offsets, &h, w.down, f, hd)?;
    let h_sq = h
        .chunks_exact(f.max(1))
        .map(|r| r.iter().map(|&v| bf16_bits_to_f32(v).powi(2)).sum())
        .collect();
    Ok((o, h_sq))
}

/// [`GroupedOps::experts_backward`] composed of the primitives: recomputes
/// the kept rows' `a = x·W_gate`, `b = x·W_up` and `h`, then
/// `dW_down = hᵀ·d`, `dh = d·W_downᵀ`, the SwiGLU backward, `dW_gate`,
/// `dW_up`, and `dX = da·W_gateᵀ + db·W_upᵀ`.
pub fn compose_backward<O: GroupedOps + ?Sized>(
    ops: &O,
    offsets: &[i32],
    x: &[u16],
    d: &[u16],
    w: &StackedExperts<'_>,
) -> Result<ExpertGrads, KernelError> {
    w.check(offsets)?;
    let (hd, f) = (w.hidden, w.ffn);
    let a = ops.grouped_gemm(GemmVariant::Forward, offsets, x, w.gate, hd, f)?;
    let b = ops.grouped_gemm(GemmVariant::Forward, offsets, x, w.up, hd, f)?;
    let h = ops.swiglu(&a, &b)?;
    let down = ops.grouped_gemm(GemmVariant::WeightGrad, offsets, &h, d, f, hd)?;
    let dh = ops.grouped_gemm(GemmVariant::DataGrad, offsets, d, w.down, f, hd)?;
    let (da, db) = ops.swiglu_backward(&a, &b, &dh)?;
    let gate = ops.grouped_gemm(GemmVariant::WeightGrad, offsets, x, &da, hd, f)?;
    let up = ops.grouped_gemm(GemmVariant::WeightGrad, offsets, x, &db, hd, f)?;
    let dx1 = ops.grouped_gemm(GemmVariant::DataGrad, offsets, &da, w.gate, hd, f)?;
    let dx = ops.grouped_gemm_onto(GemmVariant::DataGrad, offsets, &db, w.up, &dx1, hd, f)?;
    Ok(ExpertGrads { dx, gate, up, down })
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
    fn grouped_gemm_onto(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        base: &[u16],
        h: usize,
        f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        let acc = grouped_gemm_reference(variant, offsets, a, b, h, f)?;
        crate::cpu::check("base", acc.len(), base.len())?;
        Ok(acc
            .into_iter()
            .zip(base)
            .map(|(x, &c)| f32_to_bf16_bits(x + bf16_bits_to_f32(c)))
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
    fn grouped_gemm_onto(
        &self,
        variant: GemmVariant,
        offsets: &[i32],
        a: &[u16],
        b: &[u16],
        base: &[u16],
        h: usize,
        f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        self.grouped_gemm_onto_bf16(variant, offsets, a, b, base, h, f)
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
    #[cfg(feature = "cuda")]
    fn experts_forward(
        &self,
        offsets: &[i32],
        x: &[u16],
        w: &StackedExperts<'_>,
    ) -> Result<(Vec<u16>, Vec<f32>), KernelError> {
        // Shapes are checked by the device chain before any upload.
        self.experts_forward_bf16(offsets, x, w.gate, w.up, w.down, w.hidden, w.ffn)
    }
    #[cfg(feature = "cuda")]
    fn experts_backward(
        &self,
        offsets: &[i32],
        x: &[u16],
        d: &[u16],
        w: &StackedExperts<'_>,
    ) -> Result<ExpertGrads, KernelError> {
        let (dx, gate, up, down) =
            self.experts_backward_bf16(offsets, x, d, w.gate, w.up, w.down, w.hidden, w.ffn)?;
        Ok(ExpertGrads { dx, gate, up, down })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacked_weights_of_the_wrong_size_are_refused() {
        let w = StackedExperts {
            hidden: 8,
            ffn: 8,
            gate: &[0; 64],
            up: &[0; 63],
            down: &[0; 64],
        };
        let err = CpuTwins.experts_forward(&[0, 2], &[0; 16], &w).unwrap_err();
        assert_eq!(
            err,
            KernelError::Shape {
                what: "stacked up weights",
                expected: 64,
                got: 63
            }
        );
    }

    #[test]
    fn no_rows_give_zero_weight_gradients_and_no_dx() {
        let one = f32_to_bf16_bits(1.0);
        let w = StackedExperts {
            hidden: 8,
            ffn: 8,
            gate: &[one; 128],
            up: &[one; 128],
            down: &[one; 128],
        };
        let r = CpuTwins.experts_backward(&[0, 0, 0], &[], &[], &w).unwrap();
        assert!(r.dx.is_empty());
        for g in [&r.gate, &r.up, &r.down] {
            assert_eq!(g.len(), 128);
            assert!(g.iter().all(|&b| bf16_bits_to_f32(b) == 0.0));
        }
    }

    #[test]
    fn the_composed_forward_is_the_expert_mlp() {
        // One expert, one row, H = F = 8: x = 1s, W_gate = W_up = 0.125 · 1s,
        // so a = b = 1, h = silu(1) · 1, o = 8 · h · w_down.
        let v = |x: f32| f32_to_bf16_bits(x);
        let w = StackedExperts {
            hidden: 8,
            ffn: 8,
            gate: &[v(0.125); 64],
            up: &[v(0.125); 64],
            down: &[v(0.25); 64],
        };
        let (o, h_sq) = CpuTwins.experts_forward(&[0, 1], &[v(1.0); 8], &w).unwrap();
        let silu1 = 1.0 / (1.0 + (-1.0f32).exp());
        let h = bf16_bits_to_f32(v(silu1));
        assert!((h_sq[0] - 8.0 * h * h).abs() < 1e-5, "{h_sq:?}");
        for &b in &o {
            assert!((bf16_bits_to_f32(b) - 2.0 * h).abs() < 1e-2, "{o:?}");
        }
    }
}
