//! `lrmoe-dist-bench`: the NCCL transport between GPUs, one process each.
//!
//! ```text
//! lrmoe launch --nproc 2 --exec lrmoe-dist-bench -- [dist-anchors.json]
//! ```
//!
//! where the optional file holds the JSON object printed on the `DIST` line
//! of `torchrun --nproc_per_node=2 torch_anchors.py`, run in the same call.
//! Rank 0 prints two tables:
//!
//! 1. all-to-all with equal splits (the `all_to_all_single` peer): median
//!    ms, algorithm bandwidth (buffer bytes / time), ratio to PyTorch;
//! 2. the LRMoE backward all-to-all on the Qwen3-30B-A3B expert shape
//!    (16384 tokens × top-8 per rank, hidden 2048, 128 experts, Zipf(0.8)
//!    expert skew as in the anchors, experts owned in contiguous blocks):
//!    kept rows `[x | g·δ]` (2 × 2048 bf16) out to the experts' owners and
//!    `dX` rows (2048 bf16) back, at retention 1.0, 0.5 and 0.25;
//! 3. the layer crate's device executor (`layer::device::forward` /
//!    `backward` over NCCL) on the Qwen3-30B-A3B shape (16384 tokens per rank,
//!    top-8, 128 experts owned in blocks, hidden 2048, ffn 768), forward and
//!    LRMoE backward wall time at retention 1.0 / 0.5 / 0.25, beside the
//!    same executor on one GPU (EP = 1, `DeviceComm::Local`) on the same
//!    tokens per GPU, timed on each rank's GPU in the same run;
//! 4. the same layer on the hot workload (rank 0's experts +2.0 on the
//!    router logits, the peer's `--hot 2.0`) under one per-GPU memory
//!    budget: fixed ownership, replication (8 and 32 replica slots per rank),
//!    the capacity-factor baseline (1.25) and LRMoE's controller (with and
//!    without replicas) — forward,
//!    backward, kept fraction, per-rank backward load, peak memory.
//!
//! `LRMOE_DIST_TABLES` (e.g. `layer,hot`) picks tables by name: `a2a`
//! (1 and 2), `layer` (3), `hot` (4); all by default.

use std::time::Duration;

use anyhow::Context;
use layer::{DistEnv, NcclTransport, Transport};

const EXPERTS: usize = 128;
const HIDDEN: usize = 2048;
const PAIRS_PER_RANK: usize = 16384 * 8;

fn zipf_counts(rows: usize) -> Vec<u64> {
    let w: Vec<f64> = (1..=EXPERTS).map(|i| (i as f64).powf(-0.8)).collect();
    let s: f64 = w.iter().sum();
    let mut c: Vec<u64> = w.iter().map(|x| (x / s * rows as f64) as u64).collect();
    let short = rows as u64 - c.iter().sum::<u64>();
    c[0] += short;
    c
}

fn main() -> anyhow::Result<()> {
    lrmoe_benches::init_process();
    let anchors: serde_json::Value = match std::env::args().nth(1) {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(&p)?)?,
        None => serde_json::Value::Null,
    };
    let env = DistEnv::from_env()?.context("run under `lrmoe launch` (WORLD_SIZE is not set)")?;
    let t = NcclTransport::connect(&env, Duration::from_secs(120))?;
    let comm = t.comm();
    let (me, world) = (t.rank(), t.world_size());
    let say = |s: String| {
        if me == 0 {
            println!("{s}");
        }
    };
    let tables = std::env::var("LRMOE_DIST_TABLES").unwrap_or_else(|_| "a2a,layer,hot".into());
    let table = |name: &str| tables.split(',').any(|t| t.trim() == name);
    if table("a2a") {
        a2a_tables(comm, &anchors, me, world, &say)?;
    }
    let cfg = layer::MoeConfig {
        hidden: HIDDEN,
        ffn: 768,
        n_experts: EXPERTS,
        top_k: 8,
        renormalize: true,
    };
    let tokens = 16384;
    let gpu = kernels::gpu::Gpu::open(env.local_rank)?;
    if table("layer") {
        layer_table(comm, &gpu, &cfg, tokens, world, &say)?;
    }
    if table("hot") {
        hot_table(&t, &gpu, &cfg, tokens, &say)?;
    }
    Ok(())
}

/// Tables 1 and 2: NCCL's all-to-all against PyTorch's, and the LRMoE
/// backward's exchange sizes.
fn a2a_tables(
    comm: &kernels::comm::NcclComm,
    anchors: &serde_json::Value,
    me: usize,
    world: usize,
    say: &dyn Fn(String),
) -> anyhow::Result<()> {
    say(format!(
        "NCCL {} all-to-all, {world} ranks, one H200 each (rank 0's medians)\n",
        kernels::comm::version()?
    ));
    say(
        "| buffer per rank | median ms | algbw GB/s | busbw GB/s | torch algbw GB/s | / torch |"
            .into(),
    );
    say("|---|---|---|---|---|---|".into());
    for mb in [16usize, 128, 1024] {
        let bytes = mb << 20;
        let ms = comm.bench_all_to_all(bytes)?;
        let alg = bytes as f64 / (ms * 1e-3) / 1e9;
        let bus = alg * (world - 1) as f64 / world as f64;
        let peer = anchors
            .get(format!("a2a_{mb}MB_algbw_GBps"))
            .and_then(serde_json::Value::as_f64);
        say(format!(
            "| {mb} MiB | {ms:.3} | {alg:.1} | {bus:.1} | {} | {} |",
            peer.map_or("-".into(), |p| format!("{p:.1}")),
            peer.map_or("-".into(), |p| format!("{:.3}", alg / p)),
        ));
    }

    say(format!(
        "\nLRMoE backward all-to-all, Qwen3-30B-A3B experts ({EXPERTS} experts, hidden {HIDDEN}, {PAIRS_PER_RANK} pairs per rank, Zipf(0.8) skew, experts owned in blocks of {})\n",
        EXPERTS / world
    ));
    say("| retention | kept pairs (all ranks) | rows out MiB (rank 0) | out ms | dX back ms | backward all-to-all ms | / r = 1 |".into());
    say("|---|---|---|---|---|---|---|".into());
    let routed = zipf_counts(PAIRS_PER_RANK);
    let owner = |e: usize| e * world / EXPERTS;
    let mut base = None;
    for r in [1.0f64, 0.5, 0.25] {
        let kept: Vec<u64> = routed
            .iter()
            .map(|&n| (n as f64 * r).round() as u64)
            .collect();
        // Every source has the same routed counts here, so pairs from s to
        // d are the kept pairs of d's experts, for every s.
        let to: Vec<u64> = (0..world)
            .map(|d| {
                (0..EXPERTS)
                    .filter(|&e| owner(e) == d)
                    .map(|e| kept[e])
                    .sum()
            })
            .collect();
        let row_out = 2 * HIDDEN * 2;
        let row_back = HIDDEN * 2;
        let send_out: Vec<usize> = to.iter().map(|&p| p as usize * row_out).collect();
        let recv_out: Vec<usize> = (0..world).map(|_| to[me] as usize * row_out).collect();
        let out_ms = comm.bench_all_to_all_counts(&send_out, &recv_out)?;
        let send_back: Vec<usize> = (0..world).map(|_| to[me] as usize * row_back).collect();
        let recv_back: Vec<usize> = to.iter().map(|&p| p as usize * row_back).collect();
        let back_ms = comm.bench_all_to_all_counts(&send_back, &recv_back)?;
        let total = out_ms + back_ms;
        let b = *base.get_or_insert(total);
        say(format!(
            "| {r} | {} | {:.1} | {out_ms:.3} | {back_ms:.3} | {total:.3} | {:.3} |",
            kept.iter().sum::<u64>() * world as u64,
            send_out.iter().sum::<usize>() as f64 / (1 << 20) as f64,
            total / b
        ));
    }

    Ok(())
}

/// Table 3: the device executor over NCCL beside EP = 1.
fn layer_table(
    comm: &kernels::comm::NcclComm,
    gpu: &kernels::gpu::Gpu,
    cfg: &layer::MoeConfig,
    tokens: usize,
    world: usize,
    say: &dyn Fn(String),
) -> anyhow::Result<()> {
    let rs = [1.0, 0.5, 0.25];
    // The device executor's controller (`layer::DevicePlanner`) at each
    // ratio, over NCCL and on this rank's GPU alone (EP = 1, the same
    // executor) with the same tokens per GPU.
    let planners = lrmoe_benches::ratio_planners(cfg, &rs);
    let labelled: Vec<(f64, &layer::DevicePlanner)> =
        rs.iter().copied().zip(planners.iter()).collect();
    let ep_rows = layer::device::bench(
        gpu,
        layer::device::DeviceComm::Nccl(comm),
        cfg,
        tokens,
        &labelled,
        0.0,
        10,
    )?;
    let one_rows = layer::device::bench(
        gpu,
        layer::device::DeviceComm::Local,
        cfg,
        tokens,
        &labelled,
        0.0,
        10,
    )?;
    let one_fwd = one_rows[0].forward_ms;
    say(format!(
        "\nExpert-parallel MoE layer on the GPUs (Qwen3-30B-A3B shape, {} tokens per rank, top-8, {EXPERTS} experts in blocks of {}, hidden {HIDDEN}, ffn 768, random router); single GPU = the same layer with EP = 1 on the same tokens per GPU; rank 0's wall-clock medians of 10\n",
        tokens,
        EXPERTS / world
    ));
    say("| retention | kept pairs (all ranks) | EP bwd bytes out (rank 0) MiB | EP fwd ms | EP bwd ms | EP bwd / r = 1 | single-GPU fwd ms | single-GPU bwd ms | EP fwd+bwd / single-GPU |".into());
    say("|---|---|---|---|---|---|---|---|---|".into());
    for (ep, one) in ep_rows.iter().zip(&one_rows) {
        say(format!(
            "| {} | {} | {:.1} | {:.2} | {:.2} | {:.3} | {one_fwd:.2} | {:.2} | {:.3} |",
            ep.retention,
            ep.kept_total,
            ep.bytes_sent as f64 / (1 << 20) as f64,
            ep.forward_ms,
            ep.backward_ms,
            ep.backward_ms / ep_rows[0].backward_ms,
            one.backward_ms,
            (ep.forward_ms + ep.backward_ms) / (one_fwd + one.backward_ms),
        ));
    }
    Ok(())
}

/// The hot workload (`--hot 2.0`: rank 0's experts get +2 on their router
/// logits, as in the PyTorch peer) under one per-GPU memory budget: the
/// memory one GPU needs for its own experts (weights and gradients) and a
/// balanced share of the token buffers (`T·k` kept pairs of `[x | g·δ]`
/// bf16 rows). Fixed ownership and replication keep every pair; LRMoE's
/// controller keeps what the budget allows per rank.
fn hot_table(
    t: &NcclTransport,
    gpu: &kernels::gpu::Gpu,
    cfg: &layer::MoeConfig,
    tokens: usize,
    say: &dyn Fn(String),
) -> anyhow::Result<()> {
    let world = t.world_size();
    let el = cfg.n_experts / world;
    let cost = quota::CostModel::swiglu_expert(
        cfg.hidden,
        cfg.ffn,
        2,
        quota::H200_LINK_BYTES_PER_S,
        quota::H200_FLOPS_PER_S,
    );
    let pairs = (tokens * cfg.top_k) as u64;
    let budget = el as u64 * cost.instance_bytes() + pairs * cost.row_bytes();
    let cfg = *cfg;
    let budgeted = |slots: usize| -> anyhow::Result<layer::DevicePlanner> {
        Ok(layer::DevicePlanner::new(
            cfg,
            layer::CallConfig {
                retention: layer::Retention::Budgeted {
                    budgets: vec![
                        quota::RankBudget {
                            memory_bytes: budget,
                            network_bytes: u64::MAX,
                        };
                        world
                    ],
                    policy: quota::Policy::Maxmin,
                },
                replica_slots_per_rank: slots,
                replica_rule: quota::ReplicaRule::Fill,
                ..layer::CallConfig::default()
            },
        )?)
    };
    let rows: Vec<(&str, layer::DevicePlanner)> = vec![
        (
            "fixed ownership (exact)",
            layer::DevicePlanner::ratio(&cfg, 1.0),
        ),
        (
            "replication, 8 slots (exact)",
            layer::DevicePlanner::ratio_with_replicas(&cfg, 1.0, 8),
        ),
        (
            "replication, 32 slots (exact)",
            layer::DevicePlanner::ratio_with_replicas(&cfg, 1.0, 32),
        ),
        (
            "capacity factor 1.25 (drops in fwd and bwd)",
            layer::DevicePlanner::new(
                cfg,
                layer::CallConfig {
                    capacity_factor: Some(1.25),
                    ..layer::CallConfig::default()
                },
            )?,
        ),
        ("LRMoE, budget, no replicas", budgeted(0)?),
        ("LRMoE, budget, 8 slots", budgeted(8)?),
    ];
    let labelled: Vec<(f64, &layer::DevicePlanner)> = rows
        .iter()
        .enumerate()
        .map(|(i, (_, p))| (i as f64, p))
        .collect();
    let got = layer::device::bench(
        gpu,
        layer::device::DeviceComm::Nccl(t.comm()),
        &cfg,
        tokens,
        &labelled,
        2.0,
        10,
    )?;
    let mine: Vec<u64> = got
        .iter()
        .flat_map(|r| [r.peak_bytes, r.kept_pairs as u64])
        .collect();
    let all = layer::transport::all_gather(t, &mine)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    say(format!(
        "\nHot workload (router logit +2.0 on rank 0's experts, as `torch_ep_anchor.py --hot 2.0`), same shape; per-GPU memory budget {:.2} GiB (own experts' weights and gradients + a balanced share of token buffers, {pairs} kept pairs of [x | g·δ] bf16 rows); peak = device memory above the weights during one forward + backward, the larger rank's; rank 0's wall-clock medians of 10\n",
        gib(budget)
    ));
    say("| strategy | fwd ms | bwd ms | fwd+bwd ms | kept fraction | pairs processed in bwd (rank 0 / rank 1 …) | peak GiB (max rank) | peak / budget |".into());
    say("|---|---|---|---|---|---|---|---|".into());
    for (i, ((name, _), r)) in rows.iter().zip(&got).enumerate() {
        let peak = all.iter().map(|v| v[2 * i]).max().unwrap_or(0);
        let loads: Vec<String> = all.iter().map(|v| v[2 * i + 1].to_string()).collect();
        say(format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.3} | {} | {:.2} | {:.2} |",
            r.forward_ms,
            r.backward_ms,
            r.forward_ms + r.backward_ms,
            r.kept_total as f64 / (pairs * world as u64) as f64,
            loads.join(" / "),
            gib(peak),
            peak as f64 / budget as f64
        ));
    }
    Ok(())
}
