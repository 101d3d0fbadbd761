//! The run's configuration: the TOML sections (`[model]`, `[data]`,
//! `[moe]`, `[run]`), their defaults and validation, and the modes.

use std::path::PathBuf;

use quota::Policy;
use serde::{Deserialize, Serialize};

use crate::model::ModelConfig;
use crate::optim::AdamWConfig;

use super::TrainError;

/// Which backward the MoE layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every pair in the backward (exact gradient).
    Full,
    /// LRMoE: controller quotas under per-rank budgets, replicas, compaction.
    Lrmoe,
    /// Capacity-factor token dropping in forward and backward (baseline).
    Capacity,
    /// Replication only: the controller's replicas, every pair kept (the
    /// SYMI/EPLB-style baseline LRMoE is measured against).
    Replicate,
    /// SYMI-like replication (arXiv 2504.19925), owners kept: each layer's
    /// replicas in proportion to its previous step's load per expert
    /// (`moe.replica_slots_per_rank` per rank), every pair kept, each
    /// expert's pairs split evenly over its instances in forward and
    /// backward. The first step has no history and takes the controller's
    /// replicas of its own counts.
    Symi,
    /// LRMoE with the paper's selection rule, top-q (the highest-scoring
    /// pairs within each quota), whatever `moe.selection_rule` says: so one
    /// comparison trains both rules (`--modes lrmoe,lrmoe-top-q`).
    #[serde(rename = "lrmoe_top_q")]
    #[value(name = "lrmoe-top-q")]
    LrmoeTopQ,
}

impl Mode {
    /// Whether the backward is LRMoE's (quotas, selection, redistribution).
    pub fn is_lrmoe(self) -> bool {
        matches!(self, Self::Lrmoe | Self::LrmoeTopQ)
    }

    /// Whether every routed pair is in the backward (the exact gradient,
    /// dropless): fixed ownership and the replication baselines.
    pub fn is_exact(self) -> bool {
        matches!(self, Self::Full | Self::Replicate | Self::Symi)
    }

    /// The selection rule the backward runs: top-q for
    /// [`Mode::LrmoeTopQ`], else the configured one (`None` when that
    /// name is not a rule).
    pub fn rule(self, configured: &str) -> Option<lrm_score::Rule> {
        match self {
            Self::LrmoeTopQ => Some(lrm_score::Rule::TopQ),
            _ => lrm_score::Rule::from_name(configured),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Full => "Full",
            Self::Lrmoe => "LRMoE",
            Self::Capacity => "Capacity",
            Self::Replicate => "Replicate",
            Self::Symi => "SYMI-like",
            Self::LrmoeTopQ => "LRMoE top-q",
        })
    }
}

/// Model shape (the vocabulary comes from the corpus).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Width.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Expert FFN width.
    pub ffn: usize,
    /// Experts per MoE layer.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise top-k weights.
    pub renormalize: bool,
    /// Key/value heads of grouped-query attention (divides `n_heads`);
    /// unset: `n_heads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Width of one attention head; unset: `d_model / n_heads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Rotary position embeddings with this base instead of learned
    /// positions; unset: learned positions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Qwen3's per-head RMSNorm of queries and keys.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// RMSNorm epsilon; unset: 1e-6.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rms_eps: Option<f64>,
    /// Rows of the embedding and columns of the LM head; unset: the
    /// corpus's symbols. Must be at least the corpus's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// Longest sequence the model is meant for (a config.json's
    /// `max_position_embeddings`); `data.seq_len` may not exceed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            d_model: 128,
            n_layers: 2,
            n_heads: 4,
            ffn: 256,
            n_experts: 8,
            top_k: 2,
            renormalize: true,
            n_kv_heads: None,
            head_dim: None,
            rope_theta: None,
            qk_norm: false,
            rms_eps: None,
            vocab: None,
            max_positions: None,
        }
    }
}

/// Corpus and batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Text corpus (UTF-8, at least 4 KiB). `None` (the default): the
    /// built-in Shakespeare corpus ([`crate::data::SHAKESPEARE`]).
    pub corpus: Option<PathBuf>,
    /// Held-out share at the end of the corpus.
    pub val_fraction: f64,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per global batch (split over ranks).
    pub batch_size: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            corpus: None,
            val_fraction: 0.1,
            seq_len: 64,
            batch_size: 32,
        }
    }
}

/// Where the MoE layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Executor {
    /// The layer crate's host executor: routing, plan, exchanges on the
    /// host (CPU rows over the transport); with `--device cuda` on several
    /// ranks its expert GEMMs run on the GPU. A single rank with `--device
    /// cuda` runs the device executor (EP = 1) either way.
    #[default]
    Host,
    /// The layer crate's device executor (`--device cuda`): the whole
    /// model on the GPUs — one rank; launched ranks, one GPU each; or
    /// in-process ranks (`--ranks N`) sharing one GPU, taking turns on it
    /// and exchanging device to device (a plan's check, and the N-GPU
    /// simulation: `simulated` in the metrics). Each
    /// layer on each rank's GPU: routing, the
    /// controller's plan from routed counts, replicas, selection,
    /// redistribution, NCCL all-to-alls of packed kept rows.
    Device,
}

/// MoE execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoeSection {
    /// Backward mode.
    pub mode: Mode,
    /// Where the layers run (host or device executor).
    pub executor: Executor,
    /// In-process expert-parallel ranks.
    pub ranks: usize,
    /// Replicas each rank may host per layer call (lrmoe mode).
    pub replica_slots_per_rank: usize,
    /// Which replicas lrmoe mode places: `"paying"` (those whose weight and
    /// gradient traffic the controller's cost model says they repay; an
    /// empty slot's memory stays unused, so the token buffer keeps
    /// `buffer_fraction`) or `"fill"` (every one the slots allow). The
    /// replicate mode always fills.
    pub replica_rule: quota::ReplicaRule,
    /// Per-rank backward buffer budget as a share of the average routed
    /// pairs per rank (lrmoe mode).
    pub buffer_fraction: f64,
    /// Quota policy (lrmoe mode).
    pub policy: Policy,
    /// Capacity factor (capacity mode).
    pub capacity_factor: f64,
    /// Forced imbalance (every mode): experts `0..hot_experts` get
    /// `hot_bias` added to their router logits.
    pub hot_experts: usize,
    /// Router logit bias of the hot experts.
    pub hot_bias: f64,
    /// Skewed workload (every mode): `-zipf_skew · ln(1 + e)` added to
    /// expert `e`'s router logits, a power-law fall-off of the loads (0 =
    /// off); see `layer::CallConfig::zipf_skew`.
    pub zipf_skew: f64,
    /// Which pairs the backward keeps within each quota (lrmoe mode):
    /// `priority` (default: priority sampling, unbiased), `top_q` (the
    /// paper's rule), `random_q` or `proportional` (see `lrm_score::Rule`).
    /// The device layers run `top_q` and `priority`; the host executor all.
    pub selection_rule: String,
    /// LRMoE quotas that trim only the ranks above their fair share of the
    /// budget (`layer::Retention::Surplus(buffer_fraction)`: the share of
    /// all routed pairs kept is `buffer_fraction`, under-loaded ranks stay
    /// whole) instead of the controller's per-rank memory budgets.
    pub surplus_only: bool,
    /// Coefficient of the Switch/GShard auxiliary load-balancing loss
    /// (every mode; 0 = off; the host executor only). The gradients include
    /// it; the logged training and validation losses are the language
    /// model's alone (the auxiliary value is logged as `aux_loss`).
    pub aux_loss_coeff: f64,
    /// Update rate `γ` of the auxiliary-loss-free balancing bias
    /// (DeepSeek-V3; 0 = off): each layer keeps a bias per expert, added to
    /// the router probabilities for the top-k choice only, and after every
    /// step moves it by `γ · sign(mean load − load)` (the step's routed
    /// pairs per expert over all ranks), so overloaded experts are chosen
    /// less. Both executors; checkpointed.
    pub expert_bias_rate: f64,
    /// Hold every mode to LRMoE's per-rank token-buffer budget
    /// (`buffer_fraction` of the average routed pairs per rank, the same
    /// bytes the controller plans with): `full` and `replicate` keep every
    /// pair and fit by splitting each step into micro-batches (gradient
    /// accumulation, exact gradient) — as many as the busiest rank's pairs
    /// in the previous step need (the first step assumes every pair lands
    /// on one rank), rounded up to a divisor of the rank's sequences;
    /// `capacity` uses `buffer_fraction` as its
    /// capacity factor (its per-rank buffers then equal the budget);
    /// `lrmoe` fits by its quotas.
    pub fit_budget: bool,
    /// With `fit_budget`: the budget holds the forward's token buffers too
    /// (the default). The forward computes every routed pair, so a rank's
    /// forward rows (its instances' share of them) count against the same
    /// rows as its backward's; every mode that keeps the forward whole
    /// (`full`, `replicate`, `symi`, `lrmoe`, `lrmoe-top-q`) splits a step
    /// into as many micro-batches as the busier of the two needs. Off: the
    /// budget binds the backward's buffers only, and `lrmoe` never splits —
    /// its forward may hold more than the budget (the accounted memory
    /// shows it, `rank_peak_bytes`); every comparison before 2026-12-05
    /// ran so. No effect without `fit_budget`.
    pub budget_forward: bool,
    /// On bf16 device rows (the GPU executors), an LRMoE quota that binds
    /// and exceeds a whole number of the grouped GEMM's 128-row blocks by at
    /// most this share of itself is trimmed to whole blocks: the last,
    /// nearly empty block would cost a full block of work in each of the
    /// backward's five data GEMMs (see `quota::align_to_tiles`). 0 = off.
    pub tile_trim: f64,
    /// The device model on one rank (`--device cuda`, `moe.ranks = 1`):
    /// keep each expert row's projections `x·W_gate`, `x·W_up` from the
    /// forward (`2 · ffn` bf16 values a routed pair) so the backward skips
    /// recomputing them — two grouped GEMMs fewer, the memory PyTorch's
    /// layer spends the same way. Elsewhere it has no effect (the run says
    /// so once when it was asked for). Unset: on in `full` mode, whose
    /// exact backward reads every pair's projections, off in the planned
    /// modes, which recompute only the rows they keep and spend the memory
    /// on token buffers instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_projections: Option<bool>,
}

impl Default for MoeSection {
    fn default() -> Self {
        Self {
            mode: Mode::Lrmoe,
            executor: Executor::Host,
            ranks: 2,
            replica_slots_per_rank: 1,
            replica_rule: quota::ReplicaRule::Paying,
            buffer_fraction: 0.6,
            policy: Policy::Maxmin,
            capacity_factor: 1.0,
            hot_experts: 0,
            hot_bias: 0.0,
            zipf_skew: 0.0,
            // The study of issue 14 (docs/benchmarks.md): at 60% kept,
            // top-q needs 1.5–2.3× the exact backward's steps to a loss,
            // the unbiased samplings about 1.0–1.1×; priority sampling runs
            // on every executor.
            selection_rule: "priority".into(),
            surplus_only: false,
            aux_loss_coeff: 0.0,
            expert_bias_rate: 0.0,
            fit_budget: false,
            budget_forward: true,
            tile_trim: layer::TileAlign::DEVICE.max_drop,
            keep_projections: None,
        }
    }
}

/// Run control.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Output folder: metrics, checkpoint, reports.
    pub out_dir: PathBuf,
    /// Steps between evaluations.
    pub eval_every: usize,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Near the target, evaluate every this many steps as well (0: off):
    /// once the last evaluation is within `eval_near_margin` nats above
    /// `target_val_loss`, so where a run crosses the target is read on a
    /// finer grid than `eval_every` without evaluating often everywhere.
    pub eval_near_every: usize,
    /// How far above the target (nats per token, ≥ 0) the last evaluation
    /// must be for `eval_near_every` to apply.
    pub eval_near_margin: f64,
    /// Steps between checkpoints (0: only at the end).
    pub checkpoint_every: usize,
    /// Write checkpoints at all (`false`: neither periodic nor final; the
    /// run cannot be resumed).
    pub checkpoint: bool,
    /// Stop at the first evaluation at or below this validation loss.
    pub target_val_loss: Option<f64>,
    /// Stop after this much training wall time (minutes; `None`: no cap).
    /// Measured as the sum of the slowest rank's step times, so every rank
    /// stops after the same step.
    pub max_minutes: Option<f64>,
}

impl Default for RunSection {
    fn default() -> Self {
        Self {
            out_dir: PathBuf::from("runs/default"),
            eval_every: 100,
            eval_batches: 8,
            eval_near_every: 0,
            eval_near_margin: 0.1,
            checkpoint_every: 500,
            checkpoint: true,
            target_val_loss: None,
            max_minutes: None,
        }
    }
}

/// The whole training configuration (TOML; every field has a default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Seed of initialisation and batches.
    pub seed: u64,
    /// Optimizer steps.
    pub steps: usize,
    /// Model shape.
    pub model: ModelSection,
    /// Data.
    pub data: DataSection,
    /// Optimizer.
    pub optim: AdamWConfig,
    /// MoE execution.
    pub moe: MoeSection,
    /// Run control.
    pub run: RunSection,
    /// The cluster model of in-process ranks on one GPU (`--executor
    /// device`, `moe.ranks` > 1): each step's time on that many GPUs of
    /// this cluster goes to `metrics.jsonl` (`simulated`).
    pub cluster: cluster::Cluster,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            steps: 3000,
            model: ModelSection::default(),
            data: DataSection::default(),
            optim: AdamWConfig::default(),
            moe: MoeSection::default(),
            run: RunSection::default(),
            cluster: cluster::Cluster::default(),
        }
    }
}

/// The number of ranks a run has: `configured` (`moe.ranks` after the
/// flags), set explicitly by `set_by` (`None`: it is the default), for
/// launched ranks (`world`: WORLD_SIZE) or on a GPU (`gpu`). A default
/// adapts — one rank per GPU, WORLD_SIZE when launched — but an explicit
/// setting is used as it is, or refused where it cannot hold.
pub fn resolve_ranks(
    configured: usize,
    set_by: Option<&str>,
    world: Option<usize>,
    gpu: bool,
) -> Result<usize, TrainError> {
    match (world, set_by) {
        (Some(w), Some(from)) if configured != w => Err(TrainError::Config(format!(
            "{from} = {configured} disagrees with WORLD_SIZE = {w} (launched ranks take their number from the launcher)"
        ))),
        (Some(w), _) => Ok(w),
        (None, None) if gpu => Ok(1),
        (None, _) => Ok(configured),
    }
}

/// A TOML error on one line: where (line and column, 1-based), what, and
/// the offending line's text (the parser's own message draws a `^` marker
/// under it over several lines, which a one-line error cannot keep).
pub(super) fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    let Some(span) = e.span() else {
        return message;
    };
    let start = span.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    let source = text[line_start..].lines().next().unwrap_or("").trim();
    format!("line {line}, column {column}: {message} (in `{source}`)")
}

/// Whether the TOML `text` sets `key` of `[section]` (`None`: any key of
/// it). Text that does not parse sets nothing (its error comes from
/// [`TrainConfig::from_toml`]).
pub fn toml_sets(text: &str, section: &str, key: Option<&str>) -> bool {
    let Ok(table) = text.parse::<toml::Table>() else {
        return false;
    };
    match (table.get(section).and_then(toml::Value::as_table), key) {
        (Some(t), Some(k)) => t.contains_key(k),
        (Some(t), None) => !t.is_empty(),
        (None, _) => false,
    }
}

/// The largest accepted `run.max_minutes`: one year.
pub const MAX_MINUTES: f64 = 525_600.0;

impl TrainConfig {
    /// Parses TOML, naming the offending key on error.
    pub fn from_toml(text: &str) -> Result<Self, TrainError> {
        let cfg: Self =
            toml::from_str(text).map_err(|e| TrainError::Config(toml_error(text, &e)))?;
        // Sections must be tables: serde would also read one from an array.
        let input: toml::Value =
            toml::from_str(text).map_err(|e| TrainError::Config(toml_error(text, &e)))?;
        let input = serde_json::to_value(input).map_err(|e| TrainError::Config(e.to_string()))?;
        crate::strict::check_value(&input, &cfg).map_err(|e| TrainError::Config(e.to_string()))?;
        Ok(cfg)
    }

    /// Rejects settings that cannot work.
    ///
    /// `steps` must be at least 1, `run.target_val_loss` positive (a
    /// validation loss is never below 0) and `moe.buffer_fraction` in
    /// `(0, moe.ranks]`: 1 budgets the average routed pairs per rank,
    /// `moe.ranks` every pair of a step on one rank, and no more can arrive.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.cluster
            .validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        self.validate_sizes()?;
        self.validate_moe()?;
        self.validate_optim_and_run()
    }

    /// Ranks, steps, batch, sequence and evaluation sizes.
    pub(super) fn validate_sizes(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.moe.ranks == 0 {
            return bad("moe.ranks must be at least 1".into());
        }
        if self.steps == 0 {
            return bad("steps = 0: a run trains at least one step".into());
        }
        if self.data.batch_size == 0 || self.data.batch_size % self.moe.ranks != 0 {
            return bad(format!(
                "data.batch_size = {} must be a positive multiple of moe.ranks = {}",
                self.data.batch_size, self.moe.ranks
            ));
        }
        if self.data.seq_len < 2 {
            return bad("data.seq_len must be at least 2".into());
        }
        if self.run.eval_every == 0 || self.run.eval_batches == 0 {
            return bad("run.eval_every and run.eval_batches must be positive".into());
        }
        if !(self.run.eval_near_margin.is_finite() && self.run.eval_near_margin >= 0.0) {
            return bad(format!(
                "run.eval_near_margin = {} must be a finite number of nats, at least 0",
                self.run.eval_near_margin
            ));
        }
        if self.run.eval_near_every > 0 && self.run.target_val_loss.is_none() {
            return bad(
                "run.eval_near_every evaluates more often near the target: set run.target_val_loss (--target-val-loss) too"
                    .into(),
            );
        }
        Ok(())
    }

    /// The MoE section's workloads, balancing, selection and budget.
    pub(super) fn validate_moe(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.moe.hot_experts > self.model.n_experts || !self.moe.hot_bias.is_finite() {
            return bad(format!(
                "moe.hot_experts = {} must be at most model.n_experts = {} and moe.hot_bias finite",
                self.moe.hot_experts, self.model.n_experts
            ));
        }
        if !(self.moe.zipf_skew.is_finite() && self.moe.zipf_skew >= 0.0) {
            return bad(format!(
                "moe.zipf_skew = {} must be finite and ≥ 0",
                self.moe.zipf_skew
            ));
        }
        if !(self.moe.aux_loss_coeff.is_finite() && self.moe.aux_loss_coeff >= 0.0) {
            return bad(format!(
                "moe.aux_loss_coeff = {} must be finite and ≥ 0",
                self.moe.aux_loss_coeff
            ));
        }
        if !(self.moe.expert_bias_rate.is_finite() && self.moe.expert_bias_rate >= 0.0) {
            return bad(format!(
                "moe.expert_bias_rate = {} must be finite and ≥ 0",
                self.moe.expert_bias_rate
            ));
        }
        if !(0.0..=1.0).contains(&self.moe.tile_trim) {
            return bad(format!(
                "moe.tile_trim = {} must be in [0, 1]",
                self.moe.tile_trim
            ));
        }
        if lrm_score::Rule::from_name(&self.moe.selection_rule).is_none() {
            return bad(format!(
                "moe.selection_rule = {:?} is not one of {}",
                self.moe.selection_rule,
                lrm_score::Rule::ALL.map(|r| r.name()).join(", ")
            ));
        }
        let bf = self.moe.buffer_fraction;
        if !(bf.is_finite() && bf > 0.0 && bf <= self.moe.ranks as f64) {
            return bad(format!(
                "moe.buffer_fraction = {bf} must be in (0, moe.ranks = {}]: the share of the average routed pairs per rank one rank's backward buffer holds (1: the average; moe.ranks: every pair of a step)",
                self.moe.ranks
            ));
        }
        Ok(())
    }

    /// The optimizer, the capacity factor, the stop conditions and the
    /// validation split.
    pub(super) fn validate_optim_and_run(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        if !(self.optim.lr > 0.0 && self.optim.lr.is_finite()) {
            return bad("optim.lr must be positive".into());
        }
        let o = &self.optim;
        for (name, v, ok) in [
            ("optim.min_lr", o.min_lr, o.min_lr >= 0.0),
            ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0.0),
            ("optim.beta1", o.beta1, (0.0..1.0).contains(&o.beta1)),
            ("optim.beta2", o.beta2, (0.0..1.0).contains(&o.beta2)),
            ("optim.eps", o.eps, o.eps > 0.0),
            ("optim.clip", o.clip, o.clip >= 0.0),
            (
                "moe.capacity_factor",
                self.moe.capacity_factor,
                self.moe.capacity_factor > 0.0,
            ),
        ] {
            if !(v.is_finite() && ok) {
                return bad(format!("{name} = {v} is out of range"));
            }
        }
        if let Some(m) = self.run.max_minutes {
            if !(m.is_finite() && m > 0.0 && m <= MAX_MINUTES) {
                return bad(format!(
                    "run.max_minutes = {m:?} must be a number of minutes in (0, {MAX_MINUTES}] (leave it out for no cap)"
                ));
            }
        }
        if let Some(t) = self.run.target_val_loss {
            if !(t.is_finite() && t > 0.0) {
                return bad(format!(
                    "run.target_val_loss = {t} must be a positive number of nats per token (a validation loss is never below 0)"
                ));
            }
        }
        if !(self.data.val_fraction > 0.0 && self.data.val_fraction < 0.5) {
            return bad(format!(
                "data.val_fraction = {} must be in (0, 0.5)",
                self.data.val_fraction
            ));
        }
        Ok(())
    }

    /// The model's shape on a corpus of `corpus_vocab` symbols.
    pub fn model_config(&self, corpus_vocab: usize) -> Result<ModelConfig, TrainError> {
        let m = &self.model;
        if let Some(v) = m.vocab.filter(|&v| v < corpus_vocab) {
            return Err(TrainError::Config(format!(
                "model.vocab = {v} is smaller than the corpus's {corpus_vocab} symbols"
            )));
        }
        if let Some(p) = m.max_positions.filter(|&p| p < self.data.seq_len) {
            return Err(TrainError::Config(format!(
                "data.seq_len = {} exceeds the model's {p} positions (max_position_embeddings)",
                self.data.seq_len
            )));
        }
        let cfg = ModelConfig {
            vocab: m.vocab.unwrap_or(corpus_vocab),
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            ffn: m.ffn,
            n_experts: m.n_experts,
            top_k: m.top_k,
            renormalize: m.renormalize,
            max_seq: self.data.seq_len,
            n_kv_heads: m.n_kv_heads,
            head_dim: m.head_dim,
            rope_theta: m.rope_theta,
            qk_norm: m.qk_norm,
            rms_eps: m.rms_eps,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// An `[moe]` section from JSON (the Python package's layer settings),
/// checked as `lrmoe train` checks its TOML for one rank of `n_experts`
/// experts: unknown keys and values out of range are errors naming them;
/// missing keys take the TOML's defaults. The section's `ranks` is 1 and
/// it has no replica slot (one rank cannot host a replica; a slot's memory
/// would otherwise widen the token buffer beyond `buffer_fraction`).
pub fn moe_section_from_json(json: &str, n_experts: usize) -> Result<MoeSection, TrainError> {
    let mut moe: MoeSection = crate::strict::from_json(json).map_err(|e| {
        TrainError::Config(if e.path == "." {
            e.message
        } else {
            format!("{}: {}", e.path, e.message)
        })
    })?;
    moe.ranks = 1;
    moe.replica_slots_per_rank = 0;
    let mut cfg = TrainConfig {
        moe: moe.clone(),
        ..TrainConfig::default()
    };
    cfg.model.n_experts = n_experts;
    cfg.data.batch_size = 1;
    cfg.validate()?;
    Ok(moe)
}
