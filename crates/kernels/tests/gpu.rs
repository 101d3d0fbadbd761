//! Device tests: every kernel against its CPU twin on fresh random inputs,
//! with poisoned outputs (the wrappers fill outputs with 0xFF first).
//! Every device test is `#[ignore]`d (CI has no GPU, and an ignored test is
//! reported as ignored, never as passed): run them on the GPU machine with
//! `cargo test -p kernels --features cuda -- --ignored`. Without the
//! feature, `Gpu::open` must say so (a test that runs everywhere).

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use kernels::cpu::{
    bf16_bits_to_f32, combine_bf16_reference, combine_onto_bf16_reference, gather_rows_reference,
    lrm_scores_reference, router_topk_reference, select_top_reference,
    swiglu_backward_bf16_reference, swiglu_bf16_reference, unpack_rows_reference, DROPPED,
};
mod common;

use common::{seed, Rng};
use kernels::gpu::Gpu;
use kernels::KernelError;

fn gpu() -> Gpu {
    Gpu::open(0).expect("a CUDA device (these tests run with --ignored on the GPU machine)")
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_feature_opening_a_gpu_is_a_typed_error() {
    assert_eq!(Gpu::open(0).unwrap_err(), KernelError::NotCompiledWithCuda);
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn lrm_scores_match_the_cpu_twin() {
    let g = gpu();
    let mut rng = Rng(seed());
    for &(n, d_in, d_out) in &[
        (0, 8, 8),
        (1, 1, 1),
        (33, 13, 7),
        (1000, 768, 2048),
        (4097, 64, 24),
        (70000, 128, 256),
    ] {
        let h = rng.bf16(n * d_in);
        let d = rng.bf16(n * d_out);
        let gate: Vec<f32> = (0..n)
            .map(|_| (rng.next() % 1000) as f32 / 1000.0)
            .collect();
        let got = g.lrm_scores_bf16(&h, &d, &gate, d_in, d_out).unwrap();
        let want = lrm_scores_reference(&h, &d, &gate, d_in, d_out).unwrap();
        assert_eq!(got.len(), n);
        let err: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
        assert!(
            got.iter().all(|x| x.is_finite()),
            "unwritten (NaN) output at n = {n}"
        );
        assert!(
            err.sqrt() <= 1e-5 * norm.sqrt().max(1e-30),
            "relative error {} at ({n}, {d_in}, {d_out})",
            (err / norm).sqrt()
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn pack_and_unpack_match_the_cpu_twins_bit_exactly() {
    let g = gpu();
    let mut rng = Rng(seed());
    for &(rows, width, n_out) in &[
        (0, 8, 0),
        (5, 0, 3),
        (7, 13, 20),
        (1000, 2048, 777),
        (50000, 768, 65536),
        (3, 8, 3),
    ] {
        let src = rng.bf16(rows * width);
        let idx: Vec<u32> = (0..n_out)
            .map(|_| {
                if rows == 0 {
                    0
                } else {
                    (rng.next() % rows as u64) as u32
                }
            })
            .collect();
        let got = g.gather_rows_u16(&src, width, &idx).unwrap();
        assert_eq!(
            got,
            gather_rows_reference(&src, width, &idx).unwrap(),
            "gather ({rows}, {width}, {n_out})"
        );

        let inverse: Vec<u32> = (0..n_out)
            .map(|_| {
                if rows == 0 || rng.next() % 3 == 0 {
                    DROPPED
                } else {
                    (rng.next() % rows as u64) as u32
                }
            })
            .collect();
        let got = g.unpack_rows_u16(&src, width, &inverse).unwrap();
        assert_eq!(
            got,
            unpack_rows_reference(&src, width, &inverse).unwrap(),
            "unpack ({rows}, {width}, {n_out})"
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn bad_shapes_are_errors_not_launches() {
    let g = gpu();
    assert!(matches!(
        g.lrm_scores_bf16(&[0; 3], &[0; 4], &[1.0; 2], 2, 2),
        Err(KernelError::Shape { what: "h", .. })
    ));
    assert!(matches!(
        g.gather_rows_u16(&[0; 4], 2, &[2]),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn top_q_selection_matches_the_cpu_twin() {
    let g = gpu();
    let mut rng = Rng(seed());
    // Scores from a small set (ties common: the selection runs through the
    // ids' digits) or continuous (the threshold's bucket is usually kept
    // whole after two digits, and the selection stops there).
    let cases = [(1, 0), (3, 1), (8, 100), (128, 131072), (16, 40000)];
    for (&(n_experts, n_pairs), ties) in cases.iter().flat_map(|c| [(c, true), (c, false)]) {
        // Random segment sizes (some empty).
        let mut cuts: Vec<u32> = (0..n_experts - 1)
            .map(|_| (rng.next() % (n_pairs as u64 + 1)) as u32)
            .collect();
        cuts.sort_unstable();
        let mut offsets = vec![0u32];
        offsets.extend(cuts);
        offsets.push(n_pairs as u32);
        let scores: Vec<f32> = (0..n_pairs)
            .map(|_| {
                if ties {
                    (rng.next() % 50) as f32 * 0.25
                } else {
                    (rng.next() % (1 << 24)) as f32 * 1e-3
                }
            })
            .collect();
        let mut ids: Vec<u32> = (0..n_pairs as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let quotas: Vec<u32> = (0..n_experts)
            .map(|e| {
                let n = offsets[e + 1] - offsets[e];
                (rng.next() % (u64::from(n) + 2)) as u32
            })
            .collect();
        let got = g.select_top(&scores, &ids, &offsets, &quotas).unwrap();
        assert_eq!(
            got,
            select_top_reference(&scores, &ids, &offsets, &quotas).unwrap(),
            "({n_experts}, {n_pairs}, ties {ties})"
        );
    }
    assert!(g.select_top(&[f32::NAN], &[0], &[0, 1], &[1]).is_err());
}

/// ‖got − want‖ / ‖want‖ over bf16 bit patterns.
fn rel_bf16(got: &[u16], want: &[u16]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (
            f64::from(bf16_bits_to_f32(g)),
            f64::from(bf16_bits_to_f32(w)),
        );
        assert!(g.is_finite(), "non-finite (unwritten?) output");
        num += (g - w).powi(2);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn swiglu_forward_and_backward_match_the_cpu_twins() {
    let g = gpu();
    let mut rng = Rng(seed());
    for n in [0usize, 1, 1000, 3_000_001] {
        let (a, b, dh) = (rng.bf16(n), rng.bf16(n), rng.bf16(n));
        let h = g.swiglu_bf16(&a, &b).unwrap();
        assert!(
            rel_bf16(&h, &swiglu_bf16_reference(&a, &b).unwrap()) <= 1e-2,
            "swiglu n = {n}"
        );
        let (da, db) = g.swiglu_backward_bf16(&a, &b, &dh).unwrap();
        let (wa, wb) = swiglu_backward_bf16_reference(&a, &b, &dh).unwrap();
        assert!(
            rel_bf16(&da, &wa) <= 1e-2 && rel_bf16(&db, &wb) <= 1e-2,
            "swiglu backward n = {n}"
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn biased_logits_match_the_cpu_twin_exactly() {
    let g = gpu();
    let mut rng = Rng(seed());
    for &(t, e) in &[(1, 1), (3, 8), (1000, 128), (777, 40)] {
        let logits = rng.bf16(t * e);
        let bias: Vec<f32> = (0..e)
            .map(|_| (rng.next() % 401) as f32 / 50.0 - 4.0)
            .collect();
        let got = g.logits_bias_f32(&logits, &bias).unwrap();
        let want = kernels::cpu::logits_bias_reference(&logits, &bias);
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "({t}, {e}): {a} vs {b}"
            );
        }
    }
    assert!(g.logits_bias_f32(&[0; 7], &[0.0; 2]).is_err());
    assert!(g.logits_bias_f32(&[0; 4], &[]).is_err());
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn priority_sampling_kernels_match_the_cpu_twins_exactly() {
    use kernels::cpu::{priority_keys_reference, priority_weights_reference};
    let g = gpu();
    // Outputs start as 0xFF (NaN), so an element no kernel writes shows.
    g.set_poison(true);
    let mut rng = Rng(seed());
    for &(n, groups) in &[(0usize, 1usize), (1, 1), (37, 3), (5000, 64)] {
        let score: Vec<f32> = (0..n)
            .map(|i| {
                if i % 11 == 0 {
                    0.0
                } else {
                    (rng.next() % 100_000) as f32 / 997.0
                }
            })
            .collect();
        let id: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let s = rng.next();
        let rho = g.priority_keys(&score, &id, s).unwrap();
        let want = priority_keys_reference(&score, &id, s);
        assert!(
            rho.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "keys, n = {n}"
        );
        // Masks as the selection would give them: per segment, the first
        // q rows (q = half) at q and one more at q + 1.
        let mut offsets: Vec<u32> = (0..=groups).map(|k| (k * n / groups) as u32).collect();
        offsets[groups] = n as u32;
        let (mut kq, mut kq1) = (vec![0u8; n], vec![0u8; n]);
        for w in offsets.windows(2) {
            let (lo, hi) = (w[0] as usize, w[1] as usize);
            let q = (hi - lo) / 2;
            for i in lo..hi {
                kq[i] = u8::from(i < lo + q);
                kq1[i] = u8::from(i <= lo + q);
            }
        }
        let w = g
            .priority_weights(&rho, &score, (&kq, &kq1), &offsets)
            .unwrap();
        let want = priority_weights_reference(&rho, &score, &kq, &kq1, &offsets);
        assert!(
            w.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "weights, n = {n}"
        );
        let prod = g.mul_f32(&rho, &score).unwrap();
        assert!(prod
            .iter()
            .zip(rho.iter().zip(&score))
            .all(|(p, (a, b))| p.to_bits() == (a * b).to_bits()));
    }
    assert!(g.priority_keys(&[1.0], &[], 0).is_err());
    assert!(g
        .priority_weights(&[1.0], &[1.0], (&[1], &[1]), &[0, 2])
        .is_err());
    // Offsets that leave a row outside every segment.
    assert!(g
        .priority_weights(&[1.0; 3], &[1.0; 3], (&[1; 3], &[1; 3]), &[0, 2])
        .is_err());
    assert!(g
        .priority_weights(&[1.0; 3], &[1.0; 3], (&[1; 3], &[1; 3]), &[1, 3])
        .is_err());
    assert!(g.mul_f32(&[1.0], &[]).is_err());
    g.set_poison(false);
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn router_topk_picks_valid_experts_for_nan_rows_and_large_negative_biases() {
    let g = gpu();
    let (t, e, k) = (6, 16, 4);
    let mut rng = Rng(seed());
    let mut logits: Vec<f32> = (0..t * e)
        .map(|_| (rng.next() % 2001) as f32 / 250.0 - 4.0)
        .collect();
    // Row 1 all NaN, row 3 one NaN logit (its whole softmax is NaN).
    logits[e..2 * e].iter_mut().for_each(|v| *v = f32::NAN);
    logits[3 * e + 5] = f32::NAN;
    // A bias below −1 on half the experts: they rank last, not nowhere.
    let bias: Vec<f32> = (0..e)
        .map(|i| if i % 2 == 0 { -3.0 } else { 0.0 })
        .collect();
    for sel in [None, Some(bias.as_slice())] {
        let (_, idx, gates) = g.router_topk(&logits, sel, e, k, true).unwrap();
        let (_, widx, _) = router_topk_reference(&logits, sel, e, k, true).unwrap();
        assert_eq!(idx, widx, "bias {}", sel.is_some());
        assert!(idx.iter().all(|&i| (i as usize) < e), "{idx:?}");
        for r in [1, 3] {
            assert!(gates[r * k..(r + 1) * k].iter().all(|v| v.is_nan()));
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn router_topk_matches_the_cpu_twin() {
    let g = gpu();
    let mut rng = Rng(seed());
    for &(t, e, k, renorm) in &[
        (0, 8, 2, true),
        (1, 1, 1, false),
        (300, 128, 8, true),
        (5000, 64, 6, false),
        (17, 40, 40, true),
    ] {
        let logits: Vec<f32> = (0..t * e)
            .map(|_| (rng.next() % 2001) as f32 / 250.0 - 4.0)
            .collect();
        // Without and with a selection-only bias (DeepSeek-V3's balancing
        // bias, of the size of the probabilities' spread).
        let bias: Vec<f32> = (0..e)
            .map(|_| (rng.next() % 2001) as f32 / 2000.0 * 0.04 - 0.02)
            .collect();
        for sel in [None, Some(bias.as_slice())] {
            let (p, idx, gates) = g.router_topk(&logits, sel, e, k, renorm).unwrap();
            let (wp, widx, wg) = router_topk_reference(&logits, sel, e, k, renorm).unwrap();
            assert_eq!(
                idx,
                widx,
                "top-k indices ({t}, {e}, {k}, bias {})",
                sel.is_some()
            );
            for (a, b) in p.iter().zip(&wp).chain(gates.iter().zip(&wg)) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "({t}, {e}, {k}): {a} vs {b}"
                );
            }
            if !renorm {
                // The gates are the unbiased probabilities of the chosen.
                for (j, (&i, &gv)) in idx.iter().zip(&gates).enumerate() {
                    assert_eq!(gv, p[(j / k) * e + i as usize]);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn combine_matches_the_cpu_twin() {
    let g = gpu();
    let mut rng = Rng(seed());
    // (tokens, hidden, top-k, rows of o, % of pairs dropped): k above 32
    // takes the kernel's pairs in two warps' worth, a hidden width that is
    // not a multiple of 256 leaves lanes idle in the last column step, and
    // 75% dropped is a backward at r = 0.25.
    for &(t, h, k, rows, dropped) in &[
        (0, 8, 2, 4, 20),
        (3, 5, 1, 3, 20),
        (2048, 2048, 8, 16384, 20),
        (100, 96, 2, 150, 20),
        (64, 264, 40, 300, 20),
        (1000, 2048, 8, 8000, 75),
        (50, 136, 8, 400, 100),
    ] {
        let o = rng.bf16(rows * h);
        let row: Vec<u32> = (0..t * k)
            .map(|_| {
                if rng.next() % 100 < dropped {
                    DROPPED
                } else {
                    (rng.next() % rows as u64) as u32
                }
            })
            .collect();
        let gates: Vec<f32> = (0..t * k)
            .map(|_| (rng.next() % 1000) as f32 / 1000.0)
            .collect();
        let y = g.combine_bf16(&o, h, &row, &gates, k).unwrap();
        let want = combine_bf16_reference(&o, h, &row, &gates, k).unwrap();
        // Onto a base (the router's dX in the backward's scatter).
        let base = rng.bf16(t * h);
        let yb = g
            .combine_onto_bf16(Some(&base), &o, h, &row, &gates, k)
            .unwrap();
        let wantb = combine_onto_bf16_reference(Some(&base), &o, h, &row, &gates, k).unwrap();
        if t > 0 {
            assert!(rel_bf16(&y, &want) <= 1e-2, "combine ({t}, {h}, {k})");
            assert!(
                rel_bf16(&yb, &wantb) <= 1e-2,
                "combine onto ({t}, {h}, {k})"
            );
            assert_ne!(yb, y, "the base is added ({t}, {h}, {k})");
        }
        assert!(
            g.combine_onto_bf16(
                Some(&base[..base.len().saturating_sub(1)]),
                &o,
                h,
                &row,
                &gates,
                k
            )
            .is_err()
                || t * h == 0
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn grouped_gemm_matches_the_cpu_twin() {
    use kernels::cpu::{grouped_gemm_reference, GemmVariant};
    use kernels::grouped::GroupedOps;
    let g = gpu();
    let mut rng = Rng(seed());
    for &(e, h, f, max_rows) in &[(4, 64, 128, 300), (8, 128, 64, 90), (3, 256, 768, 700)] {
        // Random group sizes, some empty.
        let counts: Vec<i32> = (0..e)
            .map(|_| {
                if rng.next() % 4 == 0 {
                    0
                } else {
                    (rng.next() % max_rows) as i32
                }
            })
            .collect();
        let mut offsets = vec![0i32];
        for c in &counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        let rows = *offsets.last().unwrap() as usize;
        for variant in [
            GemmVariant::Forward,
            GemmVariant::DataGrad,
            GemmVariant::WeightGrad,
        ] {
            let (na, nb) = match variant {
                GemmVariant::Forward => (rows * h, e * h * f),
                GemmVariant::DataGrad => (rows * f, e * h * f),
                GemmVariant::WeightGrad => (rows * h, rows * f),
            };
            let (a, b) = (rng.bf16(na), rng.bf16(nb));
            let got = g
                .grouped_gemm_bf16(variant, &offsets, &a, &b, h, f)
                .unwrap();
            let want = grouped_gemm_reference(variant, &offsets, &a, &b, h, f).unwrap();
            let (mut num, mut den) = (0f64, 0f64);
            for (x, y) in got.iter().zip(&want) {
                let x = f64::from(bf16_bits_to_f32(*x));
                assert!(x.is_finite(), "{variant:?}: unwritten output");
                num += (x - f64::from(*y)).powi(2);
                den += f64::from(*y).powi(2);
            }
            let rel = (num / den.max(1e-300)).sqrt();
            assert!(
                rel <= 1e-2,
                "{variant:?} ({e}, {h}, {f}, counts {counts:?}): relative error {rel}"
            );
            // Added onto a base in the epilogue (the data gradient's second
            // half in the experts' backward): against the twin's f32 sum.
            let base = rng.bf16(want.len());
            let onto = g
                .grouped_gemm_onto_bf16(variant, &offsets, &a, &b, &base, h, f)
                .unwrap();
            let twin = kernels::grouped::CpuTwins
                .grouped_gemm_onto(variant, &offsets, &a, &b, &base, h, f)
                .unwrap();
            let r = rel_bf16(&onto, &twin);
            assert!(r <= 1e-2, "{variant:?} onto a base: relative error {r}");
            if !want.is_empty() {
                assert_ne!(onto, got, "{variant:?}: the base is added");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn device_resident_expert_chain_matches_its_composition() {
    // `Gpu`'s experts_forward / experts_backward run one device-resident
    // chain; the same chain composed of host-level operations must give the
    // same bits on the GPU (same kernels, same order) and stay within bf16
    // tolerance of the composition on the CPU twins. Empty experts included.
    use kernels::grouped::{
        compose_backward, compose_forward, CpuTwins, GroupedOps, StackedExperts,
    };
    let g = gpu();
    let mut rng = Rng(seed());
    let small = |v: Vec<u16>| -> Vec<u16> {
        // Weights of size ~0.06 keep activations in SwiGLU's curved range.
        v.into_iter()
            .map(|b| kernels::cpu::f32_to_bf16_bits(bf16_bits_to_f32(b) / 32.0))
            .collect()
    };
    for &(e, h, f, max_rows) in &[(4usize, 64usize, 128usize, 200u64), (8, 128, 64, 90)] {
        let mut offsets = vec![0i32];
        for _ in 0..e {
            let c = if rng.next() % 4 == 0 {
                0
            } else {
                (rng.next() % max_rows) as i32
            };
            offsets.push(offsets.last().unwrap() + c);
        }
        let rows = *offsets.last().unwrap() as usize;
        let (x, d) = (rng.bf16(rows * h), rng.bf16(rows * h));
        let (gate, up, down) = (
            small(rng.bf16(e * h * f)),
            small(rng.bf16(e * h * f)),
            small(rng.bf16(e * h * f)),
        );
        let w = StackedExperts {
            hidden: h,
            ffn: f,
            gate: &gate,
            up: &up,
            down: &down,
        };
        let (o, h_sq) = g.experts_forward(&offsets, &x, &w).unwrap();
        let (o_p, h_sq_p) = compose_forward(&g, &offsets, &x, &w).unwrap();
        let (o_t, h_sq_t) = compose_forward(&CpuTwins, &offsets, &x, &w).unwrap();
        assert_eq!(o, o_p, "forward: chain differs from the composed kernels");
        let rel_f = |a: &[f32], b: &[f32]| {
            let n: f64 = a.iter().zip(b).map(|(p, q)| f64::from(p - q).powi(2)).sum();
            let dd: f64 = b.iter().map(|q| f64::from(*q).powi(2)).sum();
            (n / dd.max(1e-300)).sqrt()
        };
        assert!(
            rel_f(&h_sq, &h_sq_p) <= 1e-5,
            "h_sq vs composed: {}",
            rel_f(&h_sq, &h_sq_p)
        );
        assert!(
            rel_bf16(&o, &o_t) <= 1e-2,
            "o vs twins: {}",
            rel_bf16(&o, &o_t)
        );
        assert!(
            rel_f(&h_sq, &h_sq_t) <= 1e-2,
            "h_sq vs twins: {}",
            rel_f(&h_sq, &h_sq_t)
        );

        let got = g.experts_backward(&offsets, &x, &d, &w).unwrap();
        let comp = compose_backward(&g, &offsets, &x, &d, &w).unwrap();
        let twin = compose_backward(&CpuTwins, &offsets, &x, &d, &w).unwrap();
        assert_eq!(
            got, comp,
            "backward: chain differs from the composed kernels"
        );
        // GEMMs on fewer SMs (a collective beside them) give the same bits.
        g.set_gemm_sm_reserve(100);
        let o_r = g.experts_forward(&offsets, &x, &w).unwrap().0;
        let got_r = g.experts_backward(&offsets, &x, &d, &w).unwrap();
        g.set_gemm_sm_reserve(0);
        assert_eq!(o_r, o, "forward on fewer SMs");
        assert_eq!(got_r, got, "backward on fewer SMs");
        for (name, a, b) in [
            ("dx", &got.dx, &twin.dx),
            ("gate", &got.gate, &twin.gate),
            ("up", &got.up, &twin.up),
            ("down", &got.down, &twin.down),
        ] {
            let r = rel_bf16(a, b);
            assert!(r <= 1e-2, "{name} vs twins ({e}, {h}, {f}): {r}");
        }
    }
    // Shapes are checked before any launch.
    let w = StackedExperts {
        hidden: 64,
        ffn: 64,
        gate: &[0; 10],
        up: &[0; 10],
        down: &[0; 10],
    };
    assert!(matches!(
        g.experts_forward(&[0, 4], &[0; 256], &w),
        Err(KernelError::Shape { .. })
    ));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn expanded_runs_match_the_cpu_twin() {
    use kernels::cpu::expand_runs_reference;
    let g = gpu();
    g.set_poison(true);
    let mut rng = Rng(seed());
    for &(len, pieces, step) in &[
        (1usize, 1usize, 1u32),
        (131_072, 1, 1),
        (131_072, 128, 0),
        (131_072, 1024, 1),
        (70_001, 37, 1),
        (5, 5, 0),
    ] {
        // Random cut points (distinct, sorted), random sources.
        let mut cuts: Vec<usize> = (0..pieces - 1)
            .map(|_| 1 + (rng.next() % (len as u64 - 1).max(1)) as usize)
            .filter(|&c| c < len)
            .collect();
        cuts.push(0);
        cuts.push(len);
        cuts.sort_unstable();
        cuts.dedup();
        let mut runs = Vec::new();
        for w in cuts.windows(2) {
            let src = (rng.next() % 1_000_000) as u32;
            runs.extend([w[0] as u32, src, (w[1] - w[0]) as u32]);
        }
        assert_eq!(
            g.expand_runs(&runs, step, len).unwrap(),
            expand_runs_reference(&runs, step, len).unwrap(),
            "expand_runs, len = {len}, {} runs, step {step}",
            runs.len() / 3
        );
    }
    assert!(g.expand_runs(&[], 1, 0).unwrap().is_empty());
    // Runs that leave a gap or overlap are refused before any launch.
    assert!(matches!(
        g.expand_runs(&[0, 0, 2, 3, 0, 1], 1, 4),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        g.expand_runs(&[0, 0, 2], 1, 3),
        Err(KernelError::Shape { .. })
    ));
    g.set_poison(false);
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn byte_gather_and_kept_counts_match_the_cpu_twins() {
    use kernels::cpu::{gather_u8_reference, kept_counts_reference};
    let g = gpu();
    let mut rng = Rng(seed());
    // (rows, groups, keys sorted as expert-major rows are); 20 000 groups
    // count in global memory (too many for shared bins).
    for &(n, groups, sorted) in &[
        (1usize, 1usize, false),
        (1000, 2, false),
        (131_072, 8, false),
        (70_001, 3, false),
        (131_072, 128, true),
        (131_072, 128, false),
        (50_000, 20_000, false),
        (50_000, 20_000, true),
    ] {
        let src: Vec<u8> = (0..n).map(|_| (rng.next() % 256) as u8).collect();
        let idx: Vec<u32> = (0..n).map(|_| (rng.next() % n as u64) as u32).collect();
        assert_eq!(
            g.gather_u8(&src, &idx).unwrap(),
            gather_u8_reference(&src, &idx).unwrap(),
            "gather_u8, n = {n}"
        );
        // Keys include some beyond the groups (not counted).
        let mut key: Vec<u32> = (0..n)
            .map(|_| (rng.next() % (groups as u64 + 1)) as u32)
            .collect();
        if sorted {
            key.sort_unstable();
        }
        let keep: Vec<u8> = (0..n).map(|_| u8::from(rng.next() % 3 != 0)).collect();
        assert_eq!(
            g.kept_counts(&key, &keep, groups).unwrap(),
            kept_counts_reference(&key, &keep, groups).unwrap(),
            "kept_counts, n = {n}, groups = {groups}, sorted {sorted}"
        );
    }
    assert!(matches!(
        g.gather_u8(&[1, 2], &[2]),
        Err(KernelError::Shape { .. })
    ));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn column_means_match_the_cpu_twin() {
    // The router's mean probability per expert (the auxiliary loss):
    // column means of a t × e f32 matrix, rows summed in order.
    let g = gpu();
    let mut rng = Rng(seed());
    for &(t, e) in &[(0usize, 8usize), (1, 1), (1000, 128), (4097, 40)] {
        let x: Vec<f32> = (0..t * e)
            .map(|_| (rng.next() % 10_001) as f32 / 10_000.0)
            .collect();
        let got = g
            .download(&g.col_mean(&g.upload(&x).unwrap(), t, e).unwrap(), e)
            .unwrap();
        for c in 0..e {
            let mut s = 0f32;
            for r in 0..t {
                s += x[r * e + c];
            }
            let want = if t > 0 { s / t as f32 } else { 0.0 };
            assert_eq!(got[c], want, "column {c} of ({t}, {e})");
        }
    }
    assert!(matches!(
        g.col_mean(&g.upload(&[0f32; 10]).unwrap(), 4, 4),
        Err(KernelError::Shape { .. })
    ));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn column_sums_of_bf16_match_the_cpu_twin() {
    // The router weight gradient's token groups summed: column sums of a
    // g × n bf16 matrix in f32, rows in order — bit-equal to the twin.
    let g = gpu();
    g.set_poison(true);
    let mut rng = Rng(seed());
    for &(rows, n) in &[(0usize, 8usize), (1, 1), (8, 262_144), (3, 1001)] {
        let x: Vec<u16> = (0..rows * n)
            .map(|_| kernels::cpu::f32_to_bf16_bits((rng.next() % 20_001) as f32 / 10_000.0 - 1.0))
            .collect();
        let got = g
            .download(&g.col_sum_bf16(&g.upload(&x).unwrap(), rows, n).unwrap(), n)
            .unwrap();
        let want = kernels::cpu::col_sum_bf16_reference(&x, rows, n).unwrap();
        assert_eq!(got, want, "({rows}, {n})");
    }
    g.set_poison(false);
    assert!(matches!(
        g.col_sum_bf16(&g.upload(&[0u16; 10]).unwrap(), 4, 4),
        Err(KernelError::Shape { .. })
    ));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn the_pool_peak_counts_buffers_held_at_once() {
    // Two buffers held together, then (their frees done) a third alone: the
    // peak above the reset is the pair's bytes (the pool may round each
    // allocation up), not the sum of all three; a new reset starts from
    // what is in use.
    let g = gpu();
    let mib = 1usize << 20;
    let base = g.pool_reset_peak().unwrap();
    {
        let a = g.zeros::<u8>(64 * mib).unwrap();
        let b = g.zeros::<u8>(32 * mib).unwrap();
        drop((a, b));
        g.sync().unwrap();
        let c = g.zeros::<u8>(16 * mib).unwrap();
        drop(c);
    }
    g.sync().unwrap();
    let peak = g.pool_peak_bytes().unwrap() - base;
    assert!(
        peak >= 96 * mib as u64 && peak < 100 * mib as u64,
        "peak {peak} B for 96 MiB held at once"
    );
    let held = g.zeros::<u8>(8 * mib).unwrap();
    let now = g.pool_reset_peak().unwrap();
    assert!(
        now >= base + 8 * mib as u64,
        "in use {now} B after an 8 MiB buffer, {base} B before"
    );
    drop(held);
    g.sync().unwrap();
    assert_eq!(
        g.pool_peak_bytes().unwrap(),
        now,
        "nothing allocated since the reset"
    );
}

/// The experts' backward on the forward's kept projections
/// (`experts_forward_keep` → `experts_backward_data_from`) against the
/// backward that recomputes them from `x`, on fresh random rows in uneven
/// groups (an empty one included): the same grouped GEMMs on the same rows,
/// so the forward outputs, `dX` and every weight gradient must be equal bit
/// for bit; and a projection shorter than the rows is refused.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn kept_projections_give_the_recomputed_backward() {
    let g = gpu();
    let mut rng = Rng(seed());
    let (h, f) = (64, 48);
    for sizes in [vec![5usize, 0, 130, 17], vec![300, 1]] {
        let e = sizes.len();
        let mut offsets = vec![0u32];
        for s in &sizes {
            offsets.push(offsets.last().unwrap() + *s as u32);
        }
        let rows = *offsets.last().unwrap() as usize;
        let up = |v: Vec<u16>| g.upload(&v).unwrap();
        let (x, d) = (up(rng.bf16(rows * h)), up(rng.bf16(rows * h)));
        let w = (
            up(rng.bf16s(e * h * f, 0.1)),
            up(rng.bf16s(e * h * f, 0.1)),
            up(rng.bf16s(e * f * h, 0.1)),
        );
        let wr = (&w.0, &w.1, &w.2);
        let (o0, sq0) = g.experts_forward_dev(&offsets, &x, wr, (h, f)).unwrap();
        let (o1, sq1, (a, b)) = g.experts_forward_keep(&offsets, &x, wr, (h, f)).unwrap();
        let down16 = |s: &kernels::gpu::CudaSlice<u16>, n| g.download(s, n).unwrap();
        assert_eq!(down16(&o0, rows * h), down16(&o1, rows * h));
        assert_eq!(
            g.download(&sq0, rows).unwrap(),
            g.download(&sq1, rows).unwrap()
        );
        let (dx0, st0) = g
            .experts_backward_data(&offsets, &x, &d, wr, (h, f))
            .unwrap();
        let (dx1, st1) = g
            .experts_backward_data_from(&offsets, (&a, &b), &d, wr, (h, f))
            .unwrap();
        assert_eq!(
            down16(&dx0, rows * h),
            down16(&dx1, rows * h),
            "dX ({sizes:?})"
        );
        let g0 = g.experts_backward_weights(st0, &x, &d).unwrap();
        let g1 = g.experts_backward_weights(st1, &x, &d).unwrap();
        for (name, p, q) in [
            ("gate", &g0.0, &g1.0),
            ("up", &g0.1, &g1.1),
            ("down", &g0.2, &g1.2),
        ] {
            assert_eq!(
                down16(p, e * h * f),
                down16(q, e * h * f),
                "dW_{name} ({sizes:?})"
            );
        }
        if rows > 1 {
            let short = up(vec![0u16; (rows - 1) * f]);
            assert!(g
                .experts_backward_data_from(&offsets, (&short, &b), &d, wr, (h, f))
                .is_err());
        }
    }
}
