//! Device tests of the dense transformer kernels against their CPU twins
//! (`kernels::dense`): fresh random inputs each run, outputs poisoned
//! (`Gpu::set_poison`), tolerances stated per test. `#[ignore]`d: run on
//! the GPU machine with `cargo test -p kernels --features cuda --
//! --ignored`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use kernels::cpu::{bf16_bits_to_f32, f32_to_bf16_bits as to_bf16_bits, GemmVariant};
use kernels::dense::*;
use kernels::gpu::{AttnDq, AttnFwd, CudaSlice, Gpu};

mod common;

use common::{seed, Rng};

fn gpu() -> Gpu {
    let g = Gpu::open(0).expect("a CUDA device (run with --ignored on the GPU machine)");
    g.set_poison(true);
    g
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn wide(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16_bits_to_f32(b)).collect()
}

/// Largest difference in bf16 units in the last place, across zero too.
fn max_ulps(a: &[u16], b: &[u16]) -> u32 {
    // bf16 is sign and magnitude: the position on the number line is the
    // magnitude's bits, negated below zero (so −0 and +0 are 0 ulps apart
    // and a pair either side of zero counts the steps between them).
    let line = |x: u16| {
        let m = i32::from(x & 0x7fff);
        if x & 0x8000 != 0 {
            -m
        } else {
            m
        }
    };
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (line(x) - line(y)).unsigned_abs())
        .max()
        .unwrap_or(0)
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn embedding_and_its_scatter_add_match_the_twins() {
    let g = gpu();
    let mut r = Rng(seed());
    // Widths in 16-byte vectors (136) and not (135).
    for d in [135, 136] {
        let vocab = 97;
        let table = r.f32s(vocab * d, 1.0);
        let tok: Vec<u32> = (0..1000)
            .map(|_| (r.next() % vocab as u64) as u32)
            .collect();
        let (tb, tk) = (g.upload(&table).unwrap(), g.upload(&tok).unwrap());
        // SAFETY: every token is below vocab.
        let mut x = unsafe { g.embed(&tb, &tk, tok.len(), d) }.unwrap();
        let want = embed_reference(&table, &tok, d).unwrap();
        assert_eq!(
            g.download(&x, want.len()).unwrap(),
            want,
            "a gather is exact ({d})"
        );
        // SAFETY: as above.
        unsafe { g.embed_add(&tb, &tk, &mut x, tok.len(), d) }.unwrap();
        let twice: Vec<f32> = want.iter().map(|v| v + v).collect();
        assert_eq!(
            g.download(&x, want.len()).unwrap(),
            twice,
            "gather added ({d})"
        );
    }
    let (vocab, d, n) = (97, 136, 1000);
    let tok: Vec<u32> = (0..n).map(|_| (r.next() % vocab as u64) as u32).collect();
    let tk = g.upload(&tok).unwrap();
    let dx = r.f32s(n * d, 1.0);
    let start = r.f32s(vocab * d, 1.0);
    let mut dt = g.upload(&start).unwrap();
    // SAFETY: as above.
    unsafe { g.embed_backward(&g.upload(&dx).unwrap(), &tk, &mut dt, n, d) }.unwrap();
    let want = embed_backward_reference(&dx, &tok, &start, d).unwrap();
    let e = rel(&g.download(&dt, vocab * d).unwrap(), &want);
    assert!(e < 1e-6, "scatter-add relative error {e}");
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn rmsnorm_forward_and_backward_match_the_twins() {
    let g = gpu();
    let mut r = Rng(seed());
    // Widths below, at and past a warp's multiples (100: not one), many
    // rows per warp (the head norms: 40 000 rows of 128), the block-per-row
    // kernels (multiples of 256 up to 8192: one warp a row at 256, fewer
    // rows than blocks at 17, more at 3000) and the wide warp kernels past
    // them (12 288).
    for &(rows, d) in &[
        (1, 8),
        (333, 64),
        (40_000, 128),
        (4000, 100),
        (999, 256),
        (2048, 512),
        (100, 1024),
        (17, 2048),
        (3000, 2048),
        (300, 3000),
        (5, 4096),
        (3, 12_288),
    ] {
        let x = r.f32s(rows * d, 3.0);
        let w = r.f32s(d, 2.0);
        let (xd, wd) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let (y, inv) = g.rmsnorm(&xd, &wd, rows, 1e-6).unwrap();
        let (wy, winv) = rmsnorm_reference(&x, &w, 1e-6);
        let (y, inv) = (
            g.download(&y, rows * d).unwrap(),
            g.download(&inv, rows).unwrap(),
        );
        assert!(max_ulps(&y, &wy) <= 1, "rmsnorm y ({rows}×{d})");
        // The warp kernels past 4096 sum d / 32 squares a lane in f32.
        let tol = if d > 4096 { 4e-6 } else { 1e-6 };
        assert!(rel(&inv, &winv) < tol, "rmsnorm inv ({rows}×{d})");
        // The same with the input's copy made in the pass (the outputs were
        // poisoned: set_poison in gpu()).
        let (copy, y2, inv2) = g.rmsnorm_keeping(&xd, &wd, rows, 1e-6).unwrap();
        assert_eq!(g.download(&copy, rows * d).unwrap(), x, "copy ({rows}×{d})");
        assert_eq!(
            g.download(&y2, rows * d).unwrap(),
            y,
            "keeping y ({rows}×{d})"
        );
        assert_eq!(g.download(&inv2, rows).unwrap(), inv, "keeping inv");
        // Backward into preset accumulators.
        let dy = r.bf16s(rows * d, 1.0);
        let (dx0, dw0) = (r.f32s(rows * d, 1.0), r.f32s(d, 1.0));
        let (mut dxd, mut dwd) = (g.upload(&dx0).unwrap(), g.upload(&dw0).unwrap());
        let invd = g.upload(&winv).unwrap();
        g.rmsnorm_backward(
            &xd,
            &wd,
            &invd,
            &g.upload(&dy).unwrap(),
            &mut dxd,
            &mut dwd,
            rows,
        )
        .unwrap();
        let (rdx, rdw) = rmsnorm_backward_reference(&x, &w, &winv, &dy);
        let want_dx: Vec<f32> = dx0.iter().zip(&rdx).map(|(a, b)| a + b).collect();
        let want_dw: Vec<f32> = dw0.iter().zip(&rdw).map(|(a, b)| a + b).collect();
        let e = rel(&g.download(&dxd, rows * d).unwrap(), &want_dx);
        assert!(e < 1e-5, "dx relative error {e} ({rows}×{d})");
        let e = rel(&g.download(&dwd, d).unwrap(), &want_dw);
        assert!(e < 1e-4, "dw relative error {e} ({rows}×{d})");
        // bf16 input (head norms): same math on the widened input.
        let xb = r.bf16s(rows * d, 3.0);
        let xbd = g.upload(&xb).unwrap();
        let (y, inv) = g.rmsnorm_bf16(&xbd, &wd, rows, 1e-5).unwrap();
        let (wy, winv) = rmsnorm_reference(&wide(&xb), &w, 1e-5);
        assert!(max_ulps(&g.download(&y, rows * d).unwrap(), &wy) <= 1);
        let e = rel(&g.download(&inv, rows).unwrap(), &winv);
        assert!(e < 1e-5, "bf16 rmsnorm inv relative error {e}");
        let mut dwd = g.upload(&dw0).unwrap();
        let dxb = g
            .rmsnorm_bf16_backward(&xbd, &wd, &inv, &g.upload(&dy).unwrap(), &mut dwd, rows)
            .unwrap();
        let (rdx, rdw) = rmsnorm_backward_reference(&wide(&xb), &w, &winv, &dy);
        let e = rel(&wide(&g.download(&dxb, rows * d).unwrap()), &rdx);
        assert!(e < 8e-3, "bf16 dx relative error {e}");
        let want_dw: Vec<f32> = dw0.iter().zip(&rdw).map(|(a, b)| a + b).collect();
        assert!(rel(&g.download(&dwd, d).unwrap(), &want_dw) < 1e-4);
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn head_layout_and_rope_match_the_twin() {
    let g = gpu();
    let mut r = Rng(seed());
    for &(n_seq, seq, heads, dh) in &[(1, 1, 1, 2), (2, 48, 4, 64), (3, 130, 2, 128)] {
        let n = n_seq * seq * heads * dh;
        let x = r.bf16s(n, 2.0);
        let xd = g.upload(&x).unwrap();
        for (theta, to_heads) in [(0.0, true), (0.0, false), (1e6, true), (1e4, false)] {
            let got = g
                .download(
                    &g.heads(&xd, (n_seq, seq, heads, dh), theta, to_heads)
                        .unwrap(),
                    n,
                )
                .unwrap();
            let want = heads_reference(&x, (n_seq, seq, heads, dh), theta, to_heads).unwrap();
            if theta == 0.0 {
                assert_eq!(got, want, "a pure layout change is exact");
            } else {
                // f32 angles on both sides; sincosf vs the library's sin/cos.
                let e = rel(&wide(&got), &wide(&want));
                assert!(e < 4e-3, "rope relative error {e} ({seq}×{dh}, θ {theta})");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn causal_softmax_forward_and_backward_match_the_twins() {
    let g = gpu();
    let mut r = Rng(seed());
    for &(rows, seq) in &[(1, 1), (96, 48), (4096, 512), (130, 1000)] {
        let s = r.bf16s(rows * seq, 8.0);
        let scale = 0.125;
        let p = g
            .softmax_causal(&g.upload(&s).unwrap(), rows, seq, scale)
            .unwrap();
        let p = g.download(&p, rows * seq).unwrap();
        let want = softmax_causal_reference(&s, seq, scale);
        let e = rel(&wide(&p), &wide(&want));
        assert!(e < 4e-3, "softmax relative error {e} ({rows}×{seq})");
        assert!(
            p.iter().zip(&want).all(|(a, b)| (*a == 0) == (*b == 0)),
            "mask"
        );
        let dp = r.bf16s(rows * seq, 1.0);
        let ds = g
            .softmax_causal_backward(
                &g.upload(&want).unwrap(),
                &g.upload(&dp).unwrap(),
                rows,
                seq,
                scale,
            )
            .unwrap();
        let want = softmax_causal_backward_reference(&want, &dp, seq, scale);
        let e = rel(&wide(&g.download(&ds, rows * seq).unwrap()), &wide(&want));
        assert!(e < 8e-3, "softmax backward relative error {e}");
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn fused_cross_entropy_matches_the_twin() {
    use kernels::gpu::XentLaunch;
    let g = gpu();
    let mut r = Rng(seed());
    let resident = |threads, blocks_per_sm, l2_hints| XentLaunch::Resident {
        threads,
        blocks_per_sm,
        l2_hints,
    };
    // Rows whose starts are not 16-byte aligned (v = 1001, 2) take the
    // kernels' scalar head and tail around their 8-wide middle; more rows
    // than blocks (5 000); −∞ logits (masked words) in the rows of 256, and
    // rows whose first chunks are all −∞ (the resident kernel's chunked
    // running max starts from −∞ there).
    let launches = [
        XentLaunch::Streamed,
        XentLaunch::DEFAULT,
        resident(1024, 1, false),
        resident(512, 2, true),
        resident(64, 1, false),
    ];
    for (&(n, v), how) in [
        (1, 2),
        (7, 1001),
        (3, 8),
        (5000, 256),
        (512, 256),
        (64, 151_936),
    ]
    .iter()
    .flat_map(|s| launches.iter().map(move |&h| (s, h)))
    {
        let mut logits = r.bf16s(n * v, 6.0);
        let target: Vec<u32> = (0..n).map(|_| (r.next() % v as u64) as u32).collect();
        if v == 256 {
            for (i, &t) in target.iter().enumerate().step_by(3) {
                let j = (t as usize + 1 + i % (v - 1)) % v; // never the target
                logits[i * v + j] = 0xFF80; // −∞
            }
            for (i, &t) in target.iter().enumerate().skip(1).step_by(5) {
                // The first 64 words −∞ but the target.
                for j in (0..64).filter(|&j| j != t as usize) {
                    logits[i * v + j] = 0xFF80;
                }
            }
        }
        let mut loss = g.upload(&[0.5f32]).unwrap();
        let inv_n = 1.0 / n as f32;
        // SAFETY: every target is below v.
        let d = unsafe {
            g.cross_entropy_with(
                how,
                &g.upload(&logits).unwrap(),
                &g.upload(&target).unwrap(),
                &mut loss,
                (n, v),
                inv_n,
            )
        }
        .unwrap();
        let (wl, wd) = cross_entropy_reference(&logits, &target, v, inv_n).unwrap();
        let got = f64::from(g.download(&loss, 1).unwrap()[0]) - 0.5;
        assert!(
            (got - wl).abs() <= 1e-4 * wl.abs().max(1.0),
            "loss {got} vs {wl} ({n}×{v}, {how:?})"
        );
        let e = rel(&wide(&g.download(&d, n * v).unwrap()), &wide(&wd));
        assert!(e < 4e-3, "dlogits relative error {e} ({n}×{v}, {how:?})");
    }
    // A launch out of the kernel's range is an error, not a launch.
    for bad in [
        resident(0, 1, false),
        resident(100, 1, false),
        resident(2048, 1, false),
        resident(256, 0, true),
    ] {
        let logits = g.upload(&[0u16; 8]).unwrap();
        let target = g.upload(&[0u32]).unwrap();
        let mut loss = g.upload(&[0f32]).unwrap();
        // SAFETY: the target is below v.
        let r = unsafe { g.cross_entropy_with(bad, &logits, &target, &mut loss, (1, 8), 1.0) };
        assert!(
            matches!(r, Err(kernels::KernelError::Launch(_))),
            "{bad:?}: {r:?}"
        );
    }
}

/// The AdamW hyperparameters of the tests (the third step) with `clip`.
fn adam_hp(clip: f32) -> AdamHp {
    AdamHp {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        bc1: 1.0 - 0.9f32.powi(3),
        bc2: 1.0 - 0.95f32.powi(3),
        clip,
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn gradient_norm_and_adamw_match_the_twins() {
    let g = gpu();
    let mut r = Rng(seed());
    let n = 100_003;
    let gf = r.f32s(n, 0.1);
    let gb = r.bf16s(n, 0.1);
    let want: f64 = gf
        .iter()
        .chain(wide(&gb).iter())
        .map(|&x| f64::from(x).powi(2))
        .sum();
    // Prefixes of the f32 buffer: one ending on a whole 16-byte load, one
    // past it (the tail loop).
    let gd = g.upload(&gf).unwrap();
    for len in [n - 7, n - 1] {
        let mut part = g.upload(&[0f32]).unwrap();
        g.sq_sum_into(&gd, len, &mut part).unwrap();
        let part = f64::from(g.download(&part, 1).unwrap()[0]);
        let part_want: f64 = gf[..len].iter().map(|&x| f64::from(x).powi(2)).sum();
        assert!(
            (part - part_want).abs() <= 1e-5 * part_want,
            "{len}: {part} vs {part_want}"
        );
    }
    let mut ns = g.upload(&[0f32]).unwrap();
    g.sq_sum_into(&g.upload(&gf).unwrap(), n, &mut ns).unwrap();
    g.sq_sum_into(&g.upload(&gb).unwrap(), n, &mut ns).unwrap();
    let norm_sq = g.download(&ns, 1).unwrap()[0];
    assert!(
        (f64::from(norm_sq) - want).abs() <= 1e-5 * want,
        "{norm_sq} vs {want}"
    );
    for (clip, grads) in [(0.5f32, gf.clone()), (0.0, wide(&gb)), (1e9, gf)] {
        let hp = adam_hp(clip);
        let (p0, m0, v0) = (r.f32s(n, 1.0), r.f32s(n, 0.01), r.f32s(n, 0.001));
        let v0: Vec<f32> = v0.iter().map(|x| x.abs()).collect();
        let (mut p, mut m, mut v) = (
            g.upload(&p0).unwrap(),
            g.upload(&m0).unwrap(),
            g.upload(&v0).unwrap(),
        );
        let mut p16 = g.upload(&vec![0xFFFFu16; n]).unwrap();
        if clip == 0.0 {
            g.adamw(
                &mut p,
                &mut m,
                &mut v,
                &g.upload(&gb).unwrap(),
                Some(&mut p16),
                &hp,
                &ns,
            )
            .unwrap();
        } else {
            g.adamw(
                &mut p,
                &mut m,
                &mut v,
                &g.upload(&grads).unwrap(),
                Some(&mut p16),
                &hp,
                &ns,
            )
            .unwrap();
        }
        let (mut wp, mut wm, mut wv) = (p0.clone(), m0.clone(), v0.clone());
        let w16 = adamw_reference(&mut wp, &mut wm, &mut wv, &grads, &hp, norm_sq);
        let p_got = g.download(&p, n).unwrap();
        assert!(rel(&p_got, &wp) < 1e-6, "p (clip {clip})");
        assert!(rel(&g.download(&m, n).unwrap(), &wm) < 1e-6, "m");
        assert!(rel(&g.download(&v, n).unwrap(), &wv) < 1e-6, "v");
        check_bf16_copy(
            &g.download(&p16, n).unwrap(),
            &p_got,
            &w16,
            &format!("clip {clip}"),
        );
    }
}

/// The AdamW tests' lengths: below, at and past a 4-wide vector's
/// multiple (the one-by-one tail) and 2²³ + 3 (every thread loops).
const ADAM_LENGTHS: [usize; 5] = [3, 100, 4096, 3 * 4096 + 1235, (1 << 23) + 3];

/// AdamW's bf16 copy: bit for bit the kernel's own new `p` rounded, and
/// within a bf16 rounding (1%) of the twin's copy, with a 1e-6 floor near
/// zero — where the f32 results of the device and the twin, equal to 1e-6
/// of the whole, may sit on either side of a bf16 boundary or of zero, and
/// a distance in bits says nothing (one in ~10⁷ parameters: the 1-ulp bound
/// this replaces failed once at 2²³ + 3, 2026-12-05).
fn check_bf16_copy(got16: &[u16], p_got: &[f32], want16: &[u16], what: &str) {
    let own: Vec<u16> = p_got.iter().map(|&x| to_bf16_bits(x)).collect();
    assert!(
        got16 == own.as_slice(),
        "bf16 copy against the kernel's own p, {what}"
    );
    let far = got16
        .iter()
        .zip(want16)
        .filter(|&(&a, &b)| {
            let (x, y) = (bf16_bits_to_f32(a), bf16_bits_to_f32(b));
            (x - y).abs() > (1e-2 * y.abs()).max(1e-6)
        })
        .count();
    assert_eq!(far, 0, "bf16 copy against the twin's, {what}");
}

/// AdamW against the CPU twin at lengths below, at and past a 4-wide
/// vector's multiple (the one-by-one tail) and at 2²³ + 3 parameters (every
/// thread loops), with f32 and bf16 gradients, with the bf16 copy and
/// without it (a poisoned copy must stay untouched).
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn adamw_matches_the_twin_at_every_length_with_and_without_the_copy() {
    let g = gpu();
    let s = seed();
    let mut r = Rng(s);
    let ns = g.upload(&[7.5f32]).unwrap();
    let hp = adam_hp(1.0);
    for n in ADAM_LENGTHS {
        let (p0, m0) = (r.f32s(n, 1.0), r.f32s(n, 0.01));
        let v0: Vec<f32> = r.f32s(n, 0.001).iter().map(|x| x.abs()).collect();
        let (gf, gb) = (r.f32s(n, 0.1), r.bf16s(n, 0.1));
        for bf16 in [false, true] {
            for copy in [true, false] {
                let (mut p, mut m, mut v) = (
                    g.upload(&p0).unwrap(),
                    g.upload(&m0).unwrap(),
                    g.upload(&v0).unwrap(),
                );
                let mut p16 = g.upload(&vec![0xFFFFu16; n]).unwrap();
                let c = copy.then_some(&mut p16);
                if bf16 {
                    let gd = g.upload(&gb).unwrap();
                    g.adamw(&mut p, &mut m, &mut v, &gd, c, &hp, &ns)
                } else {
                    let gd = g.upload(&gf).unwrap();
                    g.adamw(&mut p, &mut m, &mut v, &gd, c, &hp, &ns)
                }
                .unwrap();
                let (mut wp, mut wm, mut wv) = (p0.clone(), m0.clone(), v0.clone());
                let grads = if bf16 { wide(&gb) } else { gf.clone() };
                let w16 = adamw_reference(&mut wp, &mut wm, &mut wv, &grads, &hp, 7.5);
                let what = format!("n {n} bf16 {bf16} copy {copy} seed {s}");
                let p_got = g.download(&p, n).unwrap();
                assert!(rel(&p_got, &wp) < 1e-6, "p, {what}");
                assert!(rel(&g.download(&m, n).unwrap(), &wm) < 1e-6, "m, {what}");
                assert!(rel(&g.download(&v, n).unwrap(), &wv) < 1e-6, "v, {what}");
                let got16 = g.download(&p16, n).unwrap();
                if copy {
                    check_bf16_copy(&got16, &p_got, &w16, &what);
                } else {
                    assert!(got16.iter().all(|&x| x == 0xFFFF), "no copy asked, {what}");
                }
            }
        }
    }
}

/// AdamW's access-pattern probe (`Gpu::adamw_streams`, the benchmark's
/// ceiling) against its twin, at lengths below, at and past a 4-wide
/// vector's multiple and at 2²³ + 3: the adds exact (f32, one add each),
/// the bf16 copy bit for bit over a poisoned buffer.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn adamw_streams_probe_matches_its_twin() {
    let g = gpu();
    let mut r = Rng(seed());
    for n in ADAM_LENGTHS {
        let (p0, m0, v0) = (r.f32s(n, 1.0), r.f32s(n, 0.01), r.f32s(n, 0.001));
        let gb = r.bf16s(n, 0.1);
        let (mut p, mut m, mut v) = (
            g.upload(&p0).unwrap(),
            g.upload(&m0).unwrap(),
            g.upload(&v0).unwrap(),
        );
        let mut p16 = g.upload(&vec![0xFFFFu16; n]).unwrap();
        g.adamw_streams(&mut p, &mut m, &mut v, &g.upload(&gb).unwrap(), &mut p16)
            .unwrap();
        let (mut wp, mut wm, mut wv) = (p0, m0, v0);
        let w16 = adamw_streams_reference(&mut wp, &mut wm, &mut wv, &wide(&gb));
        assert_eq!(g.download(&p, n).unwrap(), wp, "p, n {n}");
        assert_eq!(g.download(&m, n).unwrap(), wm, "m, n {n}");
        assert_eq!(g.download(&v, n).unwrap(), wv, "v, n {n}");
        assert_eq!(g.download(&p16, n).unwrap(), w16, "bf16 copy, n {n}");
    }
}

/// Attention's products as grouped GEMMs with one group per (sequence,
/// key/value head) whose rows are that head's queries, against a CPU
/// product per group: scores `Q·Kᵀ`, context `P·V`, and `dV = Pᵀ·dC`
/// summed over the group's query heads.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn attention_products_as_grouped_gemms() {
    let g = gpu();
    let mut r = Rng(seed());
    let (n_seq, kv, group, seq, dh) = (2, 2, 3, 40, 64);
    let groups = n_seq * kv;
    let rows_each = group * seq;
    let q = r.bf16s(groups * rows_each * dh, 1.0);
    let k = r.bf16s(groups * seq * dh, 1.0);
    let off = g.even_offsets(groups, rows_each).unwrap();
    let s = g
        .gemm_dev(
            GemmVariant::DataGrad,
            &off,
            groups,
            groups * rows_each,
            &g.upload(&q).unwrap(),
            &g.upload(&k).unwrap(),
            seq,
            dh,
        )
        .unwrap();
    let s = wide(&g.download(&s, groups * rows_each * seq).unwrap());
    let (qf, kf) = (wide(&q), wide(&k));
    for e in 0..groups {
        for i in 0..rows_each {
            for j in 0..seq {
                let want: f32 = (0..dh)
                    .map(|t| qf[(e * rows_each + i) * dh + t] * kf[(e * seq + j) * dh + t])
                    .sum();
                let got = s[(e * rows_each + i) * seq + j];
                assert!(
                    (got - want).abs() <= 1e-2 * (1.0 + want.abs()),
                    "S[{e}][{i}][{j}]"
                );
            }
        }
    }
    let p = r.bf16s(groups * rows_each * seq, 1.0);
    let dc = r.bf16s(groups * rows_each * dh, 1.0);
    let dv = g
        .gemm_dev(
            GemmVariant::WeightGrad,
            &off,
            groups,
            groups * rows_each,
            &g.upload(&p).unwrap(),
            &g.upload(&dc).unwrap(),
            seq,
            dh,
        )
        .unwrap();
    let dv = wide(&g.download(&dv, groups * seq * dh).unwrap());
    let (pf, dcf) = (wide(&p), wide(&dc));
    for e in 0..groups {
        for j in 0..seq {
            for t in 0..dh {
                let want: f32 = (0..rows_each)
                    .map(|i| pf[(e * rows_each + i) * seq + j] * dcf[(e * rows_each + i) * dh + t])
                    .sum();
                let got = dv[(e * seq + j) * dh + t];
                assert!(
                    (got - want).abs() <= 1e-2 * (1.0 + want.abs()),
                    "dV[{e}][{j}][{t}]"
                );
            }
        }
    }
}

/// One attention case: random bf16 inputs for `dims` (q and k of scale 2,
/// v and dout of 1) on the host and the device, and the f64 twins' output,
/// row statistic and gradients.
struct AttnCase {
    dims: AttnDims,
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    dout: CudaSlice<u16>,
    o: Vec<f32>,
    lse2: Vec<f32>,
    grads: [Vec<f32>; 3],
}

fn attention_case(g: &Gpu, r: &mut Rng, dims: AttnDims) -> AttnCase {
    let (n_seq, seq, heads, kv, dh) = dims;
    let (nq, nk) = (n_seq * heads * seq * dh, n_seq * kv * seq * dh);
    let (q, k, v, dout) = (
        r.bf16s(nq, 2.0),
        r.bf16s(nk, 2.0),
        r.bf16s(nk, 1.0),
        r.bf16s(nq, 1.0),
    );
    let (o, lse2) = flash_attention_reference(dims, &q, &k, &v).unwrap();
    let (dq, dk, dv) = flash_attention_backward_reference(dims, &q, &k, &v, &dout).unwrap();
    AttnCase {
        dims,
        q: g.upload(&q).unwrap(),
        k: g.upload(&k).unwrap(),
        v: g.upload(&v).unwrap(),
        dout: g.upload(&dout).unwrap(),
        o,
        lse2,
        grads: [dq, dk, dv],
    }
}

/// A forward's output and row statistic against the twin: P is rounded to
/// bf16 for P·V and the output to bf16, ≤ 1% in norm; the statistic within
/// 2·10⁻³; every element written (the poison is NaN).
fn check_attention_forward(
    g: &Gpu,
    c: &AttnCase,
    (o, lse2): (&CudaSlice<u16>, &CudaSlice<f32>),
    what: &str,
) {
    let dims = c.dims;
    let got = wide(&g.download(o, c.o.len()).unwrap());
    assert!(got.iter().all(|x| x.is_finite()), "{dims:?} {what}: output");
    let e = rel(&got, &c.o);
    assert!(e <= 1e-2, "{dims:?} {what}: output off by {e:.2e}");
    let lse_err = g
        .download(lse2, c.lse2.len())
        .unwrap()
        .iter()
        .zip(&c.lse2)
        .map(|(a, b)| (a - b).abs())
        // (f32::max would pass over an unwritten, NaN-poisoned entry.)
        .fold(
            0f32,
            |m, x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
        );
    assert!(
        lse_err <= 2e-3,
        "{dims:?} {what}: lse2 off by {lse_err:.2e}"
    );
}

/// A backward's gradients against the twin: P and dS are rounded to bf16
/// for the products, D comes from the bf16 output, the gradients are bf16
/// (CUTLASS's grouped dK, dV also once per query head before the group's
/// f32 sum): ≤ 2% in norm, with a floor where the exact gradient is zero
/// (a single key: dS = P·(dP − D) cancels, and only rounding remains).
fn check_attention_backward(g: &Gpu, c: &AttnCase, got: [&CudaSlice<u16>; 3], what: &str) {
    let dims = c.dims;
    for ((name, got), want) in ["dq", "dk", "dv"].into_iter().zip(got).zip(&c.grads) {
        let got = wide(&g.download(got, want.len()).unwrap());
        assert!(
            got.iter().all(|x| x.is_finite()),
            "{dims:?} {what}: {name} not finite"
        );
        let diff = got
            .iter()
            .zip(want)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm = want
            .iter()
            .map(|b| f64::from(*b).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            diff <= 2e-2 * norm.max(1e-2 * (want.len() as f64).sqrt()),
            "{dims:?} {what}: {name} off by {diff:.2e} in norm (exact {norm:.2e})"
        );
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn fused_attention_forward_and_backward_match_the_twins() {
    let g = gpu();
    let mut r = Rng(seed());
    // (n_seq, seq, heads, kv_heads, head_dim): every head width the
    // kernels have, sequences not a multiple of the 64-row blocks, one of a
    // single token, grouped and plain heads.
    for dims in [
        (2, 100, 4, 2, 16),
        (1, 130, 2, 1, 32),
        (2, 64, 4, 2, 64),
        (3, 70, 6, 3, 64),
        (2, 192, 4, 4, 64),
        (1, 150, 4, 1, 128),
        (2, 257, 8, 2, 128),
        (1, 300, 4, 2, 128),
        (1, 1, 2, 2, 64),
    ] {
        let c = attention_case(&g, &mut r, dims);
        let (o, lse2) = g.flash_attention_forward(dims, &c.q, &c.k, &c.v).unwrap();
        check_attention_forward(&g, &c, (&o, &lse2), "forward");
        // dQ both ways: from the dS the dK/dV kernel stores, and recomputed.
        for path in [AttnDq::Stored, AttnDq::Recompute] {
            let (dq, dk, dv) = g
                .flash_attention_backward_with(dims, (&c.q, &c.k, &c.v), (&o, &lse2), &c.dout, path)
                .unwrap();
            check_attention_backward(&g, &c, [&dq, &dk, &dv], &format!("{path:?}"));
        }
    }
    // A head width without kernels is an error, not a launch.
    let z = g.upload(&[0u16; 48]).unwrap();
    assert!(g
        .flash_attention_forward((1, 1, 1, 1, 48), &z, &z, &z)
        .is_err());
}

/// The CUTLASS attention forward (both schedules) against the CPU twin at
/// the shapes it takes (head widths 64 and 128, sequences of whole 128-row
/// tiles, grouped and plain heads, several sequences), outputs poisoned;
/// the same tolerances as the `mma.sync` kernel's; its output and row
/// statistic feed both backwards (the `mma.sync` kernels' and CUTLASS's)
/// to the twin's gradients; shapes it does not take are errors, and the
/// defaults fall back to the `mma.sync` kernels there.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn cutlass_attention_forward_matches_the_twin_and_feeds_the_backward() {
    let g = gpu();
    let mut r = Rng(seed());
    for dims in [
        (2, 128, 4, 2, 64),
        (3, 256, 6, 3, 64),
        (1, 512, 2, 2, 64),
        (1, 128, 4, 1, 128),
        (2, 384, 8, 2, 128),
        (1, 256, 4, 4, 128),
    ] {
        let c = attention_case(&g, &mut r, dims);
        for kernel in [AttnFwd::Cooperative, AttnFwd::Pingpong] {
            assert!(g.flash_forward_takes(kernel, dims), "{dims:?}");
            let (o, lse2) = g
                .flash_attention_forward_with(dims, &c.q, &c.k, &c.v, kernel)
                .unwrap();
            check_attention_forward(&g, &c, (&o, &lse2), &format!("{kernel:?}"));
            for path in [AttnDq::Stored, AttnDq::Cutlass] {
                let (dq, dk, dv) = g
                    .flash_attention_backward_with(
                        dims,
                        (&c.q, &c.k, &c.v),
                        (&o, &lse2),
                        &c.dout,
                        path,
                    )
                    .unwrap();
                check_attention_backward(&g, &c, [&dq, &dk, &dv], &format!("{kernel:?} {path:?}"));
            }
        }
    }
    // Shapes the library does not take: an error when asked for by name,
    // the mma.sync kernels by default.
    for dims in [(1, 100, 2, 1, 64), (1, 128, 2, 1, 32), (1, 130, 2, 2, 128)] {
        let c = attention_case(&g, &mut r, dims);
        let qkv = (&c.q, &c.k, &c.v);
        assert!(!g.flash_forward_takes(AttnFwd::Cooperative, dims));
        assert!(g
            .flash_attention_forward_with(dims, &c.q, &c.k, &c.v, AttnFwd::Cooperative)
            .is_err());
        let (o, lse2) = g.flash_attention_forward(dims, &c.q, &c.k, &c.v).unwrap();
        check_attention_forward(&g, &c, (&o, &lse2), "fallback");
        assert!(g
            .flash_attention_backward_with(dims, qkv, (&o, &lse2), &c.dout, AttnDq::Cutlass)
            .is_err());
        let (dq, dk, dv) = g
            .flash_attention_backward(dims, qkv, (&o, &lse2), &c.dout)
            .unwrap();
        check_attention_backward(&g, &c, [&dq, &dk, &dv], "fallback");
    }
}

/// cuDNN's fused attention backward (`AttnDq::Cudnn`, on the machine's
/// `libcudnn.so.9`) against the CPU twin's gradients, fed by both forwards
/// (the `mma.sync` kernel at every width and length, CUTLASS's where it
/// takes the shape), outputs poisoned, the `mma.sync` backward's
/// tolerances; by default it is the backward at head widths ≥ 64. Fails where
/// cuDNN does not open: the device machine has it (PyTorch's).
#[test]
#[ignore = "needs a GPU and cuDNN: run with --ignored on the device"]
fn cudnn_attention_backward_matches_the_twin() {
    let g = gpu();
    let (path, version) = g.cudnn_attention().unwrap_or_else(|e| panic!("cuDNN: {e}"));
    eprintln!("cuDNN {version} from {}", path.display());
    let mut r = Rng(seed());
    for dims in [
        (2, 100, 4, 2, 64),
        (3, 70, 6, 3, 64),
        (1, 130, 2, 1, 32),
        (2, 128, 4, 2, 64),
        (1, 150, 4, 1, 128),
        (2, 257, 8, 2, 128),
        (2, 384, 8, 2, 128),
        (1, 256, 4, 4, 128),
    ] {
        let c = attention_case(&g, &mut r, dims);
        let qkv = (&c.q, &c.k, &c.v);
        let mut forwards = vec![AttnFwd::Mma];
        if g.flash_forward_takes(AttnFwd::Cooperative, dims) {
            forwards.push(AttnFwd::Cooperative);
        }
        for kernel in forwards {
            let (o, lse2) = g
                .flash_attention_forward_with(dims, &c.q, &c.k, &c.v, kernel)
                .unwrap();
            check_attention_forward(&g, &c, (&o, &lse2), &format!("{kernel:?}"));
            let (dq, dk, dv) = g
                .flash_attention_backward_with(dims, qkv, (&o, &lse2), &c.dout, AttnDq::Cudnn)
                .unwrap_or_else(|e| panic!("{dims:?}: {e}"));
            check_attention_backward(&g, &c, [&dq, &dk, &dv], &format!("{kernel:?} cudnn"));
            if dims.4 >= 64 {
                // The default at these widths.
                let (dq, dk, dv) = g
                    .flash_attention_backward(dims, qkv, (&o, &lse2), &c.dout)
                    .unwrap();
                check_attention_backward(&g, &c, [&dq, &dk, &dv], &format!("{kernel:?} default"));
            }
        }
    }
    // Shapes cuDNN does not take (a single token: cuDNN 9.14 refuses
    // s_q = s_kv = 1; a width it has no kernel for) are an error when asked
    // for by name, and the default backward falls back to the others.
    for dims in [(1, 1, 2, 2, 64), (2, 1, 4, 2, 128)] {
        let c = attention_case(&g, &mut r, dims);
        let qkv = (&c.q, &c.k, &c.v);
        let (o, lse2) = g.flash_attention_forward(dims, &c.q, &c.k, &c.v).unwrap();
        if g.cudnn_attention_workspace(dims).is_err() {
            assert!(g
                .flash_attention_backward_with(dims, qkv, (&o, &lse2), &c.dout, AttnDq::Cudnn)
                .is_err());
        }
        let (dq, dk, dv) = g
            .flash_attention_backward(dims, qkv, (&o, &lse2), &c.dout)
            .unwrap();
        check_attention_backward(&g, &c, [&dq, &dk, &dv], "fallback");
    }
    assert!(g.cudnn_attention_workspace((1, 64, 2, 2, 12)).is_err());
}

/// The dense model's one-group GEMMs (cuBLAS, or the grouped kernels
/// under `LRMOE_DENSE_GEMM=cutlass`: run it both ways) against the CPU twin, every variant, on shapes that are
/// not tile multiples, outputs poisoned: within bf16 rounding of the f32
/// product (1% in norm) and no element left unwritten. The tall case
/// (8 192 rows into a 256 × 136 weight gradient) is the kind cuBLAS may
/// split along the reduction, through its workspace
/// (`LRMOE_CUBLAS_WORKSPACE_MIB`: run it with 0 and 32 too).
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn one_group_gemms_match_the_cpu_twin() {
    let g = gpu();
    eprintln!("dense GEMM: {}", g.dense_gemm());
    let mut r = Rng(seed());
    for &(rows, h, f) in &[(77, 64, 40), (1000, 256, 136), (3, 8, 8), (8192, 256, 136)] {
        let off = g.even_offsets(1, rows).unwrap();
        let offsets = [0, rows as i32];
        for variant in [
            GemmVariant::Forward,
            GemmVariant::DataGrad,
            GemmVariant::WeightGrad,
        ] {
            let (na, nb, nd) = match variant {
                GemmVariant::Forward => (rows * h, h * f, rows * f),
                GemmVariant::DataGrad => (rows * f, h * f, rows * h),
                GemmVariant::WeightGrad => (rows * h, rows * f, h * f),
            };
            let (a, b) = (r.bf16s(na, 1.0), r.bf16s(nb, 1.0));
            let d = g
                .gemm_dev(
                    variant,
                    &off,
                    1,
                    rows,
                    &g.upload(&a).unwrap(),
                    &g.upload(&b).unwrap(),
                    h,
                    f,
                )
                .unwrap();
            let got = wide(&g.download(&d, nd).unwrap());
            let want =
                kernels::cpu::grouped_gemm_reference(variant, &offsets, &a, &b, h, f).unwrap();
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{variant:?} {rows}×{h}×{f}: unwritten"
            );
            let e = rel(&got, &want);
            assert!(e <= 1e-2, "{variant:?} {rows}×{h}×{f}: {e}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn sums_and_copies_through_addresses_match_the_twin_bit_for_bit() {
    use kernels::gpu::SumPart;
    let g = gpu();
    let mut r = Rng(seed());
    // Lengths around the kernel's 4096-element chunks, an empty part, and
    // one destination that is also its first source (in place).
    let lens = [1usize, 4095, 4096, 4097, 0, 10_000, 33];
    let k = 5;
    let srcs: Vec<Vec<Vec<f32>>> = lens
        .iter()
        .map(|&n| {
            (0..k)
                .map(|_| {
                    let mut v = r.f32s(n, 1e3);
                    if n > 0 {
                        v[0] = -0.0; // signed zeros: the sum from 0.0 loses them, a copy keeps them
                    }
                    v
                })
                .collect()
        })
        .collect();
    let dev: Vec<Vec<_>> = srcs
        .iter()
        .map(|p| p.iter().map(|s| g.upload(s).unwrap()).collect())
        .collect();
    for from_zero in [true, false] {
        for kk in [1, k] {
            // Poisoned destinations; part 3 sums into its own first source.
            let mut dsts: Vec<_> = lens
                .iter()
                .map(|&n| g.upload(&vec![f32::NAN; n.max(1)]).unwrap())
                .collect();
            let own = g.upload(&srcs[3][0]).unwrap();
            let parts: Vec<SumPart> = lens
                .iter()
                .enumerate()
                .map(|(j, &n)| {
                    let first = if j == 3 {
                        g.address(&own, 0).unwrap()
                    } else {
                        g.address(&dev[j][0], 0).unwrap()
                    };
                    let mut s = vec![first];
                    s.extend((1..kk).map(|p| g.address(&dev[j][p], 0).unwrap()));
                    let dst = if j == 3 {
                        first
                    } else {
                        g.address(&dsts[j], 0).unwrap()
                    };
                    SumPart { dst, srcs: s, n }
                })
                .collect();
            // SAFETY: every address holds its part's n f32 and lives past
            // the downloads below.
            unsafe { g.sum_parts(&parts, from_zero) }.unwrap();
            dsts[3] = own;
            for (j, &n) in lens.iter().enumerate() {
                let views: Vec<&[f32]> = srcs[j][..kk].iter().map(|v| v.as_slice()).collect();
                let want = sum_parts_reference(&views, from_zero);
                let got = g.download(&dsts[j], n).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "part {j}, from_zero {from_zero}, {kk} sources"
                );
            }
        }
    }
    // Parts with different numbers of sources are refused.
    let a = g.address(&dev[1][0], 0).unwrap();
    let bad = [
        SumPart {
            dst: a,
            srcs: vec![a],
            n: 1,
        },
        SumPart {
            dst: a,
            srcs: vec![a, a],
            n: 1,
        },
    ];
    // SAFETY: refused before any launch.
    assert!(unsafe { g.sum_parts(&bad, true) }.is_err());
}
