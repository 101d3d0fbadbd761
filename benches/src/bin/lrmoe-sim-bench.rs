//! `lrmoe-sim-bench`: the MoE layer on N simulated GPUs, measured on one.
//!
//! N in-process ranks take turns on this GPU (`layer::run_local_timed`,
//! each timed on the GPU's stream, `layer::device::GpuClock`), each
//! running the device executor's forward and backward on its own
//! 16 384 tokens (Qwen3-30B-A3B expert shape: 128 experts owned in blocks,
//! hidden 2048, ffn 768, top-8, random router); their timelines go through
//! the cluster model (`lrmoe::simulate`, `cluster::Cluster::default()`).
//! Beside it, the same layer at EP = 1 on the same tokens per GPU, timed
//! in the same call. The table's simulation has the overlap switched off
//! (`cluster.overlap = false`), so its check is the measurement taken on
//! 2 × H200 before the executor overlapped its exchanges: 1.65× the
//! one-GPU layer (2026-11-30, `docs/benchmarks.md`); its last column is
//! the same timelines with the executor's overlaps (the default cluster).
//! After the table: each world's parts of the layer call and each rank's
//! most memory held at once.
//!
//! Usage: `lrmoe-sim-bench [ranks …]` (default `2 4 8`); `LRMOE_SIM_R`
//! (default `1`) the retention.

use std::time::Duration;

use layer::device::DeviceComm;
use layer::{DevicePlanner, MoeConfig, Transport};

const TOKENS: usize = 16_384;
const ITERS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One rank's calls: two warm-ups, then `ITERS` timed steps whose
/// timelines rank 0 simulates; returns rank 0's simulated figures.
fn rank(
    t: &layer::LocalTransport,
    gpu: &std::sync::Arc<kernels::gpu::Gpu>,
    cfg: &MoeConfig,
    planner: &DevicePlanner,
) -> Result<Vec<[lrmoe::simulate::Simulated; 2]>, layer::LayerError> {
    use kernels::cpu::random_bf16;
    t.set_clock(std::sync::Arc::new(layer::device::GpuClock(gpu.clone())))?;
    let comm = DeviceComm::Staged(t);
    let h = cfg.hidden;
    let r = t.rank() as u64;
    let w = layer::device::random_weights(gpu, comm, cfg)?;
    let x = gpu.upload(&random_bf16(TOKENS * h, 35 + 8 * r))?;
    let dy = gpu.upload(&random_bf16(TOKENS * h, 36 + 8 * r))?;
    let mut out = Vec::new();
    for i in 0..ITERS + 2 {
        t.discard_timeline()?;
        comm.phase(lrmoe::device_model::phase::MOE_FORWARD)?;
        let sv = layer::device::forward(gpu, comm, cfg, &w, &x, planner)?;
        comm.phase(lrmoe::device_model::phase::MOE_BACKWARD)?;
        let g = layer::device::backward(gpu, comm, &w, &sv, &dy, planner)?;
        drop((g, sv));
        t.close_step(i)?;
        t.fence()?;
        if t.rank() == 0 {
            let tl = t
                .take_step(i)
                .ok_or_else(|| layer::LayerError::Config(format!("step {i} not closed")))?;
            if i < 2 {
                continue; // a warm-up
            }
            let sim = |c: &cluster::Cluster| {
                lrmoe::simulate::simulate(&tl, c, 1)
                    .map_err(|e| layer::LayerError::Config(e.to_string()))
            };
            let on = cluster::Cluster::default();
            out.push([
                sim(&cluster::Cluster {
                    overlap: false,
                    ..on
                })?,
                sim(&on)?,
            ]);
        }
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    lrmoe_benches::init_process();
    let worlds: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let worlds = if worlds.is_empty() {
        vec![2, 4, 8]
    } else {
        worlds
    };
    let r: f64 = std::env::var("LRMOE_SIM_R").map_or(Ok(1.0), |v| v.parse())?;
    let gpu = std::sync::Arc::new(kernels::gpu::Gpu::open(0)?);
    let cfg = MoeConfig {
        hidden: 2048,
        ffn: 768,
        n_experts: 128,
        top_k: 8,
        renormalize: true,
    };
    let planner = DevicePlanner::ratio(&cfg, r);
    let one = layer::device::bench(
        &gpu,
        DeviceComm::Local,
        &cfg,
        TOKENS,
        &[(r, &planner)],
        0.0,
        10,
    )?;
    let one_ms = one[0].forward_ms + one[0].backward_ms;
    let c = cluster::Cluster::default();
    println!(
        "MoE layer on N simulated GPUs (Qwen3-30B-A3B expert shape, {TOKENS} tokens per rank, r = {r}); cluster: {} GPUs per node, {} GB/s and {} µs intra-node, {} GB/s and {} µs inter-node; no overlap (last column: with the executor's overlaps, their work ×{:.3})\n",
        c.gpus_per_node, c.intra_gb_per_s, c.intra_latency_us, c.inter_gb_per_s, c.inter_latency_us,
        c.overlap_work_factor
    );
    println!(
        "one GPU (EP = 1, measured, wall-clock medians of 10): forward {:.2} ms, backward {:.2} ms, total {one_ms:.2} ms\n",
        one[0].forward_ms, one[0].backward_ms
    );
    println!("| ranks | simulated fwd ms | simulated bwd ms | simulated total ms | of which collectives ms | ÷ one GPU | one GPU's work for all ranks ÷ N ms | with the overlaps: total ms, ÷ one GPU |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut parts = Vec::new();
    for world in worlds {
        let results = layer::run_local_timed(world, Duration::from_secs(600), |t| {
            rank(t, &gpu, &cfg, &planner)
        });
        let (mut sims, mut overlapped) = (Vec::new(), Vec::new());
        for (rk, res) in results.into_iter().enumerate() {
            match res {
                Ok(v) if rk == 0 => {
                    (sims, overlapped) = v.into_iter().map(|[off, on]| (off, on)).unzip();
                }
                Ok(_) => {}
                Err(e) => anyhow::bail!("{world} ranks, rank {rk}: {e}"),
            }
        }
        let pick = |f: &dyn Fn(&lrmoe::simulate::Simulated) -> f64| {
            median(sims.iter().map(f).collect()) * 1e3
        };
        let phase = |p: &'static str| move |s: &lrmoe::simulate::Simulated| s.phase_s(p);
        let fwd = pick(&phase(lrmoe::device_model::phase::MOE_FORWARD));
        let bwd = pick(&phase(lrmoe::device_model::phase::MOE_BACKWARD));
        let total = pick(&|s| s.step_s);
        let coll = pick(&|s| s.collectives_s);
        let work = pick(&|s| s.work_all_ranks_s) / world as f64;
        let with = median(overlapped.iter().map(|s| s.step_s).collect()) * 1e3;
        println!(
            "| {world} | {fwd:.2} | {bwd:.2} | {total:.2} | {coll:.2} | {:.3} | {work:.2} | {with:.2}, {:.3} |",
            total / one_ms,
            with / one_ms
        );
        parts.push((world, sims));
    }
    // Where each simulated layer call goes: its parts (medians, ms) and
    // each rank's most memory held at once (MiB).
    for (world, sims) in parts {
        let Some(first) = sims.first() else { continue };
        let split: Vec<String> = first
            .phases
            .keys()
            .map(|p| {
                let ms = median(
                    sims.iter()
                        .map(|s| s.phases.get(p).copied().unwrap_or(0.0))
                        .collect(),
                );
                format!("{p} {:.2}", ms * 1e3)
            })
            .collect();
        let held: Vec<String> = first
            .held_bytes
            .iter()
            .map(|b| format!("{:.0}", *b as f64 / 1048576.0))
            .collect();
        println!("\n{world} ranks, ms: {}", split.join(", "));
        println!(
            "{world} ranks, most held at once per rank, MiB: {}",
            held.join(" ")
        );
    }
    Ok(())
}
