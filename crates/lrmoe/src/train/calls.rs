//! From the run's configuration to each MoE layer call's settings: the
//! executor's cost model, the per-rank budgets, `CallConfig`.

use layer::{CallConfig, Retention};
use quota::{Placement, RankBudget};

use crate::model::ModelConfig;

use super::config::{Executor, Mode, MoeSection, TrainConfig};
use super::RunOptions;

/// The cost model in the units the executor plans with: f32 rows on the
/// host executor, bf16 rows on the device executor (launched ranks with
/// `executor = "device"`, in-process device ranks, or the device-resident
/// model), so `buffer_fraction` means the same share of pairs on both.
pub(super) fn executor_cost((d_model, ffn): (usize, usize), device_rows: bool) -> quota::CostModel {
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
pub(super) fn device_rows(cfg: &TrainConfig, whole_gpu: bool) -> bool {
    whole_gpu || cfg.moe.executor == Executor::Device
}

/// The rows a rank's token buffer holds: `moe.buffer_fraction` of the
/// average routed pairs per rank, rounded up.
fn budget_rows(moe: &MoeSection, pairs_per_rank: f64) -> u64 {
    (moe.buffer_fraction * pairs_per_rank).ceil() as u64
}

/// Byte and memory model the controller plans with: each rank holds its
/// owned experts, `moe.replica_slots_per_rank` replicas and a token buffer
/// of `moe.buffer_fraction` of the average routed pairs per rank.
pub(super) fn budgets(
    moe: &MoeSection,
    (d_model, ffn): (usize, usize),
    pairs_per_rank: f64,
    placement: &Placement,
    device_rows: bool,
) -> Vec<RankBudget> {
    let cost = executor_cost((d_model, ffn), device_rows);
    let (instance, row) = (cost.instance_bytes(), cost.row_bytes());
    let buffer = budget_rows(moe, pairs_per_rank) * row;
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

pub(super) fn call_config(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    placement: &Placement,
    device_rows: bool,
) -> CallConfig {
    let shape = (mcfg.d_model, mcfg.ffn);
    let pairs = pairs_per_rank(cfg, mcfg);
    CallConfig {
        // Replica traffic is timed at the slowest `[cluster]` link the
        // ranks span (between nodes once `moe.ranks` exceeds a node).
        link_bytes_per_s: cfg.cluster.slowest_link_bytes_per_s(cfg.moe.ranks),
        ..layer_call_config(&cfg.moe, shape, pairs, placement, device_rows, cfg.seed)
    }
}

/// The average routed pairs per rank of one layer call.
pub(super) fn pairs_per_rank(cfg: &TrainConfig, mcfg: &ModelConfig) -> f64 {
    (cfg.data.batch_size / cfg.moe.ranks * cfg.data.seq_len * mcfg.top_k) as f64
}

/// Whether the backward reads the forward's projections instead of
/// recomputing them: as asked, else in `full` mode only (the exact
/// backward reads every pair's; a planned one recomputes its kept rows).
pub(super) fn keeps_projections(moe: &MoeSection) -> bool {
    moe.keep_projections.unwrap_or(moe.mode == Mode::Full)
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
        keep_projections: keeps_projections(moe),
        ..CallConfig::default()
    };
    let rule = moe.mode.rule(&moe.selection_rule).unwrap_or_default();
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
            replica_rule: quota::ReplicaRule::Fill,
            ..base
        },
        Mode::Symi => CallConfig {
            replica_slots_per_rank: moe.replica_slots_per_rank,
            replica_memory_fraction: 1.0,
            solver: redistribute::Solver::Even,
            ..base
        },
        Mode::Lrmoe | Mode::LrmoeTopQ => CallConfig {
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
            replica_rule: moe.replica_rule,
            // The budgets below hold the slots' instances; an empty slot
            // does not widen the buffer beyond `buffer_fraction`.
            slots_reserved: true,
            // A budget that holds the forward's rows (each as a kept pair's
            // bytes, as the split rule counts them): the replicas try to
            // bring every rank's forward within the buffer's rows, so the
            // step need not split.
            forward_rows_cap: (moe.fit_budget && moe.budget_forward)
                .then(|| budget_rows(moe, pairs_per_rank)),
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

/// The MoE layers' call configuration of this run, in the units its
/// executor plans with (bf16 device rows for the device executor and the
/// device-resident model, f32 host rows otherwise). On a GPU: one rank, or
/// launched ranks with `moe.executor = "device"` (one GPU each), train the
/// whole model on the GPUs (`device_model`, its MoE layers through the
/// device executor); other multi-rank runs (threads sharing GPU 0, or
/// launched processes on the host executor) keep the dense parts on the
/// CPU and run the host layer's expert GEMMs as bf16 grouped kernels on
/// their GPU.
pub(super) fn run_call_config(
    cfg: &TrainConfig,
    opts: &RunOptions,
    mcfg: &ModelConfig,
    placement: &Placement,
    whole_gpu: bool,
) -> CallConfig {
    let device_rows = device_rows(cfg, whole_gpu);
    let call = call_config(cfg, mcfg, placement, device_rows);
    if cfg.moe.keep_projections == Some(true) && !(whole_gpu && cfg.moe.ranks == 1) {
        tracing::warn!(
            "moe.keep_projections has no effect here: it applies to the device model on one rank (--device cuda, moe.ranks = 1)"
        );
    }
    if cfg.moe.fit_budget || cfg.moe.mode.is_lrmoe() {
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
