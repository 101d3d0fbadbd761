//! `lrmoe replay`: memory and modelled backward time of fixed expert
//! ownership, replication and LRMoE on routing traces, before a user changes
//! any training code.
//!
//! A trace is routed pair counts `[step][layer][source rank][expert]`
//! ([`Trace`]), read from deepseek-ai/EPLB load matrices, Megatron-Core router
//! traces, `lrmoe train`'s `metrics.jsonl`, or a seeded synthetic generator.
//! Every (step, layer) is replayed with three strategies on the same ranks
//! and per-rank budget (memory for one layer call: its experts, replicas and
//! backward token buffers — `quota`'s model):
//!
//! * **fixed** — each expert on its owner rank, every pair kept;
//! * **replication** — EPLB-style greedy replicas within the budget
//!   (`quota::plan_replicas`), every pair kept, pairs spread over instances
//!   by `redistribute`'s exact solver;
//! * **lrmoe** — the controller's replicas and quotas (`quota::plan`; by
//!   default only the replicas that pay for their traffic,
//!   `quota::ReplicaRule::Paying`), kept pairs redistributed within the
//!   controller's per-rank caps.
//!
//! Memory per rank = placement (owned experts' weights + gradients) +
//! replicas + token buffers (pairs processed in the backward × row bytes;
//! with [`ReplayConfig::count_forward`] the larger of that and the rows
//! computed in the forward × an activation row in and out). Modelled backward
//! time = slowest rank's compute + the all-to-all at link bandwidth (bytes
//! into or out of the busiest rank). Straggler ratio = max / mean pairs per
//! rank.

use std::io::BufRead;
use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use quota::{CostModel, Placement, Policy, RankBudget};

/// Errors of the replay, naming the file and line where one is at fault.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A file cannot be read.
    #[error("cannot read {path}: {error}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// A file or folder cannot be written.
    #[error("cannot write {path}: {error}")]
    Write {
        /// The path.
        path: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// A line or document is malformed.
    #[error("{path}:{line}: {message}")]
    Parse {
        /// The path.
        path: String,
        /// 1-based line (1 for whole-document formats).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The trace or the configuration is inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// The controller rejected a cell.
    #[error("step {step}, layer {layer}: {error}")]
    Quota {
        /// Step.
        step: usize,
        /// Layer.
        layer: usize,
        /// The controller's error.
        error: quota::QuotaError,
    },
    /// The redistribution rejected a cell.
    #[error("step {step}, layer {layer}: {error}")]
    Redistribute {
        /// Step.
        step: usize,
        /// Layer.
        layer: usize,
        /// The solver's error.
        error: redistribute::RedistributeError,
    },
}

/// Routed pairs `[step][layer][source rank][expert]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// Experts per layer.
    pub experts: usize,
    /// Ranks the pairs come from.
    pub ranks: usize,
    /// The counts.
    pub steps: Vec<Vec<Vec<Vec<u64>>>>,
}

impl Trace {
    /// Layers per step (0 for an empty trace).
    pub fn layers(&self) -> usize {
        self.steps.first().map_or(0, Vec::len)
    }
}

/// Spreads global per-expert counts evenly over `ranks` sources (the
/// formats that carry no per-rank split).
fn spread(global: &[u64], ranks: usize) -> Vec<Vec<u64>> {
    (0..ranks)
        .map(|r| {
            global
                .iter()
                .map(|&n| n / ranks as u64 + u64::from((r as u64) < n % ranks as u64))
                .collect()
        })
        .collect()
}

/// The most counts a trace may hold (`steps × layers × ranks × experts`
/// u64 values, 2 GiB), so a hostile file fails before it allocates.
pub const MAX_TRACE_CELLS: u128 = 1 << 28;

/// The most ranks a replay models (the planner's scale benchmark: 100 000
/// ranks × 128 experts in under a second per call). A trace claiming more
/// is refused before the replay's per-rank work would run for hours.
pub const MAX_TRACE_RANKS: usize = 100_000;

fn check_size(
    what: &str,
    steps: usize,
    layers: usize,
    ranks: usize,
    experts: usize,
) -> Result<(), ReplayError> {
    if ranks > MAX_TRACE_RANKS {
        return Err(ReplayError::Invalid(format!(
            "{what}: {ranks} ranks is more than a replay models ({MAX_TRACE_RANKS})"
        )));
    }
    let cells = [steps, layers, ranks, experts]
        .iter()
        .fold(1u128, |a, &n| a.saturating_mul(n as u128));
    if cells > MAX_TRACE_CELLS {
        return Err(ReplayError::Invalid(format!(
            "{what}: {steps} steps × {layers} layers × {ranks} ranks × {experts} experts is more than {MAX_TRACE_CELLS} counts"
        )));
    }
    Ok(())
}

fn read(path: &Path) -> Result<String, ReplayError> {
    std::fs::read_to_string(path).map_err(|error| ReplayError::Read {
        path: path.display().to_string(),
        error,
    })
}

fn parse_err(path: &Path, line: usize, message: impl Into<String>) -> ReplayError {
    ReplayError::Parse {
        path: path.display().to_string(),
        line,
        message: message.into(),
    }
}

/// deepseek-ai/EPLB load matrix `[layers][experts]` (a bare array, or an
/// object with `weight`): one step, loads spread over `ranks`.
pub fn load_eplb(path: &Path, ranks: usize) -> Result<Trace, ReplayError> {
    let text = read(path)?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| parse_err(path, e.line(), e.to_string()))?;
    let shape =
        "expected a [layers][experts] array of loads, or an object {\"weight\": [layers][experts]}";
    let (matrix, prefix) = match &doc {
        serde_json::Value::Array(_) => (&doc, ""),
        serde_json::Value::Object(o) => {
            match (o.get("weight"), o.keys().find(|k| *k != "weight")) {
                (Some(w), None) => (w, "weight"),
                (_, Some(k)) => {
                    return Err(parse_err(path, 1, format!("unknown field `{k}`: {shape}")))
                }
                (None, None) => {
                    return Err(parse_err(
                        path,
                        1,
                        format!("missing field `weight`: {shape}"),
                    ))
                }
            }
        }
        other => {
            return Err(parse_err(
                path,
                1,
                format!("got {}: {shape}", json_kind(other)),
            ))
        }
    };
    let m: Vec<Vec<f64>> = serde_path_to_error::deserialize(matrix).map_err(|e| {
        let at = e.path().to_string();
        let at = if at == "." {
            prefix.to_string()
        } else {
            format!("{prefix}{at}")
        };
        parse_err(path, 1, format!("{at}: {} ({shape})", e.inner()))
    })?;
    let experts = m.first().map_or(0, Vec::len);
    check_size(&path.display().to_string(), 1, m.len(), ranks, experts)?;
    let mut layers = Vec::with_capacity(m.len());
    for (l, row) in m.iter().enumerate() {
        if row.len() != experts {
            return Err(parse_err(
                path,
                1,
                format!("layer {l} has {} experts, layer 0 has {experts}", row.len()),
            ));
        }
        if let Some(bad) = row
            .iter()
            .find(|v| !v.is_finite() || **v < 0.0 || **v >= u64::MAX as f64)
        {
            return Err(parse_err(
                path,
                1,
                format!("layer {l}: load {bad} is not a finite non-negative number below 2^64"),
            ));
        }
        let global: Vec<u64> = row.iter().map(|&v| v.round() as u64).collect();
        layers.push(spread(&global, ranks));
    }
    Ok(Trace {
        experts,
        ranks,
        steps: vec![layers],
    })
}

/// What kind of JSON value `v` is, for messages.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Megatron-Core router traces: JSON lines `{"step", "layer", "rank",
/// "top_indices": [[expert; k]; tokens]}`.
pub fn load_megatron(path: &Path, experts: usize) -> Result<Trace, ReplayError> {
    let cells = megatron_cells(path, experts)?;
    megatron_trace(path, experts, cells)
}

/// Routed pairs per expert of each (step, layer, rank) cell of a Megatron
/// trace, every record checked: one top-k width throughout, experts in
/// range.
fn megatron_cells(path: &Path, experts: usize) -> Result<MegatronCells, ReplayError> {
    #[derive(Serialize, Deserialize)]
    struct Record {
        step: usize,
        layer: usize,
        rank: usize,
        top_indices: Vec<Vec<i64>>,
    }
    let file = std::fs::File::open(path).map_err(|error| ReplayError::Read {
        path: path.display().to_string(),
        error,
    })?;
    let mut cells = MegatronCells::new();
    let mut top_k: Option<(usize, usize)> = None;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|error| ReplayError::Read {
            path: path.display().to_string(),
            error,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Record =
            crate::strict::from_json(&line).map_err(|e| parse_err(path, i + 1, e.to_string()))?;
        check_top_k(&r.top_indices, &mut top_k, i + 1).map_err(|m| parse_err(path, i + 1, m))?;
        let counts = cells
            .entry((r.step, r.layer, r.rank))
            .or_insert_with(|| vec![0; experts]);
        for tok in &r.top_indices {
            for &e in tok {
                if e < 0 || e as usize >= experts {
                    return Err(parse_err(
                        path,
                        i + 1,
                        format!("expert {e} out of range (experts = {experts})"),
                    ));
                }
                counts[e as usize] += 1;
            }
        }
    }
    Ok(cells)
}

/// Routed pairs per expert, by (step, layer, rank).
type MegatronCells = std::collections::BTreeMap<(usize, usize, usize), Vec<u64>>;

/// Every row of a record routes to as many experts as the first, and as
/// the first record with rows (`top_k`: its width and line).
fn check_top_k(
    rows: &[Vec<i64>],
    top_k: &mut Option<(usize, usize)>,
    line: usize,
) -> Result<(), String> {
    if let Some((t, row)) = rows
        .iter()
        .enumerate()
        .find(|(_, row)| row.len() != rows[0].len())
    {
        return Err(format!(
            "top_indices row {t} has {} experts, row 0 has {} (every token routes to the same top-k)",
            row.len(),
            rows[0].len()
        ));
    }
    if let Some(k) = rows.first().map(Vec::len) {
        match *top_k {
            Some((k0, line0)) if k0 != k => {
                return Err(format!(
                    "top_indices rows have {k} experts, line {line0} has {k0}"
                ))
            }
            None => *top_k = Some((k, line)),
            _ => {}
        }
    }
    Ok(())
}

/// The cells as a trace: steps as the trace numbers them, which may be
/// sparse (a trace sampled every N steps), replayed in order, densely;
/// every step must have every layer.
fn megatron_trace(path: &Path, experts: usize, cells: MegatronCells) -> Result<Trace, ReplayError> {
    let step_ids: Vec<usize> = {
        let mut v: Vec<usize> = cells.keys().map(|k| k.0).collect();
        v.dedup();
        v
    };
    let layers = cells
        .keys()
        .map(|k| k.1)
        .max()
        .map_or(0, |l| l.saturating_add(1));
    let ranks = cells
        .keys()
        .map(|k| k.2)
        .max()
        .map_or(0, |r| r.saturating_add(1));
    check_size(
        &path.display().to_string(),
        step_ids.len(),
        layers,
        ranks,
        experts,
    )?;
    let mut out = vec![vec![vec![vec![0u64; experts]; ranks]; layers]; step_ids.len()];
    let mut seen = vec![vec![false; layers]; step_ids.len()];
    for ((s, l, r), c) in cells {
        let si = step_ids.partition_point(|&id| id < s);
        out[si][l][r] = c;
        seen[si][l] = true;
    }
    for (si, row) in seen.iter().enumerate() {
        let n = row.iter().filter(|&&x| x).count();
        if n != layers {
            return Err(ReplayError::Invalid(format!(
                "{}: step {} has {n} layers, the trace has {layers}",
                path.display(),
                step_ids[si]
            )));
        }
    }
    Ok(Trace {
        experts,
        ranks,
        steps: out,
    })
}

/// `lrmoe train`'s `metrics.jsonl` (`layers[].tokens_per_expert`), spread over `ranks`.
pub fn load_lrmoe_metrics(path: &Path, ranks: usize) -> Result<Trace, ReplayError> {
    #[derive(Serialize, Deserialize)]
    struct Layer {
        tokens_per_expert: Vec<u64>,
    }
    #[derive(Serialize, Deserialize)]
    struct Step {
        layers: Vec<Layer>,
    }
    let text = read(path)?;
    let mut steps = Vec::new();
    let mut experts = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let s: Step =
            crate::strict::from_json(line).map_err(|e| parse_err(path, i + 1, e.to_string()))?;
        if let Some(first) = steps.first().map(Vec::len) {
            if s.layers.len() != first {
                return Err(parse_err(
                    path,
                    i + 1,
                    format!("{} layers, earlier steps have {first}", s.layers.len()),
                ));
            }
        }
        check_size(
            &path.display().to_string(),
            steps.len() + 1,
            s.layers.len(),
            ranks,
            s.layers.first().map_or(0, |l| l.tokens_per_expert.len()),
        )?;
        let mut layers = Vec::new();
        for l in &s.layers {
            let e = *experts.get_or_insert(l.tokens_per_expert.len());
            if l.tokens_per_expert.len() != e {
                return Err(parse_err(
                    path,
                    i + 1,
                    format!(
                        "{} experts, earlier layers have {e}",
                        l.tokens_per_expert.len()
                    ),
                ));
            }
            layers.push(spread(&l.tokens_per_expert, ranks));
        }
        steps.push(layers);
    }
    Ok(Trace {
        experts: experts.unwrap_or(0),
        ranks,
        steps,
    })
}

/// Named synthetic routing workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Uniform expert popularity.
    Balanced,
    /// Zipf popularity over a fixed random expert order.
    HotExperts,
    /// Rank 0 routes twice as many tokens as the others, Zipf experts.
    HotRank,
    /// Zipf popularity whose hottest experts shift every 10 steps.
    Rotating,
    /// Balanced, with every 8th step a burst onto 4 experts.
    Bursts,
}

/// Synthetic generator settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Synthetic {
    /// Workload.
    pub workload: Workload,
    /// Steps.
    pub steps: usize,
    /// Layers.
    pub layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Ranks.
    pub ranks: usize,
    /// Tokens per rank per step.
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Zipf exponent of the hot workloads.
    pub zipf: f64,
    /// Seed.
    pub seed: u64,
}

/// Generates a trace: each rank's `tokens · top_k` pairs are spread over
/// the experts by the workload's popularity (expected counts, rounded so
/// every rank's total is exact).
pub fn synthetic(cfg: &Synthetic) -> Result<Trace, ReplayError> {
    if cfg.experts == 0
        || cfg.ranks == 0
        || cfg.layers == 0
        || cfg.top_k == 0
        || cfg.top_k > cfg.experts
    {
        return Err(ReplayError::Invalid(
            "synthetic: experts, ranks, layers and top_k must be positive, top_k ≤ experts".into(),
        ));
    }
    check_size("synthetic", cfg.steps, cfg.layers, cfg.ranks, cfg.experts)?;
    if !(cfg.zipf.is_finite() && (0.0..=100.0).contains(&cfg.zipf)) {
        return Err(ReplayError::Invalid(format!(
            "synthetic: the Zipf exponent {} must be a finite number in [0, 100]",
            cfg.zipf
        )));
    }
    let e_n = cfg.experts;
    let mut rng = crate::data::SplitMix(cfg.seed ^ 0x5EED);
    let mut order: Vec<usize> = (0..e_n).collect();
    for i in (1..e_n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let zipf: Vec<f64> = (0..e_n)
        .map(|r| 1.0 / ((r + 1) as f64).powf(cfg.zipf))
        .collect();
    let steps = (0..cfg.steps)
        .map(|step| {
            (0..cfg.layers)
                .map(|layer| {
                    let mut w = vec![1.0f64; e_n];
                    match cfg.workload {
                        Workload::Balanced => {}
                        Workload::HotExperts | Workload::HotRank => {
                            for (rank, &e) in order.iter().enumerate() {
                                w[(e + layer) % e_n] = zipf[rank];
                            }
                        }
                        Workload::Rotating => {
                            for (rank, &e) in order.iter().enumerate() {
                                w[(e + layer + step / 10) % e_n] = zipf[rank];
                            }
                        }
                        Workload::Bursts => {
                            if step % 8 == 7 {
                                for j in 0..4 {
                                    w[order[(j + layer) % e_n]] = e_n as f64;
                                }
                            }
                        }
                    }
                    let total: f64 = w.iter().sum();
                    (0..cfg.ranks)
                        .map(|r| {
                            let scale = if cfg.workload == Workload::HotRank && r == 0 {
                                2
                            } else {
                                1
                            };
                            let pairs = (cfg.tokens * cfg.top_k * scale) as u64;
                            quota::largest_remainder(&w, total, pairs)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    Ok(Trace {
        experts: e_n,
        ranks: cfg.ranks,
        steps,
    })
}

/// Hardware and budget of the replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReplayConfig {
    /// Model width.
    pub hidden: usize,
    /// Expert FFN width.
    pub ffn: usize,
    /// Bytes per element of activations, weights and gradients.
    pub element_bytes: u64,
    /// Per-rank memory budget for one layer call (experts, replicas, buffers).
    pub memory_budget_bytes: u64,
    /// Link bandwidth per rank and direction, bytes/s.
    pub link_bytes_per_s: f64,
    /// Compute rate per rank, FLOP/s.
    pub flops_per_s: f64,
    /// Replicas each rank may host (replication and LRMoE).
    pub replica_slots_per_rank: usize,
    /// Share of post-placement memory replicas may use.
    pub replica_memory_fraction: f64,
    /// LRMoE quota policy.
    pub policy: Policy,
    /// Which of the controller's replicas LRMoE places (replication places
    /// every one the slots allow).
    #[serde(default)]
    pub replica_rule: quota::ReplicaRule,
    /// LRMoE quotas trimmed to whole 128-row GEMM tiles where that drops at
    /// most this share of a quota (`quota::align_to_tiles`; 0: off).
    #[serde(default)]
    pub tile_trim: f64,
    /// The links between the ranks (exchange times).
    #[serde(default)]
    pub cluster: cluster::Cluster,
    /// Whether LRMoE's budgets keep the replica slots its rule leaves
    /// empty out of the token buffer, as the trainer's do
    /// (`quota::budgets_without_empty_slots`). `false`: an empty slot's
    /// bytes hold rows.
    #[serde(default)]
    pub slots_reserved: bool,
    /// Whether a rank's token buffers count the forward's rows as the
    /// trainer's accounting does since 2026-12-05 (`lrmoe train`'s
    /// `rank_peak_bytes`): the larger of the rows its instances compute in
    /// the forward (an activation row in, one out) and the backward's kept
    /// `[x | g·δ]` rows; LRMoE's controller then also holds its replicas
    /// to the forward's rows ([`quota::Config::forward_rows_cap`]).
    /// `false`: the backward's alone, the controller's model (what LRMoE's
    /// quotas budget).
    #[serde(default)]
    pub count_forward: bool,
}

impl ReplayConfig {
    fn cost(&self) -> CostModel {
        CostModel::swiglu_expert(
            self.hidden,
            self.ffn,
            self.element_bytes,
            self.link_bytes_per_s,
            self.flops_per_s,
        )
    }
}

/// The strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Fixed ownership.
    Fixed,
    /// Replication (EPLB-style greedy replicas of this step's load).
    Replication,
    /// SYMI-like replication: replicas by the previous step's load, rows
    /// split evenly over instances, optimizer state sharded.
    Symi,
    /// LRMoE.
    Lrmoe,
}

/// Every strategy, in the order of the tables.
pub const STRATEGIES: [Strategy; 4] = [
    Strategy::Fixed,
    Strategy::Replication,
    Strategy::Symi,
    Strategy::Lrmoe,
];

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Fixed => "Fixed",
            Self::Replication => "Replication",
            Self::Symi => "SYMI-like",
            Self::Lrmoe => "LRMoE",
        })
    }
}

/// One strategy at one step: peaks over ranks and layers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepFigures {
    /// Step.
    pub step: usize,
    /// Strategy.
    pub strategy: Strategy,
    /// Placement bytes of the rank and layer with the largest total.
    pub placement_bytes: u64,
    /// Replica bytes of that rank and layer.
    pub replica_bytes: u64,
    /// Token-buffer bytes of that rank and layer.
    pub buffer_bytes: u64,
    /// Their sum: the peak memory of one layer call on one rank.
    pub total_bytes: u64,
    /// Whether every rank and layer stayed within the budget.
    pub fits: bool,
    /// Modelled forward time summed over layers, seconds.
    pub forward_s: f64,
    /// Modelled backward time summed over layers, seconds.
    pub backward_s: f64,
    /// Largest max / mean pairs per rank over layers.
    pub straggler: f64,
    /// Kept share of routed pairs.
    pub kept_fraction: f64,
}

/// One layer of one strategy: where the instances are, where each expert's
/// master weights live (the owner; SYMI-like: its optimizer shard), and
/// which instance computes each (source, expert)'s pairs in the forward
/// and in the backward.
struct LayerCall {
    placement: Placement,
    home: Vec<usize>,
    /// `None`: the backward's routes (every pair kept).
    forward: Option<Vec<redistribute::Route>>,
    backward: Vec<redistribute::Route>,
}

/// `pairs[s][d]`: the pairs the routes move from source `s` to instance
/// rank `d`.
fn pair_matrix(routes: &[redistribute::Route], ranks: usize) -> Vec<Vec<u64>> {
    let mut m = vec![vec![0u64; ranks]; ranks];
    for r in routes {
        m[r.source][r.rank] += r.pairs;
    }
    m
}

/// `[home][rank]`: instances of experts homed at `home` held by `rank`.
fn instance_matrix(call: &LayerCall, ranks: usize) -> Vec<Vec<u64>> {
    let mut m = vec![vec![0u64; ranks]; ranks];
    for (e, &home) in call.home.iter().enumerate() {
        m[home][call.placement.owner[e]] += 1;
        for &r in call.placement.replicas.get(e).map_or(&[][..], |v| v) {
            m[home][r] += 1;
        }
    }
    m
}

/// Pairs each rank computes: the column sums of a pair matrix.
fn computed(pairs: &[Vec<u64>]) -> Vec<u64> {
    let n = pairs.len();
    (0..n)
        .map(|d| pairs.iter().map(|row| row[d]).sum())
        .collect()
}

/// The modelled forward and backward seconds of one layer call, phases in
/// the device executor's order, each bulk-synchronous: forward = weights
/// to instances, `x` rows out, experts (`6·H·F` FLOP per pair), `o` rows
/// back; backward = kept `[x | g·δ]` rows out, experts (`16·H·F` per kept
/// pair: recompute and both gradients), `dX` rows back, instance gradients
/// home. Exchanges through `cfg.cluster`, compute at `cfg.flops_per_s`;
/// each pass also pays the cluster's fixed cost of a layer call.
fn layer_times(
    cfg: &ReplayConfig,
    ranks: usize,
    call: &LayerCall,
    bwd: &[Vec<u64>],
) -> Result<(f64, f64), ReplayError> {
    let cost = cfg.cost();
    let act = cost.act_row_bytes;
    // An exchange the other way (the transpose) takes as long; each is one
    // collective call (`cluster.call_overhead_us`, 0 by default).
    let ex = |m: &[Vec<u64>], bytes_each: u64| {
        cfg.cluster
            .exchange_scaled_s(m, bytes_each)
            .map(|s| s + cfg.cluster.call_s())
            .map_err(|e| ReplayError::Invalid(e.to_string()))
    };
    let compute = |pairs: &[Vec<u64>], flops: f64| {
        let most = computed(pairs).into_iter().max().unwrap_or(0);
        most as f64 * flops / cost.flops_per_s
    };
    let own;
    let fwd = match &call.forward {
        Some(f) => {
            own = pair_matrix(f, ranks);
            &own[..]
        }
        None => bwd,
    };
    let inst = instance_matrix(call, ranks);
    let fwd_flops = cost.flops_per_pair * 6.0 / 16.0;
    let rows = ex(fwd, act)?;
    let forward = ex(&inst, cost.expert_weight_bytes)? + rows + compute(fwd, fwd_flops) + rows;
    let backward = ex(bwd, cost.row_bytes())?
        + compute(bwd, cost.flops_per_pair)
        + ex(bwd, act)?
        + ex(&inst, cost.expert_grad_bytes)?;
    // Each pass is one MoE-layer call (`cluster.layer_call_overhead_us`, 0
    // by default).
    let call_cost = cfg.cluster.layer_call_s();
    Ok((forward + call_cost, backward + call_cost))
}

fn figures(
    step: usize,
    strategy: Strategy,
    cfg: &ReplayConfig,
    n_ranks: usize,
    per_layer: &[LayerCall],
    routed: u64,
) -> Result<StepFigures, ReplayError> {
    let cost = cfg.cost();
    let row = cost.row_bytes();
    let inst = cost.instance_bytes();
    let mut best = (0u64, 0u64, 0u64);
    let mut fits = true;
    let (mut forward, mut backward, mut straggler, mut kept) = (0.0f64, 0.0f64, 0.0f64, 0u64);
    for call in per_layer {
        let mut ranks = vec![0u64; n_ranks];
        for &o in &call.placement.owner {
            ranks[o] += 1;
        }
        for &r in call.placement.replicas.iter().flatten() {
            ranks[r] += 1;
        }
        let bwd = pair_matrix(&call.backward, n_ranks);
        let pairs = computed(&bwd);
        kept += pairs.iter().sum::<u64>();
        // The forward computes every routed pair, and its buffers are gone
        // when the backward's rows arrive: a rank holds the larger.
        let fwd_rows = match (&call.forward, cfg.count_forward) {
            (Some(f), true) => Some(computed(&pair_matrix(f, n_ranks))),
            _ => None,
        };
        for r in 0..n_ranks {
            let owned = call.placement.owner.iter().filter(|&&o| o == r).count() as u64;
            let b = match &fwd_rows {
                Some(f) => (pairs[r] * row).max(f[r] * forward_row_bytes(&cost)),
                None => pairs[r] * row,
            };
            let (p, rp) = (owned * inst, (ranks[r] - owned) * inst);
            if p + rp + b > cfg.memory_budget_bytes {
                fits = false;
            }
            if p + rp + b > best.0 + best.1 + best.2 {
                best = (p, rp, b);
            }
        }
        let (f, b) = layer_times(cfg, n_ranks, call, &bwd)?;
        forward += f;
        backward += b;
        let mean = pairs.iter().sum::<u64>() as f64 / n_ranks.max(1) as f64;
        if mean > 0.0 {
            straggler = straggler.max(pairs.iter().copied().max().unwrap_or(0) as f64 / mean);
        }
    }
    Ok(StepFigures {
        step,
        strategy,
        placement_bytes: best.0,
        replica_bytes: best.1,
        buffer_bytes: best.2,
        total_bytes: best.0 + best.1 + best.2,
        fits,
        forward_s: forward,
        backward_s: backward,
        straggler,
        kept_fraction: if routed > 0 {
            kept as f64 / routed as f64
        } else {
            1.0
        },
    })
}

fn owners(experts: usize, ranks: usize) -> Placement {
    Placement {
        owner: (0..experts).map(|e| e * ranks / experts).collect(),
        replicas: vec![],
    }
}

fn solve(
    problem: &redistribute::Problem,
    step: usize,
    layer: usize,
) -> Result<Vec<redistribute::Route>, ReplayError> {
    redistribute::solve(problem, &redistribute::Config::default())
        .map(|a| a.routes)
        .map_err(|error| ReplayError::Redistribute { step, layer, error })
}

/// SYMI-like placement (arXiv 2504.19925): every expert gets instances in
/// proportion to `load` (its pairs in the previous iteration; at least one
/// each), as many in all as the ranks' slots allow — `⌈E/N⌉` each plus the
/// replica slots that fit in `replica_memory_fraction` of the memory left
/// after them — with no two instances of an expert on one rank, heaviest
/// per-instance load first onto the least loaded rank with a free slot.
fn symi_placement(cfg: &ReplayConfig, load: &[u64], ranks: usize) -> Placement {
    let experts = load.len();
    let inst = cfg.cost().instance_bytes().max(1);
    let base = experts.div_ceil(ranks.max(1));
    let left = cfg.memory_budget_bytes.saturating_sub(base as u64 * inst);
    let fit = (cfg.replica_memory_fraction * left as f64 / inst as f64).floor() as usize;
    let slots = base + cfg.replica_slots_per_rank.min(fit);
    let total = (slots * ranks).min(experts * ranks).max(experts);
    // One each, the rest by the largest remainder of the load shares.
    let weights: Vec<f64> = load.iter().map(|&l| l as f64 + 1e-9).collect();
    let extra = quota::largest_remainder(&weights, weights.iter().sum(), (total - experts) as u64);
    let mut count: Vec<usize> = extra.iter().map(|&x| 1 + x as usize).collect();
    for c in count.iter_mut() {
        *c = (*c).min(ranks);
    }
    // First instances of every expert, then the extra ones; heaviest
    // per-instance load first within each pass. An instance with no rank
    // left (every free slot on a rank that holds the expert) is not placed.
    let per = |e: usize| load[e] as f64 / count[e] as f64;
    let mut items: Vec<(usize, f64, usize)> = (0..experts)
        .flat_map(|e| (0..count[e]).map(move |i| (usize::from(i > 0), per(e), e)))
        .collect();
    items.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)));
    let mut rank_load = vec![0f64; ranks];
    let mut used = vec![0usize; ranks];
    let mut at: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (_, per, e) in items {
        let pick = (0..ranks)
            .filter(|&r| used[r] < slots && !at[e].contains(&r))
            .min_by(|&a, &b| rank_load[a].total_cmp(&rank_load[b]).then(a.cmp(&b)));
        if let Some(r) = pick {
            at[e].push(r);
            used[r] += 1;
            rank_load[r] += per;
        }
    }
    Placement {
        owner: at.iter().map(|v| v[0]).collect(),
        replicas: at.iter().map(|v| v[1..].to_vec()).collect(),
    }
}

/// Every source's pairs of each expert split evenly over its instances
/// (`redistribute::even_split`, the dropless baselines' split).
fn even_routes(counts: &[Vec<u64>], placement: &Placement) -> Vec<redistribute::Route> {
    redistribute::even_split(counts, &placement.all_instances())
}

/// One (step, layer) cell: the trace's counts and where it sits.
struct Cell<'a> {
    trace: &'a Trace,
    step: usize,
    layer: usize,
    counts: &'a [Vec<u64>],
    /// Fixed ownership: experts in contiguous blocks.
    base: &'a Placement,
}

impl Cell<'_> {
    /// A redistribution problem over this cell's ranks, solved exactly.
    fn solve(
        &self,
        kept: &[Vec<u64>],
        p: &Placement,
        caps: Option<Vec<u64>>,
    ) -> Result<Vec<redistribute::Route>, ReplayError> {
        let ranks = self.trace.ranks;
        let problem = redistribute::Problem {
            n_ranks: ranks,
            kept: kept.to_vec(),
            instances: p.all_instances(),
            base_load: vec![0; ranks],
            rank_capacity: caps,
        };
        solve(&problem, self.step, self.layer)
    }

    fn call(
        &self,
        placement: Placement,
        forward: Option<Vec<redistribute::Route>>,
        backward: Vec<redistribute::Route>,
    ) -> LayerCall {
        LayerCall {
            placement,
            home: self.base.owner.clone(),
            forward,
            backward,
        }
    }
}

/// Bytes a forward row holds in a rank's token buffers: an activation
/// row in and one out.
fn forward_row_bytes(cost: &CostModel) -> u64 {
    2 * cost.act_row_bytes
}

/// The forward rows a rank may compute where the budget holds them
/// ([`ReplayConfig::count_forward`]): what the memory budget leaves beside
/// the most instances a rank can host (its owned experts and every replica
/// slot), in [`forward_row_bytes`].
fn forward_rows_cap(cfg: &ReplayConfig, cost: &CostModel, base: &Placement, ranks: usize) -> u64 {
    let owned = base
        .instances_per_rank(ranks)
        .into_iter()
        .max()
        .unwrap_or(0);
    let instances = (owned + cfg.replica_slots_per_rank as u64) * cost.instance_bytes();
    cfg.memory_budget_bytes.saturating_sub(instances) / forward_row_bytes(cost).max(1)
}

/// Replication (EPLB-style greedy replicas of the cell's own load, every
/// pair kept) and LRMoE (the controller's replicas and quotas) of one cell:
/// the controller's replicas are a prefix of the replication strategy's
/// (all of them with [`quota::ReplicaRule::Fill`]).
fn replication_and_lrmoe(
    cfg: &ReplayConfig,
    cell: &Cell<'_>,
) -> Result<(LayerCall, LayerCall), ReplayError> {
    let (step, layer, counts) = (cell.step, cell.layer, cell.counts);
    let cost = cfg.cost();
    let budgets = vec![
        RankBudget {
            memory_bytes: cfg.memory_budget_bytes,
            network_bytes: u64::MAX
        };
        cell.trace.ranks
    ];
    let inputs = quota::Inputs {
        counts,
        placement: cell.base,
        cost: &cost,
        budgets: &budgets,
    };
    let qcfg = quota::Config {
        policy: cfg.policy,
        replica_slots_per_rank: cfg.replica_slots_per_rank,
        replica_memory_fraction: cfg.replica_memory_fraction,
        replica_rule: cfg.replica_rule,
        forward_rows_cap: cfg
            .count_forward
            .then(|| forward_rows_cap(cfg, &cost, cell.base, cell.trace.ranks)),
    };
    let qerr = |error| ReplayError::Quota { step, layer, error };
    let (lrmoe_replicas, with) = quota::plan_replicas_and_fill(&inputs, &qcfg).map_err(qerr)?;
    let spread = cell.solve(counts, &with, None)?;
    let with_inputs = quota::Inputs {
        placement: &lrmoe_replicas,
        ..inputs
    };
    let reserved;
    let with_inputs = if cfg.slots_reserved {
        reserved = quota::budgets_without_empty_slots(
            &budgets,
            cfg.replica_slots_per_rank,
            cell.base,
            &lrmoe_replicas,
            &cost,
        );
        quota::Inputs {
            budgets: &reserved,
            ..with_inputs
        }
    } else {
        with_inputs
    };
    let plan = quota::quotas(&with_inputs, cfg.policy).map_err(qerr)?;
    let caps = plan.ranks.iter().map(|r| r.pair_capacity).collect();
    let mut kept = plan.quotas.per_source().to_vec();
    quota::align_to_tiles(
        &mut kept,
        counts,
        layer::TileAlign::DEVICE.rows,
        cfg.tile_trim,
    )
    .map_err(qerr)?;
    let routes = cell.solve(&kept, &plan.placement, Some(caps))?;
    let forward = if plan.placement == with {
        spread.clone()
    } else {
        cell.solve(counts, &plan.placement, None)?
    };
    Ok((
        cell.call(with, None, spread),
        cell.call(plan.placement, Some(forward), routes),
    ))
}

/// SYMI-like of one cell: placed by the previous step's load. The trace's
/// first step has no history; it stands in for its own (in SYMI's favour).
fn symi(cfg: &ReplayConfig, cell: &Cell<'_>) -> LayerCall {
    let trace = cell.trace;
    let previous: Vec<u64> = (0..trace.experts)
        .map(|e| {
            trace.steps[cell.step.saturating_sub(1)][cell.layer]
                .iter()
                .map(|row| row[e])
                .sum()
        })
        .collect();
    let placed = symi_placement(cfg, &previous, trace.ranks);
    let even = even_routes(cell.counts, &placed);
    cell.call(placed, None, even)
}

/// Replays one step with every strategy.
fn replay_step(
    trace: &Trace,
    cfg: &ReplayConfig,
    step: usize,
) -> Result<[StepFigures; 4], ReplayError> {
    let ranks = trace.ranks;
    let base = owners(trace.experts, ranks);
    let (mut fixed, mut repl, mut lrm, mut sym) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut routed = 0u64;
    for (layer, counts) in trace.steps[step].iter().enumerate() {
        routed += counts.iter().flatten().sum::<u64>(); // bounded: checked in `replay`
        let cell = Cell {
            trace,
            step,
            layer,
            counts,
            base: &base,
        };
        // Fixed ownership: one instance per expert, every pair to it.
        fixed.push(cell.call(base.clone(), None, even_routes(counts, &base)));
        let (r, l) = replication_and_lrmoe(cfg, &cell)?;
        repl.push(r);
        lrm.push(l);
        sym.push(symi(cfg, &cell));
    }
    Ok([
        figures(step, Strategy::Fixed, cfg, ranks, &fixed, routed)?,
        figures(step, Strategy::Replication, cfg, ranks, &repl, routed)?,
        figures(step, Strategy::Symi, cfg, ranks, &sym, routed)?,
        figures(step, Strategy::Lrmoe, cfg, ranks, &lrm, routed)?,
    ])
}

/// Per-strategy summary over all steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Strategy.
    pub strategy: Strategy,
    /// Peak memory split (of the peak step).
    pub placement_bytes: u64,
    /// Replica bytes at the peak.
    pub replica_bytes: u64,
    /// Token-buffer bytes at the peak.
    pub buffer_bytes: u64,
    /// Peak total bytes of one layer call on one rank.
    pub total_bytes: u64,
    /// Whether every step fit the budget.
    pub fits: bool,
    /// Mean modelled forward time per step, seconds.
    pub mean_forward_s: f64,
    /// Mean modelled backward time per step, seconds.
    pub mean_backward_s: f64,
    /// Largest straggler ratio.
    pub max_straggler: f64,
    /// Mean kept fraction.
    pub mean_kept_fraction: f64,
}

/// The whole replay.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Per step and strategy.
    pub steps: Vec<StepFigures>,
    /// Per strategy.
    pub summary: Vec<Summary>,
    /// `1 − lrmoe / fixed` peak total memory.
    pub lrmoe_memory_saving: f64,
}

/// The trace's shape against itself (every step the same layers, every
/// cell ranks × experts) and its byte figures within `u64`.
fn check_trace(trace: &Trace, cfg: &ReplayConfig) -> Result<(), ReplayError> {
    if trace.ranks == 0 || trace.experts == 0 || trace.steps.is_empty() || trace.layers() == 0 {
        return Err(ReplayError::Invalid(
            "the trace has no steps, layers, experts or ranks".into(),
        ));
    }
    for (s, st) in trace.steps.iter().enumerate() {
        if st.len() != trace.layers() {
            return Err(ReplayError::Invalid(format!(
                "step {s} has {} layers, step 0 has {}",
                st.len(),
                trace.layers()
            )));
        }
        for (l, c) in st.iter().enumerate() {
            if c.len() != trace.ranks || c.iter().any(|r| r.len() != trace.experts) {
                return Err(ReplayError::Invalid(format!(
                    "step {s}, layer {l}: counts are not {} ranks × {} experts",
                    trace.ranks, trace.experts
                )));
            }
        }
        // Every byte figure of the step is at most its pairs' rows plus two
        // full sets of expert instances on one rank: checked once here so
        // the sums below cannot overflow.
        let cost = cfg.cost();
        let bound = st
            .iter()
            .flatten()
            .flatten()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .and_then(|pairs| pairs.checked_mul(cost.row_bytes()))
            .and_then(|rows| {
                (trace.experts as u64)
                    .checked_mul(2)?
                    .checked_mul(cost.instance_bytes())?
                    .checked_add(rows)
            });
        if bound.is_none() {
            return Err(ReplayError::Invalid(format!(
                "step {s}: its pairs' bytes overflow u64 (counts or sizes too large)"
            )));
        }
    }
    Ok(())
}

/// Replays every step (in parallel) and summarises.
pub fn replay(trace: &Trace, cfg: &ReplayConfig) -> Result<Report, ReplayError> {
    check_trace(trace, cfg)?;
    cfg.cluster
        .validate()
        .map_err(|e| ReplayError::Invalid(e.to_string()))?;
    let per_step: Vec<[StepFigures; 4]> = (0..trace.steps.len())
        .into_par_iter()
        .map(|s| replay_step(trace, cfg, s))
        .collect::<Result<_, _>>()?;
    let steps: Vec<StepFigures> = per_step.iter().flatten().copied().collect();
    let summary: Vec<Summary> = STRATEGIES
        .iter()
        .map(|&strategy| {
            let mine: Vec<&StepFigures> = steps.iter().filter(|f| f.strategy == strategy).collect();
            let peak = **mine
                .iter()
                .max_by_key(|f| f.total_bytes)
                .expect("invariant: the trace has steps");
            let n = mine.len() as f64;
            Summary {
                strategy,
                placement_bytes: peak.placement_bytes,
                replica_bytes: peak.replica_bytes,
                buffer_bytes: peak.buffer_bytes,
                total_bytes: peak.total_bytes,
                fits: mine.iter().all(|f| f.fits),
                mean_forward_s: mine.iter().map(|f| f.forward_s).sum::<f64>() / n,
                mean_backward_s: mine.iter().map(|f| f.backward_s).sum::<f64>() / n,
                max_straggler: mine.iter().map(|f| f.straggler).fold(0.0, f64::max),
                mean_kept_fraction: mine.iter().map(|f| f.kept_fraction).sum::<f64>() / n,
            }
        })
        .collect();
    let peak = |s: Strategy| {
        summary
            .iter()
            .find(|f| f.strategy == s)
            .map_or(0, |f| f.total_bytes)
    };
    let saving = 1.0 - peak(Strategy::Lrmoe) as f64 / peak(Strategy::Fixed).max(1) as f64;
    Ok(Report {
        steps,
        summary,
        lrmoe_memory_saving: saving,
    })
}

/// The human summary (Markdown).
pub fn table(r: &Report) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut t = String::from(
        "| strategy | placement MiB | replicas MiB | token buffers MiB | total MiB | fits budget | mean forward ms | mean backward ms | max straggler | mean kept fraction |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in &r.summary {
        t += &format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.3} | {:.3} | {:.2} | {:.3} |\n",
            s.strategy,
            mib(s.placement_bytes),
            mib(s.replica_bytes),
            mib(s.buffer_bytes),
            mib(s.total_bytes),
            if s.fits { "yes" } else { "no" },
            s.mean_forward_s * 1e3,
            s.mean_backward_s * 1e3,
            s.max_straggler,
            s.mean_kept_fraction
        );
    }
    let saving = 100.0 * r.lrmoe_memory_saving;
    t += &if saving >= 0.0 {
        format!("\nLRMoE peak memory vs fixed ownership: {saving:.1}% less.\n")
    } else {
        format!(
            "\nLRMoE peak memory vs fixed ownership: {:.1}% more.\n",
            -saving
        )
    };
    t
}

/// `replay.csv`: one row per step and strategy.
fn csv(r: &Report) -> String {
    let mut csv = String::from("step,strategy,placement_bytes,replica_bytes,buffer_bytes,total_bytes,fits,forward_s,backward_s,straggler,kept_fraction\n");
    for f in &r.steps {
        csv += &format!(
            "{},{:?},{},{},{},{},{},{},{},{},{}\n",
            f.step,
            f.strategy,
            f.placement_bytes,
            f.replica_bytes,
            f.buffer_bytes,
            f.total_bytes,
            f.fits,
            f.forward_s,
            f.backward_s,
            f.straggler,
            f.kept_fraction
        );
    }
    csv
}

/// One chart of the replay: a one-step trace (an EPLB load matrix) gets one
/// bar per strategy, its figure split into `parts`; a trace over steps gets
/// one line per strategy of the parts' sum.
fn chart(
    dir: &Path,
    r: &Report,
    (stem, title, unit): (&str, &str, &str),
    parts: &[&str],
    values: &dyn Fn(&StepFigures) -> Vec<f64>,
    reference: Option<&crate::plots::Reference>,
) -> Result<Vec<std::path::PathBuf>, ReplayError> {
    let steps: std::collections::BTreeSet<usize> = r.steps.iter().map(|f| f.step).collect();
    let one_step = steps.len() <= 1;
    let x = if one_step { "strategy" } else { "step" };
    let labels = crate::plots::Labels { title, x, y: unit };
    let of = |s: Strategy| r.steps.iter().filter(move |f| f.strategy == s);
    let drawn = if one_step {
        let bars: Vec<crate::plots::Bar> = STRATEGIES
            .iter()
            .filter_map(|&s| of(s).next())
            .map(|f| crate::plots::Bar {
                label: f.strategy.to_string(),
                parts: values(f),
            })
            .collect();
        crate::plots::stacked_bars(&dir.join(stem), labels, parts, &bars, reference)
    } else {
        let series: Vec<crate::plots::Series> = STRATEGIES
            .iter()
            .map(|&s| crate::plots::Series {
                name: s.to_string(),
                points: of(s)
                    .map(|f| (f.step as f64, values(f).iter().sum()))
                    .collect(),
            })
            .collect();
        crate::plots::lines(&dir.join(stem), labels, &series, reference)
    };
    drawn.map_err(|e| ReplayError::Invalid(e.to_string()))
}

/// Writes `replay.json`, `replay.csv` and the memory and time charts
/// (`memory.svg`/`.png`, `time.svg`/`.png`: lines over steps, or one bar per
/// strategy for a one-step trace) into `dir`, atomically; returns the paths.
pub fn write(dir: &Path, r: &Report, budget_bytes: u64) -> Result<Vec<String>, ReplayError> {
    std::fs::create_dir_all(dir).map_err(|error| ReplayError::Write {
        path: dir.display().to_string(),
        error,
    })?;
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |error| ReplayError::Write { path: p, error }
    };
    let csv = csv(r);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let budget = crate::plots::Reference {
        y: mib(budget_bytes),
        label: format!("budget {:.0} MiB", mib(budget_bytes)),
    };
    let mut out = Vec::new();
    for (name, body) in [
        (
            "replay.json",
            serde_json::to_string_pretty(r).unwrap_or_default(),
        ),
        ("replay.csv", csv),
    ] {
        let p = dir.join(name);
        crate::fsutil::write_atomic(&p, body.as_bytes()).map_err(io(&p))?;
        out.push(p.display().to_string());
    }
    let chart = |stem: &str,
                 title: &str,
                 unit: &str,
                 parts: &[&str],
                 values: &dyn Fn(&StepFigures) -> Vec<f64>,
                 reference: Option<&crate::plots::Reference>| {
        chart(dir, r, (stem, title, unit), parts, values, reference)
    };
    let mut charts = chart(
        "memory",
        "peak memory of one layer call (placement + replicas + token buffers)",
        "MiB",
        &["placement", "replicas", "token buffers"],
        &|f| {
            vec![
                mib(f.placement_bytes),
                mib(f.replica_bytes),
                mib(f.buffer_bytes),
            ]
        },
        Some(&budget),
    )?;
    charts.extend(chart(
        "time",
        "modelled MoE-layer time (cluster model)",
        "ms",
        &["forward", "backward"],
        &|f| vec![f.forward_s * 1e3, f.backward_s * 1e3],
        None,
    )?);
    out.extend(charts.iter().map(|p| p.display().to_string()));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_more_when_lrmoe_holds_more() {
        let report = |saving| Report {
            steps: vec![],
            summary: vec![],
            lrmoe_memory_saving: saving,
        };
        assert!(table(&report(0.25)).contains("25.0% less."));
        let more = table(&report(-0.107));
        assert!(more.contains("10.7% more.") && !more.contains('−') && !more.contains("-10"));
    }

    fn cfg(budget_mib: u64) -> ReplayConfig {
        ReplayConfig {
            hidden: 256,
            ffn: 128,
            element_bytes: 2,
            memory_budget_bytes: budget_mib << 20,
            link_bytes_per_s: quota::H200_LINK_BYTES_PER_S,
            flops_per_s: quota::H200_FLOPS_PER_S,
            replica_slots_per_rank: 2,
            replica_memory_fraction: 0.5,
            policy: Policy::Maxmin,
            replica_rule: quota::ReplicaRule::Paying,
            tile_trim: 0.0,
            cluster: Default::default(),
            slots_reserved: false,
            count_forward: false,
        }
    }

    fn hot(steps: usize) -> Trace {
        small(Workload::HotExperts, steps, 3)
    }

    /// A synthetic trace of 32 experts on 4 ranks, 4 096 tokens × top-4.
    fn small(workload: Workload, steps: usize, layers: usize) -> Trace {
        synthetic(&Synthetic {
            workload,
            steps,
            layers,
            experts: 32,
            ranks: 4,
            tokens: 4096,
            top_k: 4,
            zipf: 1.2,
            seed: 1,
        })
        .unwrap()
    }

    fn tmp(name: &str, body: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("lrmoe-replay-{}-{name}", std::process::id()));
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn synthetic_workloads_are_seeded_and_conserve_pairs() {
        for w in [
            Workload::Balanced,
            Workload::HotExperts,
            Workload::HotRank,
            Workload::Rotating,
            Workload::Bursts,
        ] {
            let s = Synthetic {
                workload: w,
                steps: 12,
                layers: 2,
                experts: 16,
                ranks: 3,
                tokens: 100,
                top_k: 2,
                zipf: 1.0,
                seed: 9,
            };
            let a = synthetic(&s).unwrap();
            assert_eq!(a, synthetic(&s).unwrap(), "{w:?} is not deterministic");
            for (r, row) in a.steps[11][1].iter().enumerate() {
                let want = if w == Workload::HotRank && r == 0 {
                    400
                } else {
                    200
                };
                assert_eq!(row.iter().sum::<u64>(), want, "{w:?} rank {r}");
            }
        }
    }

    #[test]
    fn strategies_keep_their_promises() {
        let trace = hot(5);
        let r = replay(&trace, &cfg(8)).unwrap();
        let s = |st: Strategy| *r.summary.iter().find(|x| x.strategy == st).unwrap();
        assert_eq!(s(Strategy::Fixed).mean_kept_fraction, 1.0);
        assert_eq!(s(Strategy::Replication).mean_kept_fraction, 1.0);
        assert_eq!(s(Strategy::Fixed).replica_bytes, 0);
        let l = s(Strategy::Lrmoe);
        assert!(
            l.fits && l.total_bytes <= 8 << 20,
            "LRMoE must stay within its budget"
        );
        assert!(l.mean_kept_fraction < 1.0 && l.mean_kept_fraction > 0.0);
        assert!(s(Strategy::Replication).max_straggler <= s(Strategy::Fixed).max_straggler);
        // SYMI-like keeps every pair and, on a hot trace, spreads the hot
        // experts' rows: less straggling than fixed ownership.
        let y = s(Strategy::Symi);
        assert_eq!(y.mean_kept_fraction, 1.0);
        assert!(y.max_straggler < s(Strategy::Fixed).max_straggler);
        // Every strategy's time is modelled and positive.
        for x in &r.summary {
            assert!(x.mean_forward_s > 0.0 && x.mean_backward_s > 0.0, "{x:?}");
        }
        // LRMoE's backward moves and computes fewer rows than fixed
        // ownership's on the same links.
        assert!(l.mean_backward_s < s(Strategy::Fixed).mean_backward_s);
        assert_eq!(r.steps.len(), 20);
    }

    #[test]
    fn symi_places_by_load_and_splits_rows_evenly() {
        let c = cfg(64);
        for (load, ranks) in [
            (vec![1000u64, 10, 10, 10, 10, 10, 10, 10], 4usize),
            (vec![0; 6], 3),
            (vec![5, 0, 900, 3, 3], 8),
        ] {
            let p = symi_placement(&c, &load, ranks);
            let base = load.len().div_ceil(ranks);
            let slots = base + c.replica_slots_per_rank;
            for e in 0..load.len() {
                let mut at = p.instances(e);
                assert!(!at.is_empty());
                let n = at.len();
                at.sort_unstable();
                at.dedup();
                assert_eq!(at.len(), n, "two instances of expert {e} on one rank");
            }
            assert!(p
                .instances_per_rank(ranks)
                .iter()
                .all(|&n| n as usize <= slots));
            // The hottest expert has the most instances.
            let hot = (0..load.len()).max_by_key(|&e| load[e]).unwrap();
            let most = (0..load.len()).map(|e| p.instances(e).len()).max().unwrap();
            if load[hot] > 0 {
                assert_eq!(p.instances(hot).len(), most, "{load:?}");
            }
            let counts: Vec<Vec<u64>> = (0..ranks)
                .map(|s| load.iter().map(|&l| l + s as u64).collect())
                .collect();
            let routes = even_routes(&counts, &p);
            for (s, row) in counts.iter().enumerate() {
                for (e, &n) in row.iter().enumerate() {
                    let got: Vec<u64> = routes
                        .iter()
                        .filter(|r| r.source == s && r.expert == e)
                        .map(|r| r.pairs)
                        .collect();
                    assert_eq!(got.iter().sum::<u64>(), n);
                    let (lo, hi) = (got.iter().min(), got.iter().max());
                    if let (Some(lo), Some(hi)) = (lo, hi) {
                        assert!(hi - lo <= 1, "uneven split {got:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn tile_trim_only_lowers_lrmoe_s_kept_pairs() {
        let trace = hot(5);
        let plain = replay(&trace, &cfg(8)).unwrap();
        let trimmed = replay(
            &trace,
            &ReplayConfig {
                tile_trim: 1.0,
                ..cfg(8)
            },
        )
        .unwrap();
        for (a, b) in plain.summary.iter().zip(&trimmed.summary) {
            if a.strategy == Strategy::Lrmoe {
                assert!(b.mean_kept_fraction <= a.mean_kept_fraction);
                assert!(b.total_bytes <= a.total_bytes && b.fits);
            } else {
                assert_eq!(a, b, "tile trimming touched {:?}", a.strategy);
            }
        }
        let bad = ReplayConfig {
            tile_trim: 2.0,
            ..cfg(8)
        };
        assert!(replay(&trace, &bad).is_err());
    }

    #[test]
    fn reserved_slots_keep_empty_slots_out_of_lrmoe_s_buffer() {
        // Balanced routing: the paying rule leaves the slots empty, so with
        // them reserved LRMoE's buffer (and kept share) shrinks by their
        // bytes; filled slots reserve nothing more; no other strategy moves.
        let trace = small(Workload::Balanced, 3, 2);
        let of = |r: &Report| {
            *r.summary
                .iter()
                .find(|x| x.strategy == Strategy::Lrmoe)
                .unwrap()
        };
        for (rule, budget) in [
            (quota::ReplicaRule::Paying, 6),
            (quota::ReplicaRule::Fill, 6),
        ] {
            let base = ReplayConfig {
                replica_rule: rule,
                ..cfg(budget)
            };
            let open = replay(&trace, &base).unwrap();
            let reserved = replay(
                &trace,
                &ReplayConfig {
                    slots_reserved: true,
                    ..base
                },
            )
            .unwrap();
            let (a, b) = (of(&open), of(&reserved));
            if rule == quota::ReplicaRule::Paying {
                assert_eq!(a.replica_bytes, 0, "balanced: no replica pays");
                assert!(b.mean_kept_fraction < a.mean_kept_fraction, "{a:?} {b:?}");
                assert!(b.total_bytes < a.total_bytes);
            } else {
                assert_eq!(a, b, "every slot filled: nothing to reserve");
            }
            for (x, y) in open.summary.iter().zip(&reserved.summary) {
                if x.strategy != Strategy::Lrmoe {
                    assert_eq!(x, y, "{:?} moved", x.strategy);
                }
            }
        }
    }

    #[test]
    fn counting_the_forward_raises_only_what_lrmoe_s_forward_holds_beyond_its_backward() {
        // Every pair kept (fixed, replication, SYMI-like): the forward's
        // rows are the backward's, nothing moves. LRMoE computes every pair
        // in the forward but keeps fewer: its buffers can only grow, here
        // past the budget its backward keeps to.
        let trace = hot(5);
        let plain = replay(&trace, &cfg(8)).unwrap();
        let counted = replay(
            &trace,
            &ReplayConfig {
                count_forward: true,
                ..cfg(8)
            },
        )
        .unwrap();
        for (a, b) in plain.summary.iter().zip(&counted.summary) {
            if a.strategy == Strategy::Lrmoe {
                assert!(b.buffer_bytes > a.buffer_bytes, "{a:?} {b:?}");
                assert_eq!(b.mean_kept_fraction, a.mean_kept_fraction);
                assert!(a.fits && !b.fits, "{a:?} {b:?}");
            } else {
                assert_eq!(a, b, "{:?} moved", a.strategy);
            }
        }
        assert!(counted.lrmoe_memory_saving < plain.lrmoe_memory_saving);
    }

    /// Where the budget holds the forward, LRMoE's forward cap is what the
    /// budget leaves beside a rank's owned experts and every replica slot,
    /// in rows of an activation in and one out.
    #[test]
    fn the_forward_cap_is_the_budget_beside_the_fullest_rank_s_instances() {
        let c = cfg(8);
        let cost = c.cost();
        // 32 experts on 4 ranks, 8 each, and 2 slots: 10 instances.
        let base = Placement {
            owner: (0..32).map(|e| e / 8).collect(),
            replicas: vec![],
        };
        let rows = forward_rows_cap(&c, &cost, &base, 4);
        let left = (8u64 << 20) - 10 * cost.instance_bytes();
        assert_eq!(rows, left / (2 * cost.act_row_bytes));
        // A budget the instances alone exceed leaves no rows.
        assert_eq!(forward_rows_cap(&cfg(0), &cost, &base, 4), 0);
    }

    #[test]
    fn hot_experts_where_fixed_ownership_does_not_fit_save_at_least_57_8_percent() {
        let trace = hot(4);
        let of = |r: &Report, s: Strategy| *r.summary.iter().find(|x| x.strategy == s).unwrap();
        let fixed_peak = of(&replay(&trace, &cfg(1 << 20)).unwrap(), Strategy::Fixed).total_bytes;
        // A budget at 40% of what fixed ownership needs.
        let budget_mib = (fixed_peak * 4 / 10) >> 20;
        let r = replay(&trace, &cfg(budget_mib)).unwrap();
        assert!(!of(&r, Strategy::Fixed).fits);
        assert!(of(&r, Strategy::Lrmoe).fits);
        assert!(
            r.lrmoe_memory_saving >= 0.578,
            "saving {}",
            r.lrmoe_memory_saving
        );
    }

    #[test]
    fn megatron_traces_count_pairs_and_name_bad_lines() {
        let good = tmp(
            "mg.jsonl",
            r#"{"step": 0, "layer": 0, "rank": 0, "top_indices": [[0, 1], [1, 2]]}
{"step": 0, "layer": 0, "rank": 1, "top_indices": [[3, 1]]}
{"step": 0, "layer": 1, "rank": 0, "top_indices": [[2, 3]]}
{"step": 0, "layer": 1, "rank": 1, "top_indices": []}
"#,
        );
        let t = load_megatron(&good, 4).unwrap();
        assert_eq!(t.steps[0][0], vec![vec![1, 2, 1, 0], vec![0, 1, 0, 1]]);
        let bad = tmp("mg-bad.jsonl", "{\"step\": 0, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0, 1]]}\n{\"step\": 0, \"layer\"");
        let e = load_megatron(&bad, 4).unwrap_err().to_string();
        assert!(e.contains("mg-bad.jsonl:2:"), "{e}");
        let unknown = tmp(
            "mg-unk.jsonl",
            "{\"step\": 0, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0, 9]]}\n",
        );
        let e = load_megatron(&unknown, 4).unwrap_err().to_string();
        assert!(
            e.contains(":1:") && e.contains("expert 9 out of range"),
            "{e}"
        );
        let ragged = tmp(
            "mg-rag.jsonl",
            "{\"step\": 0, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0]]}\n{\"step\": 0, \"layer\": 1, \"rank\": 0, \"top_indices\": [[0]]}\n{\"step\": 1, \"layer\": 0, \"rank\": 0, \"top_indices\": [[0]]}\n",
        );
        let e = load_megatron(&ragged, 4).unwrap_err().to_string();
        assert!(e.contains("step 1 has 1 layers"), "{e}");
        for p in [good, bad, unknown, ragged] {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn eplb_and_lrmoe_metrics_load_and_reject_bad_shapes() {
        let p = tmp("eplb.json", r#"{"weight": [[10, 0, 5, 1], [3, 3, 3, 3]]}"#);
        let t = load_eplb(&p, 2).unwrap();
        assert_eq!(t.layers(), 2);
        assert_eq!(t.steps[0][0], vec![vec![5, 0, 3, 1], vec![5, 0, 2, 0]]);
        let bad = tmp("eplb-bad.json", "[[1, 2], [3]]");
        assert!(load_eplb(&bad, 2)
            .unwrap_err()
            .to_string()
            .contains("layer 1 has 1 experts"));
        let m = tmp(
            "metrics.jsonl",
            "{\"layers\": [{\"tokens_per_expert\": [4, 4]}, {\"tokens_per_expert\": [2, 6]}]}\n{\"layers\": [{\"tokens_per_expert\": [4, 4]}]}\n",
        );
        let e = load_lrmoe_metrics(&m, 2).unwrap_err().to_string();
        assert!(
            e.contains("metrics.jsonl:2:") && e.contains("1 layers"),
            "{e}"
        );
        for p in [p, bad, m] {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Modelled and measured device memory of one strategy's peak layer call.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceCheck {
    /// Strategy.
    pub strategy: Strategy,
    /// Modelled bytes (placement + replicas + token buffers).
    pub modelled_bytes: u64,
    /// Bytes the GPU reported in use while they were allocated.
    pub measured_bytes: u64,
    /// `measured / modelled`.
    pub ratio: f64,
}

/// Allocates each strategy's peak split on the GPU and measures it.
pub fn check_on_device(
    gpu: &kernels::gpu::Gpu,
    r: &Report,
) -> Result<Vec<DeviceCheck>, kernels::KernelError> {
    r.summary
        .iter()
        .map(|s| {
            let measured =
                gpu.measure_allocations(&[s.placement_bytes, s.replica_bytes, s.buffer_bytes])?;
            Ok(DeviceCheck {
                strategy: s.strategy,
                modelled_bytes: s.total_bytes,
                measured_bytes: measured,
                ratio: measured as f64 / s.total_bytes.max(1) as f64,
            })
        })
        .collect()
}
