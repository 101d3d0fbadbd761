//! `lrmoe train`: the MoE language model trained on the CPU with the LRMoE
//! backward, expert parallel over in-process ranks.
//!
//! Every rank (a thread) holds the full dense model and the same optimizer
//! state; each step it takes its shard of a global batch, runs the model
//! (MoE layers exchanging tokens with the other ranks), and applies the
//! all-reduced gradients. Rank 0 evaluates, logs, and writes metrics and
//! checkpoints.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use layer::transport::all_gather;
use layer::{CallConfig, Retention, Transport};
use quota::{Placement, Policy, RankBudget};
use serde::{Deserialize, Serialize};

use crate::data::{
    eval_batch, eval_starts, load_corpus, random_batch, random_starts, unigram_baseline, Corpus,
    SplitMix,
};
use crate::device_model::DeviceModel;
use crate::model::{self, Model, ModelConfig, MoeRun};
use crate::optim::{lr_at, step as adamw_step, AdamWConfig, AdamWState};
use crate::tensorfile::{self, TensorFileError};

/// Errors of training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration cannot work.
    #[error("config: {0}")]
    Config(String),
    /// The corpus failed to load.
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    /// The model failed (shapes, NaN loss, a collective).
    #[error(transparent)]
    Model(#[from] model::ModelError),
    /// A checkpoint could not be read or written.
    #[error("checkpoint: {0}")]
    Checkpoint(TensorFileError),
    /// A metrics or report file could not be written.
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: String,
        /// The I/O error (shown in the message, not chained, so the CLI's
        /// one-line error does not repeat it).
        error: std::io::Error,
    },
}

impl From<TensorFileError> for TrainError {
    fn from(e: TensorFileError) -> Self {
        TrainError::Checkpoint(e)
    }
}

impl From<layer::TransportError> for TrainError {
    fn from(e: layer::TransportError) -> Self {
        TrainError::Model(e.into())
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |error| TrainError::Io {
        path: path.display().to_string(),
        error,
    }
}

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
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Full => "Full",
            Self::Lrmoe => "LRMoE",
            Self::Capacity => "Capacity",
            Self::Replicate => "Replicate",
            Self::Symi => "SYMI-like",
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
    /// so once). Off by default: LRMoE spends that memory on token buffers
    /// instead.
    pub keep_projections: bool,
}

impl Default for MoeSection {
    fn default() -> Self {
        Self {
            mode: Mode::Lrmoe,
            executor: Executor::Host,
            ranks: 2,
            replica_slots_per_rank: 1,
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
            tile_trim: layer::TileAlign::DEVICE.max_drop,
            keep_projections: false,
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
fn toml_error(text: &str, e: &toml::de::Error) -> String {
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
    fn validate_sizes(&self) -> Result<(), TrainError> {
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
        Ok(())
    }

    /// The MoE section's workloads, balancing, selection and budget.
    fn validate_moe(&self) -> Result<(), TrainError> {
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
    fn validate_optim_and_run(&self) -> Result<(), TrainError> {
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

/// One evaluation point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Step after which it was taken.
    pub step: usize,
    /// Training wall time so far, seconds (evaluation excluded).
    pub wall_s: f64,
    /// Cumulative time in MoE layers (forward + backward), seconds.
    pub moe_s: f64,
    /// Validation loss, nats per token.
    pub val_loss: f64,
    /// In-process ranks on one GPU (rank 0): the training time so far on
    /// `moe.ranks` GPUs of the `[cluster]`, simulated (`crate::simulate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_s: Option<f64>,
    /// The same for the MoE layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_moe_s: Option<f64>,
}

/// The outcome of a training run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSummary {
    /// Mode trained.
    pub mode: Mode,
    /// Steps done.
    pub steps: usize,
    /// Evaluation curve.
    pub evals: Vec<EvalPoint>,
    /// Final validation loss.
    pub final_val_loss: f64,
    /// Unigram baseline on the same split.
    pub unigram_val_loss: f64,
    /// First evaluation at or below the target, if any.
    pub reached_target: Option<EvalPoint>,
    /// Mean kept fraction of routed pairs in the backward.
    pub mean_kept_fraction: f64,
    /// Largest backward buffer of rank 0 (the rank that logs) in any layer
    /// call, bytes; every rank's is in `max_rank_peak_bytes`.
    pub max_buffer_bytes: u64,
    /// The most bytes of expert instances any rank held in one step
    /// (owned experts and this call's replicas, weights and gradients, every
    /// layer), modelled from the plans (`expert_bytes` in `metrics.jsonl`); 0 in summaries
    /// written before it was recorded.
    #[serde(default)]
    pub max_expert_bytes: u64,
    /// The most bytes any one rank held for expert placement, replicas and
    /// backward buffers together in one step (`rank_peak_bytes` in
    /// `metrics.jsonl`); 0 in summaries written before it was recorded.
    #[serde(default)]
    pub max_rank_peak_bytes: u64,
    /// Why the run ended.
    pub stop_reason: crate::stop::StopReason,
}

/// Command-line choices around a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from the checkpoint in `out_dir`.
    pub resume: bool,
    /// Draw a progress bar.
    pub progress: bool,
    /// This process is one rank of a launched group (`lrmoe launch`): the
    /// MoE layers and the data-parallel all-reduce run over NCCL, and only
    /// rank 0 writes metrics and checkpoints. `None`: `moe.ranks`
    /// in-process ranks.
    pub transport: Option<std::sync::Arc<layer::NcclTransport>>,
    /// This rank's GPU (`--device cuda`): with one in-process rank the
    /// fused CUDA layer runs the MoE layers; with several ranks (threads or
    /// launched processes) the layer's expert GEMMs run on it as bf16
    /// grouped kernels.
    pub gpu: Option<std::sync::Arc<kernels::gpu::Gpu>>,
    /// Raised to stop at the next step boundary (the CLI's signal handler
    /// raises it on SIGINT/SIGTERM); the run then checkpoints and returns
    /// its summary with [`crate::stop::StopReason::Signal`].
    pub stop: crate::stop::StopFlag,
    /// Start over in an `out_dir` that holds an earlier run's files
    /// (without it, and without `resume`, such a folder is refused).
    pub force: bool,
}

impl RunOptions {
    /// Whether this process writes the run's files (rank 0).
    pub fn writes(&self) -> bool {
        self.transport.as_ref().is_none_or(|t| t.rank() == 0)
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

/// The cost model in the units the executor plans with: f32 rows on the
/// host executor, bf16 rows on the device executor (launched ranks with
/// `executor = "device"`, in-process device ranks, or the device-resident
/// model), so `buffer_fraction` means the same share of pairs on both.
fn executor_cost((d_model, ffn): (usize, usize), device_rows: bool) -> quota::CostModel {
    quota::CostModel::swiglu_expert(
        d_model,
        ffn,
        if device_rows { 2 } else { 4 },
        quota::H200_LINK_BYTES_PER_S,
        quota::H200_FLOPS_PER_S,
    )
}

/// Whether the MoE layers run on bf16 device rows: the whole model on the
/// GPU, or the device executor.
fn device_rows(cfg: &TrainConfig, whole_gpu: bool) -> bool {
    whole_gpu || cfg.moe.executor == Executor::Device
}

/// Byte and memory model the controller plans with: each rank holds its
/// owned experts, `moe.replica_slots_per_rank` replicas and a token buffer
/// of `moe.buffer_fraction` of the average routed pairs per rank.
fn budgets(
    moe: &MoeSection,
    (d_model, ffn): (usize, usize),
    pairs_per_rank: f64,
    placement: &Placement,
    device_rows: bool,
) -> Vec<RankBudget> {
    let cost = executor_cost((d_model, ffn), device_rows);
    let (instance, row) = (cost.instance_bytes(), cost.row_bytes());
    let buffer = (moe.buffer_fraction * pairs_per_rank).ceil() as u64 * row;
    (0..moe.ranks)
        .map(|r| {
            let owned = placement.owner.iter().filter(|&&o| o == r).count() as u64;
            RankBudget {
                memory_bytes: (owned + moe.replica_slots_per_rank as u64) * instance + buffer,
                network_bytes: u64::MAX,
            }
        })
        .collect()
}

fn call_config(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    placement: &Placement,
    device_rows: bool,
) -> CallConfig {
    let shape = (mcfg.d_model, mcfg.ffn);
    let pairs = pairs_per_rank(cfg, mcfg);
    layer_call_config(&cfg.moe, shape, pairs, placement, device_rows, cfg.seed)
}

/// The average routed pairs per rank of one layer call.
fn pairs_per_rank(cfg: &TrainConfig, mcfg: &ModelConfig) -> f64 {
    (cfg.data.batch_size / cfg.moe.ranks * cfg.data.seq_len * mcfg.top_k) as f64
}

/// One MoE layer call's settings from an `[moe]` section, as the trainer
/// makes them: `shape` is `(d_model, ffn)`, `pairs_per_rank` the average
/// routed pairs per rank of a call (the token buffer's unit),
/// `placement` the experts' owners over `moe.ranks` ranks, `device_rows`
/// whether the rows are the device executor's bf16 ones (else f32), `seed`
/// the random selection rules' seed.
pub fn layer_call_config(
    moe: &MoeSection,
    shape: (usize, usize),
    pairs_per_rank: f64,
    placement: &Placement,
    device_rows: bool,
    seed: u64,
) -> CallConfig {
    let base = CallConfig {
        hot_experts: moe.hot_experts,
        hot_bias: moe.hot_bias,
        zipf_skew: moe.zipf_skew,
        aux_loss_coeff: moe.aux_loss_coeff,
        keep_projections: moe.keep_projections,
        ..CallConfig::default()
    };
    let rule = lrm_score::Rule::from_name(&moe.selection_rule).unwrap_or_default();
    match moe.mode {
        Mode::Full => base,
        Mode::Capacity => CallConfig {
            capacity_factor: Some(if moe.fit_budget {
                moe.buffer_fraction
            } else {
                moe.capacity_factor
            }),
            ..base
        },
        Mode::Replicate => CallConfig {
            replica_slots_per_rank: moe.replica_slots_per_rank,
            replica_memory_fraction: 1.0,
            ..base
        },
        Mode::Symi => CallConfig {
            replica_slots_per_rank: moe.replica_slots_per_rank,
            replica_memory_fraction: 1.0,
            solver: redistribute::Solver::Even,
            ..base
        },
        Mode::Lrmoe => CallConfig {
            retention: if moe.surplus_only {
                Retention::Surplus(moe.buffer_fraction.min(1.0))
            } else {
                Retention::Budgeted {
                    budgets: budgets(moe, shape, pairs_per_rank, placement, device_rows),
                    policy: moe.policy,
                }
            },
            replica_slots_per_rank: moe.replica_slots_per_rank,
            replica_memory_fraction: 1.0,
            rule,
            rule_seed: seed,
            tile_align: (device_rows && moe.tile_trim > 0.0).then_some(layer::TileAlign {
                max_drop: moe.tile_trim,
                ..layer::TileAlign::DEVICE
            }),
            ..base
        },
    }
}

/// The training state a checkpoint holds.
#[derive(Clone)]
struct State {
    model: Model<f32>,
    adam: AdamWState<f32>,
    step: usize,
    rng: SplitMix,
    evals: Vec<EvalPoint>,
    wall_s: f64,
    moe_s: f64,
    /// Simulated training and MoE-layer time so far (rank 0 of timed
    /// in-process ranks; a resumed run starts from its last evaluation's).
    sim: Option<(f64, f64)>,
    /// Each layer's balancing bias (`moe.expert_bias_rate`; empty when off).
    expert_bias: Vec<Vec<f64>>,
    /// Each layer's routed pairs per expert in the last step (all ranks;
    /// SYMI-like replicas follow it; not in the checkpoint: a resumed run's
    /// first step has no history).
    last_load: Vec<Vec<u64>>,
    /// The run's kept fractions and buffers so far (not in the checkpoint:
    /// a resumed run reads them back from `metrics.jsonl` as it cuts it
    /// back, [`truncate_metrics`]).
    logged: Logged,
}

/// Sums over the layer calls a run has logged, for its summary.
#[derive(Debug, Clone, Copy, Default)]
struct Logged {
    kept_sum: f64,
    kept_n: usize,
    max_buffer: u64,
    max_experts: u64,
    max_rank_peak: u64,
}

impl Logged {
    fn add(&mut self, kept_fraction: f64, buffer_bytes: u64) {
        self.kept_sum += kept_fraction;
        self.kept_n += 1;
        self.max_buffer = self.max_buffer.max(buffer_bytes);
    }

    /// The mean kept fraction (1 where no layer call was logged).
    fn mean_kept(&self) -> f64 {
        if self.kept_n > 0 {
            self.kept_sum / self.kept_n as f64
        } else {
            1.0
        }
    }

    /// Adds one step as it is logged (its twin for a line read back is
    /// [`Logged::add_line`]).
    fn add_step(&mut self, m: &StepMetrics) {
        self.max_experts = self.max_experts.max(m.expert_bytes);
        self.max_rank_peak = self.max_rank_peak.max(m.rank_peak_bytes);
        for l in &m.layers {
            self.add(l.kept_fraction, l.buffer_bytes);
        }
    }

    /// Adds the layer calls of one `metrics.jsonl` line.
    fn add_line(&mut self, line: &serde_json::Value) {
        let experts = line["expert_bytes"].as_u64().unwrap_or(0);
        self.max_experts = self.max_experts.max(experts);
        let peak = line["rank_peak_bytes"].as_u64().unwrap_or(0);
        self.max_rank_peak = self.max_rank_peak.max(peak);
        for l in line["layers"].as_array().into_iter().flatten() {
            if let Some(k) = l["kept_fraction"].as_f64() {
                self.add(k, l["buffer_bytes"].as_u64().unwrap_or(0));
            }
        }
    }
}

const CHECKPOINT: &str = "checkpoint.safetensors";

/// The checkpoint shape of the model tensor `name` holding `len` values.
fn shape_of(cfg: &ModelConfig, name: &str, len: usize) -> Vec<usize> {
    let (d, v, f) = (cfg.d_model, cfg.vocab, cfg.ffn);
    let (qd, kd) = (
        cfg.n_heads * cfg.head_width(),
        cfg.kv_heads() * cfg.head_width(),
    );
    match name.rsplit('.').next().unwrap_or("") {
        "embed" => vec![v, d],
        "pos" => vec![cfg.max_seq, d],
        "head" => vec![d, v],
        "router" => vec![d, cfg.n_experts],
        "gate" | "up" => vec![d, f],
        "down" => vec![f, d],
        "wq" => vec![d, qd],
        "wk" | "wv" => vec![d, kd],
        "wo" => vec![qd, d],
        _ => vec![len],
    }
}

/// The checkpoint's metadata beside the tensors.
fn checkpoint_meta(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    s: &State,
) -> HashMap<String, String> {
    let mut meta = HashMap::new();
    meta.insert("format".into(), "lrmoe-checkpoint-1".into());
    meta.insert("step".into(), s.step.to_string());
    meta.insert("adam_t".into(), s.adam.t.to_string());
    meta.insert("rng".into(), s.rng.0.to_string());
    meta.insert("wall_s".into(), s.wall_s.to_string());
    meta.insert("moe_s".into(), s.moe_s.to_string());
    if let Some((step_s, moe_s)) = s.sim {
        meta.insert("simulated_s".into(), step_s.to_string());
        meta.insert("simulated_moe_s".into(), moe_s.to_string());
    }
    meta.insert(
        "expert_bias".into(),
        serde_json::to_string(&s.expert_bias).unwrap_or_default(),
    );
    meta.insert(
        "model".into(),
        serde_json::to_string(mcfg).unwrap_or_default(),
    );
    meta.insert(
        "vocab".into(),
        corpus.vocab.iter().map(|b| format!("{b:02x}")).collect(),
    );
    meta.insert(
        "evals".into(),
        serde_json::to_string(&s.evals).unwrap_or_default(),
    );
    meta.insert("config".into(), toml::to_string(cfg).unwrap_or_default());
    meta
}

/// Bytes the checkpoint of state `s` takes on disk, at most (its final
/// evaluation curve may add a few hundred bytes; the bound's slack covers
/// them).
fn checkpoint_bytes(cfg: &TrainConfig, mcfg: &ModelConfig, corpus: &Corpus, s: &State) -> u64 {
    let meta: usize = checkpoint_meta(cfg, mcfg, corpus, s)
        .iter()
        .map(|(k, v)| k.len() + v.len() + 8)
        .sum();
    let lens: Vec<usize> = s.model.tensors().iter().map(|(_, t)| t.len()).collect();
    tensorfile::saved_bytes_bound(lens.iter().chain(&lens).chain(&lens).copied(), meta) + 64 * 1024
}

/// Free bytes on the file system that holds `dir` (or its nearest existing
/// ancestor); `None` where it cannot be read.
fn free_bytes(dir: &Path) -> Option<u64> {
    // A relative path's last ancestor is "", which never exists: the
    // working folder stands for it.
    let existing = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("."));
    let st = nix::sys::statvfs::statvfs(existing).ok()?;
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

fn save_checkpoint(
    path: &Path,
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    s: &State,
) -> Result<(), TrainError> {
    let mut tensors = Vec::new();
    for (prefix, m) in [
        ("model.", &s.model),
        ("adam.m.", &s.adam.m),
        ("adam.v.", &s.adam.v),
    ] {
        for (name, t) in m.tensors() {
            let shape = shape_of(mcfg, &name, t.len());
            tensors.push((format!("{prefix}{name}"), shape, t.as_slice()));
        }
    }
    let clock = Instant::now();
    tensorfile::save(path, &tensors, checkpoint_meta(cfg, mcfg, corpus, s))?;
    let secs = clock.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
    tracing::debug!(
        step = s.step,
        mib = bytes >> 20,
        seconds = secs,
        mib_per_s = bytes as f64 / (1u64 << 20) as f64 / secs.max(1e-9),
        "checkpoint written"
    );
    Ok(())
}

fn load_checkpoint(path: &Path, mcfg: &ModelConfig, corpus: &Corpus) -> Result<State, TrainError> {
    let mut f = tensorfile::load(path)?;
    let fmt = |m: String| content_error(path, m);
    check_header(&f, path, mcfg, corpus)?;
    let num = |f: &tensorfile::Loaded, k: &str| -> Result<f64, TrainError> {
        f.meta(k)?
            .parse::<f64>()
            .map_err(|e| fmt(format!("{k}: {e}")))
    };
    let step = num(&f, "step")? as usize;
    let adam_t = num(&f, "adam_t")? as u64;
    let rng = f
        .meta("rng")?
        .parse::<u64>()
        .map_err(|e| fmt(format!("rng: {e}")))?;
    let wall_s = num(&f, "wall_s")?;
    let moe_s = num(&f, "moe_s")?;
    // Simulated time (timed in-process ranks only).
    let sim = match (f.meta("simulated_s"), f.meta("simulated_moe_s")) {
        (Ok(_), Ok(_)) => Some((num(&f, "simulated_s")?, num(&f, "simulated_moe_s")?)),
        _ => None,
    };
    let evals: Vec<EvalPoint> =
        serde_json::from_str(f.meta("evals")?).map_err(|e| fmt(e.to_string()))?;
    let expert_bias = read_expert_bias(&f, path, mcfg)?;
    let mut take = |prefix: &str| -> Result<Model<f32>, TrainError> {
        let mut m = Model::<f32>::zeros(mcfg);
        for (name, t) in m.tensors_mut() {
            let shape = shape_of(mcfg, &name, t.len());
            *t = f.take(&format!("{prefix}{name}"), &shape)?;
        }
        Ok(m)
    };
    let model = take("model.")?;
    let adam = AdamWState {
        m: take("adam.m.")?,
        v: take("adam.v.")?,
        t: adam_t,
    };
    Ok(State {
        model,
        adam,
        step,
        rng: SplitMix(rng),
        evals,
        wall_s,
        moe_s,
        sim,
        expert_bias,
        last_load: Vec::new(),
        logged: Logged::default(),
    })
}

/// A checkpoint's content at fault, as an error naming the file.
fn content_error(path: &Path, reason: String) -> TrainError {
    TrainError::Checkpoint(TensorFileError::Content {
        path: path.display().to_string(),
        reason,
    })
}

/// A checkpoint's format, model and vocabulary against this run's.
fn check_header(
    f: &tensorfile::Loaded,
    path: &Path,
    mcfg: &ModelConfig,
    corpus: &Corpus,
) -> Result<(), TrainError> {
    let fmt = |m: String| content_error(path, m);
    if f.meta("format")? != "lrmoe-checkpoint-1" {
        return Err(fmt("not an lrmoe checkpoint".into()));
    }
    let saved: ModelConfig = crate::strict::from_json(f.meta("model")?)
        .map_err(|e| fmt(format!("metadata field model: {e}")))?;
    if saved != *mcfg {
        return Err(fmt(format!(
            "the checkpoint's model differs from the configured one ({}); resume with the configuration it was trained with",
            differences(&saved, mcfg)
        )));
    }
    let vocab: String = corpus.vocab.iter().map(|b| format!("{b:02x}")).collect();
    if f.meta("vocab")? != vocab {
        return Err(fmt("vocabulary differs from the corpus".into()));
    }
    Ok(())
}

/// The balancing bias a checkpoint carries: none in checkpoints from before
/// it, else one finite value per expert and layer.
fn read_expert_bias(
    f: &tensorfile::Loaded,
    path: &Path,
    mcfg: &ModelConfig,
) -> Result<Vec<Vec<f64>>, TrainError> {
    let fmt = |m: String| content_error(path, m);
    let expert_bias: Vec<Vec<f64>> = match f.meta("expert_bias") {
        Ok(j) => serde_json::from_str(j).map_err(|e| fmt(format!("expert_bias: {e}")))?,
        Err(_) => Vec::new(),
    };
    if !expert_bias.is_empty()
        && (expert_bias.len() != mcfg.n_layers
            || expert_bias
                .iter()
                .any(|b| b.len() != mcfg.n_experts || b.iter().any(|v| !v.is_finite())))
    {
        return Err(fmt(format!(
            "expert_bias: {} finite values per layer for {} layers expected",
            mcfg.n_experts, mcfg.n_layers
        )));
    }
    Ok(expert_bias)
}

/// Reads `path` as a checkpoint of the model `cfg` describes on `corpus`
/// and checks it as `--resume` does (format, model shape, vocabulary, every
/// tensor's shape, finite values); returns the step it holds. Nothing is
/// trained or written.
pub fn check_checkpoint(
    path: &Path,
    cfg: &TrainConfig,
    corpus: &Corpus,
) -> Result<usize, TrainError> {
    let mcfg = cfg.model_config(corpus.vocab.len())?;
    Ok(load_checkpoint(path, &mcfg, corpus)?.step)
}

/// `field saved → configured` for each field where two configurations
/// differ, e.g. `n_experts 8 → 4, ffn 256 → 128`.
fn differences<T: Serialize>(saved: &T, configured: &T) -> String {
    let (a, b) = (
        serde_json::to_value(saved).unwrap_or_default(),
        serde_json::to_value(configured).unwrap_or_default(),
    );
    match (a.as_object(), b.as_object()) {
        (Some(a), Some(b)) => a
            .iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k}: {v} in the checkpoint, {} configured",
                    b.get(k).cloned().unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        _ => String::from("unreadable"),
    }
}

/// Refuses an output folder the run cannot use, before anything is
/// created or written: a file in its place, an earlier run without
/// `--resume` or `--force` (the hint says which of them can work), or
/// `--resume` with no checkpoint to continue.
fn check_out_dir(dir: &Path, opts: &RunOptions) -> Result<(), TrainError> {
    let refuse = |m: String| Err(TrainError::Config(m));
    if dir.exists() && !dir.is_dir() {
        return refuse(format!(
            "the output folder {} is a file, not a folder: choose another --out (run.out_dir)",
            dir.display()
        ));
    }
    let (ckpt, metrics) = (dir.join(CHECKPOINT), dir.join("metrics.jsonl"));
    if opts.resume && !ckpt.exists() {
        let hint = if metrics.exists() {
            "its earlier run left no checkpoint: pass --force instead of --resume to start over"
        } else {
            "drop --resume to start a new run"
        };
        return refuse(format!(
            "--resume: {} holds no checkpoint to continue ({hint})",
            dir.display()
        ));
    }
    if !opts.resume && !opts.force {
        if ckpt.exists() {
            return refuse(format!(
                "{} holds an earlier run ({}): pass --resume to continue it or --force to start over",
                dir.display(),
                ckpt.display()
            ));
        }
        if metrics.exists() {
            return refuse(format!(
                "{} holds the metrics of an earlier run that left no checkpoint ({}): pass --force to start over",
                dir.display(),
                metrics.display()
            ));
        }
    }
    Ok(())
}

/// Says how large each checkpoint write is, and refuses a run whose
/// checkpoint cannot fit on the output folder's disk (it would fail only
/// after training).
fn check_checkpoint_room(dir: &Path, bytes: u64) -> Result<(), TrainError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let free = free_bytes(dir);
    tracing::info!(
        checkpoint_gib = gib(bytes),
        free_gib = free.map(gib),
        "checkpoint size (each write; --no-checkpoint writes none)"
    );
    match free {
        Some(free) if free < bytes => Err(TrainError::Config(format!(
            "the checkpoint needs {:.2} GiB and {}'s disk has {:.2} GiB free: free space, choose another --out, or pass --no-checkpoint (run.checkpoint = false)",
            gib(bytes),
            dir.display(),
            gib(free)
        ))),
        _ => Ok(()),
    }
}

/// Removes temporary files a killed run left behind in `dir` (the atomic
/// writer's `.<name>.<pid>.tmp`).
fn remove_orphans(dir: &Path) -> Result<(), TrainError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(_) => return Ok(()),
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = [CHECKPOINT, "metrics.jsonl"]
            .iter()
            .any(|f| name.starts_with(&format!(".{f}.")));
        if ours && name.ends_with(".tmp") {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_err(&path))?;
            tracing::info!(path = %path.display(), "removed a temporary file of an earlier, interrupted run");
        }
    }
    Ok(())
}

/// Cuts `metrics.jsonl` back to the lines of steps `<= step` (the resumed
/// checkpoint's), atomically, so a resumed run logs each step once. Lines
/// that do not parse end the kept part (a torn last line of a killed run).
/// Returns the kept lines' layer calls, for the run's summary.
fn truncate_metrics(path: &Path, step: usize) -> Result<Logged, TrainError> {
    let mut logged = Logged::default();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(logged),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut kept = String::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            break;
        };
        match v.get("step").and_then(serde_json::Value::as_u64) {
            Some(s) if s as usize <= step => {
                logged.add_line(&v);
                kept.push_str(line);
                kept.push('\n');
            }
            _ => break,
        }
    }
    if kept.len() != text.len() {
        crate::fsutil::write_atomic(path, kept.as_bytes()).map_err(io_err(path))?;
    }
    Ok(logged)
}

/// Bytes of host memory one training run needs, roughly and from above:
/// every rank's copy of the weights, AdamW moments and gradients, and one
/// step's activations (attention probabilities, the MoE rows, the logits).
/// `None` when the figure overflows `u64` (then it fits nowhere).
pub fn memory_estimate(cfg: &TrainConfig, mcfg: &ModelConfig) -> Option<u64> {
    let ranks = cfg.moe.ranks as u64;
    let seq = cfg.data.seq_len as u64;
    let n_seq = (cfg.data.batch_size as u64).checked_div(ranks)?;
    let n = n_seq.checked_mul(seq)?;
    let (d, f, v) = (mcfg.d_model as u64, mcfg.ffn as u64, mcfg.vocab as u64);
    let (e, k, l) = (
        mcfg.n_experts as u64,
        mcfg.top_k as u64,
        mcfg.n_layers as u64,
    );
    let heads = mcfg.n_heads as u64;
    let dh = mcfg.head_width() as u64;
    let (qd, kd) = (
        heads.checked_mul(dh)?,
        (mcfg.kv_heads() as u64).checked_mul(dh)?,
    );
    let per_layer_params = d
        .checked_mul(qd.checked_add(kd)?.checked_mul(2)?)?
        .checked_add(
            e.checked_mul(3)?
                .checked_mul(d)?
                .checked_mul(f)?
                .checked_add(d.checked_mul(e)?)?,
        )?;
    let params = per_layer_params
        .checked_mul(l)?
        .checked_add(v.checked_mul(d)?.checked_mul(2)?)?
        .checked_add(seq.checked_mul(d)?)?;
    let attn = n_seq
        .checked_mul(heads)?
        .checked_mul(seq)?
        .checked_mul(seq)?
        .checked_mul(2)?;
    let attn_rows = d
        .checked_mul(8)?
        .checked_add(qd.checked_mul(4)?)?
        .checked_add(kd.checked_mul(4)?)?;
    let rows = n.checked_mul(attn_rows.checked_add(k.checked_mul(d + 4 * f)?)?)?;
    let activations = attn
        .checked_add(rows)?
        .checked_mul(l)?
        .checked_add(n.checked_mul(v)?.checked_mul(2)?)?;
    let elems = params
        .checked_mul(5)?
        .checked_add(activations.checked_mul(2)?)?
        .checked_mul(ranks)?;
    elems.checked_mul(4)
}

/// The machine's memory, bytes (`None` where it cannot be read). Total,
/// not available: memory in use by others may be freed, and some VMs grow
/// their memory as it is used, so only a run that cannot fit at all is
/// refused.
fn machine_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a configuration whose buffers cannot be allocated here, before
/// any allocation aborts the process.
fn check_memory(cfg: &TrainConfig, mcfg: &ModelConfig) -> Result<(), TrainError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let hint = "lower data.seq_len, data.batch_size or the model's sizes";
    match (memory_estimate(cfg, mcfg), machine_memory()) {
        (None, _) => Err(TrainError::Config(format!(
            "the configured sizes overflow any memory ({hint})"
        ))),
        (Some(need), Some(have)) if need > have => Err(TrainError::Config(format!(
            "this run needs about {:.1} GiB of memory, this machine has {:.1} GiB ({hint})",
            gib(need),
            gib(have)
        ))),
        _ => Ok(()),
    }
}

/// Per-step, per-layer figures written to `metrics.jsonl`.
#[derive(Debug, Serialize)]
struct LayerMetrics {
    layer: usize,
    tokens_per_expert: Vec<u64>,
    load_min: u64,
    load_max: u64,
    load_cv: f64,
    /// Busiest expert's routed pairs over the mean (all ranks).
    load_max_over_mean: f64,
    kept_fraction: f64,
    peak_rank_pairs: u64,
    buffer_bytes: u64,
    replicas: usize,
    times: layer::StageTimes,
}

#[derive(Debug, Serialize)]
struct StepMetrics {
    step: usize,
    loss: f64,
    lr: f64,
    grad_norm: f64,
    wall_s: f64,
    moe_s: f64,
    tokens_per_s: f64,
    /// This rank's auxiliary balancing loss, summed over layers (present
    /// when `moe.aux_loss_coeff` is set; `loss` and `val_loss` are the
    /// language model's alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    aux_loss: Option<f64>,
    /// Micro-batches this step ran in (`moe.fit_budget`).
    micro_batches: usize,
    /// The most bytes of expert instances any rank held in this step's
    /// layer calls ([`expert_bytes_per_rank`]).
    expert_bytes: u64,
    /// The most bytes one rank held for expert instances (as
    /// `expert_bytes`) and its largest backward buffer of the step
    /// together ([`rank_peak_bytes`]).
    rank_peak_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    val_loss: Option<f64>,
    /// The device-resident model's step split, device milliseconds: dense
    /// forward, MoE forward, dense backward, MoE backward, optimizer.
    #[serde(skip_serializing_if = "Option::is_none")]
    device_ms: Option<[f64; 5]>,
    /// The device-resident model's device memory in use after the step
    /// (the pool's peak reservation plus the context), bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    device_mem_bytes: Option<u64>,
    /// In-process ranks on one GPU: the step on `moe.ranks` GPUs of the
    /// `[cluster]` (`crate::simulate`; rank 0 writes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    simulated: Option<crate::simulate::Simulated>,
    layers: Vec<LayerMetrics>,
}

fn layer_metrics(
    li: usize,
    plan: &layer::CallPlan,
    stats: &layer::BackwardStats,
    kept_all: u64,
    routed_all: u64,
) -> LayerMetrics {
    let n_e = plan.placement.owner.len();
    let per_expert: Vec<u64> = (0..n_e)
        .map(|e| plan.routed.iter().map(|r| r[e]).sum())
        .collect();
    let mean = per_expert.iter().sum::<u64>() as f64 / n_e.max(1) as f64;
    let var = per_expert
        .iter()
        .map(|&c| (c as f64 - mean).powi(2))
        .sum::<f64>()
        / n_e.max(1) as f64;
    LayerMetrics {
        layer: li,
        load_min: per_expert.iter().copied().min().unwrap_or(0),
        load_max: per_expert.iter().copied().max().unwrap_or(0),
        load_cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
        load_max_over_mean: if mean > 0.0 {
            per_expert.iter().copied().max().unwrap_or(0) as f64 / mean
        } else {
            1.0
        },
        tokens_per_expert: per_expert,
        kept_fraction: if routed_all > 0 {
            kept_all as f64 / routed_all as f64
        } else {
            1.0
        },
        peak_rank_pairs: stats.pairs_per_rank.iter().copied().max().unwrap_or(0),
        buffer_bytes: stats.buffer_bytes,
        replicas: plan.placement.replicas.iter().map(Vec::len).sum(),
        times: stats.times,
    }
}

/// Mean of `x` over ranks.
fn mean_over_ranks<X: Transport>(comm: &X, x: f64) -> Result<f64, TrainError> {
    let all = all_gather(comm, &[x])?;
    Ok(all.iter().map(|v| v[0]).sum::<f64>() / all.len() as f64)
}

/// The run folder and the state training starts from: the folder checked
/// (and made), the checkpoint resumed or a fresh model, the room for the
/// checkpoint checked, and — on the rank that writes — `metrics.jsonl`
/// opened (cut back to the checkpoint's step on a resume, the run's kept
/// fractions read back from it).
fn open_run(
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
fn fresh_state(cfg: &TrainConfig, mcfg: &ModelConfig) -> State {
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

/// The MoE layers' call configuration of this run, in the units its
/// executor plans with (bf16 device rows for the device executor and the
/// device-resident model, f32 host rows otherwise). On a GPU: one rank, or
/// launched ranks with `moe.executor = "device"` (one GPU each), train the
/// whole model on the GPUs (`device_model`, its MoE layers through the
/// device executor); other multi-rank runs (threads sharing GPU 0, or
/// launched processes on the host executor) keep the dense parts on the
/// CPU and run the host layer's expert GEMMs as bf16 grouped kernels on
/// their GPU.
fn run_call_config(
    cfg: &TrainConfig,
    opts: &RunOptions,
    mcfg: &ModelConfig,
    placement: &Placement,
    whole_gpu: bool,
) -> CallConfig {
    let device_rows = device_rows(cfg, whole_gpu);
    let call = call_config(cfg, mcfg, placement, device_rows);
    if cfg.moe.fit_budget || cfg.moe.mode == Mode::Lrmoe {
        // The per-rank budget in the units the executor plans with, for
        // `lrmoe replay --budget-mib` on this run's metrics.jsonl.
        let shape = (mcfg.d_model, mcfg.ffn);
        let pairs = pairs_per_rank(cfg, mcfg);
        let b = budgets(&cfg.moe, shape, pairs, placement, device_rows);
        tracing::info!(
            rank0_budget_bytes = b.first().map_or(0, |r| r.memory_bytes),
            element_bytes = if device_rows { 2 } else { 4 },
            "per-rank memory budget of one layer call"
        );
    }
    match &opts.gpu {
        Some(gpu) if !whole_gpu => CallConfig {
            experts: layer::ExpertBackend::Bf16(gpu.clone()),
            ..call
        },
        _ => call,
    }
}

/// The progress bar of a run of `steps` starting at `at`, shown above the
/// log lines.
fn progress_bar(steps: usize, at: usize) -> indicatif::ProgressBar {
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
struct Where {
    corpus: Corpus,
    mcfg: ModelConfig,
    /// In-process ranks with `--executor device`: one device model per rank
    /// thread, all on this one GPU (`DeviceComm::Staged` over timed
    /// in-process ranks: the multi-rank path's plan and exchanges, device
    /// to device, each rank's work timed alone for the N-GPU simulation).
    staged: bool,
    /// The whole model resident on the GPU: one rank, or launched ranks
    /// with `--executor device` (experts sharded over the ranks' GPUs,
    /// dense weights replicated); its vocabulary padded to a multiple of 8
    /// unless the configuration sets it.
    whole_gpu: bool,
}

/// Validates the configuration, loads the corpus and checks that the
/// model's sizes fit this run's device and memory.
fn where_it_runs(cfg: &TrainConfig, opts: &RunOptions) -> Result<Where, TrainError> {
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

/// Trains with `cfg`; returns rank 0's summary (every launched rank gets
/// the same figures).
pub fn train(cfg: &TrainConfig, opts: &RunOptions) -> Result<TrainSummary, TrainError> {
    let Where {
        corpus,
        mcfg,
        staged,
        whole_gpu,
    } = where_it_runs(cfg, opts)?;
    let ranks = cfg.moe.ranks;
    if let Some(t) = &opts.transport {
        if t.world_size() != ranks {
            return Err(TrainError::Config(format!(
                "moe.ranks = {ranks} but the launched group has {} ranks",
                t.world_size()
            )));
        }
    }
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
    if cfg.moe.keep_projections && !(whole_gpu && ranks == 1) {
        tracing::warn!(
            "moe.keep_projections has no effect here: it applies to the device model on one rank (--device cuda, moe.ranks = 1)"
        );
    }
    let run = MoeRun {
        placement: &placement,
        backward: &call,
        expert_bias: &[],
        replica_load: &[],
    };
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
fn run_ranks(
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
            let comm_d = layer::device::DeviceComm::Staged(comm);
            let own = new_device_model(opts, comm_d, lp.mcfg, initial, call, lp.corpus)?;
            if let Some(gpu) = opts.gpu.clone() {
                comm.on_pause(Box::new(move || gpu.sync().map_err(|e| e.to_string())));
            }
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
struct StepGrads {
    loss: f64,
    aux_loss: f64,
    moe_seconds: f64,
    /// The first micro-batch's activations (its plans feed the metrics).
    cache: model::Cache<f32>,
    /// The accumulated gradients; `moe_stats` are the first micro-batch's.
    grads: model::Gradients<f32>,
    /// Kept and routed pairs per layer, summed over micro-batches.
    kept_routed: Vec<u64>,
    /// The most pairs this rank processed in one layer call.
    busiest: u64,
    /// Routed pairs per expert and layer over every rank, summed over the
    /// micro-batches.
    expert_load: Vec<Vec<u64>>,
}

/// The device model of one rank (`comm`), from the run's first state.
fn new_device_model<'c>(
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
fn lock<'m, 'a>(
    m: &'m std::sync::Mutex<DeviceModel<'a>>,
) -> std::sync::MutexGuard<'m, DeviceModel<'a>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One optimizer step's figures, from the host model or the device one.
struct StepOut {
    loss: f64,
    aux_loss: f64,
    moe_seconds: f64,
    grad_norm: f64,
    plans: Vec<layer::CallPlan>,
    stats: Vec<layer::BackwardStats>,
    kept_routed: Vec<u64>,
    busiest: u64,
    expert_load: Vec<Vec<u64>>,
    device_ms: Option<[f64; 5]>,
    device_mem_bytes: Option<u64>,
}

/// Kept and routed pairs per layer, the most pairs rank `me` processed in
/// one layer call, and the routed pairs per expert and layer, summed over
/// a step's micro-batches.
struct Tally(Vec<u64>, u64, Vec<Vec<u64>>);

impl Tally {
    fn new(mcfg: &ModelConfig) -> Self {
        Self(
            vec![0; 2 * mcfg.n_layers],
            0,
            vec![vec![0; mcfg.n_experts]; mcfg.n_layers],
        )
    }

    /// Adds one micro-batch's per-layer backward figures.
    fn add(&mut self, mcfg: &ModelConfig, stats: &[layer::BackwardStats], me: usize, ranks: usize) {
        debug_assert_eq!(self.2.len(), mcfg.n_layers);
        for (li, st) in stats.iter().enumerate() {
            for (a, &b) in self.2[li].iter_mut().zip(&st.expert_load) {
                *a += b;
            }
            self.0[2 * li] += st.kept_pairs as u64;
            self.0[2 * li + 1] += st.routed_pairs as u64;
            let mine = if st.pairs_per_rank.len() == ranks {
                st.pairs_per_rank[me]
            } else {
                st.pairs_per_rank.first().copied().unwrap_or(0)
            };
            self.1 = self.1.max(mine);
        }
    }
}

/// `run` with the layers' balancing bias and last loads (the SYMI-like
/// replicas' input; empty unless that mode runs).
fn biased<'a>(run: &MoeRun<'a>, s: &'a State) -> MoeRun<'a> {
    MoeRun {
        expert_bias: &s.expert_bias,
        replica_load: &s.last_load,
        ..run.clone()
    }
}

/// DeepSeek-V3's bias update: `b[e] += rate · sign(mean − load[e])` per
/// layer (no change where a layer saw no pairs).
fn update_expert_bias(bias: &mut [Vec<f64>], load: &[Vec<u64>], rate: f64) {
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

fn step_grads<X: Transport>(
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
    let mut first: Option<(model::Cache<f32>, model::Gradients<f32>)> = None;
    let mut tally = Tally::new(mcfg);
    for i in 0..micro {
        let r = i * chunk..(i + 1) * chunk;
        let (l, cache) =
            model::forward(comm, mcfg, model, run, &tokens[r.clone()], &targets[r], seq)?;
        let g = model::backward(comm, mcfg, model, run, &cache, seq)?;
        loss += l / micro as f64;
        aux_loss += cache.aux_loss / micro as f64;
        moe_seconds += cache.moe_seconds + g.moe_seconds;
        tally.add(mcfg, &g.moe_stats, me, ranks);
        match &mut first {
            None => first = Some((cache, g)),
            Some((_, acc)) => {
                for ((_, a), (_, b)) in acc.grads.tensors_mut().into_iter().zip(g.grads.tensors()) {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += *y);
                }
            }
        }
    }
    let Some((cache, mut grads)) = first else {
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
        cache,
        grads,
        kept_routed: tally.0,
        busiest: tally.1,
        expert_load: tally.2,
    })
}

#[allow(clippy::too_many_arguments)]
/// What every step of one rank's loop reads: the run's settings, its data
/// and where it writes (rank 0 only: `metrics`, `bar`).
struct Loop<'a> {
    cfg: &'a TrainConfig,
    mcfg: &'a ModelConfig,
    corpus: &'a Corpus,
    run: &'a MoeRun<'a>,
    metrics: Option<&'a std::sync::Mutex<File>>,
    bar: Option<&'a indicatif::ProgressBar>,
    ckpt: &'a Path,
    stop: &'a crate::stop::StopFlag,
}

/// Figures every rank agrees on after a step (one all-gather): the mean
/// loss, the slowest rank's step time, whether any rank saw a signal.
struct Agreed {
    loss: f64,
    step_s: f64,
    any_signal: bool,
}

/// One rank's training: steps until the collective stop — data, forward,
/// backward, optimizer ([`train_step`]), the agreed figures, the balancing
/// bias, the next step's micro-batches, evaluation, metrics and checkpoint
/// — then the final evaluation and checkpoint ([`finish`]).
fn rank_loop<X: Transport>(
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
        let simulated = simulated_step(comm, &cfg.cluster, s.step)?;
        account(cfg, &mut s, &out, agreed.step_s, simulated.as_ref());
        let step_micro = micro;
        let (layers, next, buffers) = gather_layers(comm, lp, &out, micro)?;
        let instances = expert_bytes_per_rank(lp, &out.plans, device_model.is_some());
        micro = next;
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
            rank_peak_bytes: rank_peak_bytes(&instances, &buffers),
            val_loss,
            device_ms: out.device_ms,
            device_mem_bytes: out.device_mem_bytes,
            simulated,
            layers,
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
fn expert_bytes_per_rank(lp: &Loop<'_>, plans: &[layer::CallPlan], whole_gpu: bool) -> Vec<u64> {
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
/// backward buffer of the step (both per rank, in rank order).
fn rank_peak_bytes(instances: &[u64], buffers: &[u64]) -> u64 {
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
fn rank_state(lp: &Loop<'_>, initial: &State, on_device: bool) -> State {
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
fn account(
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
fn reached_now(cfg: &TrainConfig, s: &State) -> Option<EvalPoint> {
    s.evals
        .last()
        .filter(|p| p.step == s.step && cfg.run.target_val_loss.is_some_and(|t| p.val_loss <= t))
        .copied()
}

/// Rank 0 of timed in-process ranks: step `step` on as many GPUs of
/// `cluster` (every rank closed it before the collective that follows
/// its `close_step`); `None` elsewhere.
fn simulated_step<X: Transport>(
    comm: &X,
    cluster: &cluster::Cluster,
    step: usize,
) -> Result<Option<crate::simulate::Simulated>, TrainError> {
    if comm.rank() != 0 {
        return Ok(None);
    }
    comm.take_step(step)
        .map(|t| crate::simulate::simulate(&t, cluster))
        .transpose()
        .map_err(|e| TrainError::Config(format!("step {step}: {e}")))
}

/// Micro-batches of the first step: with `moe.fit_budget` in full and
/// replicate modes, the worst case (every rank's pairs on one), else one.
fn first_micro_batches(cfg: &TrainConfig, ranks: usize) -> usize {
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

/// Whether steps split into micro-batches to fit the budget.
fn splits_steps(cfg: &TrainConfig) -> bool {
    cfg.moe.fit_budget && matches!(cfg.moe.mode, Mode::Full | Mode::Replicate | Mode::Symi)
}

/// The smallest divisor of a rank's sequences that is at least `need`, so
/// every micro-batch is the same size.
fn micro_divisor(cfg: &TrainConfig, ranks: usize, need: usize) -> usize {
    let per_rank = cfg.data.batch_size / ranks;
    (need.max(1)..=per_rank)
        .find(|m| per_rank % m == 0)
        .unwrap_or(per_rank)
}

/// Data, forward, backward and optimizer of one step on this rank: on the
/// device model (only the windows' starts go down; scalars and counts come
/// back) or on the host model.
fn train_step<X: Transport>(
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
        let Tally(kept_routed, busiest, expert_load) = t;
        return Ok(StepOut {
            loss: st.loss,
            aux_loss: st.aux_loss,
            moe_seconds: st.moe_seconds,
            grad_norm: st.grad_norm,
            plans: st.plans,
            stats: st.stats.into_iter().next().unwrap_or_default(),
            kept_routed,
            busiest,
            expert_load,
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
        plans: sg.cache.moe_plans().cloned().collect(),
        stats: sg.grads.moe_stats,
        kept_routed: sg.kept_routed,
        busiest: sg.busiest,
        expert_load: sg.expert_load,
        device_ms: None,
        device_mem_bytes: None,
    })
}

/// One gather carries the loss, this rank's step time and whether it saw a
/// signal; the step's wall time is the slowest rank's.
fn agree<X: Transport>(
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

/// The step's per-layer metrics (kept fractions over all ranks), the
/// next step's micro-batches (with `moe.fit_budget`: the busiest rank's
/// pairs of a whole step over the budget's rows) and each rank's largest
/// backward buffer of the step, in rank order.
fn gather_layers<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    out: &StepOut,
    micro: usize,
) -> Result<(Vec<LayerMetrics>, usize, Vec<u64>), TrainError> {
    let (cfg, n_layers) = (lp.cfg, lp.mcfg.n_layers);
    let mut kept = out.kept_routed.clone();
    kept.push(out.busiest);
    kept.push(
        out.stats
            .iter()
            .map(|st| st.buffer_bytes)
            .max()
            .unwrap_or(0),
    );
    let totals = all_gather(comm, &kept)?;
    let buffers = totals.iter().map(|t| t[2 * n_layers + 1]).collect();
    let next = if splits_steps(cfg) {
        let ranks = comm.world_size();
        let per_rank = cfg.data.batch_size / ranks;
        let peak = totals.iter().map(|t| t[2 * n_layers]).max().unwrap_or(0);
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
    Ok((layers, next, buffers))
}

/// The validation loss on evaluation steps (every `run.eval_every` steps
/// and the last), added to the run's curve.
fn evaluate_due<X: Transport>(
    comm: &X,
    lp: &Loop<'_>,
    s: &mut State,
    train_loss: f64,
    device_model: Option<&std::sync::Mutex<DeviceModel<'_>>>,
) -> Result<Option<f64>, TrainError> {
    let cfg = lp.cfg;
    if s.step % cfg.run.eval_every != 0 && s.step != cfg.steps {
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
fn evaluate_now<X: Transport>(
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
fn log_and_checkpoint<X: Transport>(
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
fn finish<X: Transport>(
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
        stop_reason: reason,
    }))
}

/// Mean validation loss over the fixed evaluation batches.
fn evaluate<X: Transport>(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_s_peak_adds_its_own_instances_and_buffer() {
        // Rank 0 holds the most instances, rank 1 the largest buffer: the
        // peak is one rank's sum, not the sum of the two maxima.
        assert_eq!(rank_peak_bytes(&[10, 5], &[1, 20]), 25);
        assert_eq!(rank_peak_bytes(&[10, 5], &[]), 10);
        assert_eq!(rank_peak_bytes(&[], &[]), 0);
    }

    /// `moe.keep_projections` reaches every mode's call settings (the
    /// device executor reads it there), off unless asked for.
    #[test]
    fn keep_projections_reaches_the_call_in_every_mode() {
        let place = Placement {
            owner: vec![0; 4],
            replicas: vec![],
        };
        for mode in ["full", "lrmoe", "capacity"] {
            for keep in [false, true] {
                let json = format!(r#"{{"mode": "{mode}", "keep_projections": {keep}}}"#);
                let moe = moe_section_from_json(&json, 4).unwrap();
                let call = layer_call_config(&moe, (16, 8), 32.0, &place, true, 0);
                assert_eq!(call.keep_projections, keep, "{mode}");
            }
        }
        let moe = moe_section_from_json("{}", 4).unwrap();
        assert!(!layer_call_config(&moe, (16, 8), 32.0, &place, true, 0).keep_projections);
    }

    #[test]
    fn configured_ranks_are_kept_defaults_adapt() {
        let from = Some("the configuration's moe.ranks");
        // --device cuda: the default becomes one rank, a setting stays.
        assert_eq!(resolve_ranks(2, None, None, true).unwrap(), 1);
        assert_eq!(resolve_ranks(8, from, None, true).unwrap(), 8);
        assert_eq!(resolve_ranks(8, from, None, false).unwrap(), 8);
        assert_eq!(resolve_ranks(2, None, None, false).unwrap(), 2);
        // Launched: the default follows WORLD_SIZE; a setting must agree.
        assert_eq!(resolve_ranks(2, None, Some(4), false).unwrap(), 4);
        assert_eq!(resolve_ranks(4, from, Some(4), true).unwrap(), 4);
        let e = resolve_ranks(8, from, Some(2), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the configuration's moe.ranks = 8 disagrees with WORLD_SIZE = 2"),
            "{e}"
        );
    }

    #[test]
    fn a_checkpoint_that_cannot_fit_is_refused_with_the_way_out() {
        let dir = std::env::temp_dir();
        check_checkpoint_room(&dir, 1024).unwrap();
        let e = check_checkpoint_room(&dir, u64::MAX / 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GiB free") && e.contains("--no-checkpoint") && e.contains("--out"),
            "{e}"
        );
        // A folder yet to be made is measured on its nearest ancestor.
        assert!(free_bytes(&dir.join("not/yet/made")).is_some_and(|b| b > 0));
    }

    /// Micro-batches accumulate the whole batch's gradient (the exact
    /// backward, two in-process ranks): the same gradients within f32
    /// summation noise, the same loss.
    #[test]
    fn micro_batches_accumulate_the_whole_batch_gradient() {
        let mcfg = ModelConfig {
            vocab: 11,
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            ffn: 16,
            n_experts: 4,
            top_k: 2,
            renormalize: true,
            max_seq: 8,
            ..ModelConfig::small(11)
        };
        let model = Model::<f32>::init(&mcfg, 7);
        let placement = Placement {
            owner: vec![0, 0, 1, 1],
            replicas: vec![],
        };
        let call = CallConfig::default();
        let run = MoeRun {
            placement: &placement,
            backward: &call,
            expert_bias: &[],
            replica_load: &[],
        };
        let seq = 8;
        let tokens: Vec<u32> = (0..4 * seq as u32).map(|i| (i * 7 + 3) % 11).collect();
        let targets: Vec<u32> = (0..4 * seq as u32).map(|i| (i * 5 + 1) % 11).collect();
        let go = |micro: usize| {
            layer::run_local(2, std::time::Duration::from_secs(60), |t| {
                let me = t.rank();
                let r = me * 2 * seq..(me + 1) * 2 * seq;
                step_grads(
                    t,
                    &mcfg,
                    &model,
                    &run,
                    (&tokens[r.clone()], &targets[r]),
                    seq,
                    micro,
                )
                .map(|g| (g.loss, g.grads.grads))
            })
        };
        let (one, two) = (go(1), go(2));
        for (a, b) in one.into_iter().zip(two) {
            let ((la, ga), (lb, gb)) = (a.unwrap(), b.unwrap());
            assert!((la - lb).abs() <= 1e-5 * la.abs(), "loss {la} vs {lb}");
            for ((name, x), (_, y)) in ga.tensors().into_iter().zip(gb.tensors()) {
                let n: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                let d: f64 = x
                    .iter()
                    .zip(y)
                    .map(|(&p, &q)| f64::from(p - q).powi(2))
                    .sum::<f64>()
                    .sqrt();
                assert!(d <= 1e-4 * n.max(1e-12), "{name}: {d} vs norm {n}");
            }
        }
        // Three micro-batches do not split two sequences.
        let bad = layer::run_local(1, std::time::Duration::from_secs(60), |t| {
            step_grads(
                t,
                &mcfg,
                &model,
                &run,
                (&tokens[..2 * seq], &targets[..2 * seq]),
                seq,
                3,
            )
            .map(|_| ())
        });
        assert!(bad[0].is_err());
    }
}
