//! The training run's unit tests.

use super::calls::*;
use super::config::*;
use super::files::*;
use super::run::*;
use super::*;
use crate::model::{plain_moe_run, Model, ModelConfig};
use layer::CallConfig;
use quota::Placement;

#[test]
fn a_rank_s_peak_adds_its_own_instances_and_buffer() {
    // Rank 0 holds the most instances, rank 1 the largest buffer: the
    // peak is one rank's sum, not the sum of the two maxima.
    assert_eq!(rank_peak_bytes(&[10, 5], &[1, 20]), 25);
    assert_eq!(rank_peak_bytes(&[10, 5], &[]), 10);
    assert_eq!(rank_peak_bytes(&[], &[]), 0);
}

/// A model of two layers and four experts, for the tallies.
fn two_layers() -> ModelConfig {
    ModelConfig {
        n_layers: 2,
        n_experts: 4,
        ..ModelConfig::small(11)
    }
}

/// One micro-batch's backward figures with these buffers, layer by layer.
fn buffers(b0: u64, b1: u64) -> [layer::BackwardStats; 2] {
    [b0, b1].map(|buffer_bytes| layer::BackwardStats {
        buffer_bytes,
        ..Default::default()
    })
}

#[test]
fn a_step_s_unsplit_buffer_sums_its_micro_batches_per_layer() {
    let mcfg = two_layers();
    let mut t = Tally::new(&mcfg);
    assert_eq!(t.unsplit_buffer(), 0);
    t.add(&mcfg, &buffers(10, 30), 0, 1);
    assert_eq!(t.unsplit_buffer(), 30, "one micro-batch: its own peak");
    t.add(&mcfg, &buffers(25, 2), 0, 1);
    // Layer 0: 10 + 25, layer 1: 30 + 2; not the two largest (25 + 30).
    assert_eq!(t.unsplit_buffer(), 35);
}

#[test]
fn a_split_step_s_peak_buffer_is_its_largest_micro_batch_s() {
    // The step holds one micro-batch's buffer at a time: its peak is the
    // largest layer call of any micro-batch, a later one included.
    let mcfg = two_layers();
    let mut t = Tally::new(&mcfg);
    assert_eq!(t.peak_buffer, 0);
    t.add(&mcfg, &buffers(10, 30), 0, 1);
    assert_eq!(t.peak_buffer, 30);
    t.add(&mcfg, &buffers(45, 2), 0, 1);
    assert_eq!(t.peak_buffer, 45, "the second micro-batch's layer 0");
    t.add(&mcfg, &buffers(5, 5), 0, 1);
    assert_eq!(t.peak_buffer, 45);
    assert_eq!(t.unsplit_buffer(), 60);
}

#[test]
fn a_layer_call_s_token_buffer_is_the_larger_of_its_forward_s_and_backward_s() {
    // A hot expert's owner with no replica computes all its rows in the
    // forward though the backward keeps few: the forward's rows count.
    let mcfg = two_layers();
    let mut t = Tally::new(&mcfg);
    let mut st = buffers(10, 30);
    st[0].forward_buffer_bytes = 70;
    st[1].forward_buffer_bytes = 20;
    t.add(&mcfg, &st, 0, 1);
    assert_eq!(t.peak_buffer, 70);
    assert_eq!(t.unsplit_buffer(), 70);
    // A second micro-batch: per layer max(70, ·) + max(5, 40) and 30 + 5.
    let mut st = buffers(5, 5);
    st[0].forward_buffer_bytes = 40;
    t.add(&mcfg, &st, 0, 1);
    assert_eq!(t.peak_buffer, 70);
    assert_eq!(t.unsplit_buffer(), 110);
}

#[test]
fn the_replica_rules_parse_as_the_configuration_spells_them() {
    for (name, rule) in [
        ("paying", quota::ReplicaRule::Paying),
        ("fill", quota::ReplicaRule::Fill),
        ("paying-compute", quota::ReplicaRule::PayingCompute),
    ] {
        let moe = moe_section_from_json(&format!(r#"{{"replica_rule": "{name}"}}"#), 4).unwrap();
        assert_eq!(moe.replica_rule, rule, "{name}");
    }
    assert!(moe_section_from_json(r#"{"replica_rule": "paying_compute"}"#, 4).is_err());
}

/// `moe.keep_projections` reaches every mode's call settings (the
/// device executor reads it there); unset, it is on in `full` mode only.
#[test]
fn keep_projections_reaches_the_call_in_every_mode() {
    let place = Placement {
        owner: vec![0; 4],
        replicas: vec![],
    };
    for mode in ["full", "lrmoe", "capacity"] {
        for keep in [false, true] {
            let json = format!(r#"{{"mode": "{mode}", "keep_projections": {keep}}}"#);
            let moe = moe_section_from_json(&json, 4).unwrap();
            let call = layer_call_config(&moe, (16, 8), 32.0, &place, true, 0);
            assert_eq!(call.keep_projections, keep, "{mode}");
        }
    }
    for (mode, keep) in [("full", true), ("lrmoe", false), ("capacity", false)] {
        let moe = moe_section_from_json(&format!(r#"{{"mode": "{mode}"}}"#), 4).unwrap();
        let call = layer_call_config(&moe, (16, 8), 32.0, &place, true, 0);
        assert_eq!(call.keep_projections, keep, "{mode} unset");
    }
}

#[test]
fn configured_ranks_are_kept_defaults_adapt() {
    let from = Some("the configuration's moe.ranks");
    // --device cuda: the default becomes one rank, a setting stays.
    assert_eq!(resolve_ranks(2, None, None, true).unwrap(), 1);
    assert_eq!(resolve_ranks(8, from, None, true).unwrap(), 8);
    assert_eq!(resolve_ranks(8, from, None, false).unwrap(), 8);
    assert_eq!(resolve_ranks(2, None, None, false).unwrap(), 2);
    // Launched: the default follows WORLD_SIZE; a setting must agree.
    assert_eq!(resolve_ranks(2, None, Some(4), false).unwrap(), 4);
    assert_eq!(resolve_ranks(4, from, Some(4), true).unwrap(), 4);
    let e = resolve_ranks(8, from, Some(2), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the configuration's moe.ranks = 8 disagrees with WORLD_SIZE = 2"),
        "{e}"
    );
}

#[test]
fn a_checkpoint_that_cannot_fit_is_refused_with_the_way_out() {
    let dir = std::env::temp_dir();
    check_checkpoint_room(&dir, 1024).unwrap();
    let e = check_checkpoint_room(&dir, u64::MAX / 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GiB free") && e.contains("--no-checkpoint") && e.contains("--out"),
        "{e}"
    );
    // A folder yet to be made is measured on its nearest ancestor.
    assert!(free_bytes(&dir.join("not/yet/made")).is_some_and(|b| b > 0));
}

/// One MoE layer of four experts, top-2, width 16 over an 11-symbol
/// vocabulary: the step tests' model.
fn one_layer_of_four_experts() -> ModelConfig {
    ModelConfig {
        vocab: 11,
        d_model: 16,
        n_layers: 1,
        n_heads: 2,
        ffn: 16,
        n_experts: 4,
        top_k: 2,
        renormalize: true,
        max_seq: 8,
        ..ModelConfig::small(11)
    }
}

/// Four sequences of `seq` tokens and their targets over that vocabulary.
fn four_sequences(seq: usize) -> (Vec<u32>, Vec<u32>) {
    let n = 4 * seq as u32;
    (
        (0..n).map(|i| (i * 7 + 3) % 11).collect(),
        (0..n).map(|i| (i * 5 + 1) % 11).collect(),
    )
}

/// Micro-batches accumulate the whole batch's gradient (the exact
/// backward, two in-process ranks): the same gradients within f32
/// summation noise, the same loss.
#[test]
fn micro_batches_accumulate_the_whole_batch_gradient() {
    let mcfg = one_layer_of_four_experts();
    let model = Model::<f32>::init(&mcfg, 7);
    let placement = Placement {
        owner: vec![0, 0, 1, 1],
        replicas: vec![],
    };
    let call = CallConfig::default();
    let run = plain_moe_run(&placement, &call);
    let seq = 8;
    let (tokens, targets) = four_sequences(seq);
    let go = |micro: usize| {
        layer::run_local(2, std::time::Duration::from_secs(60), |t| {
            let me = t.rank();
            let r = me * 2 * seq..(me + 1) * 2 * seq;
            step_grads(
                t,
                &mcfg,
                &model,
                &run,
                (&tokens[r.clone()], &targets[r]),
                seq,
                micro,
            )
            .map(|g| (g.loss, g.grads.grads))
        })
    };
    let (one, two) = (go(1), go(2));
    for (a, b) in one.into_iter().zip(two) {
        let ((la, ga), (lb, gb)) = (a.unwrap(), b.unwrap());
        assert!((la - lb).abs() <= 1e-5 * la.abs(), "loss {la} vs {lb}");
        for ((name, x), (_, y)) in ga.tensors().into_iter().zip(gb.tensors()) {
            let n: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
            let d: f64 = x
                .iter()
                .zip(y)
                .map(|(&p, &q)| f64::from(p - q).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(d <= 1e-4 * n.max(1e-12), "{name}: {d} vs norm {n}");
        }
    }
    // Three micro-batches do not split two sequences.
    let bad = layer::run_local(1, std::time::Duration::from_secs(60), |t| {
        step_grads(
            t,
            &mcfg,
            &model,
            &run,
            (&tokens[..2 * seq], &targets[..2 * seq]),
            seq,
            3,
        )
        .map(|_| ())
    });
    assert!(bad[0].is_err());
}

/// At one rank every routed pair is that rank's, so the even forward's
/// buffer is the layer's own forward buffer; at four ranks it is a quarter
/// of it, and in the device's bf16 values half.
#[test]
fn the_even_forward_is_the_layer_s_forward_buffer_at_one_rank() {
    let mcfg = one_layer_of_four_experts();
    let model = Model::<f32>::init(&mcfg, 7);
    let placement = Placement {
        owner: vec![0; 4],
        replicas: vec![],
    };
    let call = CallConfig::default();
    let run = plain_moe_run(&placement, &call);
    let seq = 8;
    let (tokens, targets) = four_sequences(seq);
    let got = layer::run_local(1, std::time::Duration::from_secs(60), |t| {
        step_grads(t, &mcfg, &model, &run, (&tokens, &targets), seq, 1)
            .map(|g| g.grads.moe_stats[0].forward_buffer_bytes)
    });
    let layer_bytes = got[0].as_ref().copied().unwrap();
    let mut cfg = TrainConfig::default();
    (cfg.data.batch_size, cfg.data.seq_len) = (4, seq);
    assert_eq!(layer_bytes, (2 * 4 * seq * 2 * 16 * 4) as u64);
    assert_eq!(even_forward_bytes(&cfg, &mcfg, 1, false), layer_bytes);
    assert_eq!(4 * even_forward_bytes(&cfg, &mcfg, 4, false), layer_bytes);
    assert_eq!(2 * even_forward_bytes(&cfg, &mcfg, 1, true), layer_bytes);
}

/// `lrmoe_top_q` is LRMoE's backward with the paper's rule whatever
/// `moe.selection_rule` says; `lrmoe` follows the setting; both budget
/// the backward (the other modes keep every pair).
#[test]
fn the_top_q_mode_runs_lrmoe_with_top_q() {
    let place = Placement {
        owner: vec![0; 4],
        replicas: vec![],
    };
    let call = |json: &str| {
        let moe = moe_section_from_json(json, 4).unwrap();
        assert!(moe.mode.is_lrmoe(), "{json}");
        layer_call_config(&moe, (16, 8), 32.0, &place, true, 0)
    };
    let top_q = call(r#"{"mode": "lrmoe_top_q", "selection_rule": "priority"}"#);
    assert_eq!(top_q.rule, lrm_score::Rule::TopQ);
    let priority = call(r#"{"mode": "lrmoe", "selection_rule": "priority"}"#);
    assert_eq!(priority.rule, lrm_score::Rule::Priority);
    assert_eq!(top_q.retention, priority.retention);
    assert!(!matches!(top_q.retention, layer::Retention::Full));
    let full = moe_section_from_json(r#"{"mode": "full"}"#, 4).unwrap();
    let full = layer_call_config(&full, (16, 8), 32.0, &place, true, 0);
    assert_eq!(full.retention, layer::Retention::Full);
    assert_eq!(Mode::LrmoeTopQ.to_string(), "LRMoE top-q");
    assert!(!Mode::Full.is_lrmoe() && !Mode::Symi.is_lrmoe());
}

#[test]
fn evaluations_come_more_often_near_the_target() {
    let mut cfg = TrainConfig {
        steps: 100,
        ..TrainConfig::default()
    };
    cfg.run.eval_every = 25;
    cfg.run.target_val_loss = Some(2.0);
    let at = |step: usize, val_loss: f64| EvalPoint {
        step,
        wall_s: 0.0,
        moe_s: 0.0,
        val_loss,
        simulated_s: None,
        simulated_moe_s: None,
    };
    let due = |cfg: &TrainConfig, evals: &[EvalPoint]| -> Vec<usize> {
        (1..=cfg.steps)
            .filter(|&s| eval_due(cfg, s, evals))
            .collect()
    };
    // Off: the grid and the last step only, wherever the curve is.
    assert_eq!(due(&cfg, &[at(25, 2.05)]), [25, 50, 75, 100]);
    cfg.run.eval_near_every = 5;
    cfg.run.eval_near_margin = 0.1;
    // Far above the target (2.5 > 2.0 + 0.1), or no evaluation yet: the grid.
    assert_eq!(due(&cfg, &[at(25, 2.5)]), [25, 50, 75, 100]);
    assert_eq!(due(&cfg, &[]), [25, 50, 75, 100]);
    // Within the margin: every fifth step too.
    let near: Vec<usize> = (1..=20).map(|i| 5 * i).collect();
    assert_eq!(due(&cfg, &[at(25, 2.1)]), near);
    // No target: nothing is near.
    cfg.run.target_val_loss = None;
    assert_eq!(due(&cfg, &[at(25, 2.01)]), [25, 50, 75, 100]);
    // Which the configuration refuses, as it refuses a bad margin.
    assert!(cfg.validate().is_err());
    cfg.run.target_val_loss = Some(2.0);
    assert!(cfg.validate().is_ok());
    for bad in [f64::NAN, -0.1, f64::INFINITY] {
        cfg.run.eval_near_margin = bad;
        assert!(cfg.validate().is_err(), "{bad}");
    }
}

/// What a run's budget held follows `fit_budget` and `budget_forward`.
#[test]
fn the_budget_held_follows_the_two_switches() {
    let mut cfg = TrainConfig::default();
    assert!(
        cfg.moe.budget_forward,
        "the budget holds the forward by default"
    );
    assert_eq!(BudgetHeld::of(&cfg), BudgetHeld::Nothing);
    cfg.moe.fit_budget = true;
    assert_eq!(BudgetHeld::of(&cfg), BudgetHeld::ForwardAndBackward);
    cfg.moe.budget_forward = false;
    assert_eq!(BudgetHeld::of(&cfg), BudgetHeld::Backward);
    // A summary written before it was recorded reads as unrecorded.
    let held: BudgetHeld = serde_json::from_str("\"backward\"").unwrap();
    assert_eq!(held, BudgetHeld::Backward);
    assert_eq!(BudgetHeld::default(), BudgetHeld::Unrecorded);
}

/// LRMoE's controller holds the forward to the budget's rows where the
/// budget holds the forward (and only there); other modes place no
/// replicas by the cap.
#[test]
fn the_forward_cap_follows_the_budget() {
    let placement = Placement {
        owner: (0..8).map(|e| e / 4).collect(),
        replicas: vec![],
    };
    let cap = |mode: Mode, fit: bool, forward: bool| {
        let moe = MoeSection {
            ranks: 2,
            mode,
            fit_budget: fit,
            budget_forward: forward,
            buffer_fraction: 0.6,
            ..MoeSection::default()
        };
        layer_call_config(&moe, (16, 8), 1000.0, &placement, false, 0).forward_rows_cap
    };
    assert_eq!(cap(Mode::Lrmoe, true, true), Some(600));
    assert_eq!(cap(Mode::LrmoeTopQ, true, true), Some(600));
    assert_eq!(cap(Mode::Lrmoe, true, false), None);
    assert_eq!(cap(Mode::Lrmoe, false, true), None);
    for mode in [Mode::Full, Mode::Replicate, Mode::Symi, Mode::Capacity] {
        assert_eq!(cap(mode, true, true), None, "{mode:?}");
    }
}
