//! Where the host backend's expert GEMMs run ([`ExpertBackend`]): on the
//! CPU in the layer's own precision (`crate::host`), or as bf16 grouped
//! operations ([`kernels::grouped::GroupedOps`]: the CUDA kernels on this
//! rank's GPU, or their CPU twins), whose calls are here.
//!
//! Everything else in the layer — routing, the controller, scoring,
//! selection, redistribution, packing and the exchanges — is the same for
//! both; only the GEMMs and SwiGLU of the rows this rank computes move.

use std::sync::Arc;

use kernels::cpu::{bf16_bits_to_f32, from_bf16, to_bf16, Real};
use kernels::grouped::{GroupedOps, StackedExperts};

use crate::config::Experts;
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

/// Group offsets as the grouped GEMM takes them.
fn gemm_offsets(offsets: &[u32]) -> Result<Vec<i32>, LayerError> {
    offsets
        .iter()
        .map(|&o| {
            i32::try_from(o).map_err(|_| {
                LayerError::Config(format!("{o} grouped rows exceed the grouped GEMM's range"))
            })
        })
        .collect()
}

/// The instances' stacked weights as bf16 bits, lent to `run`.
fn with_stacked<T: Real, R>(
    w: Experts<&[T]>,
    (hidden, ffn): (usize, usize),
    run: impl FnOnce(&StackedExperts<'_>) -> R,
) -> R {
    let (gate, up, down) = (to_bf16(w.gate), to_bf16(w.up), to_bf16(w.down));
    run(&StackedExperts {
        hidden,
        ffn,
        gate: &gate,
        up: &up,
        down: &down,
    })
}

/// The experts' forward as bf16 grouped operations on rows `x` grouped
/// by `offsets` (one group per instance of `w`): each row's output and
/// `‖h‖²`.
pub(crate) fn bf16_forward<T: Real>(
    ops: &dyn GroupedOps,
    offsets: &[u32],
    x: &[T],
    w: Experts<&[T]>,
    dims: (usize, usize),
) -> Result<(Vec<T>, Vec<T>), LayerError> {
    if x.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let off = gemm_offsets(offsets)?;
    let xb = to_bf16(x);
    let (o, h_sq) = with_stacked(w, dims, |w| ops.experts_forward(&off, &xb, w))?;
    Ok((
        from_bf16(&o),
        h_sq.into_iter().map(|v| T::of(f64::from(v))).collect(),
    ))
}

/// The experts' backward as bf16 grouped operations on kept rows `x`
/// with output gradients `d`, grouped by `offsets`: every row's `dX` and
/// the instances' weight gradients.
pub(crate) fn bf16_backward<T: Real>(
    ops: &dyn GroupedOps,
    offsets: &[u32],
    (x, d): (&[T], &[T]),
    w: Experts<&[T]>,
    dims: (usize, usize),
) -> Result<(Vec<T>, Experts<Vec<T>>), LayerError> {
    let widen = |v: &[u16]| {
        v.iter()
            .map(|&b| T::of(f64::from(bf16_bits_to_f32(b))))
            .collect()
    };
    if x.is_empty() {
        let zeros = |v: &[T]| vec![T::zero(); v.len()];
        let g = Experts {
            gate: zeros(w.gate),
            up: zeros(w.up),
            down: zeros(w.down),
        };
        return Ok((Vec::new(), g));
    }
    let off = gemm_offsets(offsets)?;
    let (xb, db) = (to_bf16(x), to_bf16(d));
    let r = with_stacked(w, dims, |w| ops.experts_backward(&off, &xb, &db, w))?;
    let g = Experts {
        gate: widen(&r.gate),
        up: widen(&r.up),
        down: widen(&r.down),
    };
    Ok((widen(&r.dx), g))
}
