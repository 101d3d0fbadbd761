//! Exact compute-only solver: the smallest feasible peak, found by an
//! incremental search over the peak with max-flow feasibility checks (see
//! the crate doc).
//!
//! Raising the peak only raises sink capacities, so a flow found for one
//! peak stays valid for every larger one and is *augmented*, not recomputed:
//! the search starts at the lower bound (usually already optimal), gallops
//! upward, then bisects from a saved residual state. When every expert is
//! held by one rank the assignment is forced and no flow is built.

use crate::flow::{EdgeId, FlowGraph};
use crate::{peak_lower_bound, ExpertFlows, LoadModel, Problem, RedistributeError};

/// The flow network source → expert → instance rank → sink.
struct Network {
    graph: FlowGraph,
    instance_edges: Vec<Vec<EdgeId>>,
    sink_edges: Vec<EdgeId>,
    sink: usize,
}

fn build(problem: &Problem, kept: &[u64]) -> Network {
    let (n_experts, n_ranks) = (problem.n_experts(), problem.n_ranks);
    let sink = n_experts + n_ranks + 1;
    let mut graph = FlowGraph::new(sink + 1);
    // Sink edges first: Dinic scans adjacency lists newest-first, so experts
    // are tried before the (few) long residual paths through ranks.
    let sink_edges = (0..n_ranks)
        .map(|r| graph.add_edge(1 + n_experts + r, sink, 0))
        .collect();
    let mut instance_edges = Vec::with_capacity(n_experts);
    for (e, inst) in problem.instances.iter().enumerate() {
        if kept[e] == 0 {
            instance_edges.push(Vec::new());
            continue;
        }
        graph.add_edge(0, 1 + e, kept[e]);
        instance_edges.push(
            inst.iter()
                .map(|&r| graph.add_edge(1 + e, 1 + n_experts + r, kept[e]))
                .collect(),
        );
    }
    Network {
        graph,
        instance_edges,
        sink_edges,
        sink,
    }
}

/// Pairs rank `r` can take without its load exceeding `peak`.
fn rank_room(problem: &Problem, load: &LoadModel, r: usize, peak: u64) -> u64 {
    match peak.checked_sub(problem.base_load[r]) {
        None => 0,
        Some(slack) => (slack / load.compute_per_pair).min(problem.cap(r)),
    }
}

/// Raises every sink capacity to the room at `peak` and augments; returns
/// the flow added.
fn raise_to(net: &mut Network, problem: &Problem, load: &LoadModel, peak: u64) -> u64 {
    for (r, &e) in net.sink_edges.iter().enumerate() {
        net.graph.set_capacity(e, rank_room(problem, load, r, peak));
    }
    net.graph.max_flow(0, net.sink)
}

fn flows_of(net: &Network, problem: &Problem) -> ExpertFlows {
    problem
        .instances
        .iter()
        .zip(&net.instance_edges)
        .map(|(inst, edges)| {
            if edges.is_empty() {
                vec![0; inst.len()]
            } else {
                edges.iter().map(|&e| net.graph.flow(e)).collect()
            }
        })
        .collect()
}

/// The one assignment there is when every expert is held by one rank (its
/// instances all the same rank): every kept pair on it. `None` when some
/// expert has instances on two ranks, or a rank's pairs exceed its
/// capacity (the search then reports it).
fn forced(problem: &Problem, kept: &[u64]) -> Option<ExpertFlows> {
    let mut on = vec![0u64; problem.n_ranks];
    for (inst, &k) in problem.instances.iter().zip(kept) {
        let (&first, rest) = inst.split_first()?;
        if rest.iter().any(|&r| r != first) {
            return None;
        }
        on[first] = on[first].checked_add(k)?;
    }
    if on.iter().enumerate().any(|(r, &n)| n > problem.cap(r)) {
        return None;
    }
    Some(
        problem
            .instances
            .iter()
            .zip(kept)
            .map(|(inst, &k)| {
                let mut f = vec![0; inst.len()];
                f[0] = k;
                f
            })
            .collect(),
    )
}

/// Optimal expert-level flows; `kept` is [`Problem::kept_per_expert`].
pub(crate) fn solve(
    problem: &Problem,
    load: &LoadModel,
    kept: &[u64],
) -> Result<ExpertFlows, RedistributeError> {
    if let Some(f) = forced(problem, kept) {
        return Ok(f);
    }
    let total: u64 = kept.iter().sum();
    let mut net = build(problem, kept);
    let c = load.compute_per_pair;
    // At this peak every rank has room for every pair (caps aside).
    let t_max = (0..problem.n_ranks)
        .map(|r| problem.base_load[r] + c * problem.cap(r).min(total))
        .max()
        .unwrap_or(0);
    let mut lo = peak_lower_bound(problem, load).min(t_max);
    let mut value = raise_to(&mut net, problem, load, lo);
    if value == total {
        return Ok(flows_of(&net, problem));
    }
    // Gallop upward from the infeasible `lo`, keeping its residual state.
    let mut saved = (net.graph.snapshot(), value);
    let mut step = 1u64;
    let hi = loop {
        if lo >= t_max {
            return Err(RedistributeError::Infeasible {
                placeable: value,
                total,
            });
        }
        let next = lo.saturating_add(step).min(t_max);
        value += raise_to(&mut net, problem, load, next);
        if value == total {
            break next;
        }
        lo = next;
        saved = (net.graph.snapshot(), value);
        step = step.saturating_mul(2);
    };
    // Bisect (lo, hi]: lo infeasible (state saved), hi feasible.
    let mut best = flows_of(&net, problem);
    let mut hi = hi;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        net.graph.restore(&saved.0);
        let v = saved.1 + raise_to(&mut net, problem, load, mid);
        if v == total {
            hi = mid;
            best = flows_of(&net, problem);
        } else {
            lo = mid;
            saved = (net.graph.snapshot(), v);
        }
    }
    Ok(best)
}
