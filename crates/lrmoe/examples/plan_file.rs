//! Plan one layer call from a problem file (default: the workspace's
//! `examples/plan-routed.json`) and print the per-rank report.

fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/plan-routed.json"
        )
        .to_string()
    });
    let problem = lrmoe::plan::parse_problem(&std::fs::read_to_string(&path)?)?;
    let report = lrmoe::plan::run(&problem, &lrmoe::plan::Options::default())?;
    println!(
        "peak load {} (lower bound {})",
        report.peak_load, report.peak_lower_bound
    );
    for r in &report.ranks {
        println!(
            "rank {}: {} pairs, memory {:?} of {:?} bytes",
            r.rank, r.pairs, r.memory_bytes, r.memory_budget_bytes
        );
    }
    Ok(())
}
