//! Plan one layer call of a hot expert under a tight memory budget.

use quota::{plan, Config, CostModel, Inputs, Placement, Policy, RankBudget};

fn main() -> Result<(), quota::QuotaError> {
    let cost = CostModel::swiglu_expert(
        2048,
        768,
        2,
        quota::H200_LINK_BYTES_PER_S,
        quota::H200_FLOPS_PER_S,
    );
    let counts = vec![vec![4000, 300, 200, 100], vec![3500, 400, 100, 300]];
    let placement = Placement {
        owner: vec![0, 0, 1, 1],
        replicas: vec![],
    };
    let budget = RankBudget {
        memory_bytes: 3 * cost.instance_bytes() + 3000 * cost.row_bytes(),
        network_bytes: u64::MAX,
    };
    let budgets = [budget; 2];
    let inputs = Inputs {
        counts: &counts,
        placement: &placement,
        cost: &cost,
        budgets: &budgets,
    };
    let cfg = Config {
        policy: Policy::Maxmin,
        replica_slots_per_rank: 1,
        replica_memory_fraction: 0.5,
        ..Config::default()
    };
    let p = plan(&inputs, &cfg)?;
    println!("replicas added: {:?}", p.replicas_added);
    println!(
        "quotas per expert: {:?} (kept {:.1}%)",
        p.quotas.per_expert(),
        100.0 * p.kept_fraction
    );
    for (r, m) in p.ranks.iter().enumerate() {
        println!(
            "rank {r}: {} pairs max, {} of {} bytes",
            m.pair_capacity, m.memory_bytes, budget.memory_bytes
        );
    }
    Ok(())
}
