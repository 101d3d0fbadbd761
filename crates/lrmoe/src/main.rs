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
        /// Time limit of the ILP solver, milliseconds.
        #[arg(long, default_value_t = 2000)]
        ilp_time_limit_ms: u64,
        /// Write the plan here (atomically) instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Train the MoE language model on the CPU (defaults: ~4 minutes on 2
    /// cores). Under `lrmoe launch` each process is one rank and the ranks
    /// talk over NCCL (needs `--features nccl`).
    Train(TrainArgs),
    /// Start this node's ranks, one process per GPU, with RANK, WORLD_SIZE,
    /// LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; e.g.
    /// `lrmoe launch --nproc 2 -- train --ranks 2`.
    Launch(LaunchArgs),
    /// Replay routing traces: memory and backward time of fixed ownership,
    /// replication and LRMoE under one per-rank budget.
    Replay(ReplayArgs),
    /// One MoE layer's forward and LRMoE backward from safetensors files.
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
        /// Kept share of each expert's pairs in the backward.
        #[arg(long, default_value_t = 1.0)]
        retention: f64,
        /// Experts per token.
        #[arg(long, default_value_t = 2)]
        top_k: usize,
        /// Renormalise the top-k routing weights.
        #[arg(long)]
        renormalize: bool,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// TOML configuration (every field optional; flags below override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// A Hugging Face Qwen3-MoE config.json: the model's shape (replaces the
    /// configuration's model section; flags below override it).
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Transformer blocks (overrides model.n_layers, e.g. a few layers of a
    /// published shape).
    #[arg(long)]
    layers: Option<usize>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Backward mode of the MoE layers.
    #[arg(long, value_enum)]
    mode: Option<lrmoe::train::Mode>,
    /// Where the MoE layers run: the host executor, or (with --device cuda)
    /// the device expert-parallel executor and the whole model on the GPUs.
    #[arg(long, value_enum)]
    executor: Option<lrmoe::train::Executor>,
    /// In-process expert-parallel ranks.
    #[arg(long)]
    ranks: Option<usize>,
    /// Which pairs the LRMoE backward keeps within each quota: top_q,
    /// random_q, proportional or priority (moe.selection_rule).
    #[arg(long)]
    selection_rule: Option<String>,
    /// Per-rank backward buffer as a share of the average routed pairs per
    /// rank, LRMoE mode (moe.buffer_fraction).
    #[arg(long)]
    buffer_fraction: Option<f64>,
    /// Hold every mode to LRMoE's per-rank token-buffer budget: full and
    /// replicate split steps into micro-batches, capacity uses
    /// buffer_fraction as its factor (moe.fit_budget).
    #[arg(long)]
    fit_budget: bool,
    /// Output folder (metrics.jsonl, checkpoint.safetensors, reports).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Text corpus.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Stop at the first evaluation at or below this validation loss.
    #[arg(long)]
    target_val_loss: Option<f64>,
    /// Stop after this much training time, in minutes (default: no cap).
    #[arg(long)]
    max_minutes: Option<f64>,
    /// Continue from the checkpoint in the output folder.
    #[arg(long, conflicts_with = "force")]
    resume: bool,
    /// Start over in an output folder that holds an earlier run (its
    /// checkpoint and metrics are replaced).
    #[arg(long)]
    force: bool,
    /// Train full, LRMoE and capacity-factor backwards to the same target
    /// validation loss and write a comparison table and plot.
    #[arg(long)]
    compare: bool,
    /// Modes the comparison trains (comma-separated; default all four).
    #[arg(long, value_enum, value_delimiter = ',')]
    modes: Option<Vec<lrmoe::train::Mode>>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Launched ranks: seconds a collective (or the rendezvous) may wait for
    /// its peers before every rank stops with an error.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// `cuda` (needs `--features cuda`): one rank trains the whole model on
    /// GPU 0 (weights, optimizer, corpus and activations on the device;
    /// bf16 compute, f32 masters). Several ranks with `--executor device`
    /// do the same per rank: launched ranks on GPU LOCAL_RANK over NCCL, or
    /// in-process ranks (`--ranks N`) sharing GPU 0 with their exchanges
    /// staged through the host (slow; for checking). Several ranks on the
    /// host executor keep the dense parts on the CPU and run the expert
    /// GEMMs as grouped kernels on their GPU.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// Processes (GPUs) on this node.
    #[arg(long)]
    nproc: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
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
    /// Seconds the other ranks get to stop on their own after one fails.
    #[arg(long, default_value_t = 10.0)]
    grace_s: f64,
    /// Arguments of each rank (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// deepseek-ai/EPLB load matrix [layers][experts] (JSON).
    #[arg(long, group = "source")]
    eplb: Option<PathBuf>,
    /// Megatron-Core router traces (JSON lines with step, layer, rank, top_indices).
    #[arg(long, group = "source")]
    megatron: Option<PathBuf>,
    /// `lrmoe train`'s metrics.jsonl.
    #[arg(long, group = "source")]
    lrmoe_metrics: Option<PathBuf>,
    /// A synthetic workload.
    #[arg(long, value_enum, group = "source")]
    synthetic: Option<lrmoe::replay::Workload>,
    /// Experts per layer (Megatron traces and synthetic workloads).
    #[arg(long, default_value_t = 128)]
    experts: usize,
    /// Ranks (GPUs).
    #[arg(long, default_value_t = 8)]
    ranks: usize,
    /// Synthetic: steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Synthetic: MoE layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Synthetic: tokens per rank per step.
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Synthetic: experts per token.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Synthetic: Zipf exponent of the hot workloads.
    #[arg(long, default_value_t = 1.2)]
    zipf: f64,
    /// Synthetic: seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Model width.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Expert FFN width.
    #[arg(long, default_value_t = 768)]
    ffn: usize,
    /// Per-rank memory budget for one layer call, MiB.
    #[arg(long, default_value_t = 1024.0)]
    budget_mib: f64,
    /// Replicas each rank may host.
    #[arg(long, default_value_t = 2)]
    replica_slots: usize,
    /// Share of the memory left after placement that replicas may use
    /// (`lrmoe train` gives its replicas 1.0).
    #[arg(long, default_value_t = 0.5)]
    replica_memory_fraction: f64,
    /// Bytes per element of rows, weights and gradients (2: bf16 as on the
    /// GPUs; 4: f32 as the host executor's buffers).
    #[arg(long, default_value_t = 2)]
    element_bytes: u64,
    /// LRMoE quota policy.
    #[arg(long, value_enum, default_value_t = PolicyArg::Maxmin)]
    policy: PolicyArg,
    /// LRMoE quotas trimmed to whole 128-row GEMM tiles where that drops at
    /// most this share of a quota, as `moe.tile_trim` does on the GPU
    /// executors (0: off, as the host executor runs).
    #[arg(long, default_value_t = 0.0)]
    tile_trim: f64,
    /// Output folder for replay.json, replay.csv and the memory and time charts (SVG and PNG).
    #[arg(long, default_value = "runs/replay")]
    out: PathBuf,
    /// `cuda`: also allocate each strategy's modelled peak on GPU 0 and
    /// report the measured memory beside the model (needs `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn replay(a: &ReplayArgs) -> anyhow::Result<()> {
    use lrmoe::replay as rp;
    let trace = if let Some(p) = &a.eplb {
        rp::load_eplb(p, a.ranks)?
    } else if let Some(p) = &a.megatron {
        rp::load_megatron(p, a.experts)?
    } else if let Some(p) = &a.lrmoe_metrics {
        rp::load_lrmoe_metrics(p, a.ranks)?
    } else {
        let workload = a.synthetic.unwrap_or(rp::Workload::HotExperts);
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
    };
    if !(a.budget_mib.is_finite() && a.budget_mib > 0.0) {
        anyhow::bail!("--budget-mib must be positive");
    }
    if !(0.0..=1.0).contains(&a.replica_memory_fraction) {
        anyhow::bail!("--replica-memory-fraction must be in [0, 1]");
    }
    if a.element_bytes == 0 {
        anyhow::bail!("--element-bytes must be positive");
    }
    if !(0.0..=1.0).contains(&a.tile_trim) {
        anyhow::bail!("--tile-trim must be in [0, 1]");
    }
    let cfg = rp::ReplayConfig {
        hidden: a.hidden,
        ffn: a.ffn,
        element_bytes: a.element_bytes,
        memory_budget_bytes: (a.budget_mib * (1 << 20) as f64) as u64,
        link_bytes_per_s: lrmoe::quota::H200_LINK_BYTES_PER_S,
        flops_per_s: lrmoe::quota::H200_FLOPS_PER_S,
        replica_slots_per_rank: a.replica_slots,
        replica_memory_fraction: a.replica_memory_fraction,
        policy: match a.policy {
            PolicyArg::Uniform => quota::Policy::Uniform,
            PolicyArg::Maxmin => quota::Policy::Maxmin,
        },
        tile_trim: a.tile_trim,
    };
    let report = rp::replay(&trace, &cfg)?;
    let files = rp::write(&a.out, &report, cfg.memory_budget_bytes)?;
    print!("{}", rp::table(&report));
    match a.device.as_str() {
        "cpu" => {}
        "cuda" => {
            let gpu = lrmoe::kernels::gpu::Gpu::open(0)?;
            println!("\n| strategy | modelled MiB | measured MiB | measured / modelled |\n|---|---|---|---|");
            for c in rp::check_on_device(&gpu, &report)? {
                println!(
                    "| {:?} | {:.1} | {:.1} | {:.4} |",
                    c.strategy,
                    c.modelled_bytes as f64 / (1 << 20) as f64,
                    c.measured_bytes as f64 / (1 << 20) as f64,
                    c.ratio
                );
            }
        }
        other => anyhow::bail!("--device {other}: expected cpu or cuda"),
    }
    println!("wrote {}", files.join(", "));
    Ok(())
}

fn train_config(a: &TrainArgs) -> anyhow::Result<lrmoe::train::TrainConfig> {
    let mut cfg = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            lrmoe::train::TrainConfig::from_toml(&text)
                .with_context(|| format!("{}", path.display()))?
        }
        None => lrmoe::train::TrainConfig::default(),
    };
    if let Some(path) = &a.model_config {
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
        cfg.data.corpus = v.clone();
    }
    if let Some(v) = a.target_val_loss {
        cfg.run.target_val_loss = Some(v);
    }
    if let Some(v) = a.max_minutes {
        cfg.run.max_minutes = Some(v);
    }
    Ok(cfg)
}

fn train(a: &TrainArgs) -> anyhow::Result<()> {
    let mut cfg = train_config(a)?;
    let dist = lrmoe::layer::DistEnv::from_env()?;
    let transport = match dist.clone() {
        None => None,
        Some(env) => {
            if !(a.timeout_s.is_finite() && a.timeout_s > 0.0 && a.timeout_s <= 86_400.0) {
                anyhow::bail!("--timeout-s must be a number of seconds in (0, 86400]");
            }
            if a.ranks.is_some_and(|r| r != env.world) {
                anyhow::bail!(
                    "--ranks {} disagrees with WORLD_SIZE = {}",
                    a.ranks.unwrap_or(0),
                    env.world
                );
            }
            cfg.moe.ranks = env.world;
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
            if a.ranks.is_none() && transport.is_none() {
                cfg.moe.ranks = 1;
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
        println!("{}", report.table);
        println!("wrote {}", report.files.join(", "));
        return Ok(());
    }
    let s = lrmoe::train::train(&cfg, &opts)?;
    if !rank0 {
        return Ok(());
    }
    println!(
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
            println!("wrote {}", out.display());
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
                None => print!("{json}"),
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    lrmoe::keep_freed_memory();
    let cli = Cli::parse();
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
