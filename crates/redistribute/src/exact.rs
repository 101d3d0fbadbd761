//! Exact compute-only solver: binary search over the peak with max-flow
//! feasibility checks (see the crate doc).

use crate::flow::{EdgeId, FlowGraph};
use crate::{greedy, peak_lower_bound, ExpertFlows, LoadModel, Problem, RedistributeError};

/// The flow network source → expert → instance rank → sink, built once.
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
    let mut instance_edges = Vec::with_capacity(n_experts);
    for (e, inst) in problem.instances.iter().enumerate() {
        graph.add_edge(0, 1 + e, kept[e]);
        instance_edges.push(
            inst.iter()
                .map(|&r| graph.add_edge(1 + e, 1 + n_experts + r, kept[e]))
                .collect(),
        );
    }
    let sink_edges = (0..n_ranks)
        .map(|r| graph.add_edge(1 + n_experts + r, sink, 0))
        .collect();
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

/// Max flow when every rank may rise to `peak`.
fn flow_at(net: &mut Network, problem: &Problem, load: &LoadModel, peak: u64) -> u64 {
    net.graph.clear_flow();
    for (r, &e) in net.sink_edges.iter().enumerate() {
        net.graph.set_capacity(e, rank_room(problem, load, r, peak));
    }
    net.graph.max_flow(0, net.sink)
}

fn flows_of(net: &Network) -> ExpertFlows {
    net.instance_edges
        .iter()
        .map(|edges| edges.iter().map(|&e| net.graph.flow(e)).collect())
        .collect()
}

fn compute_peak(problem: &Problem, load: &LoadModel, flows: &ExpertFlows) -> u64 {
    let mut l = problem.base_load.clone();
    for (e, inst) in problem.instances.iter().enumerate() {
        for (i, &r) in inst.iter().enumerate() {
            l[r] += load.compute_per_pair * flows[e][i];
        }
    }
    l.into_iter().max().unwrap_or(0)
}

pub(crate) fn solve(problem: &Problem, load: &LoadModel) -> Result<ExpertFlows, RedistributeError> {
    let kept = problem.kept_per_expert();
    let total: u64 = kept.iter().sum();
    let mut net = build(problem, &kept);
    let (mut best, mut hi) = match greedy::solve(problem, load) {
        Some(flows) => {
            let peak = compute_peak(problem, load, &flows);
            (flows, peak)
        }
        None => {
            // Greedy got stuck on the caps: start from the loosest peak.
            let hi = (0..problem.n_ranks)
                .map(|r| problem.base_load[r] + load.compute_per_pair * problem.cap(r).min(total))
                .max()
                .unwrap_or(0);
            let placeable = flow_at(&mut net, problem, load, hi);
            if placeable < total {
                return Err(RedistributeError::Infeasible { placeable, total });
            }
            (flows_of(&net), hi)
        }
    };
    let mut lo = peak_lower_bound(problem, load).min(hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if flow_at(&mut net, problem, load, mid) == total {
            hi = mid;
            best = flows_of(&net);
        } else {
            lo = mid + 1;
        }
    }
    Ok(best)
}
