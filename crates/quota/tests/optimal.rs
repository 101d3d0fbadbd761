//! The controller's quotas against an independent exact optimizer: a linear
//! program (good_lp's microlp) over the same model, written from the crate
//! documentation's formulas and not from its code.
//!
//! The model: rank `r` processes at most `cap_r = min(⌊free_r / row⌋,
//! ⌊network_r / row⌋)` pairs (`free_r` = memory budget less its instances'
//! bytes) and source `s` keeps at most `⌊network_s / row⌋`; a cell's kept
//! pairs go to the instances of its expert. Its constraint matrix is a flow
//! network's, so the linear program's optima are integral.
//!
//! * Uniform and max-min share the retention floor `ρ* = j / 2²⁰`: keeping
//!   `⌊ρ·n⌋` of every cell is feasible at `j` and infeasible at `j + 1`.
//! * Max-min keeps the largest total any integral quota vector with
//!   `⌊ρ*·n⌋ ≤ k ≤ n` can keep within the caps.

use good_lp::{constraint, variable, Expression, ProblemVariables, Solution, SolverModel};
use proptest::prelude::*;
use quota::{quotas, CostModel, Inputs, Placement, Policy, RankBudget};

const DEN: u64 = 1 << 20;

fn cost() -> CostModel {
    CostModel {
        act_row_bytes: 6,
        grad_row_bytes: 4,
        expert_weight_bytes: 100,
        expert_grad_bytes: 100,
        flops_per_pair: 1e3,
        link_bytes_per_s: 1e9,
        flops_per_s: 1e12,
    }
}

#[derive(Debug, Clone)]
struct Case {
    counts: Vec<Vec<u64>>,
    placement: Placement,
    budgets: Vec<RankBudget>,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..5, 1usize..6, any::<bool>()).prop_flat_map(|(n_ranks, n_experts, sends)| {
        (
            prop::collection::vec(prop::collection::vec(0u64..40, n_experts), n_ranks),
            prop::collection::vec(0..n_ranks, n_experts),
            prop::collection::vec(prop::collection::vec(0..n_ranks, 0..3), n_experts),
            prop::collection::vec((0u64..2500, 0u64..2500), n_ranks),
        )
            .prop_map(move |(counts, owner, reps, budgets)| {
                let replicas = reps
                    .into_iter()
                    .enumerate()
                    .map(|(e, r)| {
                        let mut v: Vec<usize> = r.into_iter().filter(|&x| x != owner[e]).collect();
                        v.sort_unstable();
                        v.dedup();
                        v
                    })
                    .collect();
                let placement = Placement { owner, replicas };
                let inst = placement.instances_per_rank(n_ranks);
                let budgets = budgets
                    .into_iter()
                    .enumerate()
                    .map(|(r, (m, n))| RankBudget {
                        memory_bytes: inst[r] * cost().instance_bytes() + m,
                        // Half the cases are memory-only (the controller's
                        // per-expert network), half also bound sends.
                        network_bytes: if sends { n } else { u64::MAX },
                    })
                    .collect();
                Case {
                    counts,
                    placement,
                    budgets,
                }
            })
    })
}

/// `(cap_r, send_s)` from the documented formulas; `None` is unlimited.
fn caps(c: &Case) -> (Vec<Option<u64>>, Vec<Option<u64>>) {
    let cost = cost();
    let row = cost.row_bytes();
    let inst = c.placement.instances_per_rank(c.budgets.len());
    let per = |b: u64| (b != u64::MAX).then_some(b / row);
    let cap = c
        .budgets
        .iter()
        .zip(&inst)
        .map(|(b, &i)| {
            let mem = per(b.memory_bytes - i * cost.instance_bytes());
            match (mem, per(b.network_bytes)) {
                (Some(m), Some(n)) => Some(m.min(n)),
                (m, n) => m.or(n),
            }
        })
        .collect();
    let send = c.budgets.iter().map(|b| per(b.network_bytes)).collect();
    (cap, send)
}

fn floor_at(n: u64, j: u64) -> u64 {
    (u128::from(n) * u128::from(j) / u128::from(DEN)) as u64
}

/// Largest total of kept pairs with `lo ≤ k ≤ hi` per cell within the caps,
/// or `None` when even `lo` cannot be placed.
fn best_total(c: &Case, lo: &[Vec<u64>], hi: &[Vec<u64>]) -> Option<f64> {
    let (cap, send) = caps(c);
    let n_ranks = c.budgets.len();
    let instances = c.placement.all_instances();
    let mut vars = ProblemVariables::new();
    // x[s][e][i]: pairs of cell (s, e) processed on instance i of e.
    let x: Vec<Vec<Vec<_>>> = (0..n_ranks)
        .map(|_| {
            instances
                .iter()
                .map(|inst| inst.iter().map(|_| vars.add(variable().min(0.0))).collect())
                .collect()
        })
        .collect();
    let total: Expression = x.iter().flatten().flatten().copied().sum();
    let mut model = vars.maximise(total.clone()).using(good_lp::microlp);
    for s in 0..n_ranks {
        let mut sent = Expression::from(0.0);
        for (e, inst) in instances.iter().enumerate() {
            let cell: Expression = x[s][e].iter().copied().sum();
            model = model.with(constraint!(cell.clone() >= lo[s][e] as f64));
            model = model.with(constraint!(cell.clone() <= hi[s][e] as f64));
            if inst.is_empty() && lo[s][e] > 0 {
                return None;
            }
            sent += cell;
        }
        if let Some(cap) = send[s] {
            model = model.with(constraint!(sent <= cap as f64));
        }
    }
    for (r, cap) in cap.iter().enumerate() {
        let Some(cap) = cap else { continue };
        let mut load = Expression::from(0.0);
        for xs in &x {
            for (e, inst) in instances.iter().enumerate() {
                for (i, &host) in inst.iter().enumerate() {
                    if host == r {
                        load += xs[e][i];
                    }
                }
            }
        }
        model = model.with(constraint!(load <= *cap as f64));
    }
    match model.solve() {
        Ok(sol) => Some(sol.eval(&total)),
        Err(good_lp::ResolutionError::Infeasible) => None,
        Err(e) => panic!("LP failed: {e}"),
    }
}

fn at(c: &Case, j: u64) -> Vec<Vec<u64>> {
    c.counts
        .iter()
        .map(|row| row.iter().map(|&n| floor_at(n, j)).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_retention_floor_is_the_largest_feasible_one(c in case()) {
        let cost = cost();
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost, budgets: &c.budgets };
        for policy in [Policy::Uniform, Policy::Maxmin] {
            let plan = quotas(&inputs, policy).expect("budgets hold the experts");
            let j = (plan.retention_floor * DEN as f64).round() as u64;
            let floor = at(&c, j);
            prop_assert!(best_total(&c, &floor, &floor).is_some(), "{policy:?}: floor {j}/2^20 infeasible");
            if j < DEN {
                let above = at(&c, j + 1);
                prop_assert!(
                    best_total(&c, &above, &above).is_none(),
                    "{policy:?}: floor {j}/2^20 is not the largest feasible one"
                );
            }
            if policy == Policy::Uniform {
                prop_assert_eq!(plan.quotas.per_source(), floor.as_slice());
            }
        }
    }

    #[test]
    fn maxmin_keeps_the_most_pairs_above_the_floor(c in case()) {
        let cost = cost();
        let inputs = Inputs { counts: &c.counts, placement: &c.placement, cost: &cost, budgets: &c.budgets };
        let plan = quotas(&inputs, Policy::Maxmin).expect("budgets hold the experts");
        let j = (plan.retention_floor * DEN as f64).round() as u64;
        let k = plan.quotas.per_source();
        let floor = at(&c, j);
        for (s, row) in k.iter().enumerate() {
            for (e, &q) in row.iter().enumerate() {
                prop_assert!(floor[s][e] <= q && q <= c.counts[s][e], "cell ({s}, {e}) = {q}");
            }
        }
        // The plan's own quotas are placeable, and nothing keeps more.
        prop_assert!(best_total(&c, k, k).is_some(), "max-min quotas are not placeable");
        let best = best_total(&c, &floor, &c.counts).expect("the floor is feasible");
        prop_assert!(
            (plan.quotas.total() as f64 - best).abs() < 1e-6,
            "max-min keeps {} pairs, the optimum is {best}", plan.quotas.total()
        );
    }
}
