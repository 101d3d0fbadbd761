//! The CPU backend: element trait, GEMM and SwiGLU.

use crate::KernelError;

/// Floating-point element of the CPU backend (`f32` or `f64`).
pub trait Real:
    num_traits::Float
    + num_traits::FromPrimitive
    + bytemuck::Pod
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + 'static
    + private::Sealed
{
    /// Converts from `f64` (rounding for `f32`).
    fn of(x: f64) -> Self;
    /// Widens to `f64`.
    fn wide(self) -> f64;
}

impl Real for f32 {
    #[inline(always)]
    fn of(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        f64::from(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn of(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

/// An index `got` that must be below `bound`.
pub(crate) fn below(what: &'static str, bound: usize, got: usize) -> Result<(), KernelError> {
    if got < bound {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what,
            expected: bound,
            got,
        })
    }
}

pub(crate) fn check(what: &'static str, expected: usize, got: usize) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// `c (+)= op(a) · op(b)` with row-major storage: `op(a)` is `m × k`,
/// `op(b)` is `k × n`, `c` is `m × n`. With `accumulate` the product is added
/// to `c`; otherwise `c` is overwritten. `a` is stored `m × k` (`Op::N`) or
/// `k × m` (`Op::T`); likewise `b`.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Real>(
    c: &mut [T],
    a: &[T],
    op_a: Op,
    b: &[T],
    op_b: Op,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) -> Result<(), KernelError> {
    check("c", m * n, c.len())?;
    check("a", m * k, a.len())?;
    check("b", k * n, b.len())?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            c.fill(T::zero());
        }
        return Ok(());
    }
    let (a_rs, a_cs) = match op_a {
        Op::N => (k as isize, 1),
        Op::T => (1, m as isize),
    };
    let (b_rs, b_cs) = match op_b {
        Op::N => (n as isize, 1),
        Op::T => (1, k as isize),
    };
    let parallelism = if m * n * k >= 1 << 18 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths checked above make every (row, column) the strides
    // address lie inside its slice: c is m×n with (n, 1); a is m×k with
    // (k, 1) or stored k×m with (1, m); b is k×n with (n, 1) or stored n×k
    // with (1, k). `c` is exclusively borrowed and does not alias `a`/`b`.
    // T is f32 or f64 (sealed), both supported by `gemm`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// Naive triple-loop twin of [`matmul`], the reference in tests.
pub fn matmul_reference<T: Real>(
    c: &mut [T],
    a: &[T],
    op_a: Op,
    b: &[T],
    op_b: Op,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) -> Result<(), KernelError> {
    check("c", m * n, c.len())?;
    check("a", m * k, a.len())?;
    check("b", k * n, b.len())?;
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = match op_a {
                    Op::N => a[i * k + p],
                    Op::T => a[p * m + i],
                };
                let bv = match op_b {
                    Op::N => b[p * n + j],
                    Op::T => b[j * k + p],
                };
                s += av.wide() * bv.wide();
            }
            let prev = if accumulate { c[i * n + j].wide() } else { 0.0 };
            c[i * n + j] = T::of(prev + s);
        }
    }
    Ok(())
}

/// `silu(a) = a · σ(a)`.
#[inline]
pub fn silu<T: Real>(a: T) -> T {
    a / (T::one() + (-a).exp())
}

/// `d silu / d a = σ(a) · (1 + a · (1 − σ(a)))`.
#[inline]
pub fn silu_grad<T: Real>(a: T) -> T {
    let s = T::one() / (T::one() + (-a).exp());
    s * (T::one() + a * (T::one() - s))
}

/// `h = silu(a) ⊙ b`, element-wise over equal-length slices.
pub fn swiglu<T: Real>(a: &[T], b: &[T], h: &mut [T]) -> Result<(), KernelError> {
    check("b", a.len(), b.len())?;
    check("h", a.len(), h.len())?;
    for ((h, &a), &b) in h.iter_mut().zip(a).zip(b) {
        *h = silu(a) * b;
    }
    Ok(())
}

/// Backward of [`swiglu`]: from `dh`, writes `da = dh ⊙ b ⊙ silu'(a)` and
/// `db = dh ⊙ silu(a)`.
pub fn swiglu_backward<T: Real>(
    a: &[T],
    b: &[T],
    dh: &[T],
    da: &mut [T],
    db: &mut [T],
) -> Result<(), KernelError> {
    let n = a.len();
    check("b", n, b.len())?;
    check("dh", n, dh.len())?;
    check("da", n, da.len())?;
    check("db", n, db.len())?;
    for i in 0..n {
        da[i] = dh[i] * b[i] * silu_grad(a[i]);
        db[i] = dh[i] * silu(a[i]);
    }
    Ok(())
}

/// Marks a row [`unpack_rows_reference`] fills with zeros (defined in
/// [`crate::limits`], shared with the CUDA sources).
pub use crate::limits::DROPPED;

/// Widens bf16 bits to f32 exactly.
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// CPU twin of the `lrm_scores_bf16` kernel: `g² · ‖δ‖² · ‖h‖²` per row,
/// accumulated in f64. `h` is `n × d_in`, `delta` `n × d_out` (bf16 bits).
pub fn lrm_scores_reference(
    h: &[u16],
    delta: &[u16],
    gate: &[f32],
    d_in: usize,
    d_out: usize,
) -> Result<Vec<f32>, KernelError> {
    let n = gate.len();
    check("h", n * d_in, h.len())?;
    check("delta", n * d_out, delta.len())?;
    let sq = |row: &[u16]| {
        row.iter()
            .map(|&b| f64::from(bf16_bits_to_f32(b)).powi(2))
            .sum::<f64>()
    };
    Ok((0..n)
        .map(|i| {
            let g = f64::from(gate[i]);
            (g * g * sq(&delta[i * d_out..(i + 1) * d_out]) * sq(&h[i * d_in..(i + 1) * d_in]))
                as f32
        })
        .collect())
}

/// CPU twin of `gather_rows_u16`: `out[j] = src[idx[j]]`.
pub fn gather_rows_reference(
    src: &[u16],
    width: usize,
    idx: &[u32],
) -> Result<Vec<u16>, KernelError> {
    let rows = src.len().checked_div(width).unwrap_or(0);
    check("src", rows * width, src.len())?;
    let mut out = Vec::with_capacity(idx.len() * width);
    for &i in idx {
        let i = i as usize;
        if width > 0 {
            below("idx (row out of range)", rows, i)?;
        }
        out.extend_from_slice(&src[i * width..(i + 1) * width]);
    }
    Ok(out)
}

/// CPU twin of `gather_u8`: `out[j] = src[idx[j]]` on bytes.
pub fn gather_u8_reference(src: &[u8], idx: &[u32]) -> Result<Vec<u8>, KernelError> {
    idx.iter()
        .map(|&i| {
            src.get(i as usize).copied().ok_or(KernelError::Shape {
                what: "idx (byte out of range)",
                expected: src.len(),
                got: i as usize,
            })
        })
        .collect()
}

/// Checks that `runs` (`[dst, src, n]` triples, flattened) are non-empty,
/// ascending by `dst` and tile `0..len` exactly, and that no entry
/// `src + i·step` overflows `u32`.
pub fn check_runs(runs: &[u32], step: u32, len: usize) -> Result<(), KernelError> {
    let bad = |got| KernelError::Shape {
        what: "runs ([dst, src, n] triples tiling 0..len)",
        expected: len,
        got,
    };
    if runs.len() % 3 != 0 || len > i32::MAX as usize || (len > 0 && runs.is_empty()) {
        return Err(bad(runs.len()));
    }
    let mut at = 0usize;
    for r in runs.chunks_exact(3) {
        let (dst, src, n) = (r[0] as usize, u64::from(r[1]), u64::from(r[2]));
        if dst != at || n == 0 || src + (n - 1) * u64::from(step) > u64::from(u32::MAX) {
            return Err(bad(dst));
        }
        at += n as usize;
    }
    if at != len {
        return Err(bad(at));
    }
    Ok(())
}

/// CPU twin of `expand_runs`: entry `dst + i` of each run `[dst, src, n]`
/// is `src + i·step` (runs as [`check_runs`] demands).
pub fn expand_runs_reference(runs: &[u32], step: u32, len: usize) -> Result<Vec<u32>, KernelError> {
    check_runs(runs, step, len)?;
    let mut out = Vec::with_capacity(len);
    for r in runs.chunks_exact(3) {
        out.extend((0..r[2]).map(|i| r[1] + i * step));
    }
    Ok(out)
}

/// CPU twin of `key_counts` with flags (`Gpu::kept_counts`): `counts[b] = #{p : key[p] == b && keep[p] != 0}`
/// for `b < groups` (other keys are not counted).
pub fn kept_counts_reference(
    key: &[u32],
    keep: &[u8],
    groups: usize,
) -> Result<Vec<u32>, KernelError> {
    check("keep", key.len(), keep.len())?;
    let mut c = vec![0u32; groups];
    for (&k, &m) in key.iter().zip(keep) {
        if m != 0 && (k as usize) < groups {
            c[k as usize] += 1;
        }
    }
    Ok(c)
}

/// CPU twin of `unpack_rows_u16`: `out[i] = packed[inverse[i]]`, zeros for
/// [`DROPPED`].
pub fn unpack_rows_reference(
    packed: &[u16],
    width: usize,
    inverse: &[u32],
) -> Result<Vec<u16>, KernelError> {
    let rows = packed.len().checked_div(width).unwrap_or(0);
    check("packed", rows * width, packed.len())?;
    let mut out = vec![0u16; inverse.len() * width];
    for (i, &p) in inverse.iter().enumerate() {
        if p == DROPPED {
            continue;
        }
        let p = p as usize;
        if width > 0 && p >= rows {
            return Err(KernelError::Shape {
                what: "inverse (row out of range)",
                expected: rows,
                got: p,
            });
        }
        out[i * width..(i + 1) * width].copy_from_slice(&packed[p * width..(p + 1) * width]);
    }
    Ok(out)
}

/// Checks the inputs of a per-expert selection: one id per score, one
/// quota per group, and `offsets` a non-decreasing partition of the scores.
pub(crate) fn check_selection(
    scores: &[f32],
    ids: &[u32],
    offsets: &[u32],
    quotas: &[u32],
) -> Result<(), KernelError> {
    check("ids", scores.len(), ids.len())?;
    check("offsets", quotas.len() + 1, offsets.len())?;
    let end = offsets.last().copied().unwrap_or(0) as usize;
    if end != scores.len() || offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(KernelError::Shape {
            what: "offsets (not a partition of the pairs)",
            expected: scores.len(),
            got: end,
        });
    }
    Ok(())
}

/// CPU twin of `select_top_q`: within each expert's segment
/// `offsets[e]..offsets[e + 1]` keep the `min(quotas[e], n_e)` pairs of
/// highest score, ties to the smaller id, by a full sort (the naive way).
pub fn select_top_reference(
    scores: &[f32],
    ids: &[u32],
    offsets: &[u32],
    quotas: &[u32],
) -> Result<Vec<bool>, KernelError> {
    check_selection(scores, ids, offsets, quotas)?;
    let mut kept = vec![false; scores.len()];
    for (e, &q) in quotas.iter().enumerate() {
        let (lo, hi) = (offsets[e] as usize, offsets[e + 1] as usize);
        let mut idx: Vec<usize> = (lo..hi).collect();
        idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(ids[a].cmp(&ids[b])));
        for &i in idx.iter().take(q as usize) {
            kept[i] = true;
        }
    }
    Ok(kept)
}

/// f32 to bf16 bits, round to nearest even (as `__float2bfloat16_rn`).
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let u = x.to_bits();
    let round = ((u >> 16) & 1) + 0x7FFF;
    (u.wrapping_add(round) >> 16) as u16
}

/// `v` rounded to bf16 bits (round to nearest even, through `f32`).
pub fn to_bf16<T: Real>(v: &[T]) -> Vec<u16> {
    v.iter()
        .map(|x| f32_to_bf16_bits(x.to_f64().unwrap_or(f64::NAN) as f32))
        .collect()
}

/// bf16 bits widened to `T`.
pub fn from_bf16<T: Real>(v: &[u16]) -> Vec<T> {
    v.iter()
        .map(|&b| T::of(f64::from(bf16_bits_to_f32(b))))
        .collect()
}

/// CPU twin of `swiglu_fwd_bf16`.
pub fn swiglu_bf16_reference(a: &[u16], b: &[u16]) -> Result<Vec<u16>, KernelError> {
    check("b", a.len(), b.len())?;
    Ok(a.iter()
        .zip(b)
        .map(|(&x, &y)| f32_to_bf16_bits(silu(bf16_bits_to_f32(x)) * bf16_bits_to_f32(y)))
        .collect())
}

/// CPU twin of `swiglu_bwd_bf16`: `(da, db)`.
pub fn swiglu_backward_bf16_reference(
    a: &[u16],
    b: &[u16],
    dh: &[u16],
) -> Result<(Vec<u16>, Vec<u16>), KernelError> {
    check("b", a.len(), b.len())?;
    check("dh", a.len(), dh.len())?;
    let mut da = Vec::with_capacity(a.len());
    let mut db = Vec::with_capacity(a.len());
    for i in 0..a.len() {
        let (x, y, g) = (
            bf16_bits_to_f32(a[i]),
            bf16_bits_to_f32(b[i]),
            bf16_bits_to_f32(dh[i]),
        );
        da.push(f32_to_bf16_bits(g * y * silu_grad(x)));
        db.push(f32_to_bf16_bits(g * silu(x)));
    }
    Ok((da, db))
}

/// Checks a router's shapes (`1 ≤ k ≤ e`, logits a whole number of rows of
/// `e`) and returns the number of tokens.
pub(crate) fn check_router(logits_len: usize, e: usize, k: usize) -> Result<usize, KernelError> {
    if e == 0 || k == 0 || k > e {
        return Err(KernelError::Shape {
            what: "top_k (must be in 1..=experts)",
            expected: e,
            got: k,
        });
    }
    let t = logits_len / e;
    check("logits", t * e, logits_len)?;
    Ok(t)
}

/// CPU twin of `router_topk`: `(probs, idx, gates)` for `t × e` logits.
#[allow(clippy::type_complexity)]
pub fn router_topk_reference(
    logits: &[f32],
    sel_bias: Option<&[f32]>,
    e: usize,
    k: usize,
    renormalize: bool,
) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>), KernelError> {
    let t = check_router(logits.len(), e, k)?;
    if let Some(b) = sel_bias {
        check("selection bias (one per expert)", e, b.len())?;
    }
    let mut probs = vec![0f32; t * e];
    let mut idx = vec![0u32; t * k];
    let mut gates = vec![0f32; t * k];
    for r in 0..t {
        let l = &logits[r * e..(r + 1) * e];
        let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let s: f32 = l.iter().map(|&v| (v - m).exp()).sum();
        let p = &mut probs[r * e..(r + 1) * e];
        for (pi, &v) in p.iter_mut().zip(l) {
            *pi = (v - m).exp() / s;
        }
        // The choice reads `p + bias` (the same f32 add as the kernel); the
        // gates stay the unbiased probabilities.
        // A NaN key ranks as -inf (the kernel's rule: k valid experts for
        // every row; a NaN row's gates stay NaN).
        let key = |i: u32| {
            let v = match sel_bias {
                Some(b) => p[i as usize] + b[i as usize],
                None => p[i as usize],
            };
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                v
            }
        };
        let mut order: Vec<u32> = (0..e as u32).collect();
        order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        let total: f32 = order[..k].iter().map(|&i| p[i as usize]).sum();
        for j in 0..k {
            idx[r * k + j] = order[j];
            let g = p[order[j] as usize];
            gates[r * k + j] = if renormalize { g / total } else { g };
        }
    }
    Ok((probs, idx, gates))
}

/// Checks a combine's shapes (`gates` and `row` hold `t · k` entries, `o`
/// whole rows of `h`, every row index in range or [`DROPPED`], a `base` of
/// `t × h` when given) and returns `t`.
pub(crate) fn check_combine(
    base: Option<&[u16]>,
    o: &[u16],
    h: usize,
    row: &[u32],
    gates: &[f32],
    k: usize,
) -> Result<usize, KernelError> {
    check("gates", row.len(), gates.len())?;
    let t = row.len().checked_div(k).unwrap_or(0);
    check("row", t * k, row.len())?;
    let rows = o.len().checked_div(h).unwrap_or(0);
    check("o", rows * h, o.len())?;
    if let Some(&bad) = row.iter().find(|&&r| r != DROPPED && r as usize >= rows) {
        return Err(KernelError::Shape {
            what: "row (out of range)",
            expected: rows,
            got: bad as usize,
        });
    }
    if let Some(b) = base {
        check("base", t * h, b.len())?;
    }
    Ok(t)
}

/// `u ∈ (0, 1]` from `(seed, id)`: the device's `uniform01` is the host
/// rule's draw, [`lrm_score::uniform`].
pub fn uniform01_reference(seed: u64, id: u64) -> f64 {
    lrm_score::uniform(seed, id)
}

/// CPU twin of `priority_keys`: `ρ_i = √score_i / u(seed, id_i)` in f64,
/// rounded to f32.
pub fn priority_keys_reference(score: &[f32], id: &[u32], seed: u64) -> Vec<f32> {
    score
        .iter()
        .zip(id)
        .map(|(&s, &i)| (f64::from(s).sqrt() / uniform01_reference(seed, u64::from(i))) as f32)
        .collect()
}

/// CPU twin of `priority_weights`: per expert segment of `offsets`,
/// `τ` = the key of the row kept at `q + 1` but not at `q` (0 if none);
/// kept rows get `max(a, τ) / a` with `a = √score` (1 where `a = 0`),
/// dropped rows 0.
pub fn priority_weights_reference(
    rho: &[f32],
    score: &[f32],
    kept_q: &[u8],
    kept_q1: &[u8],
    offsets: &[u32],
) -> Vec<f32> {
    let mut w = vec![0f32; rho.len()];
    for seg in offsets.windows(2) {
        let (lo, hi) = (seg[0] as usize, seg[1] as usize);
        let tau = (lo..hi)
            .find(|&i| kept_q1[i] != 0 && kept_q[i] == 0)
            .map_or(0.0, |i| f64::from(rho[i]));
        for i in lo..hi {
            let a = f64::from(score[i]).sqrt();
            w[i] = if kept_q[i] == 0 {
                0.0
            } else if a > 0.0 {
                (a.max(tau) / a) as f32
            } else {
                1.0
            };
        }
    }
    w
}

/// Column sums of a row-major `g × n` bf16 matrix in f32, rows added in
/// order (twin of `Gpu::col_sum_bf16`).
pub fn col_sum_bf16_reference(x: &[u16], g: usize, n: usize) -> Result<Vec<f32>, KernelError> {
    if x.len() != g * n {
        return Err(KernelError::Shape {
            what: "matrix (g × n)",
            expected: g * n,
            got: x.len(),
        });
    }
    let mut out = vec![0f32; n];
    for row in x.chunks_exact(n.max(1)).take(g) {
        for (o, &b) in out.iter_mut().zip(row) {
            *o += bf16_bits_to_f32(b);
        }
    }
    Ok(out)
}

/// CPU twin of `bf16_to_f32_bias` ([`crate::gpu::Gpu::logits_bias_f32`]):
/// bf16 logits of `bias.len()` columns plus a per-column bias, f32.
pub fn logits_bias_reference(logits: &[u16], bias: &[f32]) -> Vec<f32> {
    let cols = bias.len().max(1);
    logits
        .iter()
        .enumerate()
        .map(|(i, &b)| bf16_bits_to_f32(b) + bias.get(i % cols).copied().unwrap_or(0.0))
        .collect()
}

/// CPU twin of `combine_bf16`: `y[t] = Σ_j gates[t, j] · o[row[t, j]]`.
pub fn combine_bf16_reference(
    o: &[u16],
    h: usize,
    row: &[u32],
    gates: &[f32],
    k: usize,
) -> Result<Vec<u16>, KernelError> {
    combine_onto_bf16_reference(None, o, h, row, gates, k)
}

/// CPU twin of `combine_bf16` with a base: `y[t] = base[t] + Σ_j gates[t,
/// j] · o[row[t, j]]`, summed in f32 from `base` and rounded once.
pub fn combine_onto_bf16_reference(
    base: Option<&[u16]>,
    o: &[u16],
    h: usize,
    row: &[u32],
    gates: &[f32],
    k: usize,
) -> Result<Vec<u16>, KernelError> {
    let t = check_combine(base, o, h, row, gates, k)?;
    let mut y = Vec::with_capacity(t * h);
    for r in 0..t {
        for c in 0..h {
            let mut acc = base.map_or(0f32, |b| bf16_bits_to_f32(b[r * h + c]));
            for j in 0..k {
                let src = row[r * k + j];
                if src != DROPPED {
                    acc = gates[r * k + j].mul_add(bf16_bits_to_f32(o[src as usize * h + c]), acc);
                }
            }
            y.push(f32_to_bf16_bits(acc));
        }
    }
    Ok(y)
}

/// The three products of the MoE expert GEMMs (see `kernels/lib/grouped_gemm.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmVariant {
    /// `D[rows, f] = A[rows, h] · B[e]`, `B`: `E × h × f`.
    Forward,
    /// `D[rows, h] = A[rows, f] · B[e]ᵀ`, `B`: `E × h × f`.
    DataGrad,
    /// `D[e] (h × f) = A[rows_e, h]ᵀ · B[rows_e, f]`.
    WeightGrad,
}

/// CPU twin of the grouped GEMM: bf16 inputs, f32 accumulation, f32 out.
/// `offsets` (`E + 1` entries) splits the routed rows into groups.
pub fn grouped_gemm_reference(
    variant: GemmVariant,
    offsets: &[i32],
    a: &[u16],
    b: &[u16],
    h: usize,
    f: usize,
) -> Result<Vec<f32>, KernelError> {
    let e = offsets.len().saturating_sub(1);
    let rows = offsets.last().copied().unwrap_or(0).max(0) as usize;
    let bf = |x: u16| f64::from(bf16_bits_to_f32(x));
    let range = |g: usize| offsets[g] as usize..offsets[g + 1] as usize;
    match variant {
        GemmVariant::Forward | GemmVariant::DataGrad => {
            let (k, n) = if variant == GemmVariant::Forward {
                (h, f)
            } else {
                (f, h)
            };
            check("a", rows * k, a.len())?;
            check("b", e * h * f, b.len())?;
            let mut d = vec![0f32; rows * n];
            for g in 0..e {
                let w = &b[g * h * f..(g + 1) * h * f];
                for r in range(g) {
                    for j in 0..n {
                        let s: f64 = (0..k)
                            .map(|p| {
                                let wv = if variant == GemmVariant::Forward {
                                    w[p * f + j]
                                } else {
                                    w[j * f + p]
                                };
                                bf(a[r * k + p]) * bf(wv)
                            })
                            .sum();
                        d[r * n + j] = s as f32;
                    }
                }
            }
            Ok(d)
        }
        GemmVariant::WeightGrad => {
            check("a", rows * h, a.len())?;
            check("b", rows * f, b.len())?;
            let mut d = vec![0f32; e * h * f];
            for g in 0..e {
                for i in 0..h {
                    for j in 0..f {
                        let s: f64 = range(g).map(|r| bf(a[r * h + i]) * bf(b[r * f + j])).sum();
                        d[g * h * f + i * f + j] = s as f32;
                    }
                }
            }
            Ok(d)
        }
    }
}

/// `n` pseudo-random bf16 values in `[-1, 1]` (xorshift from `seed`): the
/// benchmarks' and device tests' data.
pub fn random_bf16(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s % 20001) as f32 / 10000.0 - 1.0;
            (x.to_bits() >> 16) as u16
        })
        .collect()
}

/// bf16 bits times `1/√fan_in` (benchmark weights of a sensible size).
pub fn fan_in_scaled(v: Vec<u16>, fan_in: usize) -> Vec<u16> {
    let k = 1.0 / (fan_in as f32).sqrt();
    v.into_iter()
        .map(|b| ((f32::from_bits(u32::from(b) << 16) * k).to_bits() >> 16) as u16)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 20001) as f64 / 10000.0 - 1.0
            })
            .collect()
    }

    /// GEMM against its naive twin, every transpose, fresh inputs, poisoned
    /// outputs, including zero-size dimensions and the parallel path.
    #[test]
    fn router_topk_picks_valid_experts_for_nan_rows() {
        let (e, k) = (5, 3);
        let mut logits = vec![0.5f32, 2.0, -1.0, 1.0, 0.0, 1.0, f32::NAN, 0.0, 0.0, 0.0];
        logits.extend([f32::NAN; 5]);
        let (_, idx, gates) = router_topk_reference(&logits, None, e, k, true).unwrap();
        assert_eq!(&idx[..3], &[1, 3, 0]);
        // A NaN row ranks nothing above anything: experts 0..k, NaN gates.
        assert_eq!(&idx[3..6], &[0, 1, 2]);
        assert_eq!(&idx[6..], &[0, 1, 2]);
        assert!(gates[3..].iter().all(|g| g.is_nan()));
        // A bias below −1 still ranks (last).
        let bias = [-3.0f32, 0.0, -3.0, 0.0, 0.0];
        let (_, idx, _) = router_topk_reference(&logits[..5], Some(&bias), e, k, true).unwrap();
        assert_eq!(idx, vec![1, 3, 4]);
    }

    #[test]
    fn combine_onto_a_base_adds_it_once() {
        let bits = |v: &[f32]| v.iter().map(|&x| f32_to_bf16_bits(x)).collect::<Vec<_>>();
        let o = bits(&[1.0, 2.0, 3.0, 4.0]);
        let base = bits(&[0.5, -1.0]);
        // Token 0: rows 1 and dropped; h = 2.
        let row = [1, DROPPED];
        let gates = [2.0, 9.0];
        let plain = combine_bf16_reference(&o, 2, &row, &gates, 2).unwrap();
        assert_eq!(plain, bits(&[6.0, 8.0]));
        let onto = combine_onto_bf16_reference(Some(&base), &o, 2, &row, &gates, 2).unwrap();
        assert_eq!(onto, bits(&[6.5, 7.0]));
        let only = combine_onto_bf16_reference(Some(&base), &o, 2, &[DROPPED; 2], &gates, 2);
        assert_eq!(only.unwrap(), base);
        assert!(combine_onto_bf16_reference(Some(&base[..1]), &o, 2, &row, &gates, 2).is_err());
    }

    #[test]
    fn runs_expand_and_bad_runs_are_refused() {
        assert_eq!(
            expand_runs_reference(&[0, 7, 2, 2, 0, 3], 1, 5).unwrap(),
            vec![7, 8, 0, 1, 2]
        );
        assert_eq!(
            expand_runs_reference(&[0, 4, 2, 2, 9, 1], 0, 3).unwrap(),
            vec![4, 4, 9]
        );
        assert!(expand_runs_reference(&[], 1, 0).unwrap().is_empty());
        for (runs, len) in [
            (&[0u32, 0, 2][..], 3usize),
            (&[0, 0, 2, 3, 0, 1][..], 4),
            (&[0, 0, 0][..], 0),
            (&[1, 0, 2][..], 2),
            (&[0, u32::MAX, 2][..], 2),
            (&[0, 0][..], 2),
        ] {
            assert!(expand_runs_reference(runs, 1, len).is_err(), "{runs:?}");
        }
    }

    #[test]
    fn matmul_matches_reference() {
        let shapes = [
            (0, 3, 4),
            (3, 0, 4),
            (3, 4, 0),
            (1, 1, 1),
            (5, 7, 3),
            (17, 33, 9),
            (70, 80, 90),
        ];
        for (si, &(m, k, n)) in shapes.iter().enumerate() {
            for (oi, (op_a, op_b)) in [
                (Op::N, Op::N),
                (Op::T, Op::N),
                (Op::N, Op::T),
                (Op::T, Op::T),
            ]
            .into_iter()
            .enumerate()
            {
                for accumulate in [false, true] {
                    let seed = (si * 8 + oi * 2 + usize::from(accumulate)) as u64;
                    let a = rand_vec(m * k, seed);
                    let b = rand_vec(k * n, seed + 100);
                    let init = rand_vec(m * n, seed + 200);
                    let mut want = init.clone();
                    matmul_reference(&mut want, &a, op_a, &b, op_b, (m, k, n), accumulate).unwrap();
                    let mut got = if accumulate {
                        init.clone()
                    } else {
                        vec![f64::NAN; m * n]
                    };
                    matmul(&mut got, &a, op_a, &b, op_b, (m, k, n), accumulate).unwrap();
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                            "{m}x{k}x{n} {op_a:?}{op_b:?}"
                        );
                    }
                    // f32 path: relative Frobenius error ≤ 1e-5.
                    let a32: Vec<f32> = a.iter().map(|&x| x as f32).collect();
                    let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
                    let mut got32: Vec<f32> = if accumulate {
                        init.iter().map(|&x| x as f32).collect()
                    } else {
                        vec![f32::NAN; m * n]
                    };
                    matmul(&mut got32, &a32, op_a, &b32, op_b, (m, k, n), accumulate).unwrap();
                    let err: f64 = got32
                        .iter()
                        .zip(&want)
                        .map(|(g, w)| (f64::from(*g) - w).powi(2))
                        .sum();
                    let norm: f64 = want.iter().map(|w| w * w).sum();
                    assert!(
                        err.sqrt() <= 1e-5 * norm.sqrt().max(1e-30),
                        "f32 {m}x{k}x{n}"
                    );
                }
            }
        }
    }

    #[test]
    fn shape_errors_are_values() {
        let mut c = [0.0f32; 4];
        let err = matmul(&mut c, &[1.0; 3], Op::N, &[1.0; 4], Op::N, (2, 2, 2), false).unwrap_err();
        assert_eq!(
            err,
            KernelError::Shape {
                what: "a",
                expected: 4,
                got: 3
            }
        );
    }

    #[test]
    fn swiglu_gradient_matches_finite_differences() {
        for &a in &[-3.0f64, -0.5, 0.0, 0.7, 2.5] {
            let eps = 1e-6;
            let fd = (silu(a + eps) - silu(a - eps)) / (2.0 * eps);
            assert!((fd - silu_grad(a)).abs() < 1e-8, "a = {a}");
        }
    }
}
