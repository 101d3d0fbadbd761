//! CPU twins of the dense transformer kernels (`kernels/dense.cu`): the
//! device-resident model's embedding, RMSNorm, head layout with RoPE,
//! causal softmax, fused cross-entropy, gradient norms and AdamW. Each
//! computes what its kernel computes, in f32 (f64 where the kernel sums
//! with atomics, whose order is not fixed), rounding to bf16 where the
//! kernel writes bf16; the device tests compare against them.
//!
//! Layouts: the residual stream `[tokens, d]` f32; projections token-major
//! `[n_seq · seq, heads · dh]` bf16; attention operands head-major
//! `[n_seq, heads, seq, dh]` bf16; scores and probabilities `[rows, seq]`
//! bf16 where row `r` is the query at position `r % seq`.

use crate::cpu::{below, bf16_bits_to_f32, check, f32_to_bf16_bits as to_bf16_bits};
use crate::KernelError;

/// `x[i] = table[tok[i]]` (rows of `d`).
pub fn embed_reference(table: &[f32], tok: &[u32], d: usize) -> Result<Vec<f32>, KernelError> {
    let vocab = table.len() / d.max(1);
    let mut x = Vec::with_capacity(tok.len() * d);
    for &t in tok {
        let t = t as usize;
        below("token (below the vocabulary)", vocab, t)?;
        x.extend_from_slice(&table[t * d..(t + 1) * d]);
    }
    Ok(x)
}

/// `dtable[tok[i]] += dx[i]`, summed in f64.
pub fn embed_backward_reference(
    dx: &[f32],
    tok: &[u32],
    dtable: &[f32],
    d: usize,
) -> Result<Vec<f32>, KernelError> {
    check("dx", tok.len() * d, dx.len())?;
    let mut acc: Vec<f64> = dtable.iter().map(|&v| f64::from(v)).collect();
    for (row, &t) in dx.chunks_exact(d.max(1)).zip(tok) {
        let t = t as usize;
        for (a, &v) in acc[t * d..(t + 1) * d].iter_mut().zip(row) {
            *a += f64::from(v);
        }
    }
    Ok(acc.into_iter().map(|v| v as f32).collect())
}

/// RMSNorm of rows of `w.len()`: `y = bf16(x · inv · w)`, `inv = 1 /
/// sqrt(mean(x²) + eps)` per row.
pub fn rmsnorm_reference(x: &[f32], w: &[f32], eps: f32) -> (Vec<u16>, Vec<f32>) {
    let d = w.len().max(1);
    let mut y = Vec::with_capacity(x.len());
    let mut inv = Vec::with_capacity(x.len() / d);
    for row in x.chunks_exact(d) {
        // The sum in f64: an f32 running sum over a wide row (12 288) is
        // itself off by more than the kernels' blocked sums.
        let s = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>() as f32;
        let iv = 1.0 / (s / d as f32 + eps).sqrt();
        y.extend(row.iter().zip(w).map(|(&v, &g)| to_bf16_bits(v * iv * g)));
        inv.push(iv);
    }
    (y, inv)
}

/// Backward of [`rmsnorm_reference`] for `dy` (bf16): returns `dx` (f32,
/// not rounded) and `dw` (summed over rows, f64 then f32).
pub fn rmsnorm_backward_reference(
    x: &[f32],
    w: &[f32],
    inv: &[f32],
    dy: &[u16],
) -> (Vec<f32>, Vec<f32>) {
    let d = w.len().max(1);
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = vec![0f64; w.len()];
    for ((xr, gr), &iv) in x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(inv) {
        let g: Vec<f32> = gr.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        let dot: f32 = g.iter().zip(w).zip(xr).map(|((a, b), c)| a * b * c).sum();
        let c = dot * iv * iv * iv / d as f32;
        for i in 0..d {
            dx.push(g[i] * w[i] * iv - xr[i] * c);
            dw[i] += f64::from(g[i] * xr[i] * iv);
        }
    }
    (dx, dw.into_iter().map(|v| v as f32).collect())
}

/// Token-major `[n_seq · seq, heads · dh]` → head-major `[n_seq, heads,
/// seq, dh]` rotating by RoPE (base `theta`; 0: no rotation) when
/// `to_heads`; head-major → token-major rotating by the negative angle
/// otherwise.
pub fn heads_reference(
    src: &[u16],
    (n_seq, seq, heads, dh): (usize, usize, usize, usize),
    theta: f32,
    to_heads: bool,
) -> Result<Vec<u16>, KernelError> {
    check("rows", n_seq * seq * heads * dh, src.len())?;
    if dh % 2 != 0 {
        return Err(KernelError::Shape {
            what: "head_dim (even)",
            expected: dh + 1,
            got: dh,
        });
    }
    let half = dh / 2;
    let mut dst = vec![0u16; src.len()];
    for b in 0..n_seq {
        for pos in 0..seq {
            for h in 0..heads {
                let tix = ((b * seq + pos) * heads + h) * dh;
                let hix = ((b * heads + h) * seq + pos) * dh;
                let (si, di) = if to_heads { (tix, hix) } else { (hix, tix) };
                for j in 0..half {
                    let (mut x1, mut x2) = (
                        bf16_bits_to_f32(src[si + j]),
                        bf16_bits_to_f32(src[si + j + half]),
                    );
                    if theta > 0.0 {
                        let freq = theta.powf(-2.0 * j as f32 / dh as f32);
                        let (mut s, c) = (pos as f32 * freq).sin_cos();
                        if !to_heads {
                            s = -s;
                        }
                        (x1, x2) = (x1 * c - x2 * s, x2 * c + x1 * s);
                    }
                    dst[di + j] = to_bf16_bits(x1);
                    dst[di + j + half] = to_bf16_bits(x2);
                }
            }
        }
    }
    Ok(dst)
}

/// Causal softmax of bf16 score rows of `seq` (row `r` at position `r %
/// seq`), scaled by `scale`; entries after the position are 0.
pub fn softmax_causal_reference(s: &[u16], seq: usize, scale: f32) -> Vec<u16> {
    let mut p = vec![0u16; s.len()];
    for (r, (sr, pr)) in s.chunks_exact(seq).zip(p.chunks_exact_mut(seq)).enumerate() {
        let pos = r % seq;
        let v: Vec<f32> = sr[..=pos]
            .iter()
            .map(|&b| scale * bf16_bits_to_f32(b))
            .collect();
        let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = v.iter().map(|x| (x - m).exp()).sum();
        for (o, x) in pr.iter_mut().zip(&v) {
            *o = to_bf16_bits((x - m).exp() / sum);
        }
    }
    p
}

/// `ds = scale · p ⊙ (dp − Σ p·dp)` per row, bf16.
pub fn softmax_causal_backward_reference(
    p: &[u16],
    dp: &[u16],
    seq: usize,
    scale: f32,
) -> Vec<u16> {
    let mut ds = vec![0u16; p.len()];
    for (r, ((pr, gr), dr)) in p
        .chunks_exact(seq)
        .zip(dp.chunks_exact(seq))
        .zip(ds.chunks_exact_mut(seq))
        .enumerate()
    {
        let pos = r % seq;
        let f = |b: u16| bf16_bits_to_f32(b);
        let dot: f32 = (0..=pos).map(|j| f(pr[j]) * f(gr[j])).sum();
        for j in 0..=pos {
            dr[j] = to_bf16_bits(scale * f(pr[j]) * (f(gr[j]) - dot));
        }
    }
    ds
}

/// Head-major attention dimensions `(n_seq, seq, heads, kv_heads, head_dim)`.
pub type AttnDims = (usize, usize, usize, usize, usize);

fn check_attn(
    (n_seq, seq, heads, kv, dh): AttnDims,
    q: &[u16],
    k: &[u16],
    v: &[u16],
) -> Result<(), KernelError> {
    if kv == 0 || heads % kv != 0 {
        return Err(KernelError::Shape {
            what: "kv_heads (a divisor of heads)",
            expected: heads,
            got: kv,
        });
    }
    check("q", n_seq * heads * seq * dh, q.len())?;
    check("k", n_seq * kv * seq * dh, k.len())?;
    check("v", n_seq * kv * seq * dh, v.len())
}

/// The causal probabilities of one query row `i` of head `(b, hq)` against
/// its key/value head: `p_j = exp(scale·q_i·k_j − lse)` for `j ≤ i`, and lse.
fn attn_row(
    (_, seq, heads, kv, dh): AttnDims,
    q: &[f64],
    k: &[f64],
    (b, hq, i): (usize, usize, usize),
    scale: f64,
) -> (Vec<f64>, f64) {
    let hk = hq / (heads / kv);
    let qr = &q[((b * heads + hq) * seq + i) * dh..][..dh];
    let kb = &k[(b * kv + hk) * seq * dh..];
    let s: Vec<f64> = (0..=i)
        .map(|j| {
            scale
                * qr.iter()
                    .zip(&kb[j * dh..(j + 1) * dh])
                    .map(|(a, c)| a * c)
                    .sum::<f64>()
        })
        .collect();
    let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    (s.iter().map(|x| (x - lse).exp()).collect(), lse)
}

fn widen(x: &[u16]) -> Vec<f64> {
    x.iter().map(|&b| f64::from(bf16_bits_to_f32(b))).collect()
}

/// Causal grouped-query attention in f64 (scale `1/√head_dim`): the
/// output and each row's natural-log normaliser.
fn attention_f64(dims: AttnDims, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (n_seq, seq, heads, kv, dh) = dims;
    let scale = 1.0 / (dh as f64).sqrt();
    let mut o = vec![0f64; n_seq * heads * seq * dh];
    let mut lse = vec![0f64; n_seq * heads * seq];
    for b in 0..n_seq {
        for hq in 0..heads {
            let vb = &v[(b * kv + hq / (heads / kv)) * seq * dh..];
            for i in 0..seq {
                let (p, l) = attn_row(dims, q, k, (b, hq, i), scale);
                let row = (b * heads + hq) * seq + i;
                for (c, out) in o[row * dh..(row + 1) * dh].iter_mut().enumerate() {
                    *out = p
                        .iter()
                        .enumerate()
                        .map(|(j, pj)| pj * vb[j * dh + c])
                        .sum();
                }
                lse[row] = l;
            }
        }
    }
    (o, lse)
}

/// The backward of [`attention_f64`] from the output's gradient.
#[allow(clippy::type_complexity)]
fn attention_backward_f64(
    dims: AttnDims,
    (q, k, v): (&[f64], &[f64], &[f64]),
    g: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (n_seq, seq, heads, kv, dh) = dims;
    let scale = 1.0 / (dh as f64).sqrt();
    let (mut dq, mut dk, mut dv) = (
        vec![0f64; q.len()],
        vec![0f64; k.len()],
        vec![0f64; v.len()],
    );
    for b in 0..n_seq {
        for hq in 0..heads {
            let kvh = (b * kv + hq / (heads / kv)) * seq * dh;
            for i in 0..seq {
                let (p, _) = attn_row(dims, q, k, (b, hq, i), scale);
                let row = ((b * heads + hq) * seq + i) * dh;
                let gr = &g[row..row + dh];
                let dp: Vec<f64> = (0..=i)
                    .map(|j| {
                        gr.iter()
                            .zip(&v[kvh + j * dh..][..dh])
                            .map(|(a, c)| a * c)
                            .sum()
                    })
                    .collect();
                let d: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - d) * scale;
                    for c in 0..dh {
                        dv[kvh + j * dh + c] += p[j] * gr[c];
                        dq[row + c] += ds * k[kvh + j * dh + c];
                        dk[kvh + j * dh + c] += ds * q[row + c];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

fn narrow(x: Vec<f64>) -> Vec<f32> {
    x.into_iter().map(|v| v as f32).collect()
}

/// Twin of the fused attention forward (`flash_fwd_*`): causal
/// grouped-query attention on head-major bf16 `q`, `k`, `v` with scale
/// `1/√head_dim`, exact in f64. Returns the output (head-major, f32) and
/// each row's `log2 Σ_j exp(scale·q·k_j)` (the kernel's `lse2`). The
/// kernel rounds the probabilities to bf16 for its `P·V` product.
pub fn flash_attention_reference(
    dims: AttnDims,
    q: &[u16],
    k: &[u16],
    v: &[u16],
) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
    check_attn(dims, q, k, v)?;
    let (o, lse) = attention_f64(dims, &widen(q), &widen(k), &widen(v));
    Ok((
        narrow(o),
        lse.into_iter()
            .map(|l| (l / std::f64::consts::LN_2) as f32)
            .collect(),
    ))
}

/// Twin of the fused attention backward (`flash_bwd_dot`, `flash_bwd_kv_*`,
/// `flash_bwd_q_*`): the gradients of head-major `q`, `k`, `v` from the
/// output's gradient `dout` (head-major bf16), exact in f64 (`D = Σ p·dP`
/// from the exact probabilities; the kernels take `D = dO·O` with the
/// forward's bf16 output and round `P` and `dS` to bf16 for their products).
#[allow(clippy::type_complexity)]
pub fn flash_attention_backward_reference(
    dims: AttnDims,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    dout: &[u16],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>), KernelError> {
    check_attn(dims, q, k, v)?;
    let (n_seq, seq, heads, _, dh) = dims;
    check("dout", n_seq * heads * seq * dh, dout.len())?;
    let (dq, dk, dv) =
        attention_backward_f64(dims, (&widen(q), &widen(k), &widen(v)), &widen(dout));
    Ok((narrow(dq), narrow(dk), narrow(dv)))
}

/// Fused cross-entropy of bf16 logits rows of `v`: the summed loss (f64)
/// and `dlogits = bf16((softmax − onehot) · inv_n)`.
pub fn cross_entropy_reference(
    logits: &[u16],
    target: &[u32],
    v: usize,
    inv_n: f32,
) -> Result<(f64, Vec<u16>), KernelError> {
    check("logits", target.len() * v, logits.len())?;
    let mut loss = 0f64;
    let mut d = vec![0u16; logits.len()];
    for ((lr, dr), &t) in logits
        .chunks_exact(v)
        .zip(d.chunks_exact_mut(v))
        .zip(target)
    {
        let t = t as usize;
        below("target (below the vocabulary)", v, t)?;
        let x: Vec<f32> = lr.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let s: f32 = x.iter().map(|&a| (a - m).exp()).sum();
        loss += f64::from(s.ln() + m - x[t]);
        for (j, (o, &a)) in dr.iter_mut().zip(&x).enumerate() {
            let pj = (a - m).exp() / s;
            *o = to_bf16_bits((pj - if j == t { 1.0 } else { 0.0 }) * inv_n);
        }
    }
    Ok((loss, d))
}

/// AdamW hyper-parameters of one update ([`adamw_reference`] and the
/// device kernel): bias corrections `1 − β^t` precomputed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHp {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Numerical floor.
    pub eps: f32,
    /// Decoupled weight decay of this tensor (0 for gains, embeddings).
    pub weight_decay: f32,
    /// `1 − β1^t`.
    pub bc1: f32,
    /// `1 − β2^t`.
    pub bc2: f32,
    /// Global-norm clip (0: off).
    pub clip: f32,
}

/// One AdamW update of `p`, `m`, `v` with gradient `g` (f32), clipped by
/// `hp.clip / sqrt(norm_sq)` when the norm exceeds the clip; returns the
/// bf16 copy of the new `p`.
pub fn adamw_reference(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    hp: &AdamHp,
    norm_sq: f32,
) -> Vec<u16> {
    let norm = norm_sq.sqrt();
    let scale = if hp.clip > 0.0 && norm > hp.clip {
        hp.clip / norm
    } else {
        1.0
    };
    for i in 0..p.len() {
        let gi = g[i] * scale;
        m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * gi;
        v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * gi * gi;
        p[i] -=
            hp.lr * ((m[i] / hp.bc1) / ((v[i] / hp.bc2).sqrt() + hp.eps) + hp.weight_decay * p[i]);
    }
    p.iter().map(|&x| to_bf16_bits(x)).collect()
}

/// Twin of `Gpu::adamw_streams` (AdamW's access pattern without its
/// arithmetic, a bandwidth probe): `p += g`, `m += g`, `v += g` in f32;
/// returns the bf16 copy of the new `p`.
pub fn adamw_streams_reference(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> Vec<u16> {
    for i in 0..p.len() {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
    p.iter().map(|&x| to_bf16_bits(x)).collect()
}

/// Twin of `Gpu::sum_parts`: the sum of `sources`, element by element, in
/// source order — from `0.0` when `from_zero` (the bits of adding each
/// source into a zeroed buffer), else from the first source (one source:
/// an exact copy). Every source holds at least the first's length.
pub fn sum_parts_reference(sources: &[&[f32]], from_zero: bool) -> Vec<f32> {
    let Some(first) = sources.first() else {
        return Vec::new();
    };
    (0..first.len())
        .map(|i| {
            let (start, rest) = if from_zero {
                (0.0f32, sources)
            } else {
                (first[i], &sources[1..])
            };
            rest.iter().fold(start, |acc, s| acc + s[i])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn sum_parts_twin_keeps_order_and_signed_zero() {
        use super::sum_parts_reference;
        let (a, b, c) = ([1e8f32, -0.0], [1.0f32, -0.0], [-1e8f32, -0.0]);
        // ((0 + 1e8) + 1) - 1e8 = 0 in f32: order matters.
        assert_eq!(sum_parts_reference(&[&a, &b, &c], true), vec![0.0, 0.0]);
        assert_eq!(sum_parts_reference(&[&a, &c, &b], true), vec![1.0, 0.0]);
        let copy = sum_parts_reference(&[&c], false);
        assert!(copy[1].is_sign_negative(), "a copy keeps −0");
        assert!(sum_parts_reference(&[&c], true)[1].is_sign_positive());
        assert!(sum_parts_reference(&[], true).is_empty());
    }

    #[test]
    fn attention_twin_gradients_match_finite_differences() {
        // 2 sequences of 5, 4 query heads on 2 key/value heads, width 4.
        let dims = (2, 5, 4, 2, 4);
        let (n_seq, seq, heads, kv, dh) = dims;
        let mut st = 7u64;
        let mut rnd = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| {
                    st = st
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((st >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
                })
                .collect()
        };
        let (q, k, v) = (
            rnd(n_seq * heads * seq * dh),
            rnd(n_seq * kv * seq * dh),
            rnd(n_seq * kv * seq * dh),
        );
        let w = rnd(q.len());
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            let (o, _) = attention_f64(dims, q, k, v);
            o.iter().zip(&w).map(|(a, b)| a * b).sum()
        };
        let (dq, dk, dv) = attention_backward_f64(dims, (&q, &k, &v), &w);
        let eps = 1e-6;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
            for i in (0..grad.len()).step_by(7) {
                let mut t = [q.clone(), k.clone(), v.clone()];
                t[which][i] += eps;
                let up = loss(&t[0], &t[1], &t[2]);
                t[which][i] -= 2.0 * eps;
                let dn = loss(&t[0], &t[1], &t[2]);
                let fd = (up - dn) / (2.0 * eps);
                assert!(
                    (fd - grad[i]).abs() < 1e-6,
                    "tensor {which} [{i}]: {fd} vs {}",
                    grad[i]
                );
            }
        }
        // Key 0 of a causal row 0 gets probability 1: its output is v_0.
        let (o, lse) = attention_f64(dims, &q, &k, &v);
        assert!((o[0] - v[0]).abs() < 1e-12);
        assert!(lse.iter().all(|l| l.is_finite()));
        assert!(flash_attention_reference((1, 2, 3, 2, 4), &[0; 24], &[0; 16], &[0; 16]).is_err());
    }

    use super::*;

    #[test]
    fn heads_round_trip_and_rotation_inverse() {
        let (n_seq, seq, heads, dh) = (2, 5, 3, 4);
        let src: Vec<u16> = (0..n_seq * seq * heads * dh)
            .map(|i| to_bf16_bits((i % 7) as f32 - 3.0))
            .collect();
        let plain = heads_reference(&src, (n_seq, seq, heads, dh), 0.0, true).unwrap();
        // Head-major element of (sequence 1, head 2, position 3, dim 1).
        assert_eq!(
            plain[((heads + 2) * seq + 3) * dh + 1],
            src[((seq + 3) * heads + 2) * dh + 1]
        );
        let back = heads_reference(&plain, (n_seq, seq, heads, dh), 0.0, false).unwrap();
        assert_eq!(back, src);
        // Rotation then the inverse rotation: the input within bf16 rounding.
        let rot = heads_reference(&src, (n_seq, seq, heads, dh), 100.0, true).unwrap();
        let un = heads_reference(&rot, (n_seq, seq, heads, dh), 100.0, false).unwrap();
        for (a, b) in un.iter().zip(&src) {
            let (a, b) = (bf16_bits_to_f32(*a), bf16_bits_to_f32(*b));
            assert!((a - b).abs() <= 0.02 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert!(heads_reference(&src[1..], (n_seq, seq, heads, dh), 0.0, true).is_err());
    }

    #[test]
    fn causal_softmax_masks_and_normalises() {
        let seq = 4;
        let s: Vec<u16> = (0..2 * seq * seq)
            .map(|i| to_bf16_bits(i as f32 * 0.1))
            .collect();
        let p = softmax_causal_reference(&s, seq, 0.5);
        for (r, row) in p.chunks_exact(seq).enumerate() {
            let pos = r % seq;
            let sum: f32 = row.iter().map(|&b| bf16_bits_to_f32(b)).sum();
            assert!((sum - 1.0).abs() < 1e-2);
            assert!(row[pos + 1..].iter().all(|&b| b == 0));
        }
        // The backward of a row whose upstream gradient is constant is 0.
        let dp = vec![to_bf16_bits(0.75); p.len()];
        let ds = softmax_causal_backward_reference(&p, &dp, seq, 0.5);
        assert!(ds.iter().all(|&b| bf16_bits_to_f32(b).abs() < 1e-2));
    }

    #[test]
    fn cross_entropy_gradient_matches_finite_differences() {
        let v = 5;
        let logits: Vec<u16> = [0.5f32, -1.0, 2.0, 0.25, 0.0]
            .iter()
            .map(|&x| to_bf16_bits(x))
            .collect();
        let (l, d) = cross_entropy_reference(&logits, &[2], v, 1.0).unwrap();
        let x: Vec<f64> = logits
            .iter()
            .map(|&b| f64::from(bf16_bits_to_f32(b)))
            .collect();
        let f = |x: &[f64]| {
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            x.iter().map(|a| (a - m).exp()).sum::<f64>().ln() + m - x[2]
        };
        assert!((l - f(&x)).abs() < 1e-5);
        for j in 0..v {
            let mut a = x.clone();
            a[j] += 1e-6;
            let mut b = x.clone();
            b[j] -= 1e-6;
            let fd = (f(&a) - f(&b)) / 2e-6;
            assert!((f64::from(bf16_bits_to_f32(d[j])) - fd).abs() < 1e-2, "{j}");
        }
        assert!(cross_entropy_reference(&logits, &[5], v, 1.0).is_err());
    }

    #[test]
    fn rmsnorm_backward_matches_finite_differences() {
        let w = [0.5f32, 1.5, -1.0, 2.0];
        let x = [0.3f32, -1.2, 0.7, 2.0, 1.0, 0.1, -0.4, 0.9];
        let dy_f = [1.0f32, -0.5, 0.25, 2.0, -1.0, 0.5, 1.5, -0.75];
        let dy: Vec<u16> = dy_f.iter().map(|&v| to_bf16_bits(v)).collect();
        let (_, inv) = rmsnorm_reference(&x, &w, 1e-6);
        let (dx, dw) = rmsnorm_backward_reference(&x, &w, &inv, &dy);
        // Objective Σ dy · y in f64 (y unrounded).
        let obj = |x: &[f64], w: &[f64]| -> f64 {
            x.chunks_exact(4)
                .zip(dy_f.chunks_exact(4))
                .map(|(r, g)| {
                    let iv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / 4.0 + 1e-6).sqrt();
                    (0..4)
                        .map(|i| f64::from(g[i]) * r[i] * iv * w[i])
                        .sum::<f64>()
                })
                .sum()
        };
        let xd: Vec<f64> = x.iter().map(|&v| v.into()).collect();
        let wd: Vec<f64> = w.iter().map(|&v| v.into()).collect();
        for i in 0..8 {
            let (mut a, mut b) = (xd.clone(), xd.clone());
            a[i] += 1e-6;
            b[i] -= 1e-6;
            let fd = (obj(&a, &wd) - obj(&b, &wd)) / 2e-6;
            assert!((f64::from(dx[i]) - fd).abs() < 1e-4, "dx[{i}]");
        }
        for i in 0..4 {
            let (mut a, mut b) = (wd.clone(), wd.clone());
            a[i] += 1e-6;
            b[i] -= 1e-6;
            let fd = (obj(&xd, &a) - obj(&xd, &b)) / 2e-6;
            assert!((f64::from(dw[i]) - fd).abs() < 1e-4, "dw[{i}]");
        }
    }
}
