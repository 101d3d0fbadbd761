//! `lrmoe plan`: a planning problem in, a plan out (schemas in
//! `docs/formats.md`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use quota::{CostModel, Placement, Policy, RankBudget};
use redistribute::{LoadModel, Route, Solver, Status};

/// Errors of the plan command, each naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The JSON does not parse or does not match the schema.
    #[error("{path}: {message}")]
    Json {
        /// Field path (`routed_counts[0][2]`), or `.` for the document.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The problem is well-formed JSON but inconsistent.
    #[error("{field}: {message}")]
    Invalid {
        /// Field path.
        field: String,
        /// What went wrong.
        message: String,
    },
    /// The controller rejected the problem.
    #[error("controller: {0}")]
    Quota(quota::QuotaError),
    /// The redistribution rejected the problem.
    #[error("redistribute: {0}")]
    Redistribute(redistribute::RedistributeError),
}

// The causes are in the messages above, not chained as `source()` too.
impl From<quota::QuotaError> for PlanError {
    fn from(e: quota::QuotaError) -> Self {
        PlanError::Quota(e)
    }
}

impl From<redistribute::RedistributeError> for PlanError {
    fn from(e: redistribute::RedistributeError) -> Self {
        PlanError::Redistribute(e)
    }
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> PlanError {
    PlanError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Controller settings inside a problem file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerSettings {
    /// Quota policy (default uniform).
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Replicas each rank may host (default 0).
    #[serde(default)]
    pub replica_slots_per_rank: Option<usize>,
    /// Share of post-placement memory replicas may use (default 0.25).
    #[serde(default)]
    pub replica_memory_fraction: Option<f64>,
    /// Which replicas are placed: `"paying"` (default), `"paying-compute"`
    /// or `"fill"`.
    #[serde(default)]
    pub replica_rule: Option<quota::ReplicaRule>,
}

/// A planning problem (see `docs/formats.md`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Problem {
    /// Number of ranks.
    pub n_ranks: usize,
    /// Expert placement; its `owner` length fixes the number of experts.
    pub placement: Placement,
    /// Routed pairs `[n_ranks][n_experts]`: the controller runs.
    #[serde(default)]
    pub routed_counts: Option<Vec<Vec<u64>>>,
    /// Kept pairs `[n_ranks][n_experts]`: the controller is skipped.
    #[serde(default)]
    pub kept_counts: Option<Vec<Vec<u64>>>,
    /// Cost model (required with `routed_counts`).
    #[serde(default)]
    pub cost_model: Option<CostModel>,
    /// Per-rank budgets (required with `routed_counts`).
    #[serde(default)]
    pub budgets: Option<Vec<RankBudget>>,
    /// Controller settings.
    #[serde(default)]
    pub controller: ControllerSettings,
    /// Per-rank base load (default zeros).
    #[serde(default)]
    pub base_load: Option<Vec<u64>>,
    /// Load model of the redistribution (default compute-only, 1 per pair).
    #[serde(default)]
    pub load_model: Option<LoadModel>,
}

/// Parses a problem, naming the offending field on error. Objects must be
/// objects: an array where the schema has named fields is refused.
pub fn parse_problem(json: &str) -> Result<Problem, PlanError> {
    crate::strict::from_json(json).map_err(|e| PlanError::Json {
        path: e.path,
        message: e.message,
    })
}

/// Command-line choices that override the problem file.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Redistribution solver.
    pub solver: Solver,
    /// Quota policy, overriding the file's.
    pub policy: Option<Policy>,
    /// ILP time limit.
    pub ilp_time_limit: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            solver: Solver::Exact,
            policy: None,
            ilp_time_limit: Duration::from_secs(2),
        }
    }
}

/// The controller's part of a report.
#[derive(Debug, Clone, Serialize)]
pub struct ControllerReport {
    /// Policy used.
    pub policy: Policy,
    /// Kept pairs per expert (`q_e`).
    pub quotas_per_expert: Vec<u64>,
    /// Kept pairs per source and expert (`k[s][e]`).
    pub quotas_per_source: Vec<Vec<u64>>,
    /// Smallest retention ratio of any cell.
    pub retention_floor: f64,
    /// Kept share of all routed pairs.
    pub kept_fraction: f64,
    /// Replicas added for this call, `[expert, rank]`.
    pub replicas_added: Vec<(usize, usize)>,
}

/// One rank's line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// Rank.
    pub rank: usize,
    /// Pairs processed after redistribution.
    pub pairs: u64,
    /// Modelled load after redistribution.
    pub load: u64,
    /// Pair cap the controller set (absent without the controller).
    pub pair_capacity: Option<u64>,
    /// Owned experts' bytes (absent without a cost model).
    pub placement_bytes: Option<u64>,
    /// Replica bytes.
    pub replica_bytes: Option<u64>,
    /// Backward buffer bytes for the pairs assigned here.
    pub buffer_bytes: Option<u64>,
    /// Sum of the three.
    pub memory_bytes: Option<u64>,
    /// Memory budget.
    pub memory_budget_bytes: Option<u64>,
    /// Dispatch bytes received (pairs from other sources).
    pub dispatch_in_bytes: Option<u64>,
    /// Dispatch bytes sent (own pairs processed elsewhere).
    pub dispatch_out_bytes: Option<u64>,
}

/// What `lrmoe plan` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// Present when the controller ran.
    pub controller: Option<ControllerReport>,
    /// Instances of each expert used by the redistribution (owner first).
    pub instances: Vec<Vec<usize>>,
    /// Pairs per (source, expert, instance rank).
    pub assignment: Vec<Route>,
    /// Per-rank figures.
    pub ranks: Vec<RankReport>,
    /// Peak per-rank load.
    pub peak_load: u64,
    /// Lower bound on the peak (compute-only bounds).
    pub peak_lower_bound: u64,
    /// Solver requested.
    pub solver: Solver,
    /// How the solve ended.
    pub status: Status,
    /// Solve time in microseconds.
    pub solve_micros: f64,
}

fn check_matrix(field: &str, m: &[Vec<u64>], rows: usize, cols: usize) -> Result<(), PlanError> {
    if m.len() != rows {
        return Err(invalid(
            field,
            format!("expected {rows} source ranks, got {}", m.len()),
        ));
    }
    for (i, row) in m.iter().enumerate() {
        if row.len() != cols {
            return Err(invalid(
                format!("{field}[{i}]"),
                format!("expected {cols} experts, got {}", row.len()),
            ));
        }
    }
    Ok(())
}

/// Validates dimensions and the either/or fields before any planning.
pub fn validate(p: &Problem) -> Result<(), PlanError> {
    let (n_ranks, n_experts) = (p.n_ranks, p.placement.owner.len());
    // An empty problem is a malformed one (a file cut short, a generator
    // that wrote nothing), not a layer call with nothing to plan.
    if n_ranks == 0 {
        return Err(invalid("n_ranks", "must be at least 1"));
    }
    if n_experts == 0 {
        return Err(invalid(
            "placement.owner",
            "names no expert: give each expert's owning rank",
        ));
    }
    validate_placement(&p.placement, n_ranks)?;
    match (&p.routed_counts, &p.kept_counts) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "kept_counts",
                "give routed_counts or kept_counts, not both",
            ))
        }
        (None, None) => return Err(invalid("routed_counts", "missing (or give kept_counts)")),
        (Some(routed), None) => {
            check_matrix("routed_counts", routed, n_ranks, n_experts)?;
            if p.cost_model.is_none() {
                return Err(invalid("cost_model", "required with routed_counts"));
            }
            if p.budgets.is_none() {
                return Err(invalid("budgets", "required with routed_counts"));
            }
        }
        (None, Some(kept)) => check_matrix("kept_counts", kept, n_ranks, n_experts)?,
    }
    if let Some(b) = &p.budgets {
        if b.len() != n_ranks {
            return Err(invalid(
                "budgets",
                format!("expected {n_ranks} ranks, got {}", b.len()),
            ));
        }
    }
    if let Some(b) = &p.base_load {
        if b.len() != n_ranks {
            return Err(invalid(
                "base_load",
                format!("expected {n_ranks} ranks, got {}", b.len()),
            ));
        }
    }
    if let Some(f) = p.controller.replica_memory_fraction {
        if !(0.0..=1.0).contains(&f) {
            return Err(invalid(
                "controller.replica_memory_fraction",
                "must be in [0, 1]",
            ));
        }
    }
    Ok(())
}

/// Every owner and replica a rank of `n_ranks`; one replica list per expert
/// (or none); no rank holding an expert twice.
fn validate_placement(placement: &Placement, n_ranks: usize) -> Result<(), PlanError> {
    let n_experts = placement.owner.len();
    for (e, &r) in placement.owner.iter().enumerate() {
        if r >= n_ranks {
            return Err(invalid(
                format!("placement.owner[{e}]"),
                format!("rank {r} out of range (n_ranks = {n_ranks})"),
            ));
        }
    }
    if !placement.replicas.is_empty() && placement.replicas.len() != n_experts {
        return Err(invalid(
            "placement.replicas",
            format!(
                "expected {n_experts} lists (one per expert), got {}",
                placement.replicas.len()
            ),
        ));
    }
    for (e, reps) in placement.replicas.iter().enumerate() {
        for (i, &r) in reps.iter().enumerate() {
            if r >= n_ranks || r == placement.owner[e] || reps[..i].contains(&r) {
                return Err(invalid(
                    format!("placement.replicas[{e}][{i}]"),
                    format!("rank {r} is out of range or already holds expert {e}"),
                ));
            }
        }
    }
    Ok(())
}

/// Runs the controller (if routed counts are given) and the redistribution.
pub fn run(p: &Problem, opts: &Options) -> Result<PlanReport, PlanError> {
    validate(p)?;
    let n_ranks = p.n_ranks;
    let (controller, kept, placement, caps) = match (&p.routed_counts, &p.kept_counts) {
        (Some(routed), _) => {
            let cost = p.cost_model.as_ref().expect("invariant: validated");
            let budgets = p.budgets.as_deref().expect("invariant: validated");
            let defaults = quota::Config::default();
            let cfg = quota::Config {
                policy: opts
                    .policy
                    .or(p.controller.policy)
                    .unwrap_or(defaults.policy),
                replica_slots_per_rank: p
                    .controller
                    .replica_slots_per_rank
                    .unwrap_or(defaults.replica_slots_per_rank),
                replica_memory_fraction: p
                    .controller
                    .replica_memory_fraction
                    .unwrap_or(defaults.replica_memory_fraction),
                replica_rule: p.controller.replica_rule.unwrap_or(defaults.replica_rule),
                ..defaults
            };
            let inputs = quota::Inputs {
                counts: routed,
                placement: &p.placement,
                cost,
                budgets,
            };
            let plan = quota::plan(&inputs, &cfg)?;
            let caps: Vec<u64> = plan.ranks.iter().map(|r| r.pair_capacity).collect();
            let report = ControllerReport {
                policy: plan.policy,
                quotas_per_expert: plan.quotas.per_expert(),
                quotas_per_source: plan.quotas.per_source().to_vec(),
                retention_floor: plan.retention_floor,
                kept_fraction: plan.kept_fraction,
                replicas_added: plan.replicas_added.clone(),
            };
            (
                Some(report),
                plan.quotas.per_source().to_vec(),
                plan.placement,
                Some(caps),
            )
        }
        (None, Some(kept)) => (None, kept.clone(), p.placement.clone(), None),
        (None, None) => unreachable!("validated"),
    };
    let problem = redistribute::Problem {
        n_ranks,
        kept,
        instances: placement.all_instances(),
        base_load: p.base_load.clone().unwrap_or_else(|| vec![0; n_ranks]),
        rank_capacity: caps.clone(),
    };
    let load = p.load_model.unwrap_or_default();
    let cfg = redistribute::Config {
        solver: opts.solver,
        load,
        ilp_time_limit: opts.ilp_time_limit,
    };
    let a = redistribute::solve(&problem, &cfg)?;
    let ranks = rank_reports(p, &placement, &a, caps.as_deref());
    Ok(PlanReport {
        controller,
        peak_lower_bound: redistribute::peak_lower_bound(&problem, &load),
        instances: problem.instances,
        assignment: a.routes,
        ranks,
        peak_load: a.peak,
        solver: a.solver,
        status: a.status,
        solve_micros: a.solve_micros,
    })
}

fn rank_reports(
    p: &Problem,
    placement: &Placement,
    a: &redistribute::Assignment,
    caps: Option<&[u64]>,
) -> Vec<RankReport> {
    let all = placement.instances_per_rank(p.n_ranks);
    // One pass over owners and one over routes: O(ranks + experts + routes).
    let mut owned_per_rank = vec![0u64; p.n_ranks];
    for &o in &placement.owner {
        owned_per_rank[o] += 1;
    }
    let (mut recv_per_rank, mut sent_per_rank) = (vec![0u64; p.n_ranks], vec![0u64; p.n_ranks]);
    for x in a.routes.iter().filter(|x| x.rank != x.source) {
        recv_per_rank[x.rank] = recv_per_rank[x.rank].saturating_add(x.pairs);
        sent_per_rank[x.source] = sent_per_rank[x.source].saturating_add(x.pairs);
    }
    (0..p.n_ranks)
        .map(|r| {
            let (owned, recv, sent) = (owned_per_rank[r], recv_per_rank[r], sent_per_rank[r]);
            let cost = p.cost_model.as_ref();
            let bytes = |n: u64, per: fn(&CostModel) -> u64| cost.map(|c| n.saturating_mul(per(c)));
            let placement_bytes = bytes(owned, CostModel::instance_bytes);
            let replica_bytes = bytes(all[r] - owned, CostModel::instance_bytes);
            let buffer_bytes = bytes(a.pairs_per_rank[r], CostModel::row_bytes);
            RankReport {
                rank: r,
                pairs: a.pairs_per_rank[r],
                load: a.load[r],
                pair_capacity: caps.map(|c| c[r]),
                placement_bytes,
                replica_bytes,
                buffer_bytes,
                memory_bytes: cost.map(|_| {
                    [placement_bytes, replica_bytes, buffer_bytes]
                        .iter()
                        .fold(0u64, |a, b| a.saturating_add(b.unwrap_or(0)))
                }),
                memory_budget_bytes: p.budgets.as_ref().map(|b| b[r].memory_bytes),
                dispatch_in_bytes: bytes(recv, CostModel::row_bytes),
                dispatch_out_bytes: bytes(sent, CostModel::row_bytes),
            }
        })
        .collect()
}
