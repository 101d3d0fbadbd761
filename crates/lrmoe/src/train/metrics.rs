//! One step's figures for `metrics.jsonl`: per layer and per step.

use layer::transport::all_gather;
use layer::Transport;
use serde::Serialize;

use super::TrainError;

/// Per-step, per-layer figures written to `metrics.jsonl`.
#[derive(Debug, Serialize)]
pub(super) struct LayerMetrics {
    pub(super) layer: usize,
    pub(super) tokens_per_expert: Vec<u64>,
    pub(super) load_min: u64,
    pub(super) load_max: u64,
    pub(super) load_cv: f64,
    /// Busiest expert's routed pairs over the mean (all ranks).
    pub(super) load_max_over_mean: f64,
    pub(super) kept_fraction: f64,
    pub(super) peak_rank_pairs: u64,
    /// This rank's backward buffer of the call (`BackwardStats::buffer_bytes`).
    pub(super) buffer_bytes: u64,
    /// This rank's forward token buffers of the call
    /// (`BackwardStats::forward_buffer_bytes`).
    pub(super) forward_buffer_bytes: u64,
    pub(super) replicas: usize,
    pub(super) times: layer::StageTimes,
}

#[derive(Debug, Serialize)]
pub(super) struct StepMetrics {
    pub(super) step: usize,
    pub(super) loss: f64,
    pub(super) lr: f64,
    pub(super) grad_norm: f64,
    pub(super) wall_s: f64,
    pub(super) moe_s: f64,
    pub(super) tokens_per_s: f64,
    /// This rank's auxiliary balancing loss, summed over layers (present
    /// when `moe.aux_loss_coeff` is set; `loss` and `val_loss` are the
    /// language model's alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) aux_loss: Option<f64>,
    /// Micro-batches this step ran in (`moe.fit_budget`).
    pub(super) micro_batches: usize,
    /// The most bytes of expert instances any rank held in this step's
    /// layer calls ([`expert_bytes_per_rank`]).
    pub(super) expert_bytes: u64,
    /// The most bytes one rank held for expert instances (as
    /// `expert_bytes`) and its largest token buffer of the step together
    /// ([`rank_peak_bytes`]): a layer call's buffer is the larger of its
    /// forward's and its backward's (`train::run::Tally::add`).
    pub(super) rank_peak_bytes: u64,
    /// The same were the step one micro-batch: each rank's buffers summed
    /// over its micro-batches per layer (`train::run::Tally::unsplit_buffer`),
    /// what the step needs without gradient accumulation. Equal to
    /// `rank_peak_bytes` for a step of one micro-batch.
    pub(super) unsplit_peak_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) val_loss: Option<f64>,
    /// The device-resident model's step split, device milliseconds: dense
    /// forward, MoE forward, dense backward, MoE backward, optimizer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) device_ms: Option<[f64; 5]>,
    /// The device-resident model's device memory in use after the step
    /// (the pool's peak reservation plus the context), bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) device_mem_bytes: Option<u64>,
    /// In-process ranks on one GPU: the step on `moe.ranks` GPUs of the
    /// `[cluster]` (`crate::simulate`; rank 0 writes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) simulated: Option<crate::simulate::Simulated>,
    pub(super) layers: Vec<LayerMetrics>,
}

pub(super) fn layer_metrics(
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
        forward_buffer_bytes: stats.forward_buffer_bytes,
        replicas: plan.placement.replicas.iter().map(Vec::len).sum(),
        times: stats.times,
    }
}

/// Mean of `x` over ranks.
pub(super) fn mean_over_ranks<X: Transport>(comm: &X, x: f64) -> Result<f64, TrainError> {
    let all = all_gather(comm, &[x])?;
    Ok(all.iter().map(|v| v[0]).sum::<f64>() / all.len() as f64)
}
