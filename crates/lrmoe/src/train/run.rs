//! The training loop: where the run goes (CPU, one GPU, ranks), the
//! ranks' loop — data, forward, backward, reduce, optimizer, evaluation,
//! stop, checkpoint — and its summary.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use layer::transport::all_gather;
use layer::{CallConfig, CallPlan, Transport};
use quota::Placement;

use crate::data::{
    eval_batch, eval_starts, load_corpus, random_batch, random_starts, unigram_baseline, Corpus,
    SplitMix,
};
use crate::device_model::DeviceModel;
use crate::model::{self, Model, ModelConfig, MoeRun};
use crate::optim::{lr_at, step as adamw_step, AdamWState};

use super::calls::{device_rows, executor_cost, run_call_config};
use super::config::{Executor, Mode, TrainConfig};
use super::files::{
    check_checkpoint_room, check_out_dir, checkpoint_bytes, load_checkpoint, remove_orphans,
    save_checkpoint, truncate_metrics, CHECKPOINT,
};
use super::memory::check_memory;
use super::metrics::{layer_metrics, mean_over_ranks, LayerMetrics, StepMetrics};
use super::state::{Logged, State};
use super::{io_err, EvalPoint, RunOptions, TrainError, TrainSummary};

/// The run folder and the state training starts from: the folder checked
/// (and made), the checkpoint resumed or a fresh model, the room for the
/// checkpoint checked, and — on the rank that writes — `metrics.jsonl`
/// opened (cut back to the checkpoint's step on a resume, the run's kept
/// fractions read back from it).
pub(super) fn open_run(
    cfg: &TrainConfig,
    opts: &RunOptions,
    mcfg: &ModelConfig,
    corpus: &Corpus,
) -> Result<(State, Option<std::sync::Mutex<File>>), TrainError> {
    let dir = &cfg.run.out_dir;
    let ckpt = dir.join(CHECKPOINT);
    let metrics_path = dir.join("metrics.jsonl");
    if opts.writes() {
        check_out_dir(dir, opts)?;
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        remove_orphans(dir)?;
    }
    let mut initial = if opts.resume {
        let s = load_checkpoint(&ckpt, mcfg, corpus)?;
        tracing::info!(step = s.step, path = %ckpt.display(), "resumed");
        s
    } else {
        fresh_state(cfg, mcfg)
    };
    if !opts.writes() {
        return Ok((initial, None));
    }
    if cfg.run.checkpoint {
        check_checkpoint_room(dir, checkpoint_bytes(cfg, mcfg, corpus, &initial))?;
    } else if opts.force && ckpt.exists() {
        // A checkpoint of the replaced run would pair with this run's
        // metrics on a later --resume.
        std::fs::remove_file(&ckpt).map_err(io_err(&ckpt))?;
    }
    if opts.resume {
        initial.logged = truncate_metrics(&metrics_path, initial.step)?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(opts.resume)
        .write(true)
        .truncate(!opts.resume)
        .open(&metrics_path)
        .map_err(io_err(&metrics_path))?;
    Ok((initial, Some(std::sync::Mutex::new(f))))
}

/// A new run's state: the seeded model, zero moments, step 0.
pub(super) fn fresh_state(cfg: &TrainConfig, mcfg: &ModelConfig) -> State {
    State {
        model: Model::<f32>::init(mcfg, cfg.seed),
        adam: AdamWState {
            m: Model::zeros(mcfg),
            v: Model::zeros(mcfg),
            t: 0,
        },
        step: 0,
        rng: SplitMix(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD),
        evals: Vec::new(),
        wall_s: 0.0,
        moe_s: 0.0,
        sim: None,
        expert_bias: Vec::new(),
        last_load: Vec::new(),
        logged: Logged::default(),
    }
}

/// The progress bar of a run of `steps` starting at `at`, shown above the
/// log lines.
pub(super) fn progress_bar(steps: usize, at: usize) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new(steps as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {elapsed_precise} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b.set_position(at as u64);
    crate::progress::show(&b);
    b
}

/// Where and on what a run trains, checked before anything is written.
pub(super) struct Where {
    pub(super) corpus: Corpus,
    pub(super) mcfg: ModelConfig,
    /// In-process ranks with `--executor device`: one device model per rank
    /// thread, all on this one GPU (`DeviceComm::Staged` over timed
    /// in-process ranks: the multi-rank path's plan and exchanges, device
    /// to device, each rank's work timed alone for the N-GPU simulation).
    pub(super) staged: bool,
    /// The whole model resident on the GPU: one rank, or launched ranks
    /// with `--executor device` (experts sharded over the ranks' GPUs,
    /// dense weights replicated); its vocabulary padded to a multiple of 8
    /// unless the configuration sets it.
    pub(super) whole_gpu: bool,
}

/// Validates the configuration, loads the corpus and checks that the
/// model's sizes fit this run's device and memory.
pub(super) fn where_it_runs(cfg: &TrainConfig, opts: &RunOptions) -> Result<Where, TrainError> {
    cfg.validate()?;
    // Shapes first: a bad config should not wait for the corpus.
    cfg.model_config(1)?;
    if cfg.moe.executor == Executor::Device && opts.gpu.is_none() {
        return Err(TrainError::Config(
            "moe.executor = \"device\" needs --device cuda".into(),
        ));
    }
    let corpus = load_corpus(cfg.data.corpus.as_deref(), cfg.data.val_fraction)?;
    let staged = opts.gpu.is_some()
        && opts.transport.is_none()
        && cfg.moe.ranks > 1
        && cfg.moe.executor == Executor::Device;
    let whole_gpu = opts.gpu.is_some()
        && ((cfg.moe.ranks == 1 && opts.transport.is_none())
            || cfg.moe.executor == Executor::Device);
    let corpus_vocab = if whole_gpu && cfg.model.vocab.is_none() {
        crate::device_model::padded_vocab(corpus.vocab.len())
    } else {
        corpus.vocab.len()
    };
    let mcfg = cfg.model_config(corpus_vocab)?;
    crate::data::check_seq_len(&corpus, cfg.data.seq_len)?;
    if whole_gpu {
        crate::device_model::check(&mcfg, Some(cfg.data.seq_len), cfg.moe.ranks)?;
    } else {
        check_memory(cfg, &mcfg)?;
    }
    Ok(Where {
        corpus,
        mcfg,
        staged,
        whole_gpu,
    })
}

/// The ranks the run has: each owns an equal block of experts, and a
/// launched group has as many.
fn check_ranks(
    cfg: &TrainConfig,
    opts: &RunOptions,
    mcfg: &ModelConfig,
) -> Result<usize, TrainError> {
    let ranks = cfg.moe.ranks;
    if mcfg.n_experts % ranks != 0 {
        return Err(TrainError::Config(format!(
            "model.n_experts = {} is not a multiple of moe.ranks = {ranks}: \
             each rank owns an equal block of experts",
            mcfg.n_experts
        )));
    }
    if let Some(t) = &opts.transport {
        if t.world_size() != ranks {
            return Err(TrainError::Config(format!(
                "moe.ranks = {ranks} but the launched group has {} ranks",
                t.world_size()
            )));
        }
    }
    Ok(ranks)
}

/// Trains with `cfg`; returns rank 0's summary (every launched rank gets
/// the same figures).
pub fn train(cfg: &TrainConfig, opts: &RunOptions) -> Result<TrainSummary, TrainError> {
    let Where {
        corpus,
        mcfg,
        staged,
        whole_gpu,
    } = where_it_runs(cfg, opts)?;
    let ranks = check_ranks(cfg, opts, &mcfg)?;
    let unigram = unigram_baseline(&corpus);
    let ckpt = cfg.run.out_dir.join(CHECKPOINT);
    let (initial, metrics) = open_run(cfg, opts, &mcfg, &corpus)?;
    tracing::info!(
        params = initial.model.n_params(),
        vocab = mcfg.vocab,
        mode = ?cfg.moe.mode,
        ranks,
        unigram_val_loss = unigram,
        "training"
    );
    let placement = Placement {
        owner: (0..mcfg.n_experts)
            .map(|e| e * ranks / mcfg.n_experts)
            .collect(),
        replicas: vec![],
    };
    let call = run_call_config(cfg, opts, &mcfg, &placement, whole_gpu);
    let run = model::plain_moe_run(&placement, &call);
    // One device model for this process's rank (staged in-process ranks
    // build theirs in their threads).
    let device_model = if whole_gpu && !staged {
        let comm = match opts.transport.as_deref() {
            Some(t) => layer::device::DeviceComm::Nccl(t.comm()),
            None => layer::device::DeviceComm::Local,
        };
        Some(new_device_model(
            opts, comm, &mcfg, &initial, &call, &corpus,
        )?)
    } else {
        None
    };
    let bar = (opts.progress && opts.writes()).then(|| progress_bar(cfg.steps, initial.step));

    let lp = Loop {
        cfg,
        mcfg: &mcfg,
        corpus: &corpus,
        run: &run,
        metrics: metrics.as_ref(),
        bar: bar.as_ref(),
        ckpt: &ckpt,
        stop: &opts.stop,
    };
    let results = run_ranks(opts, &lp, &initial, &call, staged, device_model.as_ref());
    if bar.is_some() {
        crate::progress::hide();
    }
    let mut summary = None;
    for r in results {
        let s = r?;
        summary = summary.or(s);
    }
    let mut s = summary.ok_or_else(|| TrainError::Config("rank 0 returned no summary".into()))?;
    s.unigram_val_loss = unigram;
    Ok(s)
}

/// Every rank of this process runs the loop: the launched rank; or
/// in-process ranks — staged device ranks (each with its own device model)
/// take turns on the GPU and record their timelines (`simulated` in the
/// metrics), the others share this process's device model, if any.
pub(super) fn run_ranks(
    opts: &RunOptions,
    lp: &Loop<'_>,
    initial: &State,
    call: &CallConfig,
    staged: bool,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Vec<Result<Option<TrainSummary>, TrainError>> {
    let ranks = lp.cfg.moe.ranks;
    match &opts.transport {
        Some(t) => vec![rank_loop(t.as_ref(), lp, initial, device_model)],
        None if staged => layer::run_local_timed(ranks, Duration::from_secs(600), |comm| {
            // Timed on the GPU's stream, memory counted from the first
            // buffer.
            #[cfg(feature = "cuda")]
            if let Some(gpu) = opts.gpu.clone() {
                comm.set_clock(std::sync::Arc::new(layer::device::GpuClock(gpu)))?;
            }
            let comm_d = layer::device::DeviceComm::Staged(comm);
            let own = new_device_model(opts, comm_d, lp.mcfg, initial, call, lp.corpus)?;
            rank_loop(comm, lp, initial, Some(&own))
        }),
        None => layer::run_local(ranks, Duration::from_secs(600), |comm| {
            rank_loop(comm, lp, initial, device_model)
        }),
    }
}

/// One step's gradients on this rank's sequences, split into `micro`
/// micro-batches of equal size (gradient accumulation: the mean of the
/// micro-batches' gradients is the whole batch's).
pub(super) struct StepGrads {
    pub(super) loss: f64,
    pub(super) aux_loss: f64,
    pub(super) moe_seconds: f64,
    /// The first micro-batch's MoE plans (they feed the metrics).
    pub(super) plans: Vec<CallPlan>,
    /// The accumulated gradients; `moe_stats` are the first micro-batch's.
    pub(super) grads: model::Gradients<f32>,
    /// Kept and routed pairs per layer, summed over micro-batches.
    pub(super) kept_routed: Vec<u64>,
    /// The most pairs this rank processed in one layer call.
    pub(super) busiest: u64,
    /// The most rows this rank's instances computed in one layer call's
    /// forward.
    pub(super) busiest_forward: u64,
    /// Routed pairs per expert and layer over every rank, summed over the
    /// micro-batches.
    pub(super) expert_load: Vec<Vec<u64>>,
    /// This rank's token buffer were the step one micro-batch
    /// ([`Tally::unsplit_buffer`]).
    pub(super) unsplit_buffer: u64,
    /// This rank's largest token buffer over every micro-batch
    /// ([`Tally::peak_buffer`]).
    pub(super) peak_buffer: u64,
}

/// The device model of one rank (`comm`), from the run's first state.
pub(super) fn new_device_model<'c>(
    opts: &RunOptions,
    comm: layer::device::DeviceComm<'c>,
    mcfg: &ModelConfig,
    initial: &State,
    call: &CallConfig,
    corpus: &Corpus,
) -> Result<std::sync::Mutex<DeviceModel<'c>>, TrainError> {
    let gpu = opts
        .gpu
        .as_ref()
        .ok_or_else(|| TrainError::Config("the device model needs --device cuda".into()))?;
    Ok(std::sync::Mutex::new(DeviceModel::new(
        gpu.clone(),
        comm,
        mcfg,
        &initial.model,
        &initial.adam,
        call,
        (&corpus.train, &corpus.val),
    )?))
}

/// The device model, its lock poisoned or not (a panic elsewhere leaves
/// its buffers consistent: every update is one kernel per tensor).
pub(super) fn lock<'m, 'a>(
    m: &'m std::sync::Mutex<DeviceModel<'a>>,
) -> std::sync::MutexGuard<'m, DeviceModel<'a>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One optimizer step's figures, from the host model or the device one.
pub(super) struct StepOut {
    pub(super) loss: f64,
    pub(super) aux_loss: f64,
    pub(super) moe_seconds: f64,
    pub(super) grad_norm: f64,
    pub(super) plans: Vec<layer::CallPlan>,
    /// The first micro-batch's per-layer figures (they feed the per-layer
    /// metrics).
    pub(super) stats: Vec<layer::BackwardStats>,
    pub(super) kept_routed: Vec<u64>,
    pub(super) busiest: u64,
    pub(super) busiest_forward: u64,
    pub(super) expert_load: Vec<Vec<u64>>,
    /// This rank's token buffer were the step one micro-batch
    /// ([`Tally::unsplit_buffer`]).
    pub(super) unsplit_buffer: u64,
    /// This rank's largest token buffer over every micro-batch
    /// ([`Tally::peak_buffer`]).
    pub(super) peak_buffer: u64,
    pub(super) device_ms: Option<[f64; 5]>,
    pub(super) device_mem_bytes: Option<u64>,
}

/// One rank's figures of a step, over its micro-batches.
pub(super) struct Tally {
    /// Kept and routed pairs per layer (`[kept₀, routed₀, kept₁, …]`),
    /// summed.
    pub(super) kept_routed: Vec<u64>,
    /// The most pairs this rank processed in one layer call.
    pub(super) busiest: u64,
    /// The most rows this rank's instances computed in one layer call's
    /// forward.
    pub(super) busiest_forward: u64,
    /// Routed pairs per expert and layer over every rank, summed.
    pub(super) expert_load: Vec<Vec<u64>>,
    /// This rank's token buffer per layer, summed over the micro-batches:
    /// a call's is the larger of its forward's rows (in and out) and its
    /// backward's buffer, which do not live at once.
    buffers: Vec<u64>,
    /// This rank's largest token buffer in any one layer call of any
    /// micro-batch: what it held at once as the step ran.
    pub(super) peak_buffer: u64,
}

impl Tally {
    pub(super) fn new(mcfg: &ModelConfig) -> Self {
        Self {
            kept_routed: vec![0; 2 * mcfg.n_layers],
            busiest: 0,
            busiest_forward: 0,
            expert_load: vec![vec![0; mcfg.n_experts]; mcfg.n_layers],
            buffers: vec![0; mcfg.n_layers],
            peak_buffer: 0,
        }
    }

    /// The token buffer rank `me` would hold were the step's tokens one
    /// micro-batch: per layer, its micro-batches' buffer peaks summed, the
    /// largest layer's. A step of one micro-batch gives its own peak. Where
    /// `buffer_bytes` counts rows (in-process ranks on one GPU: the kept
    /// `[x | g·δ]` rows) the sum is the step's rows exactly; where it is a
    /// peak of live buffers (the host executor's meter, one rank per GPU's
    /// pool) some of what it holds does not grow with the rows, so the sum
    /// bounds the whole step's peak from above (`tests/train_cli.rs` holds
    /// the host's within 1.25×).
    pub(super) fn unsplit_buffer(&self) -> u64 {
        self.buffers.iter().copied().max().unwrap_or(0)
    }

    /// Adds one micro-batch's per-layer backward figures.
    pub(super) fn add(
        &mut self,
        mcfg: &ModelConfig,
        stats: &[layer::BackwardStats],
        me: usize,
        ranks: usize,
    ) {
        debug_assert_eq!(self.expert_load.len(), mcfg.n_layers);
        for (li, st) in stats.iter().enumerate() {
            for (a, &b) in self.expert_load[li].iter_mut().zip(&st.expert_load) {
                *a += b;
            }
            self.kept_routed[2 * li] += st.kept_pairs as u64;
            self.kept_routed[2 * li + 1] += st.routed_pairs as u64;
            // The forward's rows are gone (or kept, inside the backward's
            // figure) by the time the backward's buffers are made.
            let held = st.buffer_bytes.max(st.forward_buffer_bytes);
            if let Some(b) = self.buffers.get_mut(li) {
                *b += held;
            }
            self.peak_buffer = self.peak_buffer.max(held);
            let mine = if st.pairs_per_rank.len() == ranks {
                st.pairs_per_rank[me]
            } else {
                st.pairs_per_rank.first().copied().unwrap_or(0)
            };
            self.busiest = self.busiest.max(mine);
            self.busiest_forward = self.busiest_forward.max(st.forward_rows as u64);
        }
    }
}

/// `run` with the layers' balancing bias and last loads (the SYMI-like
/// replicas' input; empty unless that mode runs).
pub(super) fn biased<'a>(run: &MoeRun<'a>, s: &'a State) -> MoeRun<'a> {
    MoeRun {
        expert_bias: &s.expert_bias,
        replica_load: &s.last_load,
        ..run.clone()
    }
}

/// DeepSeek-V3's bias update: `b[e] += rate · sign(mean − load[e])` per
/// layer (no change where a layer saw no pairs).
pub(super) fn update_expert_bias(bias: &mut [Vec<f64>], load: &[Vec<u64>], rate: f64) {
    for (b, l) in bias.iter_mut().zip(load) {
        let total: u64 = l.iter().sum();
        if total == 0 || b.len() != l.len() {
            continue;
        }
        let mean = total as f64 / l.len() as f64;
        for (bv, &c) in b.iter_mut().zip(l) {
            let d = mean - c as f64;
            if d != 0.0 {
                *bv += rate * d.signum();
            }
        }
    }
}

pub(super) fn step_grads<X: Transport>(
    comm: &X,
    mcfg: &ModelConfig,
    model: &Model<f32>,
    run: &MoeRun<'_>,
    (tokens, targets): (&[u32], &[u32]),
    seq: usize,
    micro: usize,
) -> Result<StepGrads, TrainError> {
    let (me, ranks) = (comm.rank(), comm.world_size());
    let sequences = tokens.len() / seq.max(1);
    if micro == 0 || sequences % micro != 0 {
        return Err(TrainError::Config(format!(
            "{sequences} sequences do not split into {micro} micro-batches"
        )));
    }
    let chunk = sequences / micro * seq;
    let (mut loss, mut aux_loss, mut moe_seconds) = (0.0, 0.0, 0.0);
    let mut first: Option<(Vec<CallPlan>, model::Gradients<f32>)> = None;
    let mut tally = Tally::new(mcfg);
    for i in 0..micro {
        let r = i * chunk..(i + 1) * chunk;
        let (l, cache) =
            model::forward(comm, mcfg, model, run, &tokens[r.clone()], &targets[r], seq)?;
        loss += l / micro as f64;
        aux_loss += cache.aux_loss / micro as f64;
        moe_seconds += cache.moe_seconds;
        let plans: Vec<CallPlan> = cache.moe_plans().cloned().collect();
        let g = model::backward(comm, mcfg, model, run, cache, seq)?;
        moe_seconds += g.moe_seconds;
        tally.add(mcfg, &g.moe_stats, me, ranks);
        match &mut first {
            None => first = Some((plans, g)),
            Some((_, acc)) => {
                for ((_, a), (_, b)) in acc.grads.tensors_mut().into_iter().zip(g.grads.tensors()) {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += *y);
                }
            }
        }
    }
    let Some((plans, mut grads)) = first else {
        return Err(TrainError::Config("a step of zero micro-batches".into()));
    };
    if micro > 1 {
        let k = 1.0 / micro as f32;
        for (_, a) in grads.grads.tensors_mut() {
            a.iter_mut().for_each(|x| *x *= k);
        }
    }
    Ok(StepGrads {
        loss,
        aux_loss,
        moe_seconds,
        plans,
        grads,
        unsplit_buffer: tally.unsplit_buffer(),
        peak_buffer: tally.peak_buffer,
        kept_routed: tally.kept_routed,
        busiest: tally.busiest,
        busiest_forward: tally.busiest_forward,
        expert_load: tally.expert_load,
    })
}

#[allow(clippy::too_many_arguments)]
/// What every step of one rank's loop reads: the run's settings, its data
/// and where it writes (rank 0 only: `metrics`, `bar`).
pub(super) struct Loop<'a> {
    pub(super) cfg: &'a TrainConfig,
    pub(super) mcfg: &'a ModelConfig,
    pub(super) corpus: &'a Corpus,
    pub(super) run: &'a MoeRun<'a>,
    pub(super) metrics: Option<&'a std::sync::Mutex<File>>,
    pub(super) bar: Option<&'a indicatif::ProgressBar>,
    pub(super) ckpt: &'a Path,
    pub(super) stop: &'a crate::stop::StopFlag,
}

/// Figures every rank agrees on after a step (one all-gather): the mean
/// loss, the slowest rank's step time, whether any rank saw a signal.
pub(super) struct Agreed {
    pub(super) loss: f64,
    pub(super) step_s: f64,
    pub(super) any_signal: bool,
}

/// One rank's training: steps until the collective stop — data, forward,
/// backward, optimizer ([`train_step`]), the agreed figures, the balancing
/// bias, the next step's micro-batches, evaluation, metrics and checkpoint
/// — then the final evaluation and checkpoint ([`finish`]).
pub(super) fn rank_loop<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    initial: &State,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<Option<TrainSummary>, TrainError> {
    let cfg = lp.cfg;
    let mut s = rank_state(lp, initial, device_model.is_some());
    let max_s = cfg.run.max_minutes.map(|m| m * 60.0);
    let mut reached = s
        .evals
        .iter()
        .copied()
        .find(|e| cfg.run.target_val_loss.is_some_and(|t| e.val_loss <= t));
    // The stop is collective: every input of `stop::decide` is the same on
    // every rank (the step count, the mean validation loss, the slowest
    // rank's step time, any rank's signal), so all ranks leave the loop
    // after the same step.
    let mut reason =
        crate::stop::decide(s.step, cfg.steps, reached.is_some(), s.wall_s, max_s, false);
    let mut micro = first_micro_batches(cfg, comm.world_size());
    while reason.is_none() {
        let clock = Instant::now();
        let lr = lr_at(&cfg.optim, s.step, cfg.steps);
        // Timed in-process ranks: the step's timeline alone (the loop's
        // evaluations, logs and checkpoints between steps are dropped).
        comm.discard_timeline()?;
        let out = train_step(comm, lp, &mut s, micro, lr, device_model)?;
        comm.close_step(s.step)?;
        let agreed = agree(comm, out.loss, clock.elapsed().as_secs_f64(), lp.stop)?;
        let layer_calls = cfg.model.n_layers * micro;
        let simulated = simulated_step(comm, &cfg.cluster, s.step, layer_calls)?;
        account(cfg, &mut s, &out, agreed.step_s, simulated.as_ref());
        let step_micro = micro;
        let g = gather_layers(comm, lp, &out, micro)?;
        let instances = expert_bytes_per_rank(lp, &out.plans, device_model.is_some());
        micro = g.next_micro;
        let val_loss = evaluate_due(comm, lp, &mut s, agreed.loss, device_model)?;
        if val_loss.is_some() {
            reached = reached_now(cfg, &s).or(reached);
        }
        let m = StepMetrics {
            step: s.step,
            loss: agreed.loss,
            lr,
            grad_norm: out.grad_norm,
            wall_s: s.wall_s,
            moe_s: s.moe_s,
            tokens_per_s: (cfg.data.batch_size * cfg.data.seq_len) as f64 / agreed.step_s,
            aux_loss: (cfg.moe.aux_loss_coeff != 0.0).then_some(out.aux_loss),
            micro_batches: step_micro,
            expert_bytes: instances.iter().copied().max().unwrap_or(0),
            rank_peak_bytes: rank_peak_bytes(&instances, &g.buffers),
            unsplit_peak_bytes: rank_peak_bytes(&instances, &g.unsplit_buffers),
            val_loss,
            device_ms: out.device_ms,
            device_mem_bytes: out.device_mem_bytes,
            simulated,
            layers: g.layers,
        };
        log_and_checkpoint(comm, lp, &mut s, &m, device_model)?;
        reason = crate::stop::decide(
            s.step,
            cfg.steps,
            reached.is_some(),
            s.wall_s,
            max_s,
            agreed.any_signal,
        );
    }
    let reason = reason.unwrap_or(crate::stop::StopReason::Steps);
    finish(comm, lp, s, reason, reached, device_model)
}

/// The bytes of expert instances each rank holds in the layer calls of
/// `plans` (one per layer), in rank order: its owned experts and the
/// call's replicas on it, each an instance of weights and gradients
/// (`quota::CostModel::instance_bytes`) in the rows the executor plans
/// with (bf16 on the device, f32 on the host), summed over the layers —
/// every layer's experts are resident at once.
pub(super) fn expert_bytes_per_rank(
    lp: &Loop<'_>,
    plans: &[layer::CallPlan],
    whole_gpu: bool,
) -> Vec<u64> {
    let shape = (lp.mcfg.d_model, lp.mcfg.ffn);
    let cost = executor_cost(shape, device_rows(lp.cfg, whole_gpu));
    let mut per_rank = vec![0u64; lp.cfg.moe.ranks.max(1)];
    for p in plans {
        for (r, n) in p
            .placement
            .instances_per_rank(per_rank.len())
            .into_iter()
            .enumerate()
        {
            per_rank[r] += n * cost.instance_bytes();
        }
    }
    per_rank
}

/// The most bytes one rank held: its expert instances plus its largest
/// token buffer of the step (both per rank, in rank order).
pub(super) fn rank_peak_bytes(instances: &[u64], buffers: &[u64]) -> u64 {
    (0..instances.len().max(buffers.len()))
        .map(|r| instances.get(r).copied().unwrap_or(0) + buffers.get(r).copied().unwrap_or(0))
        .max()
        .unwrap_or(0)
}

/// This rank's state for the loop: the run's first state, with the
/// balancing bias started where it is on. With a device model (which holds
/// the weights and moments; their host copies come back for checkpoints
/// only) the host model and moments are left out, so in-process ranks do
/// not hold one host model each.
pub(super) fn rank_state(lp: &Loop<'_>, initial: &State, on_device: bool) -> State {
    let (cfg, mcfg) = (lp.cfg, lp.mcfg);
    let mut s = if on_device {
        State {
            model: Model::default(),
            adam: AdamWState {
                m: Model::default(),
                v: Model::default(),
                t: initial.adam.t,
            },
            evals: initial.evals.clone(),
            expert_bias: initial.expert_bias.clone(),
            last_load: initial.last_load.clone(),
            ..*initial
        }
    } else {
        initial.clone()
    };
    if cfg.moe.expert_bias_rate > 0.0 && s.expert_bias.is_empty() {
        s.expert_bias = vec![vec![0.0; mcfg.n_experts]; mcfg.n_layers];
    }
    s
}

/// A step's times into the state (wall, MoE, simulated), the step count,
/// and the balancing bias moved by the step's loads (all ranks' pairs, the
/// same on every rank: experts above the mean are chosen less).
pub(super) fn account(
    cfg: &TrainConfig,
    s: &mut State,
    out: &StepOut,
    step_s: f64,
    simulated: Option<&crate::simulate::Simulated>,
) {
    if let Some(sm) = simulated {
        let acc = s.sim.get_or_insert((0.0, 0.0));
        acc.0 += sm.step_s;
        acc.1 += sm.moe_s;
    }
    s.wall_s += step_s;
    s.moe_s += out.moe_seconds;
    s.step += 1;
    if cfg.moe.mode == Mode::Symi {
        s.last_load.clone_from(&out.expert_load);
    }
    if cfg.moe.expert_bias_rate > 0.0 {
        update_expert_bias(
            &mut s.expert_bias,
            &out.expert_load,
            cfg.moe.expert_bias_rate,
        );
    }
}

/// The evaluation just taken (at this step), if it is at the target.
pub(super) fn reached_now(cfg: &TrainConfig, s: &State) -> Option<EvalPoint> {
    s.evals
        .last()
        .filter(|p| p.step == s.step && cfg.run.target_val_loss.is_some_and(|t| p.val_loss <= t))
        .copied()
}

/// Rank 0 of timed in-process ranks: step `step` on as many GPUs of
/// `cluster` (every rank closed it before the collective that follows
/// its `close_step`), which made `layer_calls` MoE-layer calls each way
/// (layers × micro-batches); `None` elsewhere.
pub(super) fn simulated_step<X: Transport>(
    comm: &X,
    cluster: &cluster::Cluster,
    step: usize,
    layer_calls: usize,
) -> Result<Option<crate::simulate::Simulated>, TrainError> {
    if comm.rank() != 0 {
        return Ok(None);
    }
    let sim = comm
        .take_step(step)
        .map(|t| crate::simulate::simulate(&t, cluster, layer_calls))
        .transpose()
        .map_err(|e| TrainError::Config(format!("step {step}: {e}")))?;
    Ok(sim.map(|s| crate::simulate::Simulated {
        host_probe_s: Some(crate::simulate::host_probe()),
        ..s
    }))
}

/// Micro-batches of the first step: where steps split to fit the budget
/// ([`splits_steps`]), the worst case (every rank's pairs on one), else one.
pub(super) fn first_micro_batches(cfg: &TrainConfig, ranks: usize) -> usize {
    if splits_steps(cfg) {
        micro_divisor(
            cfg,
            ranks,
            (ranks as f64 / cfg.moe.buffer_fraction).ceil() as usize,
        )
    } else {
        1
    }
}

/// Whether steps split into micro-batches to fit the budget: the modes
/// that keep every pair, and with `moe.budget_forward` LRMoE too (its
/// forward keeps every pair).
pub(super) fn splits_steps(cfg: &TrainConfig) -> bool {
    let m = cfg.moe.mode;
    cfg.moe.fit_budget && (m.is_exact() || (cfg.moe.budget_forward && m.is_lrmoe()))
}

/// The smallest divisor of a rank's sequences that is at least `need`, so
/// every micro-batch is the same size.
pub(super) fn micro_divisor(cfg: &TrainConfig, ranks: usize, need: usize) -> usize {
    let per_rank = cfg.data.batch_size / ranks;
    (need.max(1)..=per_rank)
        .find(|m| per_rank % m == 0)
        .unwrap_or(per_rank)
}

/// Data, forward, backward and optimizer of one step on this rank: on the
/// device model (only the windows' starts go down; scalars and counts come
/// back) or on the host model.
pub(super) fn train_step<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    s: &mut State,
    micro: usize,
    lr: f64,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<StepOut, TrainError> {
    let (cfg, mcfg) = (lp.cfg, lp.mcfg);
    let (me, ranks) = (comm.rank(), comm.world_size());
    let seq = cfg.data.seq_len;
    let per_rank = cfg.data.batch_size / ranks;
    if let Some(dm) = device_model {
        let starts = random_starts(lp.corpus.train.len(), cfg.data.batch_size, seq, &mut s.rng);
        let mine = &starts[me * per_rank..(me + 1) * per_rank];
        let st = {
            let mut dm = lock(dm);
            dm.set_replica_load(&s.last_load);
            dm.train_step(mine, seq, micro, &cfg.optim, lr, &s.expert_bias)?
        };
        let mut t = Tally::new(mcfg);
        for m in &st.stats {
            t.add(mcfg, m, me, ranks);
        }
        let unsplit_buffer = t.unsplit_buffer();
        let Tally {
            kept_routed,
            busiest,
            busiest_forward,
            expert_load,
            peak_buffer,
            ..
        } = t;
        return Ok(StepOut {
            loss: st.loss,
            aux_loss: st.aux_loss,
            moe_seconds: st.moe_seconds,
            grad_norm: st.grad_norm,
            plans: st.plans,
            stats: st.stats.into_iter().next().unwrap_or_default(),
            kept_routed,
            busiest,
            busiest_forward,
            expert_load,
            unsplit_buffer,
            peak_buffer,
            device_ms: Some(st.split_ms),
            device_mem_bytes: Some(st.device_bytes),
        });
    }
    let (tokens, targets) = random_batch(&lp.corpus.train, cfg.data.batch_size, seq, &mut s.rng);
    let lo = me * per_rank * seq;
    let hi = lo + per_rank * seq;
    let step_run = biased(lp.run, s);
    let sg = step_grads(
        comm,
        mcfg,
        &s.model,
        &step_run,
        (&tokens[lo..hi], &targets[lo..hi]),
        seq,
        micro,
    )?;
    let grad_norm = adamw_step(&cfg.optim, &mut s.model, &sg.grads.grads, &mut s.adam, lr);
    Ok(StepOut {
        loss: sg.loss,
        aux_loss: sg.aux_loss,
        moe_seconds: sg.moe_seconds,
        grad_norm,
        plans: sg.plans,
        stats: sg.grads.moe_stats,
        kept_routed: sg.kept_routed,
        busiest: sg.busiest,
        busiest_forward: sg.busiest_forward,
        expert_load: sg.expert_load,
        unsplit_buffer: sg.unsplit_buffer,
        peak_buffer: sg.peak_buffer,
        device_ms: None,
        device_mem_bytes: None,
    })
}

/// One gather carries the loss, this rank's step time and whether it saw a
/// signal; the step's wall time is the slowest rank's.
pub(super) fn agree<X: Transport>(
    comm: &X,
    loss: f64,
    local_s: f64,
    stop: &crate::stop::StopFlag,
) -> Result<Agreed, TrainError> {
    let signal = if stop.is_raised() { 1.0 } else { 0.0 };
    let views = all_gather(comm, &[loss, local_s, signal])?;
    Ok(Agreed {
        loss: views.iter().map(|v| v[0]).sum::<f64>() / views.len() as f64,
        step_s: views.iter().map(|v| v[1]).fold(0.0, f64::max),
        any_signal: views.iter().any(|v| v[2] > 0.0),
    })
}

/// What [`gather_layers`] agrees on after a step.
pub(super) struct Gathered {
    /// Per-layer metrics (kept fractions over all ranks).
    pub(super) layers: Vec<LayerMetrics>,
    /// The next step's micro-batches (with `moe.fit_budget`: the busiest
    /// rank's pairs of a whole step over the budget's rows).
    pub(super) next_micro: usize,
    /// Each rank's largest token buffer of the step, over every
    /// micro-batch ([`Tally::peak_buffer`]), in rank order.
    pub(super) buffers: Vec<u64>,
    /// Each rank's token buffer were the step one micro-batch
    /// ([`Tally::unsplit_buffer`]), in rank order.
    pub(super) unsplit_buffers: Vec<u64>,
}

/// The step's figures over every rank ([`Gathered`]), in one all-gather.
pub(super) fn gather_layers<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    out: &StepOut,
    micro: usize,
) -> Result<Gathered, TrainError> {
    let (cfg, n_layers) = (lp.cfg, lp.mcfg.n_layers);
    let mut kept = out.kept_routed.clone();
    kept.push(out.busiest);
    kept.push(out.peak_buffer);
    kept.push(out.unsplit_buffer);
    kept.push(out.busiest_forward);
    let totals = all_gather(comm, &kept)?;
    let buffers = totals.iter().map(|t| t[2 * n_layers + 1]).collect();
    let unsplit_buffers = totals.iter().map(|t| t[2 * n_layers + 2]).collect();
    let next = if splits_steps(cfg) {
        let ranks = comm.world_size();
        let per_rank = cfg.data.batch_size / ranks;
        // The busiest rank's backward pairs, and with `moe.budget_forward`
        // its forward rows (the same bytes a pair).
        let peak = (totals.iter())
            .map(|t| {
                let forward = if cfg.moe.budget_forward {
                    t[2 * n_layers + 3]
                } else {
                    0
                };
                t[2 * n_layers].max(forward)
            })
            .max()
            .unwrap_or(0);
        let budget_rows =
            cfg.moe.buffer_fraction * (per_rank * cfg.data.seq_len * lp.mcfg.top_k) as f64;
        let need = ((peak * micro as u64) as f64 / budget_rows.max(1.0)).ceil() as usize;
        micro_divisor(cfg, ranks, need)
    } else {
        micro
    };
    let layers = out
        .plans
        .iter()
        .zip(&out.stats)
        .enumerate()
        .map(|(li, (plan, st))| {
            let k: u64 = totals.iter().map(|t| t[2 * li]).sum();
            let n: u64 = totals.iter().map(|t| t[2 * li + 1]).sum();
            layer_metrics(li, plan, st, k, n)
        })
        .collect();
    Ok(Gathered {
        layers,
        next_micro: next,
        buffers,
        unsplit_buffers,
    })
}

/// Whether step `step` evaluates: every `run.eval_every` steps, the last
/// step, and every `run.eval_near_every` steps while the last evaluation
/// of `evals` is within `run.eval_near_margin` above the target. Every
/// rank holds the same curve (the validation loss is a mean over ranks),
/// so every rank decides alike.
pub(super) fn eval_due(cfg: &TrainConfig, step: usize, evals: &[EvalPoint]) -> bool {
    let run = &cfg.run;
    let near = run.eval_near_every > 0
        && step % run.eval_near_every == 0
        && run
            .target_val_loss
            .zip(evals.last())
            .is_some_and(|(t, e)| e.val_loss <= t + run.eval_near_margin);
    step % run.eval_every == 0 || step == cfg.steps || near
}

/// The validation loss on evaluation steps ([`eval_due`]), added to the
/// run's curve.
pub(super) fn evaluate_due<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    s: &mut State,
    train_loss: f64,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<Option<f64>, TrainError> {
    let cfg = lp.cfg;
    if !eval_due(cfg, s.step, &s.evals) {
        return Ok(None);
    }
    let v = evaluate_now(comm, lp, s, device_model)?;
    if comm.rank() == 0 {
        tracing::info!(
            step = s.step,
            val_loss = v,
            train_loss,
            wall_s = s.wall_s,
            "eval"
        );
    }
    Ok(Some(v))
}

/// The validation loss now (every rank takes part), added to the run's
/// curve at the current step.
pub(super) fn evaluate_now<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    s: &mut State,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<f64, TrainError> {
    let run = biased(lp.run, s);
    let v = evaluate(
        comm,
        lp.cfg,
        lp.mcfg,
        lp.corpus,
        &run,
        &s.model,
        device_model,
    )?;
    s.evals.push(EvalPoint {
        step: s.step,
        wall_s: s.wall_s,
        moe_s: s.moe_s,
        val_loss: v,
        simulated_s: s.sim.map(|x| x.0),
        simulated_moe_s: s.sim.map(|x| x.1),
    });
    Ok(v)
}

/// Rank 0 appends the step's metrics line and moves the progress bar; on
/// checkpoint steps every rank takes part in bringing the device model's
/// weights back (a collective) and rank 0 writes the checkpoint.
pub(super) fn log_and_checkpoint<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    s: &mut State,
    m: &StepMetrics,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<(), TrainError> {
    let cfg = lp.cfg;
    s.logged.add_step(m);
    let checkpoint_due = cfg.run.checkpoint
        && cfg.run.checkpoint_every > 0
        && s.step % cfg.run.checkpoint_every == 0;
    if let (true, Some(dm)) = (checkpoint_due, device_model) {
        (s.model, s.adam) = lock(dm).download(comm)?;
    }
    let (0, Some(metrics)) = (comm.rank(), lp.metrics) else {
        return Ok(());
    };
    let line = serde_json::to_string(m).unwrap_or_default() + "\n";
    let mut f = metrics.lock().unwrap_or_else(|p| p.into_inner());
    f.write_all(line.as_bytes())
        .map_err(io_err(&cfg.run.out_dir.join("metrics.jsonl")))?;
    if let Some(b) = lp.bar {
        b.set_position(s.step as u64);
        let last = s
            .evals
            .last()
            .map_or(String::new(), |e| format!(" val {:.3}", e.val_loss));
        b.set_message(format!("loss {:.3}{last}", m.loss));
    }
    if checkpoint_due {
        save_checkpoint(lp.ckpt, cfg, lp.mcfg, lp.corpus, s)?;
    }
    Ok(())
}

/// After the last step: the final validation loss (evaluated unless the
/// last step did), the device model's weights back, the final checkpoint,
/// and rank 0's summary.
pub(super) fn finish<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    mut s: State,
    reason: crate::stop::StopReason,
    reached: Option<EvalPoint>,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<Option<TrainSummary>, TrainError> {
    let cfg = lp.cfg;
    let me = comm.rank();
    if me == 0 {
        tracing::info!(step = s.step, reason = %reason, "stopping");
    }
    let final_val = match s.evals.last() {
        Some(e) if e.step == s.step => e.val_loss,
        _ => evaluate_now(comm, lp, &mut s, device_model)?,
    };
    // A run stopped by its step count or time cap whose final evaluation
    // is at the target reached it there.
    let reached = reached.or_else(|| reached_now(cfg, &s));
    if let (true, Some(dm)) = (cfg.run.checkpoint, device_model) {
        (s.model, s.adam) = lock(dm).download(comm)?;
    }
    if me == 0 && lp.metrics.is_some() && cfg.run.checkpoint {
        save_checkpoint(lp.ckpt, cfg, lp.mcfg, lp.corpus, &s)?;
    }
    Ok(Some(TrainSummary {
        mode: cfg.moe.mode,
        steps: s.step,
        evals: s.evals,
        final_val_loss: final_val,
        unigram_val_loss: f64::NAN,
        reached_target: reached,
        mean_kept_fraction: s.logged.mean_kept(),
        max_buffer_bytes: s.logged.max_buffer,
        max_expert_bytes: s.logged.max_experts,
        max_rank_peak_bytes: s.logged.max_rank_peak,
        max_unsplit_peak_bytes: s.logged.max_unsplit_peak,
        max_held_bytes: s.logged.max_held,
        host_probe_ms: s.logged.mean_probe_ms(),
        mean_replicas_per_call: s.logged.mean_replicas(),
        forward_buffers_counted: true,
        even_forward_bytes: even_forward_bytes(
            cfg,
            lp.mcfg,
            comm.world_size(),
            device_model.is_some(),
        ),
        budget_held: super::BudgetHeld::of(cfg),
        stop_reason: reason,
    }))
}

/// One layer call's forward token buffer on a rank were a step's routed
/// rows spread evenly over `ranks`, in one micro-batch: an `x` row in and
/// an `o` row out per routed pair, in the rows the executor plans with
/// ([`executor_cost`]: bf16 on the device, f32 on the host), as the
/// layer's `BackwardStats::forward_buffer_bytes` counts them. Any
/// placement that computes every pair of an unsplit step holds at least
/// this on its busiest rank.
pub(super) fn even_forward_bytes(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    ranks: usize,
    whole_gpu: bool,
) -> u64 {
    let cost = executor_cost((mcfg.d_model, mcfg.ffn), device_rows(cfg, whole_gpu));
    let rows = ((cfg.data.batch_size * cfg.data.seq_len * mcfg.top_k) as u64)
        .div_ceil(ranks.max(1) as u64);
    rows * 2 * cost.act_row_bytes
}

/// Mean validation loss over the fixed evaluation batches.
pub(super) fn evaluate<X: Transport>(
    comm: &X,
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    run: &MoeRun<'_>,
    model: &Model<f32>,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<f64, TrainError> {
    let (me, ranks) = (comm.rank(), comm.world_size());
    let seq = cfg.data.seq_len;
    let per_rank = cfg.data.batch_size / ranks;
    let mut total = 0.0;
    if let Some(dm) = device_model {
        let mut dm = lock(dm);
        for i in 0..cfg.run.eval_batches {
            let starts = eval_starts(
                corpus.val.len(),
                cfg.data.batch_size,
                seq,
                i,
                cfg.run.eval_batches,
            );
            let mine = &starts[me * per_rank..(me + 1) * per_rank];
            total += dm.eval_loss(mine, seq, run.expert_bias)?;
        }
        drop(dm);
        return mean_over_ranks(comm, total / cfg.run.eval_batches as f64);
    }
    for i in 0..cfg.run.eval_batches {
        let (x, y) = eval_batch(
            &corpus.val,
            cfg.data.batch_size,
            seq,
            i,
            cfg.run.eval_batches,
        );
        let lo = me * per_rank * seq;
        let (loss, _) = model::forward(
            comm,
            mcfg,
            model,
            run,
            &x[lo..lo + per_rank * seq],
            &y[lo..lo + per_rank * seq],
            seq,
        )?;
        total += loss;
    }
    mean_over_ranks(comm, total / cfg.run.eval_batches as f64)
}
