//! The experts' math on rows grouped by expert, for the forward and the
//! LRMoE backward: on the CPU in the layer's own precision (the `gemm`
//! crate), or as bf16 grouped operations ([`kernels::grouped::GroupedOps`]:
//! the CUDA kernels on this rank's GPU, or their CPU twins).
//!
//! Everything else in the layer — routing, the controller, scoring,
//! selection, redistribution, packing and the exchanges — is the same for
//! both; only the GEMMs and SwiGLU of the rows this rank computes move.

use std::sync::Arc;

use kernels::cpu::{
    bf16_bits_to_f32, from_bf16, matmul, swiglu, swiglu_backward, to_bf16, Op, Real,
};
use kernels::grouped::{GroupedOps, StackedExperts};

use crate::config::{ExpertWeights, MoeConfig, MoeParams};
use crate::LayerError;

/// Where the experts' GEMMs run.
#[derive(Clone, Default)]
pub enum ExpertBackend {
    /// On the CPU, in the layer's element type.
    #[default]
    Cpu,
    /// bf16 grouped operations (bf16 rows and weights, f32 accumulation).
    Bf16(Arc<dyn GroupedOps>),
}

impl std::fmt::Debug for ExpertBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "Cpu"),
            Self::Bf16(ops) => write!(f, "Bf16({})", ops.name()),
        }
    }
}

impl PartialEq for ExpertBackend {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Cpu, Self::Cpu) => true,
            (Self::Bf16(a), Self::Bf16(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

fn offsets(sizes: &[usize]) -> Result<Vec<i32>, LayerError> {
    let mut o = Vec::with_capacity(sizes.len() + 1);
    let mut at = 0usize;
    o.push(0);
    for &s in sizes {
        at += s;
        o.push(i32::try_from(at).map_err(|_| {
            LayerError::Config(format!("{at} grouped rows exceed the grouped GEMM's range"))
        })?);
    }
    Ok(o)
}

/// Every expert's gate, up and down matrices back to back, as bf16 bits,
/// lent to `run`.
fn with_stacked<'a, T: Real + 'a, R>(
    cfg: &MoeConfig,
    n: usize,
    weights: &dyn Fn(usize) -> &'a ExpertWeights<T>,
    run: impl FnOnce(&StackedExperts<'_>) -> R,
) -> R {
    let stack = |sel: fn(&ExpertWeights<T>) -> &Vec<T>| -> Vec<u16> {
        (0..n).flat_map(|e| to_bf16(sel(weights(e)))).collect()
    };
    let (gate, up, down) = (stack(|w| &w.gate), stack(|w| &w.up), stack(|w| &w.down));
    run(&StackedExperts {
        hidden: cfg.hidden,
        ffn: cfg.ffn,
        gate: &gate,
        up: &up,
        down: &down,
    })
}

/// Forward of the experts on `xs` (rows grouped by expert, `sizes[e]` rows
/// for expert `e`): the output rows `o` and `‖h‖²` of each row, where `h`
/// is the down projection's input.
pub(crate) fn forward<'a, T: Real + 'a>(
    backend: &ExpertBackend,
    cfg: &MoeConfig,
    weights: &dyn Fn(usize) -> &'a ExpertWeights<T>,
    sizes: &[usize],
    xs: &[T],
) -> Result<(Vec<T>, Vec<T>), LayerError> {
    let (hd, f) = (cfg.hidden, cfg.ffn);
    let n = xs.len() / hd;
    match backend {
        ExpertBackend::Cpu => {
            let mut o = vec![T::zero(); n * hd];
            let mut h_sq = vec![T::zero(); n];
            let mut start = 0;
            for (e, &rows) in sizes.iter().enumerate() {
                if rows == 0 {
                    continue;
                }
                let w = weights(e);
                let (_, _, hmat) = expert_hidden(cfg, w, &xs[start * hd..(start + rows) * hd])?;
                let oe = &mut o[start * hd..(start + rows) * hd];
                matmul(oe, &hmat, Op::N, &w.down, Op::N, (rows, f, hd), false)?;
                for (r, hr) in hmat.chunks_exact(f).enumerate() {
                    h_sq[start + r] = hr.iter().map(|&v| v * v).sum();
                }
                start += rows;
            }
            Ok((o, h_sq))
        }
        ExpertBackend::Bf16(_) if n == 0 => Ok((Vec::new(), Vec::new())),
        ExpertBackend::Bf16(ops) => {
            let off = offsets(sizes)?;
            let x = to_bf16(xs);
            let (o, h_sq) = with_stacked(cfg, sizes.len(), weights, |w| {
                ops.experts_forward(&off, &x, w)
            })?;
            Ok((
                from_bf16(&o),
                h_sq.into_iter().map(|v| T::of(f64::from(v))).collect(),
            ))
        }
    }
}

/// Backward of the experts on kept rows grouped by expert: adds each
/// expert's weight gradients into `grads` and returns `dX` of every row.
/// `dos` holds the rows' `g · δ`.
pub(crate) fn backward<'a, T: Real + 'a>(
    backend: &ExpertBackend,
    cfg: &MoeConfig,
    weights: &dyn Fn(usize) -> &'a ExpertWeights<T>,
    sizes: &[usize],
    xs: &[T],
    dos: &[T],
    grads: &mut MoeParams<T>,
) -> Result<Vec<T>, LayerError> {
    let (hd, f) = (cfg.hidden, cfg.ffn);
    let n = xs.len() / hd;
    match backend {
        ExpertBackend::Cpu => {
            let mut dx = vec![T::zero(); n * hd];
            let mut start = 0;
            for (e, &rows) in sizes.iter().enumerate() {
                if rows == 0 {
                    continue;
                }
                let w = weights(e);
                let g = &mut grads.experts[e];
                let xe = &xs[start * hd..(start + rows) * hd];
                let doe = &dos[start * hd..(start + rows) * hd];
                let (a, b, h) = expert_hidden(cfg, w, xe)?;
                matmul(&mut g.down, &h, Op::T, doe, Op::N, (f, rows, hd), true)?;
                // `dh` overwrites `h`, read for the last time above: at most
                // five `ffn`-wide intermediates live at once.
                let mut dh = h;
                matmul(&mut dh, doe, Op::N, &w.down, Op::T, (rows, hd, f), false)?;
                let mut da = vec![T::zero(); rows * f];
                let mut db = vec![T::zero(); rows * f];
                swiglu_backward(&a, &b, &dh, &mut da, &mut db)?;
                drop((a, b, dh));
                matmul(&mut g.gate, xe, Op::T, &da, Op::N, (hd, rows, f), true)?;
                matmul(&mut g.up, xe, Op::T, &db, Op::N, (hd, rows, f), true)?;
                let dxe = &mut dx[start * hd..(start + rows) * hd];
                matmul(dxe, &da, Op::N, &w.gate, Op::T, (rows, f, hd), false)?;
                matmul(dxe, &db, Op::N, &w.up, Op::T, (rows, f, hd), true)?;
                start += rows;
            }
            Ok(dx)
        }
        // No rows here: no kernel call, nothing to add.
        ExpertBackend::Bf16(_) if n == 0 => Ok(Vec::new()),
        ExpertBackend::Bf16(ops) => {
            let off = offsets(sizes)?;
            let (x, d) = (to_bf16(xs), to_bf16(dos));
            let r = with_stacked(cfg, sizes.len(), weights, |w| {
                ops.experts_backward(&off, &x, &d, w)
            })?;
            let hf = hd * f;
            for (e, &rows) in sizes.iter().enumerate() {
                if rows == 0 {
                    continue;
                }
                let g = &mut grads.experts[e];
                for (dst, src) in [
                    (&mut g.gate, &r.gate[e * hf..(e + 1) * hf]),
                    (&mut g.up, &r.up[e * hf..(e + 1) * hf]),
                    (&mut g.down, &r.down[e * hf..(e + 1) * hf]),
                ] {
                    for (t, &s) in dst.iter_mut().zip(src) {
                        *t += T::of(f64::from(bf16_bits_to_f32(s)));
                    }
                }
            }
            Ok(from_bf16(&r.dx))
        }
    }
}

/// `(a, b, h)` of one expert on rows `x` (`rows × hidden`): `a = x·W_gate`,
/// `b = x·W_up`, `h = silu(a) ⊙ b`. The forward and the backward's
/// recomputation share it.
#[allow(clippy::type_complexity)]
fn expert_hidden<T: Real>(
    cfg: &MoeConfig,
    w: &ExpertWeights<T>,
    x: &[T],
) -> Result<(Vec<T>, Vec<T>, Vec<T>), LayerError> {
    let (hd, f) = (cfg.hidden, cfg.ffn);
    let rows = x.len() / hd;
    let mut a = vec![T::zero(); rows * f];
    let mut b = vec![T::zero(); rows * f];
    let mut h = vec![T::zero(); rows * f];
    matmul(&mut a, x, Op::N, &w.gate, Op::N, (rows, hd, f), false)?;
    matmul(&mut b, x, Op::N, &w.up, Op::N, (rows, hd, f), false)?;
    swiglu(&a, &b, &mut h)?;
    Ok((a, b, h))
}
