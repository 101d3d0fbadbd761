//! # redistribute — place kept pairs on existing expert instances
//!
//! After the backward's quotas and LRM selection, source rank `s` holds
//! `kept[s][e]` pairs for expert `e`. Expert `e` has a fixed list of
//! *instances* — its owner rank and the replicas the controller placed at
//! forward time (no new replicas appear here). [`solve`] decides how many of
//! the kept pairs of each `(source, expert)` go to each instance so that the
//! busiest rank is as idle as possible.
//!
//! ## Load model
//!
//! Loads are integers in caller-chosen units (for example nanoseconds or
//! kFLOP). With `P_r` the pairs processed on rank `r`, `sent_r` the pairs
//! whose source is `r` but are processed elsewhere and `recv_r` the pairs
//! processed on `r` whose source is elsewhere:
//!
//! ```text
//! load_r = base_r + c · P_r + m · (sent_r + recv_r)
//! peak   = max_r load_r            (minimised)
//! ```
//!
//! `c` = [`LoadModel::compute_per_pair`] (≥ 1), `m` =
//! [`LoadModel::network_per_pair`] (0 for the compute-only model). An optional
//! per-rank cap `P_r ≤ cap_r` ([`Problem::rank_capacity`]) carries the quota
//! controller's memory and network budgets, so whatever the solver returns
//! fits them.
//!
//! ## Solvers ([`Solver`])
//!
//! * **Exact** (compute-only, `m = 0`): for a candidate peak `T`, rank `r` can
//!   take `min(cap_r, ⌊(T − base_r)/c⌋)` pairs; `T` is feasible iff the
//!   integral max-flow source → expert (`K_e`) → instance ranks → sink carries
//!   every kept pair. A search upward from the lower bounds of
//!   [`peak_lower_bound`], each step one Dinic max-flow ([`flow`]) that
//!   augments the last one, returns the optimum of the ILP below: while the
//!   flow falls short, its minimum cut (a set of experts and the ranks they
//!   can reach) says how far `T` must rise before that cut has room, and `T`
//!   jumps there (usually one or two steps, where a bisection took fifteen).
//! * **ILP** (good_lp; microlp by default, `highs` / `coin_cbc` as cargo
//!   features): integer `x[e][r]` (or `y[s][e][r]` when `m > 0`) and an
//!   *integer* peak `T` (a continuous peak makes microlp and CBC stall),
//!   `Σ_r x[e][r] = K_e`, `load_r ≤ T`, `P_r ≤ cap_r`, minimise `T`. It runs
//!   under [`Config::ilp_time_limit`]; on a time-out with an incumbent that
//!   plan is returned ([`Status::TimeLimit`]); with none, or on a solver
//!   error, the greedy plan is returned ([`Status::FellBack`]).
//! * **Greedy** (baseline, longest-processing-time order): experts in
//!   decreasing `K_e`, each water-filled onto its least-loaded instances.
//!   If caps leave it stuck, it falls back to the exact solver.
//! * **Even** (no search, [`even_split`]): each (source, expert)'s pairs split
//!   evenly over the expert's instances — the split of the dropless
//!   replication baselines (SYMI-like), kept for comparing against them.
//!   Rank capacities are not consulted.
//!
//! Expert-level flows are split back to sources deterministically: pairs stay
//! on their source rank where the source hosts an instance, the rest fill
//! instances in rank order. This never changes the compute load and sends
//! as few pairs as the expert-level plan allows.
//!
//! ## Invariants
//!
//! Every returned [`Assignment`] conserves pairs per `(source, expert)`, only
//! uses instances of the pair's expert, respects `rank_capacity`, and reports
//! loads computed from the routes themselves. Exact's peak equals the ILP
//! optimum; greedy's peak is never below it.
//!
//! ## Not here
//!
//! No rows are moved (see `pack`), no quotas are chosen (see `quota`), no I/O.
//! Only this crate depends on good_lp.

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod flow;

mod exact;
mod greedy;
mod ilp;

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RedistributeError {
    /// A vector's length does not match the problem's dimensions.
    #[error("{what}: expected length {expected}, got {got}")]
    Shape {
        /// Which field.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// An expert has kept pairs but no instance to run them.
    #[error("expert {expert} has {pairs} kept pairs but no instance")]
    NoInstance {
        /// The expert.
        expert: usize,
        /// Its kept pairs.
        pairs: u64,
    },
    /// An instance names a rank outside `0..n_ranks`, or appears twice.
    #[error(
        "expert {expert}: instance rank {rank} is out of range or repeated (n_ranks = {n_ranks})"
    )]
    BadInstance {
        /// The expert.
        expert: usize,
        /// The offending rank.
        rank: usize,
        /// Number of ranks.
        n_ranks: usize,
    },
    /// The per-rank caps cannot hold every kept pair.
    #[error("rank capacities hold only {placeable} of {total} kept pairs")]
    Infeasible {
        /// Pairs that fit.
        placeable: u64,
        /// Pairs to place.
        total: u64,
    },
    /// The exact solver only handles the compute-only model.
    #[error("the exact solver needs network_per_pair = 0 (got {network_per_pair}); use the ILP")]
    ExactNeedsComputeOnly {
        /// The configured network weight.
        network_per_pair: u64,
    },
    /// `compute_per_pair` must be at least 1.
    #[error("compute_per_pair must be >= 1")]
    ZeroComputeCost,
    /// A sum of loads does not fit in 64 bits.
    #[error("load overflow: counts or costs are too large")]
    Overflow,
}

/// A redistribution problem. Ranks and experts are indices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Problem {
    /// Number of ranks (GPUs).
    pub n_ranks: usize,
    /// Kept pairs, `[n_ranks][n_experts]`: source rank × expert.
    pub kept: Vec<Vec<u64>>,
    /// Ranks holding an instance of each expert (owner first, then replicas).
    pub instances: Vec<Vec<usize>>,
    /// Load already on each rank before this layer's pairs, `[n_ranks]`.
    pub base_load: Vec<u64>,
    /// Optional cap on pairs processed per rank, `[n_ranks]`.
    pub rank_capacity: Option<Vec<u64>>,
}

impl Problem {
    /// Number of experts.
    pub fn n_experts(&self) -> usize {
        self.instances.len()
    }

    /// Kept pairs per expert, summed over sources.
    pub fn kept_per_expert(&self) -> Vec<u64> {
        let mut k = vec![0u64; self.n_experts()];
        for row in &self.kept {
            for (e, &n) in row.iter().enumerate() {
                k[e] = k[e].saturating_add(n);
            }
        }
        k
    }

    /// Cap of rank `r` (unlimited when no caps are given).
    pub fn cap(&self, r: usize) -> u64 {
        self.rank_capacity.as_ref().map_or(u64::MAX, |c| c[r])
    }
}

/// Weights of the load model (see the crate doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadModel {
    /// Load of processing one pair (`c`, ≥ 1).
    pub compute_per_pair: u64,
    /// Load of sending or receiving one pair's rows (`m`).
    pub network_per_pair: u64,
}

impl Default for LoadModel {
    fn default() -> Self {
        Self {
            compute_per_pair: 1,
            network_per_pair: 0,
        }
    }
}

/// Which algorithm [`solve`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Solver {
    /// Peak search with max-flow feasibility checks (optimal, compute-only).
    #[default]
    Exact,
    /// Integer program through good_lp.
    Ilp,
    /// Longest-processing-time water-filling (baseline).
    Greedy,
    /// Every (source, expert)'s pairs split evenly over the expert's
    /// instances ([`even_split`]): the dropless replication baselines'
    /// split (SYMI-like), not a search; rank capacities are not consulted.
    Even,
}

/// Configuration of [`solve`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Algorithm.
    pub solver: Solver,
    /// Load model.
    pub load: LoadModel,
    /// Time limit handed to the ILP solver.
    pub ilp_time_limit: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            solver: Solver::Exact,
            load: LoadModel::default(),
            ilp_time_limit: Duration::from_secs(2),
        }
    }
}

/// `pairs` kept pairs of `(source, expert)` processed on `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// Source rank (where the token lives).
    pub source: usize,
    /// Expert.
    pub expert: usize,
    /// Rank of the instance that processes the pairs.
    pub rank: usize,
    /// Number of pairs.
    pub pairs: u64,
}

/// How the solve ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The solver proved its plan optimal (exact, ILP) or the heuristic finished (greedy).
    Done,
    /// The ILP hit its time limit; its best plan is returned.
    TimeLimit,
    /// The requested solver failed; the named fallback's plan is returned.
    FellBack {
        /// Why the requested solver did not deliver.
        reason: String,
        /// Solver whose plan is returned.
        used: Solver,
    },
}

/// A solved redistribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// Non-empty routes, sorted by (expert, source, rank).
    pub routes: Vec<Route>,
    /// Modelled load per rank.
    pub load: Vec<u64>,
    /// Pairs processed per rank.
    pub pairs_per_rank: Vec<u64>,
    /// `max(load)`.
    pub peak: u64,
    /// The solver requested.
    pub solver: Solver,
    /// How it ended.
    pub status: Status,
    /// Wall time of the solve in microseconds.
    pub solve_micros: f64,
}

/// Checks dimensions, instance lists and caps.
pub fn validate(problem: &Problem) -> Result<(), RedistributeError> {
    let (r, e) = (problem.n_ranks, problem.n_experts());
    shape("kept", r, problem.kept.len())?;
    for row in &problem.kept {
        shape("kept[source]", e, row.len())?;
    }
    shape("base_load", r, problem.base_load.len())?;
    if let Some(c) = &problem.rank_capacity {
        shape("rank_capacity", r, c.len())?;
    }
    // Every later sum (per expert, per rank, loads) is bounded by the total.
    problem
        .kept
        .iter()
        .flatten()
        .try_fold(0u64, |a, &k| a.checked_add(k))
        .ok_or(RedistributeError::Overflow)?;
    let k = problem.kept_per_expert();
    let mut seen = vec![usize::MAX; r];
    for (expert, inst) in problem.instances.iter().enumerate() {
        if inst.is_empty() && k[expert] > 0 {
            return Err(RedistributeError::NoInstance {
                expert,
                pairs: k[expert],
            });
        }
        for &rank in inst {
            if rank >= r || seen[rank] == expert {
                return Err(RedistributeError::BadInstance {
                    expert,
                    rank,
                    n_ranks: r,
                });
            }
            seen[rank] = expert;
        }
    }
    Ok(())
}

fn shape(what: &'static str, expected: usize, got: usize) -> Result<(), RedistributeError> {
    if expected == got {
        Ok(())
    } else {
        Err(RedistributeError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// Solves `problem` with the configured solver.
pub fn solve(problem: &Problem, cfg: &Config) -> Result<Assignment, RedistributeError> {
    let start = Instant::now();
    validate(problem)?;
    if cfg.load.compute_per_pair == 0 {
        return Err(RedistributeError::ZeroComputeCost);
    }
    let kept = problem.kept_per_expert();
    checked_total_load(problem, &cfg.load, &kept)?;
    let (routes, status) = match cfg.solver {
        Solver::Exact => {
            if cfg.load.network_per_pair != 0 {
                return Err(RedistributeError::ExactNeedsComputeOnly {
                    network_per_pair: cfg.load.network_per_pair,
                });
            }
            (
                split_to_sources(problem, &exact::solve(problem, &cfg.load, &kept)?),
                Status::Done,
            )
        }
        Solver::Greedy => match greedy::solve(problem, &cfg.load) {
            Some(flows) => (split_to_sources(problem, &flows), Status::Done),
            None => (
                split_to_sources(problem, &exact::solve(problem, &cfg.load, &kept)?),
                Status::FellBack {
                    reason: "rank capacities left greedy stuck".into(),
                    used: Solver::Exact,
                },
            ),
        },
        Solver::Ilp => ilp::solve(problem, cfg)?,
        Solver::Even => (even_split(&problem.kept, &problem.instances), Status::Done),
    };
    let mut a = assignment_from_routes(problem, &cfg.load, routes);
    a.solver = cfg.solver;
    a.status = status;
    a.solve_micros = start.elapsed().as_secs_f64() * 1e6;
    Ok(a)
}

/// Every source's pairs of each expert split evenly over the expert's
/// instances (`instances[e]`, owner first): `n` pairs over `m` instances
/// give `⌊n/m⌋` to each and one more to `n mod m` of them, the first ones
/// counted from a starting instance that rotates with the source, so the
/// remainders of many sources spread. Routes with no pair are left out;
/// sorted by (expert, source, rank).
pub fn even_split(kept: &[Vec<u64>], instances: &[Vec<usize>]) -> Vec<Route> {
    let mut routes = Vec::new();
    let mut by_rank: Vec<usize> = Vec::new();
    for (expert, inst) in instances.iter().enumerate() {
        let m = inst.len().max(1);
        // Positions in rank order, so each (expert, source)'s routes come
        // out sorted by rank with no sort of the whole list.
        by_rank.clear();
        by_rank.extend(0..inst.len());
        by_rank.sort_by_key(|&i| inst[i]);
        for (source, row) in kept.iter().enumerate() {
            let n = row.get(expert).copied().unwrap_or(0);
            for &i in &by_rank {
                let turn = ((i + m - source % m) % m) as u64;
                let pairs = n / m as u64 + u64::from(turn < n % m as u64);
                if pairs > 0 {
                    routes.push(Route {
                        source,
                        expert,
                        rank: inst[i],
                        pairs,
                    });
                }
            }
        }
    }
    routes
}

/// Rejects problems whose worst-case load overflows `u64`.
fn checked_total_load(
    problem: &Problem,
    load: &LoadModel,
    kept: &[u64],
) -> Result<(), RedistributeError> {
    let total: u64 = kept
        .iter()
        .try_fold(0u64, |a, &k| a.checked_add(k))
        .ok_or(RedistributeError::Overflow)?;
    let per_pair = load
        .compute_per_pair
        .checked_add(
            load.network_per_pair
                .checked_mul(2)
                .ok_or(RedistributeError::Overflow)?,
        )
        .ok_or(RedistributeError::Overflow)?;
    let base_max = problem.base_load.iter().copied().max().unwrap_or(0);
    total
        .checked_mul(per_pair)
        .and_then(|x| x.checked_add(base_max))
        .and_then(|x| x.checked_mul(2))
        .map(|_| ())
        .ok_or(RedistributeError::Overflow)
}

fn route_key(r: &Route) -> (usize, usize, usize) {
    (r.expert, r.source, r.rank)
}

/// Builds an [`Assignment`] (loads, peak) from routes under `load`.
pub fn assignment_from_routes(
    problem: &Problem,
    load: &LoadModel,
    mut routes: Vec<Route>,
) -> Assignment {
    routes.retain(|r| r.pairs > 0);
    if !routes
        .windows(2)
        .all(|w| route_key(&w[0]) <= route_key(&w[1]))
    {
        routes.sort_unstable_by_key(route_key);
    }
    let n = problem.n_ranks;
    let mut pairs_per_rank = vec![0u64; n];
    let mut moved = vec![0u64; n];
    for r in &routes {
        pairs_per_rank[r.rank] += r.pairs;
        if r.rank != r.source {
            moved[r.rank] += r.pairs;
            moved[r.source] += r.pairs;
        }
    }
    let load: Vec<u64> = (0..n)
        .map(|r| {
            problem.base_load[r]
                + load.compute_per_pair * pairs_per_rank[r]
                + load.network_per_pair * moved[r]
        })
        .collect();
    let peak = load.iter().copied().max().unwrap_or(0);
    Assignment {
        routes,
        load,
        pairs_per_rank,
        peak,
        solver: Solver::Exact,
        status: Status::Done,
        solve_micros: 0.0,
    }
}

/// The largest of three simple lower bounds on the compute-only peak: the
/// largest base load; the average over all ranks; and for each expert, the
/// average over its instances of their base loads plus its pairs.
/// (Caps only raise the optimum, so these stay valid with caps.)
pub fn peak_lower_bound(problem: &Problem, load: &LoadModel) -> u64 {
    let c = load.compute_per_pair;
    let k = problem.kept_per_expert();
    let max_base = problem.base_load.iter().copied().max().unwrap_or(0);
    let n = problem.n_ranks.max(1) as u64;
    let total = problem.base_load.iter().sum::<u64>() + c * k.iter().sum::<u64>();
    let mut lb = max_base.max(total.div_ceil(n));
    for (e, inst) in problem.instances.iter().enumerate() {
        if inst.is_empty() {
            continue;
        }
        let s: u64 = inst.iter().map(|&r| problem.base_load[r]).sum::<u64>() + c * k[e];
        lb = lb.max(s.div_ceil(inst.len() as u64));
    }
    lb
}

/// Describes the first way `routes` fails to conserve pairs per
/// `(source, expert)` or to use only instances of the expert; `None` if they
/// are a valid plan for `problem` (caps not checked).
pub fn conservation_error(problem: &Problem, routes: &[Route]) -> Option<String> {
    let mut got = vec![vec![0u64; problem.n_experts()]; problem.n_ranks];
    for r in routes {
        if r.source >= problem.n_ranks || r.expert >= problem.n_experts() {
            return Some(format!("route {r:?} is out of range"));
        }
        if !problem.instances[r.expert].contains(&r.rank) {
            return Some(format!(
                "route {r:?} uses a rank without an instance of its expert"
            ));
        }
        got[r.source][r.expert] += r.pairs;
    }
    for (s, row) in got.iter().enumerate() {
        for (e, &n) in row.iter().enumerate() {
            if n != problem.kept[s][e] {
                return Some(format!(
                    "source {s} expert {e}: {n} pairs routed, {} kept",
                    problem.kept[s][e]
                ));
            }
        }
    }
    None
}

/// Expert-level plan: `flows[e][i]` pairs of expert `e` on its `i`-th instance.
pub(crate) type ExpertFlows = Vec<Vec<u64>>;

/// Splits expert-level flows into per-source routes: local pairs first, then
/// the remaining sources fill the remaining instances in rank order. Routes
/// come out sorted by (expert, source, rank) without a sort.
fn split_to_sources(problem: &Problem, flows: &ExpertFlows) -> Vec<Route> {
    // Per expert at most one local route per instance, and the other
    // routes each end a source's pairs or an instance's room: at most
    // sources + instances of them.
    let instances: usize = problem.instances.iter().map(Vec::len).sum();
    let mut routes = Vec::with_capacity(problem.n_ranks * problem.n_experts() + 2 * instances);
    let mut left_inst: Vec<u64> = Vec::new();
    let mut local: Vec<u64> = vec![0; problem.n_ranks];
    let mut order: Vec<usize> = Vec::new();
    for (expert, inst) in problem.instances.iter().enumerate() {
        left_inst.clear();
        left_inst.extend_from_slice(&flows[expert]);
        for (i, &rank) in inst.iter().enumerate() {
            local[rank] = problem.kept[rank][expert].min(left_inst[i]);
            left_inst[i] -= local[rank];
        }
        order.clear();
        order.extend(0..inst.len());
        order.sort_unstable_by_key(|&i| inst[i]);
        let mut oi = 0;
        // `local` is zero off this expert's instances (reset below).
        for (source, &here) in local.iter().enumerate() {
            let mut left = problem.kept[source][expert] - here;
            let local_route = Route {
                source,
                expert,
                rank: source,
                pairs: here,
            };
            // The local route goes in before the first other route past
            // its rank, so the source's routes stay in rank order (no other
            // route reaches the source's own instance: its local pairs
            // either filled it or were all the source had).
            let mut local_due = here > 0;
            while left > 0 {
                let Some(&i) = order.get(oi) else { break };
                let take = left.min(left_inst[i]);
                if take > 0 {
                    if local_due && inst[i] > source {
                        routes.push(local_route);
                        local_due = false;
                    }
                    routes.push(Route {
                        source,
                        expert,
                        rank: inst[i],
                        pairs: take,
                    });
                    left -= take;
                    left_inst[i] -= take;
                }
                if left_inst[i] == 0 {
                    oi += 1;
                }
            }
            if local_due {
                routes.push(local_route);
            }
        }
        for &rank in inst {
            local[rank] = 0;
        }
    }
    routes
}

#[cfg(test)]
mod tests;
