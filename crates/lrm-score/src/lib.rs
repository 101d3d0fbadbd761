//! # lrm-score — which routed pairs matter most to an expert's weight update
//!
//! For one expert projection `y = W h` (`W`: `d_out × d_in`), the routed pair
//! `i` (one token sent to one expert) contributes `g_i · δ_i · h_iᵀ` to the
//! weight gradient `∂L/∂W`, where
//!
//! * `h_i` (`d_in`) is the projection's saved input row,
//! * `δ_i` (`d_out`) is the gradient of the loss with respect to the
//!   projection's output row *before* it is scaled by the routing weight,
//! * `g_i` is the pair's routing weight.
//!
//! The contribution is rank 1, so its squared Frobenius norm factorises:
//!
//! ```text
//! score_i = ‖g_i · δ_i · h_iᵀ‖²_F = g_i² · ‖δ_i‖² · ‖h_i‖²
//! ```
//!
//! [`pair_scores`] computes it for every pair in one pass over the rows,
//! without forming any `d_out × d_in` matrix. Inputs are row-major `f32` or
//! `bf16` ([`half::bf16`]) matrices; the two row norms are accumulated in
//! `f32` or `f64` ([`Accumulate`]); the scores are `f32`. Work is split over
//! rows with rayon.
//!
//! [`select_top`] then keeps, for every expert `e`, the `min(q_e, n_e)`
//! highest-scoring of its `n_e` pairs, where `q_e` is the expert's backward
//! quota (set earlier by the `quota` crate). Selection is linear time
//! (counting-sort bucketing by expert, then `select_nth_unstable` per expert),
//! not a sort.
//!
//! [`select`] generalises the choice to a [`Rule`]: top-q (the paper's
//! rule, [`select_top`]), random-q, sampling proportional to the
//! contribution's norm `√score` with `1/π` weights, and priority sampling
//! with threshold-corrected weights (the formulas are on [`Rule`]). The two sampling rules are unbiased: the weighted kept
//! contributions sum, in expectation, to the complete gradient.
//!
//! ## Invariants
//!
//! * Scores are finite and `≥ 0`; a non-finite score (from a NaN or infinite
//!   input, or an overflow of `f32`) is [`ScoreError::NonFinite`], never a
//!   silent keep or drop.
//! * [`select_top`] keeps exactly `min(q_e, n_e)` pairs of each expert, and
//!   every kept score is `≥` every dropped score of the same expert; every
//!   rule of [`select`] keeps at most `min(q_e, n_e)` (the sampling rules
//!   may keep one fewer when rounding leaves `Σ π` just below `q`).
//! * The random rules draw from `(seed, id)` only: the same candidates give
//!   the same choice in any order, on every rank.
//! * **Tie rule:** among equal scores the pair with the smaller `id` wins. Pair
//!   ids are caller-chosen (for example `token · top_k + slot`); with ids
//!   unique per expert the kept set does not depend on the order in which
//!   pairs are given.
//!
//! ## Not here
//!
//! No quotas are decided here (see `quota`), no rows are moved (see `pack`),
//! and nothing touches a GPU (the CUDA twin lives in `kernels`).

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use half::bf16;
use rayon::prelude::*;

mod rules;
pub use rules::{uniform, Rule};

/// Errors of this crate. Every variant names the offending pair, expert or
/// shape so the caller can report it without re-deriving it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScoreError {
    /// A buffer's length does not match the declared shape.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which buffer.
        what: &'static str,
        /// Length implied by the shape.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A score (or the input it came from) is NaN or infinite.
    #[error("pair {pair}: score is not finite ({value})")]
    NonFinite {
        /// Position of the pair in the input.
        pair: usize,
        /// The offending value.
        value: f32,
    },
    /// A pair names an expert outside `0..n_experts`.
    #[error("pair {pair}: expert {expert} out of range (n_experts = {n_experts})")]
    ExpertOutOfRange {
        /// Position of the pair in the input.
        pair: usize,
        /// The expert it names.
        expert: u32,
        /// Number of experts (quotas given).
        n_experts: usize,
    },
}

/// Precision used to accumulate the two squared row norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accumulate {
    /// Sum squares in `f32` (fast; relative error ~1e-6 for d ≤ 8192).
    #[default]
    F32,
    /// Sum squares in `f64` (reference precision).
    F64,
}

/// Element types a score can be read from.
pub trait Element: Copy + Send + Sync {
    /// Widen to `f32` exactly (both `f32` and `bf16` convert losslessly).
    fn widen(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The rows one projection contributes to the scores of `n` pairs.
#[derive(Debug, Clone, Copy)]
pub struct PairRows<'a, T> {
    /// Saved projection inputs, row-major `n × d_in`.
    pub h: &'a [T],
    /// Output gradients (before the routing weight), row-major `n × d_out`.
    pub delta: &'a [T],
    /// Routing weights, length `n`.
    pub gate: &'a [f32],
    /// Width of `h` rows.
    pub d_in: usize,
    /// Width of `delta` rows.
    pub d_out: usize,
}

impl<T> PairRows<'_, T> {
    /// Number of pairs (rows).
    pub fn n_pairs(&self) -> usize {
        self.gate.len()
    }

    fn check(&self) -> Result<(), ScoreError> {
        let n = self.gate.len();
        check_len("h", n * self.d_in, self.h.len())?;
        check_len("delta", n * self.d_out, self.delta.len())
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), ScoreError> {
    if expected == got {
        Ok(())
    } else {
        Err(ScoreError::Shape {
            what,
            expected,
            got,
        })
    }
}

#[inline]
fn sq_norm_f32<T: Element>(row: &[T]) -> f32 {
    // Eight independent partial sums let the compiler vectorise the loop
    // without reassociation flags.
    let mut acc = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            let x = x.widen();
            *a += x * x;
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for &x in rest {
        let x = x.widen();
        s += x * x;
    }
    s
}

#[inline]
fn sq_norm_f64<T: Element>(row: &[T]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = row.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            let x = f64::from(x.widen());
            *a += x * x;
        }
    }
    let mut s = acc.iter().sum::<f64>();
    for &x in rest {
        let x = f64::from(x.widen());
        s += x * x;
    }
    s
}

/// Writes `out[i] = gate_i² · ‖delta_i‖² · ‖h_i‖²` for every pair `i`.
///
/// `out` has length `rows.n_pairs()`; the caller owns it so the hot path
/// allocates nothing. Errors on a shape mismatch or a non-finite score (the
/// first such pair in index order).
pub fn pair_scores<T: Element>(
    rows: PairRows<'_, T>,
    accumulate: Accumulate,
    out: &mut [f32],
) -> Result<(), ScoreError> {
    rows.check()?;
    check_len("out", rows.n_pairs(), out.len())?;
    if rows.n_pairs() == 0 {
        return Ok(());
    }
    // Rows are small (a few KiB); batch them so rayon's per-task overhead is
    // amortised over roughly 64 KiB of input.
    let row_bytes = (rows.d_in + rows.d_out).max(1) * std::mem::size_of::<T>();
    let batch = (65536 / row_bytes).clamp(1, 4096);
    out.par_chunks_mut(batch)
        .enumerate()
        .for_each(|(chunk_idx, out_chunk)| {
            let start = chunk_idx * batch;
            for (j, o) in out_chunk.iter_mut().enumerate() {
                let i = start + j;
                let h = &rows.h[i * rows.d_in..(i + 1) * rows.d_in];
                let d = &rows.delta[i * rows.d_out..(i + 1) * rows.d_out];
                let g = rows.gate[i];
                *o = match accumulate {
                    Accumulate::F32 => g * g * sq_norm_f32(d) * sq_norm_f32(h),
                    Accumulate::F64 => {
                        let g = f64::from(g);
                        (g * g * sq_norm_f64(d) * sq_norm_f64(h)) as f32
                    }
                };
            }
        });
    first_non_finite(out)
}

/// Returns an error naming the first non-finite value of `scores`.
pub fn first_non_finite(scores: &[f32]) -> Result<(), ScoreError> {
    match scores.iter().position(|s| !s.is_finite()) {
        None => Ok(()),
        Some(pair) => Err(ScoreError::NonFinite {
            pair,
            value: scores[pair],
        }),
    }
}

/// Pairs to choose among: parallel arrays, one entry per routed pair.
#[derive(Debug, Clone, Copy)]
pub struct Candidates<'a> {
    /// Expert of each pair, `< quotas.len()`.
    pub expert: &'a [u32],
    /// Caller-chosen id of each pair; smaller ids win ties. Must be unique
    /// within an expert for the result to be order-independent.
    pub id: &'a [u64],
    /// Score of each pair (finite, e.g. from [`pair_scores`]).
    pub score: &'a [f32],
}

/// `true` if pair `a` ranks before pair `b` (higher score, then smaller id).
#[inline]
fn ranks_before(score_a: f32, id_a: u64, score_b: f32, id_b: u64) -> bool {
    score_a > score_b || (score_a == score_b && id_a < id_b)
}

/// Keeps the `min(quotas[e], n_e)` best pairs of every expert `e`.
///
/// Writes `kept[i] = true` for kept pairs and `false` for dropped ones, and
/// returns the number kept per expert. Runs in expected `O(n)` time; experts
/// are processed in parallel.
pub fn select_top(
    candidates: Candidates<'_>,
    quotas: &[usize],
    kept: &mut [bool],
) -> Result<Vec<usize>, ScoreError> {
    let n = candidates.score.len();
    check_len("expert", n, candidates.expert.len())?;
    check_len("id", n, candidates.id.len())?;
    check_len("kept", n, kept.len())?;
    first_non_finite(candidates.score)?;
    let n_experts = quotas.len();

    // Counting sort of pair indices by expert: offsets, then fill.
    let mut offsets = vec![0usize; n_experts + 1];
    for (pair, &e) in candidates.expert.iter().enumerate() {
        let e_idx = e as usize;
        if e_idx >= n_experts {
            return Err(ScoreError::ExpertOutOfRange {
                pair,
                expert: e,
                n_experts,
            });
        }
        offsets[e_idx + 1] += 1;
    }
    for e in 0..n_experts {
        offsets[e + 1] += offsets[e];
    }
    let mut order = vec![0u32; n];
    let mut cursor = offsets.clone();
    for (pair, &e) in candidates.expert.iter().enumerate() {
        order[cursor[e as usize]] = pair as u32;
        cursor[e as usize] += 1;
    }

    // Partition `order` into per-expert slices and select in each.
    let mut slices: Vec<&mut [u32]> = Vec::with_capacity(n_experts);
    let mut rest = order.as_mut_slice();
    for e in 0..n_experts {
        let (head, tail) = rest.split_at_mut(offsets[e + 1] - offsets[e]);
        slices.push(head);
        rest = tail;
    }
    let score = candidates.score;
    let id = candidates.id;
    let kept_counts: Vec<usize> = slices
        .par_iter_mut()
        .zip(quotas.par_iter())
        .map(|(pairs, &q)| {
            let keep = q.min(pairs.len());
            if keep > 0 && keep < pairs.len() {
                pairs.select_nth_unstable_by(keep - 1, |&a, &b| {
                    let (a, b) = (a as usize, b as usize);
                    if ranks_before(score[a], id[a], score[b], id[b]) {
                        std::cmp::Ordering::Less
                    } else if ranks_before(score[b], id[b], score[a], id[a]) {
                        std::cmp::Ordering::Greater
                    } else {
                        // Equal score and id: fall back to position so the
                        // order is total and the result still deterministic.
                        a.cmp(&b)
                    }
                });
            }
            keep
        })
        .collect();

    kept.fill(false);
    for (e, pairs) in slices.iter().enumerate() {
        for &p in &pairs[..kept_counts[e]] {
            kept[p as usize] = true;
        }
    }
    Ok(kept_counts)
}

/// Keeps at most `min(quotas[e], n_e)` pairs of every expert `e` by
/// `rule` (see [`Rule`]; `seed` drives the random rules, the same seed and
/// candidates give the same choice in any order), writing `kept[i]` and
/// the kept pairs' weights `weight[i]` (0 for dropped pairs). Returns the
/// number kept per expert. [`Rule::TopQ`] is [`select_top`] with weight 1.
pub fn select(
    candidates: Candidates<'_>,
    quotas: &[usize],
    rule: Rule,
    seed: u64,
    kept: &mut [bool],
    weight: &mut [f32],
) -> Result<Vec<usize>, ScoreError> {
    check_len("weight", kept.len(), weight.len())?;
    if rule == Rule::TopQ {
        let counts = select_top(candidates, quotas, kept)?;
        for (w, &k) in weight.iter_mut().zip(kept.iter()) {
            *w = if k { 1.0 } else { 0.0 };
        }
        return Ok(counts);
    }
    let n = candidates.score.len();
    check_len("expert", n, candidates.expert.len())?;
    check_len("id", n, candidates.id.len())?;
    check_len("kept", n, kept.len())?;
    first_non_finite(candidates.score)?;
    if let Some(pair) = candidates.score.iter().position(|&s| s < 0.0) {
        return Err(ScoreError::NonFinite {
            pair,
            value: candidates.score[pair],
        });
    }
    let n_experts = quotas.len();
    let mut buckets: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
    for (pair, &e) in candidates.expert.iter().enumerate() {
        let bucket = buckets
            .get_mut(e as usize)
            .ok_or(ScoreError::ExpertOutOfRange {
                pair,
                expert: e,
                n_experts,
            })?;
        bucket.push(pair as u32);
    }
    let chosen: Vec<Vec<(u32, f32)>> = buckets
        .par_iter_mut()
        .zip(quotas.par_iter())
        .enumerate()
        .map(|(e, (idx, &q))| {
            let mut out = Vec::with_capacity(q.min(idx.len()));
            let seed_e = seed ^ (e as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            rules::choose(
                rule,
                seed_e,
                idx,
                candidates.score,
                candidates.id,
                q,
                &mut out,
            );
            out
        })
        .collect();
    kept.fill(false);
    weight.fill(0.0);
    for list in &chosen {
        for &(i, w) in list {
            kept[i as usize] = true;
            weight[i as usize] = w;
        }
    }
    Ok(chosen.iter().map(Vec::len).collect())
}

#[cfg(test)]
mod tests;
