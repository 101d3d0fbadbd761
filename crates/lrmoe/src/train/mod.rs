//! `lrmoe train`: the MoE language model trained on the CPU with the LRMoE
//! backward, expert parallel over in-process ranks.
//!
//! Every rank (a thread) holds the full dense model and the same optimizer
//! state; each step it takes its shard of a global batch, runs the model
//! (MoE layers exchanging tokens with the other ranks), and applies the
//! all-reduced gradients. Rank 0 evaluates, logs, and writes metrics and
//! checkpoints.
//!
//! The files, each using only those above it and this one's errors and
//! public types: `config` (the TOML sections, defaults, validation),
//! `calls` (each MoE layer call's settings from the run's), `metrics` (a
//! step's figures), `state` (what a rank carries between steps), `files`
//! (the checkpoint, the run folder, `metrics.jsonl`), `memory` (whether the
//! run fits), and `run` (where it runs, the ranks' loop, the summary).

use std::path::Path;

use layer::Transport;
use serde::{Deserialize, Serialize};

use crate::model;
use crate::tensorfile::TensorFileError;

mod calls;
mod config;
mod files;
mod memory;
mod metrics;
mod run;
mod state;

pub use calls::*;
pub use config::*;
pub use files::check_checkpoint;
pub use memory::memory_estimate;
pub use run::*;

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

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |error| TrainError::Io {
        path: path.display().to_string(),
        error,
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
    /// token buffers together in one step (`rank_peak_bytes` in
    /// `metrics.jsonl`); 0 in summaries written before it was recorded.
    #[serde(default)]
    pub max_rank_peak_bytes: u64,
    /// The same were every step one micro-batch (`unsplit_peak_bytes` in
    /// `metrics.jsonl`): what the run's steps need without gradient
    /// accumulation, modelled by summing each rank's micro-batches' buffer
    /// peaks per layer. Equal to `max_rank_peak_bytes` in a run that never
    /// split a step; 0 in summaries written before it was recorded.
    #[serde(default)]
    pub max_unsplit_peak_bytes: u64,
    /// Timed in-process ranks on a GPU: the most device memory one rank
    /// held at once, measured from the pool (`simulated.held_bytes` in
    /// `metrics.jsonl`: all of that rank's buffers, the dense model's and
    /// the optimizer's too); 0 elsewhere.
    #[serde(default)]
    pub max_held_bytes: u64,
    /// Timed in-process ranks: the mean over the steps of the host probe
    /// (`crate::simulate::host_probe`, milliseconds), the host's speed while
    /// this run trained; `None` elsewhere and in summaries written before
    /// it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_probe_ms: Option<f64>,
    /// Replicas the controller placed per MoE-layer call, on average
    /// (`layers[].replicas` in `metrics.jsonl`); 0 in summaries written
    /// before it was recorded.
    #[serde(default)]
    pub mean_replicas_per_call: f64,
    /// Whether the token buffers in `max_rank_peak_bytes` and
    /// `max_unsplit_peak_bytes` count the forward's rows beside the
    /// backward's buffers (a layer call's buffer is the larger of the two:
    /// `train::run::Tally::add`); `false` in summaries written before they
    /// did (2026-12-05), whose buffers are the backward's alone.
    #[serde(default)]
    pub forward_buffers_counted: bool,
    /// One layer call's forward token buffer on a rank were the step's
    /// routed rows spread evenly over the ranks, one micro-batch
    /// (`train::run::even_forward_bytes`): the least buffer a run that computes
    /// every pair unsplit can hold, beside its expert instances. 0 in
    /// summaries written before it was recorded (2026-12-05, session 53).
    #[serde(default)]
    pub even_forward_bytes: u64,
    /// What the memory budget held (`moe.fit_budget`, `moe.budget_forward`).
    #[serde(default)]
    pub budget_held: BudgetHeld,
    /// Why the run ended.
    pub stop_reason: crate::stop::StopReason,
}

/// What a run's memory budget held: with `moe.fit_budget` the modes fit
/// it (micro-batches, quotas), and with `moe.budget_forward` the forward's
/// rows count against it beside the backward's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetHeld {
    /// Not recorded: summaries written before 2026-12-05. Their
    /// comparisons that fit a budget held the backward's buffers alone.
    #[default]
    Unrecorded,
    /// No budget (`moe.fit_budget` off).
    Nothing,
    /// The backward's buffers alone (`moe.budget_forward = false`).
    Backward,
    /// The forward's rows and the backward's buffers.
    ForwardAndBackward,
}

impl BudgetHeld {
    /// What `cfg`'s budget holds.
    pub fn of(cfg: &TrainConfig) -> Self {
        match (cfg.moe.fit_budget, cfg.moe.budget_forward) {
            (false, _) => Self::Nothing,
            (true, false) => Self::Backward,
            (true, true) => Self::ForwardAndBackward,
        }
    }
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

#[cfg(test)]
mod tests;
