//! Random, often inconsistent problems never panic `plan::run`.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use lrmoe::plan::{run, ControllerSettings, Options, Problem};
use lrmoe::quota::{CostModel, Placement, RankBudget, ReplicaRule};
use proptest::prelude::*;

fn problem() -> impl Strategy<Value = Problem> {
    (
        0usize..4,
        prop::collection::vec(0usize..5, 0..5),
        prop::collection::vec(prop::collection::vec(0u64..50, 0..5), 0..5),
        any::<bool>(),
        prop::collection::vec((0u64..5000, 0u64..5000), 0..5),
        prop::option::of(prop::collection::vec(0u64..10, 0..5)),
        (
            prop_oneof![Just(0u64), 1u64..100, Just(u64::MAX)],
            0usize..3,
            prop_oneof![
                Just(ReplicaRule::Paying),
                Just(ReplicaRule::PayingCompute),
                Just(ReplicaRule::Fill)
            ],
        ),
    )
        .prop_map(
            |(n_ranks, owner, counts, routed, budgets, base_load, (rows, slots, rule))| Problem {
                n_ranks,
                placement: Placement {
                    owner,
                    replicas: vec![],
                },
                routed_counts: routed.then(|| counts.clone()),
                kept_counts: (!routed).then_some(counts),
                cost_model: Some(CostModel {
                    act_row_bytes: 8,
                    grad_row_bytes: 8,
                    expert_weight_bytes: 100,
                    expert_grad_bytes: 100,
                    flops_per_pair: 1.0,
                    forward_flops_per_pair: 0.0,
                    exchange_row_bytes: rows,
                    link_bytes_per_s: 1.0,
                    flops_per_s: 1.0,
                }),
                budgets: Some(
                    budgets
                        .into_iter()
                        .map(|(m, n)| RankBudget {
                            memory_bytes: m,
                            network_bytes: n,
                        })
                        .collect(),
                ),
                controller: ControllerSettings {
                    replica_slots_per_rank: Some(slots),
                    replica_rule: Some(rule),
                    ..Default::default()
                },
                base_load,
                load_model: None,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn never_panics(p in problem()) {
        let _ = run(&p, &Options::default());
    }
}
