//! The selection rules (documented on [`Rule`]).

/// Which pairs to keep within a quota: the selection rules.
///
/// Every rule takes an expert's candidates (score `s_i = g_i²‖δ_i‖²‖h_i‖²`,
/// a caller-chosen unique `id_i`) and its quota `q`, keeps at most
/// `min(q, n)` of them, and gives each kept pair a weight `w_i` that
/// multiplies its contribution `g_i δ_i` in the backward. Let
/// `a_i = √s_i = ‖g_i δ_i h_iᵀ‖_F`, the norm of the pair's contribution to
/// the down projection's weight gradient, and `u_i ∈ (0, 1]` a uniform
/// number drawn from `(seed, id_i)` alone (so every rank, given the same
/// candidates, makes the same choice in any order).
///
/// * [`Rule::TopQ`] — the paper's rule: the `q` largest `s_i` (ties to the
///   smaller id), `w_i = 1`. Deterministic; biased towards large
///   contributions (the dropped mass is lost).
/// * [`Rule::RandomQ`] — `q` pairs uniformly at random (the `q` smallest
///   `u_i`), `w_i = 1`: the baseline that ignores scores.
/// * [`Rule::Proportional`] — sampling proportional to the contribution's
///   norm (the variance-minimising choice for an unbiased estimate of the
///   gradient sum; Katharopoulos & Fleuret 2018, VCAS 2024): inclusion
///   probabilities `π_i = min(1, c·a_i)` with `c` set so `Σ π_i = q`
///   (capped pairs are always kept), then systematic sampling over the pairs
///   in `u_i` order (exactly `q` kept when `Σ π_i = q`), `w_i = 1/π_i`.
///   Unbiased: `E[Σ_kept w_i x_i] = Σ_i x_i` for any per-pair `x_i` with
///   `x_i = 0` where `a_i = 0`. If every `a_i` is 0, `π_i = q/n`.
/// * [`Rule::Priority`] — priority sampling (Duffield, Lund & Thorup 2007):
///   priorities `ρ_i = a_i / u_i`, keep the `q` largest, threshold `τ` =
///   the `(q+1)`-th largest priority, `w_i = max(a_i, τ) / a_i` (1 where
///   `a_i = 0`). Unbiased for sums like [`Rule::Proportional`], close to
///   top-q when scores are skewed.
///
/// With `q ≥ n` every rule keeps every pair with weight 1; with `q = 0`
/// none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Rule {
    /// The `q` highest scores, weight 1 (the paper's rule).
    #[default]
    TopQ,
    /// `q` pairs uniformly at random, weight 1.
    RandomQ,
    /// Systematic sampling with inclusion `∝ √score`, weight `1/π`.
    Proportional,
    /// Priority sampling on `√score`, threshold-corrected weights.
    Priority,
}

impl Rule {
    /// Every rule, in the order the study reports them.
    pub const ALL: [Rule; 4] = [
        Rule::TopQ,
        Rule::RandomQ,
        Rule::Proportional,
        Rule::Priority,
    ];

    /// The rule's name in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Rule::TopQ => "top_q",
            Rule::RandomQ => "random_q",
            Rule::Proportional => "proportional",
            Rule::Priority => "priority",
        }
    }

    /// The rule of a name (`top_q`, `random_q`, `proportional`, `priority`).
    pub fn from_name(s: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.name() == s)
    }
}

/// A uniform number in `(0, 1]` from `(seed, id)` (SplitMix64 finaliser).
pub fn uniform(seed: u64, id: u64) -> f64 {
    let mut z = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 11) + 1) as f64 / (1u64 << 53) as f64
}

/// One expert's choice among the candidates `idx` (indices into
/// `score`/`id`): pushes `(candidate, weight)` for each kept one.
pub(crate) fn choose(
    rule: Rule,
    seed: u64,
    idx: &mut [u32],
    score: &[f32],
    id: &[u64],
    q: usize,
    kept: &mut Vec<(u32, f32)>,
) {
    let n = idx.len();
    if q >= n {
        kept.extend(idx.iter().map(|&i| (i, 1.0)));
        return;
    }
    if q == 0 {
        return;
    }
    let norm = |i: u32| f64::from(score[i as usize]).sqrt();
    let u = |i: u32| uniform(seed, id[i as usize]);
    match rule {
        Rule::TopQ => {
            idx.select_nth_unstable_by(q - 1, |&a, &b| {
                let (sa, sb) = (score[a as usize], score[b as usize]);
                sb.total_cmp(&sa).then(id[a as usize].cmp(&id[b as usize]))
            });
            kept.extend(idx[..q].iter().map(|&i| (i, 1.0)));
        }
        Rule::RandomQ => {
            idx.select_nth_unstable_by(q - 1, |&a, &b| {
                u(a).total_cmp(&u(b))
                    .then(id[a as usize].cmp(&id[b as usize]))
            });
            kept.extend(idx[..q].iter().map(|&i| (i, 1.0)));
        }
        Rule::Priority => {
            // ρ = a / u, larger first; τ is the (q+1)-th largest.
            let rho = |i: u32| norm(i) / u(i);
            idx.select_nth_unstable_by(q, |&a, &b| {
                rho(b)
                    .total_cmp(&rho(a))
                    .then(id[a as usize].cmp(&id[b as usize]))
            });
            let tau = rho(idx[q]);
            kept.extend(idx[..q].iter().map(|&i| {
                let a = norm(i);
                let w = if a > 0.0 { a.max(tau) / a } else { 1.0 };
                (i, w as f32)
            }));
        }
        Rule::Proportional => {
            let pi = inclusion(idx, score, id, q);
            // Systematic sampling in u order: points start + j, j = 0..q.
            let mut order: Vec<(f64, u32, f64)> =
                idx.iter().zip(&pi).map(|(&i, &p)| (u(i), i, p)).collect();
            order.sort_by(|a, b| {
                a.0.total_cmp(&b.0)
                    .then(id[a.1 as usize].cmp(&id[b.1 as usize]))
            });
            let start = uniform(seed ^ 0x5bd1_e995, n as u64) - f64::EPSILON;
            let start = start.clamp(0.0, 1.0 - f64::EPSILON);
            let (mut cum, mut next, mut taken) = (0.0f64, start, 0usize);
            for &(_, i, p) in &order {
                let hi = cum + p;
                if taken < q && next < hi && p > 0.0 {
                    kept.push((i, (1.0 / p.min(1.0)) as f32));
                    taken += 1;
                    next += 1.0;
                }
                cum = hi;
            }
        }
    }
}

/// Inclusion probabilities `π_i = min(1, c·a_i)`, `Σ π_i = q` (`0 < q < n`).
/// Pairs are capped at 1 in decreasing `a` (ties to the smaller id); if the uncapped pairs all have `a = 0`, the rest of the
/// quota is spread evenly over them (their down-projection contribution is
/// zero, so any inclusion is unbiased).
fn inclusion(idx: &[u32], score: &[f32], id: &[u64], q: usize) -> Vec<f64> {
    let n = idx.len();
    let a: Vec<f64> = idx
        .iter()
        .map(|&i| f64::from(score[i as usize]).sqrt())
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    let key = |i: usize| id[idx[i] as usize];
    order.sort_by(|&i, &j| a[j].total_cmp(&a[i]).then(key(i).cmp(&key(j))));
    let mut pi = vec![0.0; n];
    // Summed in the sorted order, so the result does not depend on the
    // candidates' order.
    let mut rest: f64 = order.iter().map(|&i| a[i]).sum();
    let mut m = 0;
    while m < q && rest > 0.0 && rest.is_finite() {
        let c = (q - m) as f64 / rest;
        if c * a[order[m]] <= 1.0 {
            for &i in &order[m..] {
                pi[i] = c * a[i];
            }
            for &i in &order[..m] {
                pi[i] = 1.0;
            }
            return pi;
        }
        rest -= a[order[m]];
        m += 1;
    }
    for &i in &order[..m] {
        pi[i] = 1.0;
    }
    if n > m && q > m {
        let even = (q - m) as f64 / (n - m) as f64;
        for &i in &order[m..] {
            pi[i] = even;
        }
    }
    pi
}
