//! The router of the host executor: softmax over the router logits, the
//! top-k experts of each token, and the capacity-factor baseline's mask.

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

/// Which pairs reach their expert: all, or the first `⌈factor · P / E⌉` per
/// expert in pair order.
pub(crate) fn capacity_mask(
    factor: Option<f64>,
    expert_of_pair: &[u32],
    n_experts: usize,
) -> Result<Vec<bool>, LayerError> {
    let Some(factor) = factor else {
        return Ok(vec![true; expert_of_pair.len()]);
    };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(LayerError::Config(format!(
            "capacity factor {factor} must be positive"
        )));
    }
    let cap = (factor * expert_of_pair.len() as f64 / n_experts as f64).ceil() as usize;
    let mut used = vec![0usize; n_experts];
    Ok(expert_of_pair
        .iter()
        .map(|&e| {
            used[e as usize] += 1;
            used[e as usize] <= cap
        })
        .collect())
}
