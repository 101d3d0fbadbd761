//! The router's rules: softmax over the router logits and the top-k experts
//! of each token (the host backend's), the capacity-factor baseline's
//! capacity and the auxiliary loss's terms (every backend's).

use kernels::cpu::Real;

use crate::LayerError;

pub(crate) fn softmax_rows<T: Real>(logits: &mut [T], width: usize) {
    for row in logits.chunks_exact_mut(width) {
        let max = row.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
        let mut sum = T::zero();
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum;
        }
    }
}

/// Indices of the `k` largest entries of `row` (ties: lower index first).
pub(crate) fn top_k<T: Real>(row: &[T], k: usize, out: &mut [u32]) {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let better = |a: &u32, b: &u32| {
        let (x, y) = (row[*a as usize], row[*b as usize]);
        y.partial_cmp(&x)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, better);
    }
    idx[..k].sort_by(better);
    out.copy_from_slice(&idx[..k]);
}

/// The per-expert capacity `⌈factor · pairs / n_experts⌉` of a source
/// with `pairs` routed pairs, if the call has a capacity factor — the
/// capacity-factor baseline's one rule, for every executor.
pub(crate) fn expert_capacity(
    factor: Option<f64>,
    pairs: usize,
    n_experts: usize,
) -> Result<Option<usize>, LayerError> {
    match factor {
        None => Ok(None),
        Some(f) if f.is_finite() && f > 0.0 => {
            Ok(Some((f * pairs as f64 / n_experts as f64).ceil() as usize))
        }
        Some(f) => Err(LayerError::Config(format!(
            "capacity factor {f} must be positive"
        ))),
    }
}

/// The Switch/GShard auxiliary loss `α · E · Σ_e f_e · P_e` of one rank's
/// routing — `f_e`: the share of its routed pairs at expert `e` (from
/// `counts`), `P_e`: the mean router probability of `e` over its `tokens`
/// tokens (`mean_p`, computed only when the loss is on) — and its gradient
/// with respect to each token's probability of `e`, `α · E · f_e / (T · W)`
/// over `world` ranks (the ranks' losses are summed into the model's).
/// `(0, [])` when off. The rule of every executor; each computes `P_e` its
/// own way.
pub(crate) fn aux_loss_terms(
    alpha: f64,
    counts: &[u64],
    tokens: usize,
    world: usize,
    mean_p: impl FnOnce() -> Result<Vec<f64>, LayerError>,
) -> Result<(f64, Vec<f64>), LayerError> {
    if !(alpha.is_finite() && alpha >= 0.0) {
        return Err(LayerError::Config(format!(
            "aux_loss_coeff {alpha} must be finite and ≥ 0"
        )));
    }
    let pairs: u64 = counts.iter().sum();
    if alpha == 0.0 || tokens == 0 || pairs == 0 {
        return Ok((0.0, Vec::new()));
    }
    let mean_p = mean_p()?;
    let f: Vec<f64> = counts.iter().map(|&c| c as f64 / pairs as f64).collect();
    let scale = alpha * counts.len() as f64;
    let loss = scale * f.iter().zip(&mean_p).map(|(a, b)| a * b).sum::<f64>();
    let dp = f
        .iter()
        .map(|&fe| scale * fe / (tokens as f64 * world as f64))
        .collect();
    Ok((loss, dp))
}
