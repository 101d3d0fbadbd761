//! Layer tests: finite differences, an independent naive reference, EP = N
//! against EP = 1, compaction of the backward exchange, bad input.

#![allow(clippy::needless_range_loop, clippy::type_complexity)] // the reference reads as the math does

use std::time::Duration;

use super::*;
use quota::Placement;

const TIMEOUT: Duration = Duration::from_secs(60);

fn cfg(renormalize: bool) -> MoeConfig {
    MoeConfig {
        hidden: 6,
        ffn: 5,
        n_experts: 4,
        top_k: 2,
        renormalize,
    }
}

fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x2545F4914F6CDD1D) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20001) as f64 / 10000.0 - 1.0
        })
        .collect()
}

fn placement(n_experts: usize, n_ranks: usize) -> Placement {
    Placement {
        owner: (0..n_experts).map(|e| e * n_ranks / n_experts).collect(),
        replicas: vec![],
    }
}

/// Output of running the layer on `n_ranks` in-process ranks, tokens split
/// evenly, concatenated back in token order.
struct Run {
    y: Vec<f64>,
    dx: Vec<f64>,
    grads: MoeParams<f64>,
    kept: Vec<bool>,
    bytes_sent: u64,
    kept_pairs: usize,
    /// Σ over ranks of each rank's auxiliary loss.
    aux: f64,
}

fn run(
    cfg: &MoeConfig,
    bwd: &CallConfig,
    params: &MoeParams<f64>,
    x: &[f64],
    dy: &[f64],
    n_ranks: usize,
) -> Result<Run, LayerError> {
    let hd = cfg.hidden;
    let n_tok = x.len() / hd;
    let place = placement(cfg.n_experts, n_ranks);
    let per_rank: Vec<Result<_, LayerError>> = run_local(n_ranks, TIMEOUT, |t| {
        let r = t.rank();
        let (lo, hi) = (r * n_tok / n_ranks, (r + 1) * n_tok / n_ranks);
        let (y, saved) = forward(t, cfg, bwd, params, &place, &x[lo * hd..hi * hd])?;
        let (dx, grads, stats) = backward(t, cfg, bwd, params, &saved, &dy[lo * hd..hi * hd])?;
        Ok((y, dx, grads, stats, saved.aux_loss()))
    });
    let mut out = Run {
        y: vec![],
        dx: vec![],
        grads: MoeParams::zeros(cfg),
        kept: vec![],
        bytes_sent: 0,
        kept_pairs: 0,
        aux: 0.0,
    };
    for (r, res) in per_rank.into_iter().enumerate() {
        let (y, dx, grads, stats, aux) = res?;
        out.aux += aux;
        out.y.extend(y);
        out.dx.extend(dx);
        out.kept.extend(stats.kept);
        out.bytes_sent += stats.bytes_sent;
        out.kept_pairs += stats.kept_pairs;
        if r == 0 {
            out.grads = grads;
        } else {
            assert_eq!(
                out.grads, grads,
                "all-reduced gradients differ between ranks"
            );
        }
    }
    Ok(out)
}

/// Naive per-pair reference in f64: forward, and the exact gradient of the
/// computation with the expert contributions of pairs where `kept` is false
/// removed (the router gradient stays complete).
fn reference(
    cfg: &MoeConfig,
    p: &MoeParams<f64>,
    x: &[f64],
    dy: &[f64],
    kept: &[bool],
) -> (Vec<f64>, Vec<f64>, MoeParams<f64>) {
    let (hd, f, en, k) = (cfg.hidden, cfg.ffn, cfg.n_experts, cfg.top_k);
    let n = x.len() / hd;
    let silu = |a: f64| a / (1.0 + (-a).exp());
    let dsilu = |a: f64| {
        let s = 1.0 / (1.0 + (-a).exp());
        s * (1.0 + a * (1.0 - s))
    };
    let mut y = vec![0.0; n * hd];
    let mut dx = vec![0.0; n * hd];
    let mut g = MoeParams::<f64>::zeros(cfg);
    for t in 0..n {
        let xt = &x[t * hd..(t + 1) * hd];
        let logits: Vec<f64> = (0..en)
            .map(|e| (0..hd).map(|i| xt[i] * p.router[i * en + e]).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let prob: Vec<f64> = logits.iter().map(|l| (l - m).exp() / z).collect();
        let mut order: Vec<usize> = (0..en).collect();
        order.sort_by(|&a, &b| prob[b].partial_cmp(&prob[a]).unwrap().then(a.cmp(&b)));
        let sel = &order[..k];
        let s: f64 = sel.iter().map(|&e| prob[e]).sum();
        let gate: Vec<f64> = sel
            .iter()
            .map(|&e| {
                if cfg.renormalize {
                    prob[e] / s
                } else {
                    prob[e]
                }
            })
            .collect();
        let mut dg = vec![0.0; k];
        for (j, &e) in sel.iter().enumerate() {
            let w = &p.experts[e];
            let a: Vec<f64> = (0..f)
                .map(|c| (0..hd).map(|i| xt[i] * w.gate[i * f + c]).sum())
                .collect();
            let b: Vec<f64> = (0..f)
                .map(|c| (0..hd).map(|i| xt[i] * w.up[i * f + c]).sum())
                .collect();
            let h: Vec<f64> = (0..f).map(|c| silu(a[c]) * b[c]).collect();
            let o: Vec<f64> = (0..hd)
                .map(|i| (0..f).map(|c| h[c] * w.down[c * hd + i]).sum())
                .collect();
            for i in 0..hd {
                y[t * hd + i] += gate[j] * o[i];
            }
            let dyt = &dy[t * hd..(t + 1) * hd];
            dg[j] = (0..hd).map(|i| dyt[i] * o[i]).sum();
            if !kept[t * k + j] {
                continue;
            }
            let dout: Vec<f64> = dyt.iter().map(|v| v * gate[j]).collect();
            let ge = &mut g.experts[e];
            let dh: Vec<f64> = (0..f)
                .map(|c| (0..hd).map(|i| dout[i] * w.down[c * hd + i]).sum())
                .collect();
            for c in 0..f {
                for i in 0..hd {
                    ge.down[c * hd + i] += h[c] * dout[i];
                }
                let da = dh[c] * b[c] * dsilu(a[c]);
                let db = dh[c] * silu(a[c]);
                for i in 0..hd {
                    ge.gate[i * f + c] += xt[i] * da;
                    ge.up[i * f + c] += xt[i] * db;
                    dx[t * hd + i] += da * w.gate[i * f + c] + db * w.up[i * f + c];
                }
            }
        }
        let mut dp = vec![0.0; en];
        if cfg.renormalize {
            let dot: f64 = (0..k).map(|j| dg[j] * gate[j]).sum();
            for (j, &e) in sel.iter().enumerate() {
                dp[e] = (dg[j] - dot) / s;
            }
        } else {
            for (j, &e) in sel.iter().enumerate() {
                dp[e] = dg[j];
            }
        }
        let dot: f64 = (0..en).map(|e| prob[e] * dp[e]).sum();
        for e in 0..en {
            let dl = prob[e] * (dp[e] - dot);
            for i in 0..hd {
                g.router[i * en + e] += xt[i] * dl;
                dx[t * hd + i] += dl * p.router[i * en + e];
            }
        }
    }
    (y, dx, g)
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn assert_grads_close(got: &MoeParams<f64>, want: &MoeParams<f64>, tol: f64) {
    for ((name, g), (_, w)) in got.tensors().into_iter().zip(want.tensors()) {
        assert_close(&name, g, w, tol);
    }
}

fn setup(cfg: &MoeConfig, n_tok: usize, seed: u64) -> (MoeParams<f64>, Vec<f64>, Vec<f64>) {
    let params = MoeParams::<f64>::init(cfg, seed);
    (
        params,
        data(n_tok * cfg.hidden, seed + 1),
        data(n_tok * cfg.hidden, seed + 2),
    )
}

/// Loss `Σ dy · y` of the layer on one rank.
fn loss(cfg: &MoeConfig, params: &MoeParams<f64>, x: &[f64], dy: &[f64]) -> f64 {
    let r = run(cfg, &CallConfig::default(), params, x, dy, 1).unwrap();
    r.y.iter().zip(dy).map(|(a, b)| a * b).sum()
}

#[test]
fn full_retention_gradients_match_central_finite_differences() {
    for renormalize in [false, true] {
        let cfg = cfg(renormalize);
        let (params, x, dy) = setup(&cfg, 9, 11);
        let r = run(&cfg, &CallConfig::default(), &params, &x, &dy, 1).unwrap();
        let eps = 1e-6;
        let fd = |perturb: &dyn Fn(&mut MoeParams<f64>, &mut Vec<f64>, f64)| {
            let (mut p1, mut x1) = (params.clone(), x.clone());
            perturb(&mut p1, &mut x1, eps);
            let (mut p2, mut x2) = (params.clone(), x.clone());
            perturb(&mut p2, &mut x2, -eps);
            (loss(&cfg, &p1, &x1, &dy) - loss(&cfg, &p2, &x2, &dy)) / (2.0 * eps)
        };
        let check = |name: &str, analytic: f64, numeric: f64| {
            assert!(
                (analytic - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "{name} (renorm {renormalize}): analytic {analytic}, numeric {numeric}"
            );
        };
        for i in [0, 7, 23] {
            check("router", r.grads.router[i], fd(&|p, _, d| p.router[i] += d));
        }
        for e in 0..cfg.n_experts {
            for i in [0, 13, 29] {
                check(
                    "gate",
                    r.grads.experts[e].gate[i],
                    fd(&|p, _, d| p.experts[e].gate[i] += d),
                );
                check(
                    "up",
                    r.grads.experts[e].up[i],
                    fd(&|p, _, d| p.experts[e].up[i] += d),
                );
                check(
                    "down",
                    r.grads.experts[e].down[i],
                    fd(&|p, _, d| p.experts[e].down[i] += d),
                );
            }
        }
        for i in [0, 5, 17, 40, 53] {
            check("x", r.dx[i], fd(&|_, x, d| x[i] += d));
        }
    }
}

#[test]
fn full_retention_matches_the_naive_reference_for_every_ep_size() {
    let cfg = cfg(true);
    let (params, x, dy) = setup(&cfg, 24, 5);
    let all = vec![true; 24 * cfg.top_k];
    let (y, dx, g) = reference(&cfg, &params, &x, &dy, &all);
    for n_ranks in [1, 2, 4] {
        for slots in [0, 1] {
            let bwd = CallConfig {
                replica_slots_per_rank: slots,
                replica_rule: quota::ReplicaRule::Fill,
                ..CallConfig::default()
            };
            let r = run(&cfg, &bwd, &params, &x, &dy, n_ranks).unwrap();
            assert_close("y", &r.y, &y, 1e-12);
            assert_close("dx", &r.dx, &dx, 1e-12);
            assert_grads_close(&r.grads, &g, 1e-12);
            assert!(r.kept.iter().all(|&k| k));
        }
    }
}

#[test]
fn pruned_backward_equals_the_gradient_without_the_dropped_pairs() {
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 32, 9);
    for n_ranks in [1, 2, 4] {
        for retention in [0.75, 0.5, 0.25, 0.0] {
            let bwd = CallConfig {
                retention: Retention::Ratio(retention),
                replica_slots_per_rank: 1,
                replica_rule: quota::ReplicaRule::Fill,
                ..CallConfig::default()
            };
            let r = run(&cfg, &bwd, &params, &x, &dy, n_ranks).unwrap();
            let kept_frac = r.kept_pairs as f64 / r.kept.len() as f64;
            assert!(
                (kept_frac - retention).abs() < 0.15,
                "kept {kept_frac} for {retention}"
            );
            let (y, dx, g) = reference(&cfg, &params, &x, &dy, &r.kept);
            assert_close("y", &r.y, &y, 1e-12);
            assert_close("dx", &r.dx, &dx, 1e-12);
            assert_grads_close(&r.grads, &g, 1e-12);
        }
    }
}

#[test]
fn kept_pairs_are_the_highest_scoring_of_each_expert() {
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 40, 3);
    let place = placement(cfg.n_experts, 1);
    let bwd = CallConfig {
        retention: Retention::Ratio(0.5),
        ..CallConfig::default()
    };
    let res: Vec<Result<_, LayerError>> = run_local(1, TIMEOUT, |t| {
        let (_, saved) = forward(t, &cfg, &bwd, &params, &place, &x)?;
        let (_, _, stats) = backward(t, &cfg, &bwd, &params, &saved, &dy)?;
        Ok((saved.expert_of_pair().to_vec(), stats))
    });
    let (experts, stats) = res.into_iter().next().unwrap().unwrap();
    for e in 0..cfg.n_experts as u32 {
        let mine: Vec<usize> = (0..experts.len()).filter(|&p| experts[p] == e).collect();
        let min_kept = mine
            .iter()
            .filter(|&&p| stats.kept[p])
            .map(|&p| stats.scores[p])
            .fold(f32::MAX, f32::min);
        let max_dropped = mine
            .iter()
            .filter(|&&p| !stats.kept[p])
            .map(|&p| stats.scores[p])
            .fold(f32::MIN, f32::max);
        assert!(min_kept >= max_dropped, "expert {e}");
    }
}

#[test]
fn forward_buffers_hold_the_rows_each_rank_s_owned_experts_computed() {
    // No replica: every rank computes all the rows of the experts it owns
    // in the forward, however few its backward keeps.
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 48, 5);
    let ranks = 2;
    let place = placement(cfg.n_experts, ranks);
    let bwd = CallConfig {
        retention: Retention::Ratio(0.25),
        ..CallConfig::default()
    };
    let n_tok = x.len() / cfg.hidden;
    let res: Vec<Result<_, LayerError>> = run_local(ranks, TIMEOUT, |t| {
        let r = t.rank();
        let (lo, hi) = (r * n_tok / ranks, (r + 1) * n_tok / ranks);
        let rows = lo * cfg.hidden..hi * cfg.hidden;
        let (_, saved) = forward(t, &cfg, &bwd, &params, &place, &x[rows.clone()])?;
        let (_, _, stats) = backward(t, &cfg, &bwd, &params, &saved, &dy[rows])?;
        Ok(stats)
    });
    let row_bytes = (2 * cfg.hidden * std::mem::size_of::<f64>()) as u64;
    let mut total = 0;
    for (r, stats) in res.into_iter().enumerate() {
        let stats = stats.unwrap();
        assert_eq!(stats.forward_buffer_bytes % row_bytes, 0);
        let rows = stats.forward_buffer_bytes / row_bytes;
        let owned: u64 = (0..cfg.n_experts)
            .filter(|&e| place.owner[e] == r)
            .map(|e| stats.expert_load[e])
            .sum();
        assert_eq!(rows, owned, "rank {r}");
        assert!(rows > 0);
        total += rows;
    }
    assert_eq!(total as usize, n_tok * cfg.top_k, "every pair once");
}

#[test]
fn f32_layer_matches_f64_within_tolerance() {
    let cfg = MoeConfig {
        hidden: 16,
        ffn: 24,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let (params, x, dy) = setup(&cfg, 64, 21);
    let r64 = run(&cfg, &CallConfig::default(), &params, &x, &dy, 2).unwrap();
    let to32 = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
    let p32 = MoeParams {
        router: to32(&params.router),
        experts: params
            .experts
            .iter()
            .map(|e| ExpertWeights {
                gate: to32(&e.gate),
                up: to32(&e.up),
                down: to32(&e.down),
            })
            .collect(),
    };
    let place = placement(cfg.n_experts, 2);
    let (x32, dy32) = (to32(&x), to32(&dy));
    let bwd = CallConfig::default();
    let res: Vec<Result<_, LayerError>> = run_local(2, TIMEOUT, |t| {
        let n = 32 * cfg.hidden;
        let r = t.rank();
        let (y, saved) = forward(t, &cfg, &bwd, &p32, &place, &x32[r * n..(r + 1) * n])?;
        let (dx, g, _) = backward(t, &cfg, &bwd, &p32, &saved, &dy32[r * n..(r + 1) * n])?;
        Ok((y, dx, g))
    });
    let (y0, dx0, g) = res.into_iter().next().unwrap().unwrap();
    let rel = |a: &[f32], b: &[f64]| {
        let num: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - y).powi(2))
            .sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-300)).sqrt()
    };
    let n = 32 * cfg.hidden;
    assert!(rel(&y0, &r64.y[..n]) < 1e-5);
    assert!(rel(&dx0, &r64.dx[..n]) < 1e-5);
    assert!(rel(&g.router, &r64.grads.router) < 1e-5);
    assert!(rel(&g.experts[3].down, &r64.grads.experts[3].down) < 1e-5);
}

#[test]
fn backward_exchange_bytes_scale_with_the_kept_fraction() {
    let cfg = MoeConfig {
        hidden: 32,
        ffn: 16,
        n_experts: 8,
        top_k: 2,
        renormalize: false,
    };
    let (params, x, dy) = setup(&cfg, 256, 4);
    let bytes = |r: f64| {
        let bwd = CallConfig {
            retention: Retention::Ratio(r),
            ..CallConfig::default()
        };
        run(&cfg, &bwd, &params, &x, &dy, 4).unwrap().bytes_sent as f64
    };
    let full = bytes(1.0);
    assert!(full > 0.0);
    for r in [0.5, 0.25] {
        let ratio = bytes(r) / full;
        assert!(
            (ratio - r).abs() < 0.08,
            "retention {r}: bytes ratio {ratio}"
        );
    }
}

#[test]
fn per_expert_selection_keeps_the_same_pairs_for_every_ep_size() {
    // The selection is per expert over every source's pairs, so how tokens
    // are split over ranks changes neither the kept set nor the gradients.
    let cfg = cfg(true);
    let (params, x, dy) = setup(&cfg, 48, 21);
    for retention in [Retention::Ratio(0.5), Retention::Ratio(0.25)] {
        let bwd = CallConfig {
            retention,
            ..CallConfig::default()
        };
        let one = run(&cfg, &bwd, &params, &x, &dy, 1).unwrap();
        for n_ranks in [2, 4] {
            let r = run(&cfg, &bwd, &params, &x, &dy, n_ranks).unwrap();
            assert_eq!(r.kept, one.kept, "EP = {n_ranks}: another kept set");
            assert_close("dx", &r.dx, &one.dx, 1e-10);
            assert_grads_close(&r.grads, &one.grads, 1e-10);
        }
        // ...and every expert kept round(r · n_e) pairs, its best ones.
        let (_, dx, g) = reference(&cfg, &params, &x, &dy, &one.kept);
        assert_close("dx", &one.dx, &dx, 1e-12);
        assert_grads_close(&one.grads, &g, 1e-12);
    }
}

#[test]
fn a_binding_send_budget_selects_per_source_within_its_cells() {
    let cfg = MoeConfig {
        hidden: 8,
        ffn: 8,
        n_experts: 4,
        top_k: 2,
        renormalize: false,
    };
    let (params, x, dy) = setup(&cfg, 64, 9);
    let place = placement(cfg.n_experts, 2);
    // Each source may send at most 24 rows of 128 B in the backward.
    let budget = quota::RankBudget {
        memory_bytes: u64::MAX / 4,
        network_bytes: 24 * 128,
    };
    let bwd = CallConfig {
        retention: Retention::Budgeted {
            budgets: vec![budget; 2],
            policy: quota::Policy::Maxmin,
        },
        ..CallConfig::default()
    };
    let res: Vec<Result<_, LayerError>> = run_local(2, TIMEOUT, |t| {
        let r = t.rank();
        let (x, dy) = (
            &x[r * 32 * 8..(r + 1) * 32 * 8],
            &dy[r * 32 * 8..(r + 1) * 32 * 8],
        );
        let (_, saved) = forward(t, &cfg, &bwd, &params, &place, x)?;
        let (_, _, stats) = backward(t, &cfg, &bwd, &params, &saved, dy)?;
        Ok((
            saved.plan.clone(),
            saved.expert_of_pair().to_vec(),
            stats.kept,
        ))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (plan, experts, kept) = r.unwrap();
        assert_eq!(plan.selection, Selection::PerSourceExpert);
        for e in 0..cfg.n_experts {
            let k = (0..kept.len())
                .filter(|&p| kept[p] && experts[p] as usize == e)
                .count() as u64;
            assert!(
                k <= plan.kept[rank][e],
                "rank {rank} expert {e}: {k} > its cell quota"
            );
        }
        assert!(plan.kept[rank].iter().sum::<u64>() <= 24);
    }
}

#[test]
fn budgeted_retention_runs_the_controller() {
    let cfg = MoeConfig {
        hidden: 8,
        ffn: 8,
        n_experts: 4,
        top_k: 2,
        renormalize: false,
    };
    let (params, x, dy) = setup(&cfg, 64, 8);
    // Per rank: 2 experts (2 × 2 × 3·8·8·8 B = 6144 B) + room for 20 pairs of 128 B.
    let budget = quota::RankBudget {
        memory_bytes: 6144 + 20 * 128,
        network_bytes: u64::MAX,
    };
    let bwd = CallConfig {
        retention: Retention::Budgeted {
            budgets: vec![budget; 2],
            policy: quota::Policy::Maxmin,
        },
        ..CallConfig::default()
    };
    let r = run(&cfg, &bwd, &params, &x, &dy, 2).unwrap();
    assert!(
        r.kept_pairs <= 40,
        "kept {} pairs with room for 40",
        r.kept_pairs
    );
    assert!(r.kept_pairs >= 30);
    let (_, dx, g) = reference(&cfg, &params, &x, &dy, &r.kept);
    assert_close("dx", &r.dx, &dx, 1e-12);
    assert_grads_close(&r.grads, &g, 1e-12);
}

#[test]
fn bad_configs_and_inputs_are_errors() {
    let good = cfg(false);
    let (params, x, dy) = setup(&good, 4, 1);
    let bad_k = MoeConfig { top_k: 5, ..good };
    assert!(matches!(
        run(&bad_k, &CallConfig::default(), &params, &x, &dy, 1),
        Err(LayerError::Config(_))
    ));
    let zero = MoeConfig {
        n_experts: 0,
        ..good
    };
    assert!(matches!(
        run(&zero, &CallConfig::default(), &params, &x, &dy, 1),
        Err(LayerError::Config(_))
    ));
    let mut nan_dy = dy.clone();
    nan_dy[3] = f64::NAN;
    assert!(matches!(
        run(&good, &CallConfig::default(), &params, &x, &nan_dy, 1),
        Err(LayerError::NonFinite(_))
    ));
    let wrong = MoeConfig { hidden: 7, ..good };
    assert!(matches!(
        run(&wrong, &CallConfig::default(), &params, &x, &dy, 1),
        Err(LayerError::Shape { .. })
    ));
    let bad_ratio = CallConfig {
        retention: Retention::Ratio(1.5),
        ..CallConfig::default()
    };
    assert!(matches!(
        run(&good, &bad_ratio, &params, &x, &dy, 2),
        Err(LayerError::Config(_))
    ));
}

#[test]
fn capacity_dropping_skips_the_expert_in_forward_and_backward() {
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 40, 12);
    let bwd = CallConfig {
        capacity_factor: Some(0.5),
        ..CallConfig::default()
    };
    let r = run(&cfg, &bwd, &params, &x, &dy, 1).unwrap();
    // At factor 0.5 each expert takes at most ⌈0.5 · 80 / 4⌉ = 10 pairs.
    assert!(r.kept_pairs <= 40);
    // Reference: dropped pairs have no expert output and no gradient, so the
    // computation equals the dropless one with those pairs' weight set to 0.
    let full = run(&cfg, &CallConfig::default(), &params, &x, &dy, 1).unwrap();
    assert!(
        r.y.iter().zip(&full.y).any(|(a, b)| (a - b).abs() > 1e-9),
        "dropping changed nothing"
    );
    let (_, _, g) = reference(&cfg, &params, &x, &dy, &r.kept);
    for e in 0..cfg.n_experts {
        assert_close("down", &r.grads.experts[e].down, &g.experts[e].down, 1e-12);
        assert_close("gate", &r.grads.experts[e].gate, &g.experts[e].gate, 1e-12);
    }
    let bad = CallConfig {
        capacity_factor: Some(-1.0),
        ..CallConfig::default()
    };
    assert!(matches!(
        run(&cfg, &bad, &params, &x, &dy, 1),
        Err(LayerError::Config(_))
    ));
}

#[test]
fn a_hot_expert_bias_skews_routing_and_keeps_gradients_exact() {
    let cfg = cfg(true);
    let (params, x, dy) = setup(&cfg, 40, 21);
    let hot = CallConfig {
        hot_experts: 1,
        hot_bias: 3.0,
        ..CallConfig::default()
    };
    let res: Vec<Result<_, LayerError>> = run_local(1, TIMEOUT, |t| {
        let place = placement(cfg.n_experts, 1);
        let (_, plain) = forward(t, &cfg, &CallConfig::default(), &params, &place, &x)?;
        let (_, skewed) = forward(t, &cfg, &hot, &params, &place, &x)?;
        Ok((plain.plan.routed[0].clone(), skewed.plan.routed[0].clone()))
    });
    let (plain, skewed) = res.into_iter().next().unwrap().unwrap();
    assert_eq!(
        skewed[0], 40,
        "every token picks the hot expert: {skewed:?}"
    );
    assert!(skewed[0] > plain[0]);
    // Finite differences through the biased router (f64).
    assert_fd_through_router(&cfg, &hot, &params, &x, &dy, true);
    let bad = CallConfig {
        hot_experts: 9,
        hot_bias: 1.0,
        ..CallConfig::default()
    };
    assert!(run(&cfg, &bad, &params, &x, &dy, 1).is_err());
}

/// Central finite differences of `Σ y·dy` (f64, one rank) against the
/// two-rank layer's router gradient at a few entries and, with `input`,
/// its input gradient.
fn assert_fd_through_router(
    cfg: &MoeConfig,
    call: &CallConfig,
    params: &MoeParams<f64>,
    x: &[f64],
    dy: &[f64],
    input: bool,
) {
    let r = run(cfg, call, params, x, dy, 2).unwrap();
    let loss = |p: &MoeParams<f64>, x: &[f64]| -> f64 {
        let y = run(cfg, call, p, x, dy, 1).unwrap().y;
        y.iter().zip(dy).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    for i in [0, 7, 23] {
        let (mut p1, mut p2) = (params.clone(), params.clone());
        p1.router[i] += eps;
        p2.router[i] -= eps;
        let numeric = (loss(&p1, x) - loss(&p2, x)) / (2.0 * eps);
        assert!(
            (r.grads.router[i] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
            "router[{i}]: {} vs {numeric}",
            r.grads.router[i]
        );
    }
    if input {
        for i in [0, 5, 17] {
            let (mut x1, mut x2) = (x.to_vec(), x.to_vec());
            x1[i] += eps;
            x2[i] -= eps;
            let numeric = (loss(params, &x1) - loss(params, &x2)) / (2.0 * eps);
            assert!(
                (r.dx[i] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "dx[{i}]: {} vs {numeric}",
                r.dx[i]
            );
        }
    }
}

#[test]
fn a_zipf_skew_makes_loads_fall_off_and_is_a_constant_bias() {
    // -s·ln(1 + e) on the logits: the max/mean load grows with s, the
    // hottest expert is expert 0, and a negative or non-finite skew is
    // refused.
    let cfg = MoeConfig {
        hidden: 8,
        ffn: 6,
        n_experts: 16,
        top_k: 2,
        renormalize: true,
    };
    let (params, x, _) = setup(&cfg, 400, 31);
    let imbalance = |s: f64| -> (f64, Vec<u64>) {
        let call = CallConfig {
            zipf_skew: s,
            ..CallConfig::default()
        };
        let res: Vec<Result<_, LayerError>> = run_local(1, TIMEOUT, |t| {
            let place = placement(cfg.n_experts, 1);
            let (_, saved) = forward(t, &cfg, &call, &params, &place, &x)?;
            Ok(saved.plan.routed[0].clone())
        });
        let load = res.into_iter().next().unwrap().unwrap();
        let mean = load.iter().sum::<u64>() as f64 / load.len() as f64;
        (*load.iter().max().unwrap() as f64 / mean, load)
    };
    let (flat, _) = imbalance(0.0);
    let (mid, _) = imbalance(1.0);
    let (steep, load) = imbalance(3.0);
    assert!(flat < mid && mid < steep, "{flat} {mid} {steep}");
    assert_eq!(load.iter().max(), Some(&load[0]), "{load:?}");
    assert!(steep >= 4.0, "max/mean {steep} at skew 3");
    for bad in [-1.0, f64::INFINITY] {
        let call = CallConfig {
            zipf_skew: bad,
            ..CallConfig::default()
        };
        assert!(matches!(
            call.logit_bias(cfg.n_experts),
            Err(LayerError::Config(_))
        ));
    }
}

#[test]
fn the_balancing_bias_moves_the_choice_but_not_the_gates_or_gradients() {
    // DeepSeek-V3's auxiliary-loss-free bias: a large bias on expert 1
    // puts it in every token's top-k; its gate is still the plain router
    // probability, so y differs from the plain routing's only through the
    // choice, and every gradient still matches finite differences.
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 40, 23);
    let mut expert_bias = vec![0.0; cfg.n_experts];
    expert_bias[1] = 2.0;
    let biased = CallConfig {
        expert_bias,
        ..CallConfig::default()
    };
    let res: Vec<Result<_, LayerError>> = run_local(1, TIMEOUT, |t| {
        let place = placement(cfg.n_experts, 1);
        let (_, plain) = forward(t, &cfg, &CallConfig::default(), &params, &place, &x)?;
        let (_, skewed) = forward(t, &cfg, &biased, &params, &place, &x)?;
        let (_, _, st) = backward(t, &cfg, &biased, &params, &skewed, &dy)?;
        Ok((
            plain.plan.routed[0].clone(),
            skewed.plan.routed[0].clone(),
            st.expert_load,
        ))
    });
    let (plain, skewed, load) = res.into_iter().next().unwrap().unwrap();
    assert_eq!(
        skewed[1], 40,
        "every token picks the biased expert: {skewed:?}"
    );
    assert!(skewed[1] > plain[1]);
    assert_eq!(load, skewed, "the stats report the call's load");
    // The layer with the bias equals a reference that routes to the same
    // experts with unbiased gates: check through finite differences.
    assert_fd_through_router(&cfg, &biased, &params, &x, &dy, false);
    // A wrong-length or non-finite bias is refused.
    for bad in [vec![0.5; cfg.n_experts + 1], vec![f64::NAN; cfg.n_experts]] {
        let call = CallConfig {
            expert_bias: bad,
            ..CallConfig::default()
        };
        assert!(matches!(
            run(&cfg, &call, &params, &x, &dy, 1),
            Err(LayerError::Config(_))
        ));
    }
}

/// The replica tests' layer: four experts of width 6 × 5, top-2, and 48
/// tokens of inputs and output gradients drawn from `seed`.
fn replica_case(seed: u64) -> (MoeConfig, MoeParams<f64>, Vec<f64>, Vec<f64>) {
    let cfg = MoeConfig {
        hidden: 6,
        ffn: 5,
        n_experts: 4,
        top_k: 2,
        renormalize: true,
    };
    let (params, x, dy) = setup(&cfg, 48, seed);
    (cfg, params, x, dy)
}

#[test]
fn replicas_compute_with_the_owners_weights_copied_to_them() {
    // Each rank's copies of the experts it does not own are garbage: a
    // correct layer never reads them — replicas get the owner's weights over
    // the transport, and gradients come back from the owners.
    let (cfg, params, x, dy) = replica_case(17);
    replicas_match_the_reference(&cfg, (&params, &x, &dy), 2, 1);
}

#[test]
fn replicas_from_several_owners_in_one_exchange_match_the_reference() {
    // 4 ranks of 4 experts, two slots each, every slot filled: ranks get
    // blocks from several owners, owners send several blocks to one rank
    // and take gradients back from several replicas of one expert, all in
    // one exchange of the three tensors each way.
    let cfg = MoeConfig {
        hidden: 6,
        ffn: 5,
        n_experts: 16,
        top_k: 3,
        renormalize: true,
    };
    let (params, x, dy) = setup(&cfg, 96, 23);
    replicas_match_the_reference(&cfg, (&params, &x, &dy), 4, 2);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Replicas placed by a random previous load (`replicas_by_load`: up
    /// to every rank holding an expert, several blocks to one rank, several
    /// owners to one rank): every rank's poisoned copies are replaced by
    /// the owners' weights and the replicas' gradients summed back, as
    /// the one-rank reference gives them.
    #[test]
    fn replicas_anywhere_match_the_reference(
        n_ranks in 2usize..=4,
        per_rank in 1usize..=3,
        slots in 1usize..=3,
        load in proptest::collection::vec(0u64..50, 12),
        seed in 0u64..1000,
    ) {
        let cfg = MoeConfig {
            hidden: 4,
            ffn: 3,
            n_experts: n_ranks * per_rank,
            top_k: 2,
            renormalize: true,
        };
        let load = load[..cfg.n_experts].to_vec();
        let owners = placement(cfg.n_experts, n_ranks);
        let placed = quota::replicas_by_load(&owners, &load, n_ranks, slots).unwrap();
        let replicas = placed.replicas.iter().map(Vec::len).sum::<usize>();
        let (params, x, dy) = setup(&cfg, 8 * n_ranks, seed);
        let call = |retention| CallConfig {
            retention,
            replica_slots_per_rank: slots,
            replica_load: Some(load.clone()),
            ..CallConfig::default()
        };
        replicas_match_the_reference_under(&cfg, (&params, &x, &dy), n_ranks, &call, replicas);
    }
}

/// The layer on `n_ranks` in-process ranks with `slots` replica slots a
/// rank, every slot filled, each rank's copies of the experts it does not
/// own poisoned: outputs and gradients as the one-rank reference gives
/// them (full retention, and half kept).
fn replicas_match_the_reference(
    cfg: &MoeConfig,
    data: (&MoeParams<f64>, &[f64], &[f64]),
    n_ranks: usize,
    slots: usize,
) {
    let call = |retention| CallConfig {
        retention,
        replica_slots_per_rank: slots,
        replica_rule: quota::ReplicaRule::Fill,
        ..CallConfig::default()
    };
    replicas_match_the_reference_under(cfg, data, n_ranks, &call, slots * n_ranks);
}

/// [`replicas_match_the_reference`] with the call `call` makes of a
/// retention, `replicas` replicas expected in the call.
fn replicas_match_the_reference_under(
    cfg: &MoeConfig,
    (params, x, dy): (&MoeParams<f64>, &[f64], &[f64]),
    n_ranks: usize,
    call: &dyn Fn(Retention) -> CallConfig,
    replicas_expected: usize,
) {
    let hd = cfg.hidden;
    let tokens = x.len() / hd;
    let all = vec![true; tokens * cfg.top_k];
    let (y_ref, dx_ref, g_ref) = reference(cfg, params, x, dy, &all);
    for retention in [Retention::Full, Retention::Ratio(0.5)] {
        let bwd = call(retention.clone());
        let place = placement(cfg.n_experts, n_ranks);
        let per = tokens / n_ranks;
        let res: Vec<Result<_, LayerError>> = run_local(n_ranks, TIMEOUT, |t| {
            let r = t.rank();
            let mut mine = params.clone();
            for (e, ex) in mine.experts.iter_mut().enumerate() {
                if place.owner[e] != r {
                    for v in ex.gate.iter_mut().chain(&mut ex.up).chain(&mut ex.down) {
                        *v = 1e3;
                    }
                }
            }
            let (lo, hi) = (r * per, (r + 1) * per);
            let (y, saved) = forward(t, cfg, &bwd, &mine, &place, &x[lo * hd..hi * hd])?;
            let replicas = saved
                .plan
                .placement
                .replicas
                .iter()
                .map(Vec::len)
                .sum::<usize>();
            let (dx, grads, stats) = backward(t, cfg, &bwd, &mine, &saved, &dy[lo * hd..hi * hd])?;
            Ok((y, dx, grads, stats.kept, replicas))
        });
        let mut y = vec![];
        let mut dx = vec![];
        let mut kept = vec![];
        let mut grads = vec![];
        for r in res {
            let (yr, dxr, g, k, replicas) = r.unwrap();
            assert_eq!(replicas, replicas_expected, "the call's replicas");
            y.extend(yr);
            dx.extend(dxr);
            kept.extend(k);
            grads.push(g);
        }
        for g in &grads[1..] {
            assert_eq!(&grads[0], g, "ranks disagree on the gradients");
        }
        if retention == Retention::Full {
            assert_close("y", &y, &y_ref, 1e-12);
            assert_close("dx", &dx, &dx_ref, 1e-12);
            assert_grads_close(&grads[0], &g_ref, 1e-12);
        } else {
            let (_, dx_k, g_k) = reference(cfg, params, x, dy, &kept);
            assert_close("y", &y, &y_ref, 1e-12);
            assert_close("dx", &dx, &dx_k, 1e-12);
            assert_grads_close(&grads[0], &g_k, 1e-12);
        }
    }
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let n: f64 = got.iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum();
    let d: f64 = want.iter().map(|w| w * w).sum();
    (n / d.max(1e-300)).sqrt()
}

#[test]
fn bf16_grouped_experts_match_the_reference_within_bf16_tolerance() {
    // The bf16 expert backend composed of the CUDA kernels' CPU twins (the
    // GPU backend runs the same composition on the device's kernels).
    use kernels::cpu::{bf16_bits_to_f32, f32_to_bf16_bits};
    let cfg = MoeConfig {
        hidden: 16,
        ffn: 8,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let (mut params, mut x, dy) = setup(&cfg, 64, 3);
    let round = |v: &mut Vec<f64>| {
        for a in v.iter_mut() {
            *a = f64::from(bf16_bits_to_f32(f32_to_bf16_bits(*a as f32)));
        }
    };
    for (_, t) in params.tensors_mut() {
        round(t);
    }
    round(&mut x);
    let twins = ExpertBackend::Bf16(std::sync::Arc::new(kernels::grouped::CpuTwins));
    for (retention, n_ranks) in [
        (Retention::Full, 1),
        (Retention::Full, 2),
        (Retention::Ratio(0.5), 2),
        (Retention::Full, 4),
    ] {
        let call = CallConfig {
            retention: retention.clone(),
            replica_slots_per_rank: 1,
            replica_rule: quota::ReplicaRule::Fill,
            experts: twins.clone(),
            ..CallConfig::default()
        };
        let r = run(&cfg, &call, &params, &x, &dy, n_ranks).unwrap();
        let (y, dx, g) = reference(&cfg, &params, &x, &dy, &r.kept);
        let what = format!("{retention:?} on {n_ranks} ranks");
        assert!(rel_err(&r.y, &y) <= 1e-2, "{what}: y {}", rel_err(&r.y, &y));
        assert!(
            rel_err(&r.dx, &dx) <= 2e-2,
            "{what}: dx {}",
            rel_err(&r.dx, &dx)
        );
        for ((name, got), (_, want)) in r.grads.tensors().into_iter().zip(g.tensors()) {
            let e = rel_err(got, want);
            assert!(e <= 2e-2, "{what}: {name} {e}");
        }
        if retention == Retention::Full {
            assert!(r.kept.iter().all(|&k| k));
        }
    }
}

#[test]
fn device_quotas_are_the_host_plans_per_expert_quotas() {
    let cfg = cfg(false);
    let routed = vec![vec![5u32, 0, 9, 2], vec![3, 4, 1, 0]];
    let q = |retention| {
        quotas_of(
            &cfg,
            &CallConfig {
                retention,
                ..CallConfig::default()
            },
            &routed,
        )
    };
    assert_eq!(q(Retention::Full).unwrap(), vec![8, 4, 10, 2]);
    // round(r · n_e) per expert over all sources (2.5 rounds away from 0).
    assert_eq!(q(Retention::Ratio(0.25)).unwrap(), vec![2, 1, 3, 1]);
    assert_eq!(q(Retention::Ratio(0.0)).unwrap(), vec![0; 4]);
    // The controller under a memory budget: never more than routed, and
    // the ranks' pair caps hold every split of the quotas.
    let inst = 2 * 3 * 6 * 5 * 2; // two experts per rank, bf16
    let budget = quota::RankBudget {
        memory_bytes: 2 * inst + 5 * 2 * 6 * 2,
        network_bytes: u64::MAX,
    };
    let budgeted = q(Retention::Budgeted {
        budgets: vec![budget; 2],
        policy: quota::Policy::Maxmin,
    })
    .unwrap();
    assert!(budgeted.iter().zip([8, 4, 10, 2]).all(|(&k, n)| k <= n));
    assert!(budgeted[0] + budgeted[1] <= 5 && budgeted[2] + budgeted[3] <= 5);
    // Replicas are planned for device executors too (the quotas do not
    // depend on them).
    let replicas = CallConfig {
        replica_slots_per_rank: 1,
        replica_rule: quota::ReplicaRule::Fill,
        ..CallConfig::default()
    };
    assert_eq!(
        quotas_of(&cfg, &replicas, &routed).unwrap(),
        vec![8, 4, 10, 2]
    );
    let send_bound = CallConfig {
        retention: Retention::Budgeted {
            budgets: vec![
                quota::RankBudget {
                    memory_bytes: u64::MAX / 4,
                    network_bytes: 100
                };
                2
            ],
            policy: quota::Policy::Maxmin,
        },
        ..CallConfig::default()
    };
    // Selection per source runs on the host backend; the device refuses it.
    assert!(quotas_of(&cfg, &send_bound, &routed).is_ok());
    assert!(DevicePlanner::new(cfg, send_bound.clone()).is_err());
    assert!(DevicePlanner::host(cfg, send_bound).is_ok());
    assert!(quotas_of(&cfg, &CallConfig::default(), &routed[..1]).is_ok());
    assert!(quotas_of(&cfg, &CallConfig::default(), &[vec![1; 3]]).is_err());
}

#[test]
fn the_forward_plan_is_its_routes_then_its_quotas() {
    use crate::plan::{check_plan, check_routes};
    let cfg = MoeConfig {
        hidden: 16,
        ffn: 8,
        n_experts: 16,
        top_k: 2,
        renormalize: false,
    };
    // Room for the 4 owned experts, a replica slot and ~120 rows (bf16).
    let per_expert = 3 * 16 * 8 * 2 * 2;
    let budget = quota::RankBudget {
        memory_bytes: 5 * per_expert + 120 * 16 * 2 * 2,
        network_bytes: u64::MAX,
    };
    let call = |rule| CallConfig {
        retention: Retention::Budgeted {
            budgets: vec![budget; 4],
            policy: quota::Policy::Maxmin,
        },
        replica_slots_per_rank: 1,
        replica_memory_fraction: 1.0,
        replica_rule: rule,
        slots_reserved: true,
        ..CallConfig::default()
    };
    let (mut replicated, mut binding) = (0, 0);
    for (i, rule) in [quota::ReplicaRule::Paying, quota::ReplicaRule::Fill]
        .into_iter()
        .enumerate()
    {
        let planner = DevicePlanner::new(cfg, call(rule)).unwrap();
        for seed in 0..6u64 {
            // Skewed counts: expert e gets ~ 60 / (e + 1) of each source's pairs.
            let routed: Vec<Vec<u32>> = (0..4u64)
                .map(|s| {
                    (0..16u64)
                        .map(|e| (60 / (e + 1) + (seed * 7 + s * 3 + e * 5) % 9) as u32)
                        .collect()
                })
                .collect();
            let routes = planner.routes(&routed).unwrap();
            check_routes(&routes.instances, &routes.forward, &routed, 4).unwrap();
            let whole = planner.forward(&routed).unwrap();
            let (instances, forward) = (routes.instances.clone(), routes.forward.clone());
            let plan = planner.complete(routes).unwrap();
            assert_eq!(plan, whole, "rule {i}, seed {seed}");
            assert_eq!(
                (plan.instances.clone(), plan.forward.clone()),
                (instances, forward)
            );
            // The controller's own answer, from `quota` directly.
            let counts: Vec<Vec<u64>> = (routed.iter())
                .map(|r| r.iter().map(|&c| u64::from(c)).collect())
                .collect();
            let d = CallConfig::default();
            let cost = quota::CostModel::swiglu_expert(16, 8, 2, d.link_bytes_per_s, d.flops_per_s);
            let owners = Placement {
                owner: (0..16).map(|e| e / 4).collect(),
                replicas: vec![],
            };
            let budgets = vec![budget; 4];
            let inputs = quota::Inputs {
                counts: &counts,
                placement: &owners,
                cost: &cost,
                budgets: &budgets,
            };
            let qcfg = quota::Config {
                policy: quota::Policy::Maxmin,
                replica_slots_per_rank: 1,
                replica_memory_fraction: 1.0,
                replica_rule: rule,
                forward_rows_cap: None,
            };
            let with = quota::plan_replicas(&inputs, &qcfg).unwrap();
            assert_eq!(plan.instances, with.all_instances());
            let trimmed = quota::budgets_without_empty_slots(&budgets, 1, &owners, &with, &cost);
            let inputs = quota::Inputs {
                placement: &with,
                budgets: &trimmed,
                ..inputs
            };
            let q = quota::quotas(&inputs, quota::Policy::Maxmin).unwrap();
            let per_expert: Vec<u32> = (0..16)
                .map(|e| q.quotas.per_source().iter().map(|r| r[e] as u32).sum())
                .collect();
            assert_eq!(plan.quotas, per_expert);
            let caps: Vec<u64> = q.ranks.iter().map(|r| r.pair_capacity).collect();
            assert_eq!(plan.caps.as_ref(), Some(&caps));
            binding += usize::from(q.kept_fraction < 1.0);
            check_plan(&plan, &routed, 4).unwrap();
            replicated += usize::from(!crate::plan::one_instance_each(&plan.instances));
            assert!(plan.caps.is_some(), "a budgeted call has caps");
            // The backward's half is checked too.
            let mut bad = plan.clone();
            bad.quotas.pop();
            assert!(check_plan(&bad, &routed, 4).is_err());
            let mut bad = plan.clone();
            bad.caps = Some(vec![1; 3]);
            assert!(check_plan(&bad, &routed, 4).is_err());
        }
    }
    assert!(replicated > 0, "some calls place replicas");
    assert!(binding > 0, "some calls' quotas bind");
    // Counts of another shape are refused before anything is planned.
    let planner = DevicePlanner::new(cfg, call(quota::ReplicaRule::Paying)).unwrap();
    assert!(planner.routes(&[vec![1; 16], vec![1; 15]]).is_err());
    assert!(planner.routes(&vec![vec![1; 16]; 3]).is_err());
}

#[test]
fn the_device_planner_spreads_pairs_over_replicas_and_redistributes_kept_ones() {
    use crate::plan::{check_plan, check_split};
    let cfg = cfg(false);
    // Rank 0's expert 0 is hot: with one replica slot per rank the
    // controller places a replica of it on rank 1.
    let routed = vec![vec![40u32, 2, 3, 1], vec![30, 1, 2, 2]];
    let planner = DevicePlanner::new(
        cfg,
        CallConfig {
            retention: Retention::Ratio(0.5),
            replica_slots_per_rank: 1,
            replica_rule: quota::ReplicaRule::Fill,
            ..CallConfig::default()
        },
    )
    .unwrap();
    let plan = planner.forward(&routed).unwrap();
    check_plan(&plan, &routed, 2).unwrap();
    assert_eq!(
        plan.instances[0],
        vec![0, 1],
        "a replica of the hot expert on rank 1"
    );
    assert_eq!(plan.quotas, vec![35, 2, 3, 2]);
    // The forward's split balances the load: the replica takes a share.
    let load = |split: &crate::Split, r: usize| split.loads()[r];
    let (l0, l1) = (load(&plan.forward, 0), load(&plan.forward, 1));
    assert_eq!(l0 + l1, 81);
    assert!(l0.abs_diff(l1) <= 1, "forward loads {l0} and {l1}");
    // The backward's kept pairs are redistributed over the same instances.
    let kept = vec![vec![20u32, 1, 2, 1], vec![15, 1, 1, 1]];
    let split = planner.backward(&plan, &kept).unwrap();
    check_split(&split, &kept, &plan.instances).unwrap();
    let (b0, b1) = (load(&split, 0), load(&split, 1));
    assert!(b0.abs_diff(b1) <= 1, "backward loads {b0} and {b1}");
    assert!(planner.take_last_plan().is_some());
    // A plan that disagrees with the counts is an error, not a launch.
    let mut bad = plan.clone();
    bad.forward[(0, 0, 0)] += 1;
    assert!(check_plan(&bad, &routed, 2).is_err());
    let mut bad = plan.clone();
    bad.instances[1] = vec![1];
    assert!(check_plan(&bad, &routed, 2).is_err());
    // Without replicas every pair goes to its owner, forward and backward.
    let owners = DevicePlanner::new(cfg, CallConfig::default()).unwrap();
    let plan = owners.forward(&routed).unwrap();
    check_plan(&plan, &routed, 2).unwrap();
    for (s, row) in routed.iter().enumerate() {
        for (e, &c) in row.iter().enumerate() {
            assert_eq!(plan.forward.cell(s, e)[e / 2], c);
        }
    }
    let split = owners.backward(&plan, &kept).unwrap();
    check_split(&split, &kept, &plan.instances).unwrap();
    // Pairs moved to a rank without the expert's instance: the same sums,
    // refused all the same.
    let mut astray = split.clone();
    astray[(1, 0, 0)] -= 1;
    astray[(1, 0, 1)] += 1;
    let err = check_split(&astray, &kept, &plan.instances).unwrap_err();
    assert!(
        err.to_string()
            .contains("source 1, expert 0: pairs sent to rank 1"),
        "{err}"
    );
    // Capacity-factor dropping runs on the device executor too.
    let capped = DevicePlanner::new(
        cfg,
        CallConfig {
            capacity_factor: Some(1.0),
            ..CallConfig::default()
        },
    )
    .unwrap();
    assert_eq!(capped.capacity_factor(), Some(1.0));
    // The auxiliary loss runs on the device too; the random rule does not.
    let aux = DevicePlanner::new(
        cfg,
        CallConfig {
            aux_loss_coeff: 0.01,
            ..CallConfig::default()
        },
    )
    .unwrap();
    assert_eq!(aux.aux_loss_coeff(), 0.01);
    assert!(DevicePlanner::new(
        cfg,
        CallConfig {
            rule: lrm_score::Rule::RandomQ,
            ..CallConfig::default()
        }
    )
    .is_err());
}

#[test]
fn surplus_retention_trims_only_the_overloaded_rank() {
    let cfg = cfg(false); // 4 experts, 2 ranks: experts 0, 1 on rank 0
    let placement = Placement {
        owner: vec![0, 0, 1, 1],
        replicas: vec![],
    };
    let call = |f| CallConfig {
        retention: Retention::Surplus(f),
        ..CallConfig::default()
    };
    // Rank 0 holds 90 of 100 pairs; keep 60: the cap is 50, rank 1 whole.
    let routed = vec![vec![30u64, 15, 3, 2], vec![30, 15, 3, 2]];
    let plan = plan_call::<f32>(&cfg, &call(0.6), routed.clone(), &placement).unwrap();
    assert_eq!(plan.quotas, vec![33, 17, 6, 4]);
    assert_eq!(plan.selection, Selection::PerExpert);
    // Balanced loads: every expert keeps the same share.
    let even = vec![vec![10u64, 15, 10, 15], vec![10, 15, 10, 15]];
    let plan = plan_call::<f32>(&cfg, &call(0.6), even, &placement).unwrap();
    assert_eq!(plan.quotas, vec![12, 18, 12, 18]);
    // Everything kept at 1, nothing at 0; out of range is an error.
    let plan = plan_call::<f32>(&cfg, &call(1.0), routed.clone(), &placement).unwrap();
    assert_eq!(plan.quotas, vec![60, 30, 6, 4]);
    let plan = plan_call::<f32>(&cfg, &call(0.0), routed.clone(), &placement).unwrap();
    assert_eq!(plan.quotas, vec![0; 4]);
    assert!(plan_call::<f32>(&cfg, &call(1.5), routed, &placement).is_err());
}

#[test]
fn a_reserved_slot_left_empty_holds_no_rows() {
    // f32 rows: a row 48 B, an instance 720 B. Each rank's budget holds its
    // two experts, one replica slot and 20 rows.
    let cfg = cfg(false);
    let placement = Placement {
        owner: vec![0, 0, 1, 1],
        replicas: vec![],
    };
    let budget = quota::RankBudget {
        memory_bytes: 3 * 720 + 20 * 48,
        network_bytes: u64::MAX,
    };
    let call = |rule, slots_reserved| CallConfig {
        retention: Retention::Budgeted {
            budgets: vec![budget; 2],
            policy: quota::Policy::Maxmin,
        },
        replica_slots_per_rank: 1,
        replica_memory_fraction: 1.0,
        replica_rule: rule,
        slots_reserved,
        ..CallConfig::default()
    };
    let routed = vec![vec![10u64, 10, 10, 10], vec![10, 10, 10, 10]];
    let caps = |rule, reserved| {
        let plan =
            plan_call::<f32>(&cfg, &call(rule, reserved), routed.clone(), &placement).unwrap();
        let replicas: usize = plan.placement.replicas.iter().map(Vec::len).sum();
        (replicas, plan.caps.unwrap())
    };
    use quota::ReplicaRule::{Fill, Paying};
    // Ten pairs moved never repay an instance's traffic: no replica; the
    // empty slot stays out of the buffer only when reserved.
    assert_eq!(caps(Paying, true), (0, vec![20, 20]));
    assert_eq!(caps(Paying, false), (0, vec![35, 35]));
    // Filled slots take their bytes either way.
    assert_eq!(caps(Fill, true), (2, vec![20, 20]));
    assert_eq!(caps(Fill, false), (2, vec![20, 20]));
}

fn expert_grads(p: &MoeParams<f64>) -> Vec<f64> {
    p.experts
        .iter()
        .flat_map(|e| e.gate.iter().chain(&e.up).chain(&e.down).copied())
        .collect()
}

#[test]
fn sampling_rules_are_exact_at_full_retention_and_unbiased_below_it() {
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 32, 5);
    let exact = run(&cfg, &CallConfig::default(), &params, &x, &dy, 2).unwrap();
    for rule in lrm_score::Rule::ALL {
        // Every pair kept: weight 1, the exact gradient.
        let all = CallConfig {
            retention: Retention::Ratio(1.0),
            rule,
            ..CallConfig::default()
        };
        let r = run(&cfg, &all, &params, &x, &dy, 2).unwrap();
        assert_close("dx", &r.dx, &exact.dx, 1e-12);
        assert_grads_close(&r.grads, &exact.grads, 1e-12);
    }
    // Half the pairs: the reweighted rules' expert gradients average to the
    // exact ones over seeds; top-q's (deterministic) stay biased.
    let want = expert_grads(&exact.grads);
    let mean_error = |rule, seeds: u64| -> f64 {
        let mut sum = vec![0.0; want.len()];
        for seed in 0..seeds {
            let half = CallConfig {
                retention: Retention::Ratio(0.5),
                rule,
                rule_seed: seed,
                ..CallConfig::default()
            };
            let r = run(&cfg, &half, &params, &x, &dy, 2).unwrap();
            assert!((r.kept_pairs as f64 / r.kept.len() as f64 - 0.5).abs() < 0.1);
            for (s, g) in sum.iter_mut().zip(expert_grads(&r.grads)) {
                *s += g / seeds as f64;
            }
        }
        rel_err(&sum, &want)
    };
    let top = mean_error(lrm_score::Rule::TopQ, 1);
    for rule in [lrm_score::Rule::Proportional, lrm_score::Rule::Priority] {
        let e = mean_error(rule, 400);
        assert!(
            e < 0.1 && e < top / 2.0,
            "{rule:?}: mean error {e}, top-q {top}"
        );
    }
}

#[test]
fn the_device_and_host_priority_rules_draw_the_same_uniforms() {
    for (seed, id) in [
        (0u64, 0u64),
        (7, 1 << 40),
        (u64::MAX, 12345),
        (99, u64::MAX),
    ] {
        assert_eq!(
            kernels::cpu::uniform01_reference(seed, id).to_bits(),
            lrm_score::uniform(seed, id).to_bits()
        );
    }
    // The device planner takes top-q and priority sampling, nothing else.
    let cfg = cfg(false);
    for (rule, ok) in [
        (lrm_score::Rule::TopQ, true),
        (lrm_score::Rule::Priority, true),
        (lrm_score::Rule::RandomQ, false),
        (lrm_score::Rule::Proportional, false),
    ] {
        let call = CallConfig {
            rule,
            ..CallConfig::default()
        };
        assert_eq!(DevicePlanner::new(cfg, call).is_ok(), ok, "{rule:?}");
    }
    let p = DevicePlanner::new(
        cfg,
        CallConfig {
            rule: lrm_score::Rule::Priority,
            rule_seed: 3,
            ..CallConfig::default()
        },
    )
    .unwrap();
    let plan = p.forward(&[vec![3, 1, 2, 0], vec![1, 1, 1, 1]]).unwrap();
    assert!(plan.priority_seed().is_some());
}

#[test]
fn the_auxiliary_balancing_loss_gradient_matches_finite_differences() {
    for (n_ranks, renormalize) in [(1, false), (1, true), (2, true)] {
        let cfg = cfg(renormalize);
        let (params, x, dy) = setup(&cfg, 12, 21);
        let call = CallConfig {
            aux_loss_coeff: 0.3,
            ..CallConfig::default()
        };
        // The gradients are those of Σ y·dy + (mean over ranks of aux).
        let total = |p: &MoeParams<f64>, x: &[f64]| {
            let r = run(&cfg, &call, p, x, &dy, n_ranks).unwrap();
            r.y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>() + r.aux / n_ranks as f64
        };
        let r = run(&cfg, &call, &params, &x, &dy, n_ranks).unwrap();
        assert!(r.aux > 0.0);
        let plain = run(&cfg, &CallConfig::default(), &params, &x, &dy, n_ranks).unwrap();
        assert_eq!(plain.aux, 0.0);
        assert_eq!(r.y, plain.y, "the auxiliary loss changes no output");
        let eps = 1e-6;
        let fd = |perturb: &dyn Fn(&mut MoeParams<f64>, &mut Vec<f64>, f64)| {
            let (mut p1, mut x1) = (params.clone(), x.clone());
            perturb(&mut p1, &mut x1, eps);
            let (mut p2, mut x2) = (params.clone(), x.clone());
            perturb(&mut p2, &mut x2, -eps);
            (total(&p1, &x1) - total(&p2, &x2)) / (2.0 * eps)
        };
        for i in [0, 3, 7, 13, 23] {
            let numeric = fd(&|p, _, d| p.router[i] += d);
            let analytic = r.grads.router[i];
            assert!(
                (analytic - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "router[{i}] ({n_ranks} ranks, renorm {renormalize}): {analytic} vs {numeric}"
            );
            assert!(
                (analytic - plain.grads.router[i]).abs() > 1e-9,
                "no aux gradient"
            );
        }
        for i in [0, 5, 17, 40] {
            let numeric = fd(&|_, x, d| x[i] += d);
            assert!(
                (r.dx[i] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "x[{i}] ({n_ranks} ranks): {} vs {numeric}",
                r.dx[i]
            );
        }
    }
    let bad = CallConfig {
        aux_loss_coeff: -1.0,
        ..CallConfig::default()
    };
    let cfg = cfg(false);
    let (params, x, dy) = setup(&cfg, 4, 1);
    assert!(run(&cfg, &bad, &params, &x, &dy, 1).is_err());
}

#[test]
fn tile_aligned_quotas_drop_small_remainders_of_binding_quotas_only() {
    let cfg = cfg(false);
    // Two sources, four experts: 1040, 1000, 300 and 50 routed pairs.
    let routed = vec![vec![520u32, 500, 150, 25], vec![520, 500, 150, 25]];
    let q = |retention, tile_align| {
        quotas_of(
            &cfg,
            &CallConfig {
                retention,
                tile_align,
                ..CallConfig::default()
            },
            &routed,
        )
    };
    let a = Some(TileAlign::DEVICE);
    // r = 0.25: 260, 250, 75, 13 → 256 (drops 4 ≤ 260/16), 250 (remainder
    // 122 too large), 75 and 13 (below one tile).
    assert_eq!(
        q(Retention::Ratio(0.25), None).unwrap(),
        vec![260, 250, 75, 13]
    );
    assert_eq!(
        q(Retention::Ratio(0.25), a).unwrap(),
        vec![256, 250, 75, 13]
    );
    // Quotas that keep every routed pair are never trimmed.
    assert_eq!(q(Retention::Full, a).unwrap(), vec![1040, 1000, 300, 50]);
    assert_eq!(
        q(Retention::Ratio(1.0), a).unwrap(),
        vec![1040, 1000, 300, 50]
    );
    // A bad fraction is an error, not a silent no-op.
    let bad = Some(TileAlign {
        rows: 128,
        max_drop: f64::NAN,
    });
    assert!(q(Retention::Ratio(0.25), bad).is_err());
}

#[test]
fn symi_like_calls_replicate_by_the_given_load_split_evenly_and_stay_exact() {
    // SYMI-like replication: replicas from the previous call's load (here
    // all on expert 3), every pair kept, pairs split evenly over the
    // instances — still the exact layer.
    let (cfg, params, x, dy) = replica_case(23);
    let all = vec![true; 48 * cfg.top_k];
    let (y_ref, dx_ref, g_ref) = reference(&cfg, &params, &x, &dy, &all);
    let call = CallConfig {
        replica_slots_per_rank: 1,
        replica_rule: quota::ReplicaRule::Fill,
        solver: redistribute::Solver::Even,
        replica_load: Some(vec![0, 0, 0, 1000]),
        ..CallConfig::default()
    };
    let r = run(&cfg, &call, &params, &x, &dy, 2).unwrap();
    assert_close("y", &r.y, &y_ref, 1e-12);
    assert_close("dx", &r.dx, &dx_ref, 1e-12);
    assert_grads_close(&r.grads, &g_ref, 1e-12);
    assert!(r.kept.iter().all(|&k| k));
    // The plan: expert 3 (owned by rank 1) replicated on rank 0, by load.
    let routed = vec![vec![10u64, 10, 10, 10], vec![10, 10, 10, 10]];
    let plan = plan_call::<f64>(&cfg, &call, routed, &placement(4, 2)).unwrap();
    assert_eq!(plan.placement.replicas[3], vec![0]);
    assert!(plan.placement.replicas[..3].iter().all(Vec::is_empty));
    assert_eq!(call.forward_solver(), redistribute::Solver::Even);
    assert_eq!(
        CallConfig::default().forward_solver(),
        redistribute::Solver::Exact
    );
}

/// The per-expert quotas of [`device_plan_call`], as the device layers
/// take them.
fn quotas_of(
    cfg: &MoeConfig,
    call: &CallConfig,
    routed: &[Vec<u32>],
) -> Result<Vec<u32>, LayerError> {
    Ok(device_plan_call(cfg, call, routed)?.device_quotas())
}

/// The split checks against a search cell by cell.
mod split_checks {
    use proptest::prelude::*;

    proptest! {
        /// `check_split` refuses exactly the splits whose cells do not add up
        /// to their counts or send pairs to a rank without the expert's
        /// instance, and names the first such cell, as a search cell by cell
        /// does.
        #[test]
        fn check_split_refuses_exactly_the_bad_cells(
            (world, experts, cells, extra) in (1usize..5, 1usize..6).prop_flat_map(|(w, e)| (
                Just(w),
                Just(e),
                prop::collection::vec(0u32..3, w * e * w),
                prop::collection::vec(prop::collection::vec(0usize..5, 0..3), e),
            )),
        ) {
            use crate::plan::check_split;
            // Owner `e % world` plus any extra ranks (below the world or not).
            let instances: Vec<Vec<usize>> = (0..experts)
                .map(|e| {
                    let mut v = vec![e % world];
                    for &r in &extra[e] {
                        if !v.contains(&r) {
                            v.push(r);
                        }
                    }
                    v
                })
                .collect();
            let mut split = crate::Split::zeros(world, experts, world);
            for s in 0..world {
                for e in 0..experts {
                    for r in 0..world {
                        split[(s, e, r)] = cells[(s * experts + e) * world + r];
                    }
                }
            }
            let counts: Vec<Vec<u32>> = (0..world)
                .map(|s| (0..experts).map(|e| split.cell(s, e).iter().sum()).collect())
                .collect();
            // The first cell, source-major, that sends to a rank without an
            // instance, and its first such rank.
            let stray = (0..world)
                .flat_map(|s| (0..experts).map(move |e| (s, e)))
                .find_map(|(s, e)| {
                    (0..world)
                        .find(|&r| split[(s, e, r)] > 0 && !instances[e].contains(&r))
                        .map(|r| (s, e, r))
                });
            match (check_split(&split, &counts, &instances), stray) {
                (Ok(()), None) => {}
                (Err(err), Some((s, e, r))) => prop_assert!(
                    err.to_string().contains(&format!(
                        "source {s}, expert {e}: pairs sent to rank {r}, which holds no instance"
                    )),
                    "{err}"
                ),
                (got, want) => prop_assert!(false, "check_split {got:?}, first stray cell {want:?}"),
            }
            // A count one above the first cell's pairs is refused.
            if let Some(first) = counts.first() {
                let mut more = counts.clone();
                more[0][0] = first[0] + 1;
                prop_assert!(check_split(&split, &more, &instances).is_err());
            }
        }
    }
}

#[test]
fn block_moves_merge_only_where_both_sides_continue() {
    use crate::stages::common::{block_runs, tensor_block};
    let moves = [
        (0, 5),
        (1, 6),
        (2, 7),
        (2, 8),
        (5, 9),
        (6, 10),
        (6, 10),
        (8, 12),
    ];
    assert_eq!(
        block_runs(moves),
        vec![(0, 5, 3), (2, 8, 1), (5, 9, 2), (6, 10, 1), (8, 12, 1)]
    );
    assert!(block_runs([]).is_empty());
    // Parts of 2, 0 and 3 blocks, three tensors: part by part, each
    // tensor's blocks in turn, every position once.
    let starts = [0, 2, 2, 5];
    let mut seen: Vec<usize> = [(0, 2), (2, 3)]
        .iter()
        .flat_map(|&(d, n)| (0..3).flat_map(move |t| (0..n).map(move |i| (t, starts[d] + i))))
        .map(|(t, j)| tensor_block(&starts, 3, t, j))
        .collect();
    assert_eq!(&seen[..4], &[0, 1, 2, 3]);
    assert_eq!(tensor_block(&starts, 3, 1, 2), 9);
    seen.sort_unstable();
    assert_eq!(seen, (0..15).collect::<Vec<_>>());
}

#[test]
fn a_budget_that_cannot_hold_the_experts_is_an_error_on_every_rank() {
    // The quotas (the plan's second half) run while the experts compute,
    // after the rows went out: a budget they refuse must still end every
    // rank with the controller's error, not a hang or a panic.
    let cfg = MoeConfig {
        hidden: 8,
        ffn: 8,
        n_experts: 8,
        top_k: 2,
        renormalize: false,
    };
    let (params, x, _) = setup(&cfg, 64, 5);
    for (slots, memory_bytes) in [(1, 100), (0, 100), (1, 1)] {
        let bwd = CallConfig {
            retention: Retention::Budgeted {
                budgets: vec![
                    quota::RankBudget {
                        memory_bytes,
                        network_bytes: u64::MAX,
                    };
                    4
                ],
                policy: quota::Policy::Maxmin,
            },
            replica_slots_per_rank: slots,
            replica_rule: quota::ReplicaRule::Fill,
            ..CallConfig::default()
        };
        // The routes (replicas, the forward's split) pass; the quotas fail.
        let planner = DevicePlanner::host(cfg, bwd.clone())
            .unwrap()
            .for_values::<f64>();
        let routes = planner.routes(&vec![vec![4u32; 8]; 4]).unwrap();
        assert!(planner.complete(routes).is_err());
        let place = placement(cfg.n_experts, 4);
        let started = std::time::Instant::now();
        let res: Vec<Result<_, LayerError>> = run_local(4, TIMEOUT, |t| {
            let lo = t.rank() * 16 * cfg.hidden;
            forward(t, &cfg, &bwd, &params, &place, &x[lo..lo + 16 * cfg.hidden]).map(|_| ())
        });
        for r in res {
            let err = r.expect_err("a budget below the experts' bytes");
            assert!(err.to_string().contains("memory"), "slots {slots}: {err}");
        }
        assert!(
            started.elapsed() < TIMEOUT / 2,
            "the ranks waited for a peer"
        );
    }
}

/// Timed ranks record where the executor waits for an exchange it ran work
/// beside (the NCCL path's overlaps): once in the forward (the dispatch,
/// beside the experts on the rank's own rows) and once in the backward
/// (the dX return, beside the weight gradients), each after an exchange
/// with no other collective between, so the simulator can overlap exactly
/// that work with that exchange.
#[test]
fn timed_ranks_mark_the_two_overlapped_exchanges_of_a_call() {
    use crate::timeline::Entry;
    let cfg = MoeConfig {
        hidden: 16,
        ffn: 8,
        n_experts: 8,
        top_k: 2,
        renormalize: false,
    };
    let (params, x, dy) = setup(&cfg, 64, 7);
    let place = placement(cfg.n_experts, 2);
    let bwd = CallConfig::default();
    let res: Vec<Result<_, LayerError>> = run_local_timed(2, TIMEOUT, |t| {
        let n = 32 * cfg.hidden;
        let r = t.rank();
        t.phase("moe forward")?;
        let (_, saved) = forward(t, &cfg, &bwd, &params, &place, &x[r * n..(r + 1) * n])?;
        t.phase("moe backward")?;
        backward(t, &cfg, &bwd, &params, &saved, &dy[r * n..(r + 1) * n])?;
        t.close_step(0)?;
        t.fence()?;
        Ok(t.take_step(0))
    });
    let all = res
        .into_iter()
        .map(Result::unwrap)
        .find_map(|x| x)
        .expect("a rank took the step");
    for entries in &all {
        let joined: Vec<usize> = (0..entries.len())
            .filter(|&i| matches!(entries[i], Entry::Joined { .. }))
            .collect();
        let phases: Vec<&str> = joined.iter().map(|&i| entries[i].phase()).collect();
        assert_eq!(phases, ["moe forward", "moe backward"], "{entries:?}");
        for &i in &joined {
            let before = entries[..i]
                .iter()
                .rev()
                .find(|e| !matches!(e, Entry::Work { .. }));
            assert!(
                matches!(before, Some(Entry::Exchange { .. })),
                "the last collective before a join is an exchange: {before:?}"
            );
        }
    }
    assert_eq!(all[0].len(), all[1].len(), "both ranks record alike");
}
