//! Exact compute-only solver: the smallest feasible peak, found by an
//! incremental search over the peak with max-flow feasibility checks (see
//! the crate doc).
//!
//! Raising the peak only raises sink capacities, so a flow found for one
//! peak stays valid for every larger one and is *augmented*, not recomputed:
//! the search starts at the lower bound (usually already optimal) and, while
//! the flow falls short, jumps to the smallest peak at which the flow's
//! minimum cut has room for every pair ([`crate::flow`]'s cut-guided
//! search). The experts held by one rank are placed before the search
//! (their pairs are their rank's, and no peak below that load is tried)
//! and the flow carries only the experts with a choice — at 16 ranks with
//! a replica slot each, ~16 of 128 experts; none when every expert is held
//! by one rank, whose assignment is then forced. The peak is the same
//! optimum; the split among equally good ones may differ from a flow over
//! every expert.

use crate::flow::{EdgeId, FlowGraph};
use crate::{peak_lower_bound, ExpertFlows, LoadModel, Problem, RedistributeError};

/// The flow network source → expert → instance rank → sink.
struct Network {
    graph: FlowGraph,
    instance_edges: Vec<Vec<EdgeId>>,
    sink_edges: Vec<EdgeId>,
    sink: usize,
    /// Pairs already on each rank before the flow: those of the experts
    /// held by that rank alone (none in the certificate's network).
    fixed: Vec<u64>,
}

/// The flow network over `kept` (pairs per expert; an expert with none
/// gets no edge), with `fixed` pairs on each rank beside it.
fn build(problem: &Problem, kept: &[u64], fixed: Vec<u64>) -> Network {
    let (n_experts, n_ranks) = (problem.n_experts(), problem.n_ranks);
    let sink = n_experts + n_ranks + 1;
    let edges = n_ranks
        + (problem.instances.iter().zip(kept))
            .filter(|&(_, &k)| k > 0)
            .map(|(inst, _)| 1 + inst.len())
            .sum::<usize>();
    let mut graph = FlowGraph::with_capacity(sink + 1, edges);
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
        fixed,
    }
}

/// Pairs rank `r` can take without its load exceeding `peak`, less the
/// `fixed` pairs already on it (the search starts where they fit).
fn rank_room(problem: &Problem, load: &LoadModel, (r, fixed): (usize, u64), peak: u64) -> u64 {
    match peak.checked_sub(problem.base_load[r]) {
        None => 0,
        Some(slack) => (slack / load.compute_per_pair)
            .min(problem.cap(r))
            .saturating_sub(fixed),
    }
}

/// Raises every sink capacity to the room at `peak` and augments; returns
/// the flow added.
fn raise_to(net: &mut Network, problem: &Problem, load: &LoadModel, peak: u64) -> u64 {
    for (r, &e) in net.sink_edges.iter().enumerate() {
        let room = rank_room(problem, load, (r, net.fixed[r]), peak);
        net.graph.set_capacity(e, room);
    }
    net.graph.max_flow(0, net.sink)
}

/// Each expert's flow per instance; an expert with pairs but no edge was
/// fixed on its one rank ([`one_rank_experts`]) and keeps them all there.
fn flows_of(net: &Network, problem: &Problem, kept: &[u64]) -> ExpertFlows {
    problem
        .instances
        .iter()
        .zip(&net.instance_edges)
        .zip(kept)
        .map(|((inst, edges), &k)| {
            if edges.is_empty() {
                let mut f = vec![0; inst.len()];
                if let Some(first) = f.first_mut() {
                    *first = k;
                }
                f
            } else {
                edges.iter().map(|&e| net.graph.flow(e)).collect()
            }
        })
        .collect()
}

/// The experts held by one rank have no choice: their pairs are that
/// rank's before the search (`fixed`, per rank) and the flow carries the
/// others' (`free`, per expert: zero for a fixed one). `None` when those
/// pairs alone exceed a rank's cap (the full network's search then
/// reports what fits).
fn one_rank_experts(problem: &Problem, kept: &[u64]) -> Option<(Vec<u64>, Vec<u64>)> {
    let mut fixed = vec![0u64; problem.n_ranks];
    let mut free = kept.to_vec();
    for (e, inst) in problem.instances.iter().enumerate() {
        if let [r] = inst[..] {
            fixed[r] = fixed[r].checked_add(kept[e])?;
            free[e] = 0;
        }
    }
    let fits = fixed.iter().enumerate().all(|(r, &f)| f <= problem.cap(r));
    fits.then_some((fixed, free))
}

/// Whether a fresh max-flow at `peak` places every kept pair: the
/// certificate the tests hold the search's optimum to (feasible at its
/// peak, not one unit below).
#[cfg(test)]
pub(crate) fn feasible_at(problem: &Problem, load: &LoadModel, peak: u64) -> bool {
    let kept = problem.kept_per_expert();
    let mut net = build(problem, &kept, vec![0; problem.n_ranks]);
    raise_to(&mut net, problem, load, peak) == kept.iter().sum::<u64>()
}

/// Optimal expert-level flows; `kept` is [`Problem::kept_per_expert`].
pub(crate) fn solve(
    problem: &Problem,
    load: &LoadModel,
    kept: &[u64],
) -> Result<ExpertFlows, RedistributeError> {
    let total: u64 = kept.iter().sum();
    // The flow carries only the experts with a choice; the others' pairs
    // sit on their rank, and no peak below their load is tried.
    let (fixed, free) = one_rank_experts(problem, kept)
        .unwrap_or_else(|| (vec![0; problem.n_ranks], kept.to_vec()));
    let c = load.compute_per_pair;
    let floor = (0..problem.n_ranks)
        .map(|r| problem.base_load[r] + c * fixed[r])
        .max()
        .unwrap_or(0);
    let placed = total - free.iter().sum::<u64>();
    let mut net = build(problem, &free, fixed);
    // At this peak every rank has room for every pair (caps aside).
    let t_max = (0..problem.n_ranks)
        .map(|r| problem.base_load[r] + c * problem.cap(r).min(total))
        .max()
        .unwrap_or(0);
    // From the lower bound (usually already optimal) upward: each short flow
    // names the cut that binds, and the peak jumps to where that cut has
    // room for every pair. Every jump lands at or below the optimum (a cut's
    // room is necessary), capacities only rise, so each step augments the
    // last flow, and the first peak whose flow carries every pair is the
    // smallest feasible one.
    let mut peak = peak_lower_bound(problem, load).max(floor).min(t_max);
    let mut value = placed + raise_to(&mut net, problem, load, peak);
    while value < total {
        let Some(next) = cut_peak(&mut net, problem, load, total - placed, peak, t_max) else {
            return Err(RedistributeError::Infeasible {
                placeable: value,
                total,
            });
        };
        peak = next;
        value += raise_to(&mut net, problem, load, peak);
    }
    Ok(flows_of(&net, problem, kept))
}

/// The smallest peak in `(peak, t_max]` at which the minimum cut of the
/// network's current maximum flow (short of `total` at `peak`) has room for
/// `total` pairs: its fixed edges plus its ranks' room at that peak. `None`
/// when not even `t_max` gives it room: no peak is feasible.
fn cut_peak(
    net: &mut Network,
    problem: &Problem,
    load: &LoadModel,
    total: u64,
    peak: u64,
    t_max: u64,
) -> Option<u64> {
    let side = net.graph.source_side(0);
    let graph = &net.graph;
    // The cut's capacity: the edges it crosses that do not enter the sink
    // (fixed), plus the room of its ranks (the peak's).
    let fixed = graph
        .cut_edges(&side)
        .filter(|&(_, _, to)| to != net.sink)
        .fold(0u64, |a, (e, _, _)| a.saturating_add(graph.capacity(e)));
    let ranks: Vec<usize> = (0..problem.n_ranks)
        .filter(|&r| graph.crosses(net.sink_edges[r], &side))
        .collect();
    let room = |p: u64| {
        ranks.iter().fold(0u64, |a, &r| {
            a.saturating_add(rank_room(problem, load, (r, net.fixed[r]), p))
        })
    };
    let need = total.saturating_sub(fixed);
    if peak >= t_max || room(t_max) < need {
        return None;
    }
    // room(lo) < need ≤ room(hi); room only grows with the peak.
    let (mut lo, mut hi) = (peak, t_max);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if room(mid) >= need {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}
