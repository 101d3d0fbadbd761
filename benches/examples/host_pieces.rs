//! Host seconds of each piece of an MoE layer call on 16 in-process ranks
//! taking turns (`layer::run_local_timed`, the simulator's regime without a
//! GPU): the parts that the device simulation's `host_phases` report,
//! measured where they can be without a device. The layer runs on the host
//! backend with narrow experts (hidden 64, ffn 32), so the expert GEMMs are
//! negligible and what remains is the host work every backend does:
//! planning, layouts, checks, selection bookkeeping. 128 experts, top-8,
//! 1 024 tokens a rank (qwen3-moe-mini's routing at 16 ranks), the
//! trainer's LRMoE settings and fixed ownership; each part's seconds as
//! the simulator counts them (`lrmoe::simulate::simulate`: between two
//! collectives the slowest rank's), median over steps; and the number of
//! collectives (exchanges and sums over the ranks) a call makes, each of
//! the last call's listed by the part it follows with rank 0's bytes.
//!
//! `cargo run --release -p lrmoe-benches --example host_pieces [-- STEPS]`

use std::collections::BTreeMap;
use std::time::Duration;

use layer::{MoeConfig, MoeParams, Transport};

use lrmoe::train::{layer_call_config, Executor, Mode, MoeSection};

fn main() -> anyhow::Result<()> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(12);
    let (ranks, tokens) = (16usize, 1024usize);
    let cfg = MoeConfig {
        hidden: 64,
        ffn: 32,
        n_experts: 128,
        top_k: 8,
        renormalize: true,
    };
    let params = MoeParams::<f32>::init(&cfg, 5);
    let placement = quota::Placement {
        owner: (0..cfg.n_experts)
            .map(|e| e * ranks / cfg.n_experts)
            .collect(),
        replicas: vec![],
    };
    println!(
        "host probe: {:.3} ms\n",
        lrmoe::simulate::host_probe() * 1e3
    );
    println!("| mode | part | median ms a call (as simulated) |\n|---|---|---|");
    for mode in [Mode::Full, Mode::Lrmoe] {
        let moe = MoeSection {
            ranks,
            mode,
            executor: Executor::Device,
            // Skewed routing, so that replicas pay and the controller works.
            zipf_skew: 0.3,
            ..MoeSection::default()
        };
        let call = layer::CallConfig {
            zipf_skew: 0.3,
            ..layer_call_config(
                &moe,
                (cfg.hidden, cfg.ffn),
                (tokens * cfg.top_k) as f64,
                &placement,
                false,
                0,
            )
        };
        let results = layer::run_local_timed(ranks, Duration::from_secs(600), |t| {
            let hd = cfg.hidden;
            let mut steps_read = Vec::new();
            let cluster = cluster::Cluster::default();
            let mut read = |t: &layer::LocalTransport, step: usize| -> anyhow::Result<()> {
                if let Some(all) = t.take_step(step) {
                    // The collectives of a call (rank 0's; every rank
                    // makes the same ones).
                    let collectives = (all.first().into_iter().flatten())
                        .filter(|e| {
                            matches!(
                                e,
                                layer::timeline::Entry::Exchange { .. }
                                    | layer::timeline::Entry::Reduce { .. }
                            )
                        })
                        .count();
                    // Each collective of the call, named by the part it
                    // follows, with the bytes this rank sends or sums.
                    let mut after = String::new();
                    let mut listed = Vec::new();
                    for e in all.first().into_iter().flatten() {
                        match e {
                            layer::timeline::Entry::Work { phase, .. } => after = phase.clone(),
                            layer::timeline::Entry::Exchange { bytes_to, .. } => {
                                listed.push(format!(
                                    "exchange after {after}: {} B",
                                    bytes_to.iter().sum::<u64>()
                                ))
                            }
                            layer::timeline::Entry::Reduce { bytes, .. } => {
                                listed.push(format!("sum after {after}: {bytes} B"))
                            }
                            layer::timeline::Entry::Joined { .. } => {
                                listed.push(format!("the exchange joined after {after}"))
                            }
                            layer::timeline::Entry::Held { .. } => {}
                        }
                    }
                    let phases = lrmoe::simulate::simulate(&all, &cluster, 0)?.phases;
                    steps_read.push((phases, collectives, listed));
                }
                Ok(())
            };
            for step in 0..steps {
                let seed = (step * ranks + t.rank()) as f64;
                let x: Vec<f32> = (0..tokens * hd)
                    .map(|i| ((i as f64 * 0.754_877_666 + seed * 1.618).sin()) as f32)
                    .collect();
                let dy: Vec<f32> = x.iter().map(|v| v * 0.01).collect();
                t.phase("moe forward")?;
                let (_, saved) = layer::forward(t, &cfg, &call, &params, &placement, &x)?;
                // Past the forward's collectives every rank has closed the
                // step before.
                if t.rank() == 0 && step > 0 {
                    read(t, step - 1).map_err(|e| layer::LayerError::Config(e.to_string()))?;
                }
                t.phase("moe backward")?;
                drop(layer::backward(t, &cfg, &call, &params, &saved, &dy)?);
                t.phase("(between steps)")?;
                t.close_step(step)?;
            }
            t.all_gather_bytes(&[])?;
            if t.rank() == 0 {
                read(t, steps - 1).map_err(|e| layer::LayerError::Config(e.to_string()))?;
            }
            Ok::<_, layer::LayerError>(steps_read)
        });
        let mut by_part: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut collectives = Vec::new();
        let mut listed = Vec::new();
        for r in results {
            // The first step warms the caches and the GEMM crate's packing.
            for (step, n, l) in r.map_err(|e| anyhow::anyhow!("{e}"))?.into_iter().skip(1) {
                for (part, s) in step {
                    by_part.entry(part).or_default().push(s);
                }
                collectives.push(n);
                listed = l;
            }
        }
        for (part, mut v) in by_part {
            v.sort_by(f64::total_cmp);
            println!("| {mode:?} | {part} | {:.3} |", v[v.len() / 2] * 1e3);
        }
        collectives.sort_unstable();
        if let Some(n) = collectives.get(collectives.len() / 2) {
            println!("| {mode:?} | collectives a call (a count) | {n} |");
        }
        for (i, c) in listed.iter().enumerate() {
            println!(
                "| {mode:?} | collective {} of the last call: {c} | — |",
                i + 1
            );
        }
    }
    Ok(())
}
