//! Shared workload generators for the benchmarks: Zipf-skewed routing counts
//! and the replica placements the controller would make for them.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Routed pairs `[n_ranks][n_experts]`: each rank routes `pairs_per_rank`
/// pairs, expert popularity Zipf(`s`) over a seeded random expert order.
pub fn zipf_counts(
    n_ranks: usize,
    n_experts: usize,
    pairs_per_rank: u64,
    s: f64,
    seed: u64,
) -> Vec<Vec<u64>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..n_experts).collect();
    for i in (1..n_experts).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let weights: Vec<f64> = (0..n_experts)
        .map(|r| 1.0 / ((r + 1) as f64).powf(s))
        .collect();
    let total: f64 = weights.iter().sum();
    let cdf: Vec<f64> = weights
        .iter()
        .scan(0.0, |acc, w| {
            *acc += w / total;
            Some(*acc)
        })
        .collect();
    (0..n_ranks)
        .map(|_| {
            let mut row = vec![0u64; n_experts];
            for _ in 0..pairs_per_rank {
                let u: f64 = rng.random();
                let k = cdf.partition_point(|&c| c < u).min(n_experts - 1);
                row[order[k]] += 1;
            }
            row
        })
        .collect()
}

/// Owners in contiguous blocks (expert `e` on rank `e · n_ranks / n_experts`)
/// plus `extra` replicas placed by the controller's greedy rule.
pub fn placement_with_replicas(
    counts: &[Vec<u64>],
    n_experts: usize,
    extra: usize,
) -> quota::Placement {
    let n_ranks = counts.len();
    let placement = quota::Placement {
        owner: (0..n_experts).map(|e| e * n_ranks / n_experts).collect(),
        replicas: vec![],
    };
    let cost = quota::CostModel {
        act_row_bytes: 1,
        grad_row_bytes: 1,
        expert_weight_bytes: 1,
        expert_grad_bytes: 1,
        flops_per_pair: 1.0,
        forward_flops_per_pair: 0.0,
        exchange_row_bytes: 0,
        link_bytes_per_s: 1.0,
        flops_per_s: 1.0,
    };
    let budgets = vec![quota::RankBudget::UNLIMITED; n_ranks];
    let inputs = quota::Inputs {
        counts,
        placement: &placement,
        cost: &cost,
        budgets: &budgets,
    };
    let cfg = quota::Config {
        replica_slots_per_rank: extra.div_ceil(n_ranks),
        replica_memory_fraction: 1.0,
        replica_rule: quota::ReplicaRule::Fill,
        ..quota::Config::default()
    };
    let mut p = quota::plan_replicas(&inputs, &cfg).expect("unlimited budgets");
    // Trim to exactly `extra` replicas (the slot rounding may allow more).
    let mut n = 0;
    for reps in p.replicas.iter_mut() {
        let keep = reps.len().min(extra.saturating_sub(n));
        reps.truncate(keep);
        n += keep;
    }
    p
}

/// A redistribution problem at `(experts, ranks, extra replicas)` with
/// Zipf(1.2) counts, 4096 tokens × top-8 per rank, 60% kept.
pub fn redistribution_problem(
    n_experts: usize,
    n_ranks: usize,
    extra: usize,
    seed: u64,
) -> redistribute::Problem {
    let routed = zipf_counts(n_ranks, n_experts, 4096 * 8, 1.2, seed);
    let placement = placement_with_replicas(&routed, n_experts, extra);
    let kept = routed
        .iter()
        .map(|row| row.iter().map(|&n| n * 6 / 10).collect())
        .collect();
    redistribute::Problem {
        n_ranks,
        kept,
        instances: placement.all_instances(),
        base_load: vec![0; n_ranks],
        rank_capacity: None,
    }
}

/// The layer's device planners keeping `round(r · n_e)` pairs of every
/// expert, one per retention in `rs` (`layer::DevicePlanner::ratio`), for
/// the device benchmarks' rows.
pub fn ratio_planners(cfg: &layer::MoeConfig, rs: &[f64]) -> Vec<layer::DevicePlanner> {
    rs.iter()
        .map(|&r| layer::DevicePlanner::ratio(cfg, r))
        .collect()
}

/// What every bench binary does first: keeps freed heap memory (the host
/// layouts' pages, see [`lrmoe::keep_freed_memory`]) and logs to stderr at
/// `LRMOE_LOG` (default `info`; the layer's `LRMOE_EP_PROFILE=1` timeline
/// is logged there).
pub fn init_process() {
    lrmoe::keep_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LRMOE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
}
