//! The layer's stages on the host backend against the host executor: the
//! same outputs, input gradients and weight gradients (f64) on 1, 2 and 4
//! in-process ranks, at full retention, at r = 0.5 (the same pairs kept),
//! with replica slots, the capacity factor, the logit and balancing biases
//! and the auxiliary loss; the router's gradient and the kept pairs' count
//! against the call's quotas.

use std::time::Duration;

use super::*;
use quota::Placement;

const TIMEOUT: Duration = Duration::from_secs(60);

fn cfg() -> MoeConfig {
    MoeConfig {
        hidden: 6,
        ffn: 5,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    }
}

fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20001) as f64 / 10000.0 - 1.0
        })
        .collect()
}

/// Outputs of one layer call on every rank, in token order, and the
/// gradients of the whole layer (router summed, experts by owner).
#[derive(Debug)]
struct Out {
    y: Vec<f64>,
    dx: Vec<f64>,
    grads: MoeParams<f64>,
    kept: usize,
    /// Replicas the call placed (the stages' plan).
    replicas: usize,
}

/// The host executor (`crate::forward`, `crate::backward`).
fn executor(call: &CallConfig, p: &MoeParams<f64>, x: &[f64], dy: &[f64], ranks: usize) -> Out {
    let cfg = cfg();
    let (hd, t) = (cfg.hidden, x.len() / cfg.hidden);
    let place = Placement {
        owner: (0..cfg.n_experts)
            .map(|e| e * ranks / cfg.n_experts)
            .collect(),
        replicas: vec![],
    };
    let res = run_local(ranks, TIMEOUT, |tr| {
        let r = tr.rank();
        let (lo, hi) = (r * t / ranks, (r + 1) * t / ranks);
        let (y, saved) = forward(tr, &cfg, call, p, &place, &x[lo * hd..hi * hd])?;
        let (dx, g, s) = backward(tr, &cfg, call, p, &saved, &dy[lo * hd..hi * hd])?;
        Ok::<_, LayerError>((y, dx, g, s.kept_pairs))
    });
    let mut out = Out {
        y: vec![],
        dx: vec![],
        grads: MoeParams::zeros(&cfg),
        kept: 0,
        replicas: 0,
    };
    for r in res {
        let (y, dx, g, k) = r.unwrap();
        out.y.extend(y);
        out.dx.extend(dx);
        out.kept += k;
        out.grads = g;
    }
    out
}

/// The stages on the host backend (`host::forward`, `host::backward`).
fn stages(call: &CallConfig, p: &MoeParams<f64>, x: &[f64], dy: &[f64], ranks: usize) -> Out {
    let cfg = cfg();
    let (hd, t) = (cfg.hidden, x.len() / cfg.hidden);
    let planner = DevicePlanner::new(cfg, call.clone())
        .unwrap()
        .for_values::<f64>();
    let res = run_local(ranks, TIMEOUT, |tr| {
        let r = tr.rank();
        let (lo, hi) = (r * t / ranks, (r + 1) * t / ranks);
        let w = host::rank_weights(&cfg, call, p, (r, ranks))?;
        let sv = host::forward(tr, &cfg, &w, &x[lo * hd..hi * hd], &planner)?;
        let g = host::backward(tr, &w, &sv, &dy[lo * hd..hi * hd], &planner)?;
        Ok::<_, LayerError>((sv.y.clone(), g))
    });
    let (h, f, el) = (cfg.hidden, cfg.ffn, cfg.n_experts / ranks);
    let mut out = Out {
        y: vec![],
        dx: vec![],
        grads: MoeParams::zeros(&cfg),
        kept: 0,
        replicas: (planner.take_last_plan()).map_or(0, |p| p.placement.replicas.len()),
    };
    for (r, res) in res.into_iter().enumerate() {
        let (y, g) = res.unwrap();
        out.y.extend(y);
        out.dx.extend(g.dx);
        out.kept += g.kept_pairs;
        out.grads.router = g.router;
        for i in 0..el {
            let e = &mut out.grads.experts[r * el + i];
            e.gate = g.experts.gate[i * h * f..(i + 1) * h * f].to_vec();
            e.up = g.experts.up[i * h * f..(i + 1) * h * f].to_vec();
            e.down = g.experts.down[i * f * h..(i + 1) * f * h].to_vec();
        }
    }
    out
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale,
            "{what}[{i}]: {a} against {b} (scale {scale})"
        );
    }
}

fn same(what: &str, a: &Out, b: &Out) {
    close(&format!("{what}: y"), &a.y, &b.y, 1e-12);
    close(&format!("{what}: dx"), &a.dx, &b.dx, 1e-12);
    for ((name, ga), (_, gb)) in a.grads.tensors().into_iter().zip(b.grads.tensors()) {
        close(&format!("{what}: {name}"), ga, gb, 1e-12);
    }
    assert_eq!(a.kept, b.kept, "{what}: kept pairs");
}

fn case(seed: u64) -> (MoeParams<f64>, Vec<f64>, Vec<f64>) {
    let cfg = cfg();
    let t = 64;
    (
        MoeParams::init(&cfg, seed),
        data(t * cfg.hidden, seed + 1),
        data(t * cfg.hidden, seed + 2),
    )
}

#[test]
fn the_stages_on_the_host_equal_the_host_executor_at_every_ep_size() {
    let (p, x, dy) = case(3);
    for ranks in [1, 2, 4] {
        for (name, call) in [
            ("full", CallConfig::default()),
            (
                "r = 0.5",
                CallConfig {
                    retention: Retention::Ratio(0.5),
                    ..CallConfig::default()
                },
            ),
        ] {
            let (a, b) = (
                stages(&call, &p, &x, &dy, ranks),
                executor(&call, &p, &x, &dy, ranks),
            );
            same(&format!("{name} on {ranks} ranks"), &a, &b);
        }
    }
}

#[test]
fn the_stages_on_the_host_equal_the_host_executor_with_replicas() {
    let (p, x, dy) = case(5);
    // A hot expert pulls the load to rank 0's block: the controller
    // replicates it into the free slots.
    for retention in [Retention::Full, Retention::Ratio(0.5)] {
        let call = CallConfig {
            retention: retention.clone(),
            replica_slots_per_rank: 1,
            hot_experts: 1,
            hot_bias: 2.0,
            ..CallConfig::default()
        };
        for ranks in [2, 4] {
            let (a, b) = (
                stages(&call, &p, &x, &dy, ranks),
                executor(&call, &p, &x, &dy, ranks),
            );
            assert!(a.replicas > 0, "no replica placed on {ranks} ranks");
            same(&format!("replicas, {retention:?}, {ranks} ranks"), &a, &b);
        }
    }
}

#[test]
fn the_stages_on_the_host_equal_the_host_executor_under_the_baselines_and_biases() {
    let (p, x, dy) = case(7);
    let calls = [
        (
            "capacity 0.5",
            CallConfig {
                capacity_factor: Some(0.5),
                ..CallConfig::default()
            },
        ),
        (
            "balancing bias",
            CallConfig {
                expert_bias: (0..8).map(|e| 0.05 * f64::from(e)).collect(),
                ..CallConfig::default()
            },
        ),
        (
            "aux loss, zipf",
            CallConfig {
                aux_loss_coeff: 0.01,
                zipf_skew: 0.3,
                retention: Retention::Ratio(0.75),
                ..CallConfig::default()
            },
        ),
    ];
    for (name, call) in calls {
        for ranks in [1, 2] {
            let (a, b) = (
                stages(&call, &p, &x, &dy, ranks),
                executor(&call, &p, &x, &dy, ranks),
            );
            same(&format!("{name}, {ranks} ranks"), &a, &b);
        }
    }
}
