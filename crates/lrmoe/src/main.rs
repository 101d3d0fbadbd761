//! The `lrmoe` command line. Every failure is one line on stderr and a
//! non-zero exit status.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use lrmoe::{quota, redistribute};

#[derive(Parser)]
#[command(
    name = "lrmoe",
    version,
    about = "LRMoE: plannable, compacted MoE backward"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan one layer call: quotas, replicas and the redistribution, as JSON.
    #[command(allow_negative_numbers = true)]
    Plan {
        /// Planning problem (JSON; schema in docs/formats.md).
        #[arg(long)]
        input: PathBuf,
        /// Redistribution solver.
        #[arg(long, value_enum, default_value_t = SolverArg::Exact)]
        solver: SolverArg,
        /// Quota policy (overrides the problem file's).
        #[arg(long, value_enum)]
        policy: Option<PolicyArg>,
        /// Time limit of the ILP solver, milliseconds (≥ 1).
        #[arg(long, default_value_t = 2000, value_parser = at_least_u64::<1>)]
        ilp_time_limit_ms: u64,
        /// Write the plan here (atomically) instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Train the MoE language model: by default on the CPU, on the built-in
    /// Shakespeare corpus, 3000 steps into runs/default (about 5 minutes on
    /// 2 idle cores). Under `lrmoe launch` each process is one rank and the
    /// ranks talk over NCCL (needs `--features nccl`).
    #[command(allow_negative_numbers = true)]
    Train(TrainArgs),
    /// Start this node's ranks, one process per GPU, with RANK, WORLD_SIZE,
    /// LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; e.g.
    /// `lrmoe launch --nproc 2 -- train --ranks 2`.
    #[command(allow_negative_numbers = true)]
    Launch(LaunchArgs),
    /// Replay routing traces: memory and backward time of fixed ownership,
    /// replication and LRMoE under one per-rank budget.
    #[command(allow_negative_numbers = true)]
    Replay(ReplayArgs),
    /// Write a comparison's table and plots again from its compare.json
    /// (`train --compare` writes it): compare.md, compare.{svg,png} against
    /// wall time and, for simulated ranks, compare-simulated.{svg,png}
    /// against the simulated MoE-layer time. Several inputs (the same
    /// target and simulated GPUs, each mode once unless --rerun) are joined into one
    /// comparison, written with its compare.json into --out.
    Redraw {
        /// The comparison (compare.json, or the folder holding one);
        /// repeat it to join comparisons trained in parts.
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// Folder to write into (default: the input's folder; required
        /// with several inputs).
        #[arg(long)]
        out: Option<PathBuf>,
        /// When joining, a mode in a later input replaces that mode's run
        /// from an earlier one (a mode trained again, e.g. after a time
        /// limit cut its first run off) instead of being an error.
        #[arg(long)]
        rerun: bool,
    },
    /// One table over several comparisons (compare.json), a row each: every
    /// mode's MoE-layer and whole-step time to the target (simulated where
    /// present), steps and kept share, the best exact-backward baseline, every mode that changes the
    /// backward against it on the evaluation grid and between evaluations,
    /// and LRMoE's memory against fixed ownership's.
    #[command(allow_negative_numbers = true)]
    Summary {
        /// A comparison (compare.json, or the folder holding one); repeat
        /// it, one row each.
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// With --steps-bound: count the comparisons where LRMoE takes at
        /// most this many times the best exact-backward baseline's MoE-layer
        /// time to the target (on the evaluation grid; issue 30: 0.8), and
        /// name per setting (`setting/variant` inputs) the variant closest
        /// to both bounds and count per variant those meeting them.
        #[arg(long, requires = "steps_bound")]
        time_bound: Option<f64>,
        /// With --time-bound: and at most this many times its steps (issue
        /// 30: 1.15).
        #[arg(long, requires = "time_bound")]
        steps_bound: Option<f64>,
        /// Count the comparisons where LRMoE's accounted memory is at least
        /// this share below fixed ownership's unsplit need (issue 30: 0.5),
        /// runs that counted the forward's buffers apart from older ones.
        #[arg(long)]
        memory_bound: Option<f64>,
        /// Also write the table to this file (atomically).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// One MoE layer's forward and LRMoE backward from safetensors files.
    #[command(allow_negative_numbers = true)]
    LayerGrad {
        /// Layer weights: router, experts.{e}.{gate,up,down}.
        #[arg(long)]
        weights: PathBuf,
        /// Inputs: x and dy, both tokens × hidden.
        #[arg(long)]
        inputs: PathBuf,
        /// Output file (written atomically).
        #[arg(long)]
        out: PathBuf,
        /// Kept share of each expert's pairs in the backward, in [0, 1].
        #[arg(long, default_value_t = 1.0, value_parser = fraction)]
        retention: f64,
        /// Experts per token (≥ 1).
        #[arg(long, default_value_t = 2, value_parser = at_least::<1>)]
        top_k: usize,
        /// Renormalise the top-k routing weights.
        #[arg(long)]
        renormalize: bool,
    },
}

/// `lrmoe train`. Flags override the `--config` file, which overrides the
/// defaults shown; `docs/formats.md` lists every configuration field.
#[derive(clap::Args)]
struct TrainArgs {
    /// TOML configuration; every field optional (docs/formats.md).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// A Hugging Face Qwen3-MoE config.json giving the model's shape, in
    /// place of the configuration's [model] section (with a warning where
    /// the configuration has one).
    #[arg(long, value_name = "FILE")]
    model_config: Option<PathBuf>,
    /// Transformer blocks [default: model.n_layers, 2].
    #[arg(long, value_name = "N", value_parser = at_least::<1>)]
    layers: Option<usize>,
    /// Optimizer steps [default: steps, 3000].
    #[arg(long, value_name = "N", value_parser = at_least::<1>)]
    steps: Option<usize>,
    /// Seed of the initial weights, the batches and the sampling rules
    /// [default: seed, 0].
    #[arg(long, value_name = "N", value_parser = whole_u64)]
    seed: Option<u64>,
    /// Text corpus, UTF-8 [default: data.corpus, or the built-in
    /// Shakespeare corpus].
    #[arg(long, value_name = "FILE")]
    corpus: Option<PathBuf>,
    /// Output folder: metrics.jsonl, checkpoint.safetensors, reports
    /// [default: run.out_dir, runs/default].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Continue the run in the output folder from its checkpoint.
    #[arg(long, conflicts_with = "force", help_heading = "Run")]
    resume: bool,
    /// Start over in an output folder that holds an earlier run (its
    /// checkpoint and metrics are replaced).
    #[arg(long, help_heading = "Run")]
    force: bool,
    /// Stop at the first evaluation at or below this validation loss, in
    /// nats per token (> 0) [default: run.target_val_loss, none].
    #[arg(long, value_name = "LOSS", value_parser = positive, help_heading = "Run")]
    target_val_loss: Option<f64>,
    /// Stop after this much training time, in minutes, (0, 525600]
    /// [default: run.max_minutes, no cap].
    #[arg(long, value_name = "MIN", value_parser = minutes, help_heading = "Run")]
    max_minutes: Option<f64>,
    /// Write no checkpoint, neither periodic nor final (the run cannot be
    /// resumed) [default: run.checkpoint, true].
    #[arg(long, help_heading = "Run")]
    no_checkpoint: bool,
    /// No progress bar.
    #[arg(long, help_heading = "Run")]
    no_progress: bool,
    /// Backward of the MoE layers [default: moe.mode, lrmoe].
    #[arg(long, value_enum, help_heading = "MoE backward")]
    mode: Option<lrmoe::train::Mode>,
    /// Which pairs the LRMoE backward keeps within each quota: priority,
    /// top_q, random_q or proportional [default: moe.selection_rule,
    /// priority].
    #[arg(long, value_name = "RULE", help_heading = "MoE backward")]
    selection_rule: Option<String>,
    /// Each rank's backward buffer, as a share of the average routed pairs
    /// per rank, in (0, ranks]: 1 holds the average, `ranks` every pair of
    /// a step on one rank [default: moe.buffer_fraction, 0.6].
    #[arg(long, value_name = "F", value_parser = positive, help_heading = "MoE backward")]
    buffer_fraction: Option<f64>,
    /// Hold every mode to LRMoE's per-rank buffer: full and replicate split
    /// steps into micro-batches, capacity uses the buffer fraction as its
    /// factor [default: moe.fit_budget, false].
    #[arg(long, help_heading = "MoE backward")]
    fit_budget: bool,
    /// With --fit-budget: whether the budget holds the forward's rows too,
    /// so that LRMoE (whose forward computes every pair) splits its steps
    /// where its forward does not fit; `false` binds the backward's buffers
    /// alone, as runs before 2026-12-05 did [default: moe.budget_forward,
    /// true; the flag alone: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true",
          help_heading = "MoE backward")]
    budget_forward: Option<bool>,
    /// Train several modes to the same --target-val-loss, one after the
    /// other into <out>/<mode>, and write a comparison table and plot.
    #[arg(long, help_heading = "Comparison")]
    compare: bool,
    /// Modes --compare trains, comma-separated [default: full, replicate,
    /// lrmoe, capacity].
    #[arg(long, value_enum, value_delimiter = ',', help_heading = "Comparison")]
    modes: Option<Vec<lrmoe::train::Mode>>,
    /// Where the model trains: `cpu`, or `cuda` (a build with `--features
    /// cuda`): the whole model on GPU 0, bf16 compute and f32 masters.
    #[arg(
        long,
        value_name = "DEVICE",
        default_value = "cpu",
        help_heading = "Where it runs"
    )]
    device: String,
    /// Expert-parallel ranks in this process [default: moe.ranks, 2 on the
    /// CPU, 1 with --device cuda; launched ranks: WORLD_SIZE].
    #[arg(long, value_name = "N", value_parser = at_least::<1>, help_heading = "Where it runs")]
    ranks: Option<usize>,
    /// Executor of the MoE layers with several ranks: `host` (rows
    /// exchanged through host memory) or `device` (with --device cuda: the
    /// whole model per rank on the GPU, exchanges over NCCL, or device to
    /// device between in-process ranks, which report their simulated step
    /// on as many GPUs) [default: moe.executor, host].
    #[arg(long, value_enum, help_heading = "Where it runs")]
    executor: Option<lrmoe::train::Executor>,
    /// Launched ranks (`lrmoe launch`): seconds a collective or the
    /// rendezvous may wait for its peers before every rank stops with an
    /// error, in (0, 86400].
    #[arg(long, value_name = "S", default_value_t = 300.0, value_parser = seconds, help_heading = "Where it runs")]
    timeout_s: f64,
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// Processes (GPUs) on this node (≥ 1).
    #[arg(long, value_parser = at_least::<1>)]
    nproc: usize,
    /// Nodes in the job (≥ 1).
    #[arg(long, default_value_t = 1, value_parser = at_least::<1>)]
    nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0, value_parser = at_least::<0>)]
    node_rank: usize,
    /// Rank 0's host.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rank 0's rendezvous port (default: a free port; required with several nodes).
    #[arg(long)]
    master_port: Option<u16>,
    /// Run this program instead of lrmoe (e.g. a test binary).
    #[arg(long)]
    exec: Option<PathBuf>,
    /// Seconds the other ranks get to stop on their own after one fails,
    /// in [0, 86400].
    #[arg(long, default_value_t = 10.0, value_parser = grace_seconds)]
    grace_s: f64,
    /// Arguments of each rank (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
}

/// `lrmoe replay`: exactly one source of routing loads is required.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).multiple(false)))]
struct ReplayArgs {
    /// deepseek-ai/EPLB load matrix [layers][experts] (JSON).
    #[arg(long, value_name = "FILE", group = "source")]
    eplb: Option<PathBuf>,
    /// Megatron-Core router traces (JSON lines with step, layer, rank, top_indices).
    #[arg(long, value_name = "FILE", group = "source")]
    megatron: Option<PathBuf>,
    /// `lrmoe train`'s metrics.jsonl.
    #[arg(long, value_name = "FILE", group = "source")]
    lrmoe_metrics: Option<PathBuf>,
    /// A synthetic workload.
    #[arg(long, value_enum, group = "source")]
    synthetic: Option<lrmoe::replay::Workload>,
    /// Experts per layer (Megatron traces and synthetic workloads; ≥ 1).
    #[arg(long, default_value_t = 128, value_parser = at_least::<1>)]
    experts: usize,
    /// Ranks (GPUs; ≥ 1).
    #[arg(long, default_value_t = 8, value_parser = at_least::<1>)]
    ranks: usize,
    /// Synthetic: steps (≥ 1).
    #[arg(long, default_value_t = 100, value_parser = at_least::<1>)]
    steps: usize,
    /// Synthetic: MoE layers (≥ 1).
    #[arg(long, default_value_t = 4, value_parser = at_least::<1>)]
    layers: usize,
    /// Synthetic: tokens per rank per step (≥ 1).
    #[arg(long, default_value_t = 16384, value_parser = at_least::<1>)]
    tokens: usize,
    /// Synthetic: experts per token (≥ 1).
    #[arg(long, default_value_t = 8, value_parser = at_least::<1>)]
    top_k: usize,
    /// Synthetic: Zipf exponent of the hot workloads (≥ 0).
    #[arg(long, default_value_t = 1.2, value_parser = non_negative)]
    zipf: f64,
    /// Synthetic: seed.
    #[arg(long, default_value_t = 0, value_parser = whole_u64)]
    seed: u64,
    /// Model width (≥ 1).
    #[arg(long, default_value_t = 2048, value_parser = at_least::<1>)]
    hidden: usize,
    /// Expert FFN width (≥ 1).
    #[arg(long, default_value_t = 768, value_parser = at_least::<1>)]
    ffn: usize,
    /// Per-rank memory budget for one layer call, MiB (> 0).
    #[arg(long, default_value_t = 1024.0, value_parser = positive)]
    budget_mib: f64,
    /// Replicas each rank may host.
    #[arg(long, default_value_t = 2, value_parser = at_least::<0>)]
    replica_slots: usize,
    /// Share of the memory left after placement that replicas may use, in
    /// [0, 1] (`lrmoe train` gives its replicas 1.0).
    #[arg(long, default_value_t = 0.5, value_parser = fraction)]
    replica_memory_fraction: f64,
    /// Bytes per element of rows, weights and gradients (2: bf16 as on the
    /// GPUs; 4: f32 as the host executor's buffers).
    #[arg(long, default_value_t = 2, value_parser = at_least_u64::<1>)]
    element_bytes: u64,
    /// LRMoE quota policy.
    #[arg(long, value_enum, default_value_t = PolicyArg::Maxmin)]
    policy: PolicyArg,
    /// LRMoE's replicas: `paying` keeps those whose compute and token rows
    /// taken off the busiest rank pay for their weight and gradient
    /// traffic in the cost model, `paying-compute` the same without the
    /// token rows (the rule before 2026-12-04's session 43), `fill` every
    /// one the slots allow (the replication strategy always fills).
    #[arg(long, value_enum, default_value_t = ReplicaRuleArg::Paying)]
    replica_rule: ReplicaRuleArg,
    /// LRMoE quotas trimmed to whole 128-row GEMM tiles where that drops at
    /// most this share of a quota, in [0, 1], as `moe.tile_trim` does on
    /// the GPU executors (0: off, as the host executor runs).
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    tile_trim: f64,
    /// Keep the replica slots LRMoE's rule leaves empty out of its token
    /// buffer, as `lrmoe train` does (off: an empty slot's bytes hold rows).
    #[arg(long)]
    slots_reserved: bool,
    /// Count the forward's rows in each rank's token buffers, as `lrmoe
    /// train`'s accounting does (a rank holds the larger of its forward's
    /// rows and its backward's; off: the backward's alone, the
    /// controller's model), and let LRMoE's controller place the replicas
    /// that bring every rank's forward within the budget, as the trainer's
    /// does where its budget holds the forward.
    #[arg(long)]
    count_forward: bool,
    /// Cluster model: GPUs per node (ranks are numbered node by node).
    #[arg(long, default_value_t = 8, value_parser = at_least::<1>)]
    gpus_per_node: usize,
    /// Cluster model: intra-node bandwidth per GPU and direction, GB/s (the
    /// default is fitted to the all-to-alls measured on 2 and 4 H200s).
    #[arg(long, default_value_t = 336.0, value_parser = positive)]
    intra_gb_per_s: f64,
    /// Cluster model: inter-node bandwidth per GPU and direction, GB/s
    /// (DeepEP's RDMA figure at 400 Gb/s; not validated here).
    #[arg(long, default_value_t = 45.0, value_parser = positive)]
    inter_gb_per_s: f64,
    /// Output folder for replay.json, replay.csv and the memory and time charts (SVG and PNG).
    #[arg(long, value_name = "DIR", default_value = "runs/replay")]
    out: PathBuf,
    /// `cuda`: also allocate each strategy's modelled peak on GPU 0 and
    /// report the measured memory beside the model (needs `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Standard output for the commands' results. A closed pipe (`lrmoe summary
/// … | head`) ends the output quietly instead of panicking; another write
/// error is one line on standard error. Either way the command's own work
/// (its files, a checkpoint) goes on.
fn write_stdout(args: std::fmt::Arguments) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("lrmoe: cannot write to standard output: {e}");
        }
    }
}

/// `print!` through [`write_stdout`].
macro_rules! say {
    ($($t:tt)*) => { write_stdout(format_args!($($t)*)) };
}

/// `println!` through [`write_stdout`].
macro_rules! sayln {
    ($($t:tt)*) => { write_stdout(format_args!("{}\n", format_args!($($t)*))) };
}

fn replay(a: &ReplayArgs) -> anyhow::Result<()> {
    use lrmoe::replay as rp;
    // The GPU is opened before anything is computed or written, so a build
    // or machine without one fails with nothing left behind.
    let gpu = match a.device.as_str() {
        "cpu" => None,
        "cuda" => Some(lrmoe::kernels::gpu::Gpu::open(0)?),
        other => anyhow::bail!("--device {other}: expected cpu or cuda"),
    };
    let trace = if let Some(p) = &a.eplb {
        rp::load_eplb(p, a.ranks)?
    } else if let Some(p) = &a.megatron {
        rp::load_megatron(p, a.experts)?
    } else if let Some(p) = &a.lrmoe_metrics {
        rp::load_lrmoe_metrics(p, a.ranks)?
    } else if let Some(workload) = a.synthetic {
        rp::synthetic(&rp::Synthetic {
            workload,
            steps: a.steps,
            layers: a.layers,
            experts: a.experts,
            ranks: a.ranks,
            tokens: a.tokens,
            top_k: a.top_k,
            zipf: a.zipf,
            seed: a.seed,
        })?
    } else {
        anyhow::bail!(
            "no routing source: give one of --eplb, --megatron, --lrmoe-metrics, --synthetic"
        );
    };
    let cluster = lrmoe::cluster::Cluster {
        gpus_per_node: a.gpus_per_node,
        intra_gb_per_s: a.intra_gb_per_s,
        inter_gb_per_s: a.inter_gb_per_s,
        ..Default::default()
    };
    let cfg = rp::ReplayConfig {
        hidden: a.hidden,
        ffn: a.ffn,
        element_bytes: a.element_bytes,
        memory_budget_bytes: (a.budget_mib * (1 << 20) as f64) as u64,
        // LRMoE's controller times replica traffic at the slowest link the
        // ranks span, as the trainer does.
        link_bytes_per_s: cluster.slowest_link_bytes_per_s(trace.ranks),
        flops_per_s: lrmoe::quota::H200_FLOPS_PER_S,
        replica_slots_per_rank: a.replica_slots,
        replica_memory_fraction: a.replica_memory_fraction,
        policy: match a.policy {
            PolicyArg::Uniform => quota::Policy::Uniform,
            PolicyArg::Maxmin => quota::Policy::Maxmin,
        },
        replica_rule: match a.replica_rule {
            ReplicaRuleArg::Paying => quota::ReplicaRule::Paying,
            ReplicaRuleArg::Fill => quota::ReplicaRule::Fill,
            ReplicaRuleArg::PayingCompute => quota::ReplicaRule::PayingCompute,
        },
        tile_trim: a.tile_trim,
        cluster,
        slots_reserved: a.slots_reserved,
        count_forward: a.count_forward,
    };
    let report = rp::replay(&trace, &cfg)?;
    let files = rp::write(&a.out, &report, cfg.memory_budget_bytes)?;
    say!("{}", rp::table(&report));
    if let Some(gpu) = &gpu {
        sayln!(
            "\n| strategy | modelled MiB | measured MiB | measured / modelled |\n|---|---|---|---|"
        );
        for c in rp::check_on_device(gpu, &report)? {
            sayln!(
                "| {:?} | {:.1} | {:.1} | {:.4} |",
                c.strategy,
                c.modelled_bytes as f64 / (1 << 20) as f64,
                c.measured_bytes as f64 / (1 << 20) as f64,
                c.ratio
            );
        }
    }
    sayln!("wrote {}", files.join(", "));
    Ok(())
}

/// The run's configuration: defaults, then the `--config` file, then the
/// flags. Also says where `moe.ranks` came from (`None`: its default), so
/// that a default may adapt to the device but a setting is never replaced.
fn train_config(
    a: &TrainArgs,
) -> anyhow::Result<(lrmoe::train::TrainConfig, Option<&'static str>)> {
    let (mut cfg, text) = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let cfg = lrmoe::train::TrainConfig::from_toml(&text)
                .with_context(|| format!("{}", path.display()))?;
            (cfg, text)
        }
        None => (lrmoe::train::TrainConfig::default(), String::new()),
    };
    let ranks_from = if a.ranks.is_some() {
        Some("--ranks")
    } else if lrmoe::train::toml_sets(&text, "moe", Some("ranks")) {
        Some("the configuration's moe.ranks")
    } else {
        None
    };
    if let Some(path) = &a.model_config {
        // A flag overrides the file, as every flag does; it says so.
        if lrmoe::train::toml_sets(&text, "model", None) {
            tracing::warn!(
                "--model-config {} replaces the configuration's [model] section",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let hf = lrmoe::hf_config::parse(&text).with_context(|| format!("{}", path.display()))?;
        if let Some(w) = hf.warning() {
            tracing::warn!("{}: {w}", path.display());
        }
        cfg.model = hf.model;
    }
    if let Some(v) = a.layers {
        cfg.model.n_layers = v;
    }
    if let Some(v) = a.steps {
        cfg.steps = v;
    }
    if let Some(v) = a.seed {
        cfg.seed = v;
    }
    if let Some(v) = a.mode {
        cfg.moe.mode = v;
    }
    if let Some(v) = a.selection_rule.clone() {
        cfg.moe.selection_rule = v;
    }
    if let Some(v) = a.buffer_fraction {
        cfg.moe.buffer_fraction = v;
    }
    if a.fit_budget {
        cfg.moe.fit_budget = true;
    }
    if let Some(v) = a.budget_forward {
        cfg.moe.budget_forward = v;
    }
    if let Some(v) = a.executor {
        cfg.moe.executor = v;
    }
    if let Some(v) = a.ranks {
        cfg.moe.ranks = v;
    }
    if let Some(v) = &a.out {
        cfg.run.out_dir = v.clone();
    }
    if let Some(v) = &a.corpus {
        cfg.data.corpus = Some(v.clone());
    }
    if let Some(v) = a.target_val_loss {
        cfg.run.target_val_loss = Some(v);
    }
    if let Some(v) = a.max_minutes {
        cfg.run.max_minutes = Some(v);
    }
    if a.no_checkpoint {
        cfg.run.checkpoint = false;
    }
    Ok((cfg, ranks_from))
}

fn train(a: &TrainArgs) -> anyhow::Result<()> {
    let (mut cfg, ranks_from) = train_config(a)?;
    let dist = lrmoe::layer::DistEnv::from_env()?;
    let transport = match dist.clone() {
        None => None,
        Some(env) => {
            cfg.moe.ranks = lrmoe::train::resolve_ranks(
                cfg.moe.ranks,
                ranks_from,
                Some(env.world),
                a.device == "cuda",
            )?;
            let t =
                lrmoe::layer::NcclTransport::connect(&env, Duration::from_secs_f64(a.timeout_s))?;
            tracing::info!(
                rank = env.rank,
                world = env.world,
                gpu = env.local_rank,
                "NCCL ready"
            );
            Some(std::sync::Arc::new(t))
        }
    };
    let rank0 = transport.as_ref().is_none_or(|t| {
        use lrmoe::layer::Transport;
        t.rank() == 0
    });
    let gpu = match a.device.as_str() {
        "cpu" => None,
        "cuda" => {
            if transport.is_none() {
                cfg.moe.ranks = lrmoe::train::resolve_ranks(cfg.moe.ranks, ranks_from, None, true)?;
            }
            let ordinal = dist.as_ref().map_or(0, |d| d.local_rank);
            Some(std::sync::Arc::new(lrmoe::kernels::gpu::Gpu::open(
                ordinal,
            )?))
        }
        other => anyhow::bail!("--device {other}: expected cpu or cuda"),
    };
    let stop = lrmoe::stop::install_for_run()?;
    let opts = lrmoe::train::RunOptions {
        resume: a.resume,
        force: a.force,
        progress: !a.no_progress,
        transport,
        gpu,
        stop,
    };
    if a.compare {
        let modes = a
            .modes
            .clone()
            .unwrap_or_else(|| lrmoe::compare::MODES.to_vec());
        let report = lrmoe::compare::run(&cfg, &opts, &modes)?;
        if !rank0 {
            return Ok(());
        }
        sayln!("{}", report.table);
        sayln!("wrote {}", report.files.join(", "));
        return Ok(());
    }
    let s = lrmoe::train::train(&cfg, &opts)?;
    if !rank0 {
        return Ok(());
    }
    sayln!(
        "steps {} ({}) | validation loss {:.4} nats/token | unigram baseline {:.4} | mean kept fraction {:.3} | {}",
        s.steps,
        s.stop_reason,
        s.final_val_loss,
        s.unigram_val_loss,
        s.mean_kept_fraction,
        cfg.run.out_dir.display()
    );
    Ok(())
}

#[derive(Clone, Copy, ValueEnum)]
enum SolverArg {
    Exact,
    Ilp,
    Greedy,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyArg {
    Uniform,
    Maxmin,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReplicaRuleArg {
    Paying,
    Fill,
    PayingCompute,
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(a) => train(&a),
        Command::Launch(a) => {
            if !(a.grace_s.is_finite() && (0.0..=86_400.0).contains(&a.grace_s)) {
                anyhow::bail!("--grace-s must be a number of seconds in [0, 86400]");
            }
            if a.exec.is_none() && a.args.is_empty() {
                anyhow::bail!("nothing to launch: give the rank's arguments after `--`, e.g. `lrmoe launch --nproc 2 -- train`");
            }
            lrmoe::launch::launch(&lrmoe::launch::LaunchOptions {
                nproc: a.nproc,
                nnodes: a.nnodes,
                node_rank: a.node_rank,
                master_addr: a.master_addr,
                master_port: a.master_port,
                program: a.exec,
                args: a.args,
                grace: Duration::from_secs_f64(a.grace_s),
                stop: lrmoe::stop::install_for_launcher()?,
            })?;
            Ok(())
        }
        Command::Replay(a) => replay(&a),
        Command::Redraw { input, out, rerun } => {
            let input = lrmoe::compare::comparison_files(&input);
            if rerun && input.len() < 2 {
                anyhow::bail!("--rerun replaces runs when joining: give two or more --input");
            }
            let report = match (input.as_slice(), out) {
                ([one], out) => {
                    let dir = out.unwrap_or_else(|| match one.parent() {
                        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                        _ => PathBuf::from("."),
                    });
                    lrmoe::compare::redraw(one, &dir)?
                }
                (_, Some(dir)) => lrmoe::compare::merge(&input, &dir, rerun)?,
                (_, None) => anyhow::bail!(
                    "redraw with {} inputs joins them: say where with --out",
                    input.len()
                ),
            };
            sayln!("{}", report.table);
            sayln!("wrote {}", report.files.join(", "));
            Ok(())
        }
        Command::Summary {
            input,
            time_bound,
            steps_bound,
            memory_bound,
            out,
        } => {
            let bounds = time_bound
                .zip(steps_bound)
                .map(|(time, steps)| lrmoe::compare::Bounds { time, steps });
            let input = lrmoe::compare::comparison_files(&input);
            let table = lrmoe::compare::summary(&input, bounds, memory_bound)?;
            if let Some(path) = &out {
                lrmoe::fsutil::write_atomic(path, table.as_bytes())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            say!("{table}");
            if let Some(path) = out {
                sayln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::LayerGrad {
            weights,
            inputs,
            out,
            retention,
            top_k,
            renormalize,
        } => {
            if !(0.0..=1.0).contains(&retention) {
                anyhow::bail!("--retention {retention} must be in [0, 1]");
            }
            let opts = lrmoe::layer_grad::Options {
                top_k,
                renormalize,
                retention,
            };
            lrmoe::layer_grad::run(&weights, &inputs, &out, &opts)?;
            sayln!("wrote {}", out.display());
            Ok(())
        }
        Command::Plan {
            input,
            solver,
            policy,
            ilp_time_limit_ms,
            out,
        } => {
            let text = std::fs::read_to_string(&input)
                .with_context(|| format!("cannot read {}", input.display()))?;
            let problem = lrmoe::plan::parse_problem(&text)
                .with_context(|| format!("{}", input.display()))?;
            let opts = lrmoe::plan::Options {
                solver: match solver {
                    SolverArg::Exact => redistribute::Solver::Exact,
                    SolverArg::Ilp => redistribute::Solver::Ilp,
                    SolverArg::Greedy => redistribute::Solver::Greedy,
                },
                policy: policy.map(|p| match p {
                    PolicyArg::Uniform => quota::Policy::Uniform,
                    PolicyArg::Maxmin => quota::Policy::Maxmin,
                }),
                ilp_time_limit: Duration::from_millis(ilp_time_limit_ms),
            };
            let report = lrmoe::plan::run(&problem, &opts)
                .with_context(|| format!("{}", input.display()))?;
            let json = serde_json::to_string_pretty(&report)? + "\n";
            match out {
                Some(path) => lrmoe::fsutil::write_atomic(&path, json.as_bytes())
                    .with_context(|| format!("cannot write {}", path.display()))?,
                None => say!("{json}"),
            }
            Ok(())
        }
    }
}

// Value parsers: a flag's value out of range is refused by clap with the
// flag's name and the range (`invalid value '-5' for '--steps <N>':
// expected a whole number ≥ 1`). Negative numbers reach them because the
// subcommands allow negative numbers as values.

/// A whole number ≥ `MIN`.
fn at_least<const MIN: usize>(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if v >= MIN => Ok(v),
        _ => Err(format!("expected a whole number ≥ {MIN}")),
    }
}

/// A whole number ≥ `MIN` (64-bit).
fn at_least_u64<const MIN: u64>(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(v) if v >= MIN => Ok(v),
        _ => Err(format!("expected a whole number ≥ {MIN}")),
    }
}

/// A whole number in [0, 2^64).
fn whole_u64(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<u64>()
        .map_err(|_| "expected a whole number in [0, 18446744073709551615]".into())
}

/// A finite number inside `ok`, described by `range`.
fn number_in(s: &str, ok: impl Fn(f64) -> bool, range: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && ok(v) => Ok(v),
        _ => Err(format!("expected a number {range}")),
    }
}

fn positive(s: &str) -> Result<f64, String> {
    number_in(s, |v| v > 0.0, "> 0")
}

fn non_negative(s: &str) -> Result<f64, String> {
    number_in(s, |v| v >= 0.0, "≥ 0")
}

fn fraction(s: &str) -> Result<f64, String> {
    number_in(s, |v| (0.0..=1.0).contains(&v), "in [0, 1]")
}

fn minutes(s: &str) -> Result<f64, String> {
    number_in(
        s,
        |v| v > 0.0 && v <= lrmoe::train::MAX_MINUTES,
        "of minutes in (0, 525600]",
    )
}

fn seconds(s: &str) -> Result<f64, String> {
    number_in(s, |v| v > 0.0 && v <= 86_400.0, "of seconds in (0, 86400]")
}

fn grace_seconds(s: &str) -> Result<f64, String> {
    number_in(
        s,
        |v| (0.0..=86_400.0).contains(&v),
        "of seconds in [0, 86400]",
    )
}

/// Parses the command line; a usage error is one line, as every other
/// error is (`--help` and `--version` print as clap draws them).
fn parse_cli() -> Result<Cli, ExitCode> {
    match Cli::try_parse() {
        Ok(cli) => Ok(cli),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            Err(ExitCode::SUCCESS)
        }
        Err(e) => {
            // clap's message up to its usage block, on one line.
            let text = e.to_string();
            let message: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .filter(|l| !l.is_empty())
                .collect();
            let message = message.join(" ");
            let message = message.strip_prefix("error: ").unwrap_or(&message);
            eprintln!("lrmoe: {message} (see --help)");
            Err(ExitCode::from(2))
        }
    }
}

fn main() -> ExitCode {
    lrmoe::keep_freed_memory();
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    tracing_subscriber::fmt()
        .with_writer(lrmoe::progress::make_writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LRMOE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lrmoe: {}", lrmoe::errline::one_line(e.chain()));
            ExitCode::from(2)
        }
    }
}
