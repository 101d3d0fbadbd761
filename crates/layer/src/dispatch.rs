//! The dispatcher of the host executor: the redistribution every rank
//! follows (solved on rank 0, broadcast), the sender and receiver plans of
//! the backward exchange (`pack`), the replica weights sent to their
//! instances, and the expert gradients reduced back to their owners.

use kernels::cpu::Real;
use quota::Placement;

use crate::config::{ExpertWeights, MoeConfig, MoeParams};
use crate::transport::{all_gather, all_reduce_sum, all_to_all, Transport, TransportError};
use crate::LayerError;

/// Routes `(source, expert, rank, pairs)` from rank 0's solve, broadcast so
/// every rank follows one plan even if a solver could differ between runs.
pub(crate) fn agreed_routes<X: Transport>(
    comm: &X,
    problem: &redistribute::Problem,
    solver: redistribute::Solver,
) -> Result<(Vec<redistribute::Route>, Vec<u64>), LayerError> {
    let mine: Vec<u64> = if comm.rank() == 0 {
        let cfg = redistribute::Config {
            solver,
            ..redistribute::Config::default()
        };
        let a = redistribute::solve(problem, &cfg)?;
        a.routes
            .iter()
            .flat_map(|r| [r.source as u64, r.expert as u64, r.rank as u64, r.pairs])
            .collect()
    } else {
        Vec::new()
    };
    let all = all_gather(comm, &mine)?;
    let routes: Vec<redistribute::Route> = all[0]
        .chunks_exact(4)
        .map(|c| redistribute::Route {
            source: c[0] as usize,
            expert: c[1] as usize,
            rank: c[2] as usize,
            pairs: c[3],
        })
        .collect();
    let mut pairs_per_rank = vec![0u64; problem.n_ranks];
    for r in &routes {
        pairs_per_rank[r.rank] += r.pairs;
    }
    Ok((routes, pairs_per_rank))
}

/// Sender plan of this rank and receiver plan for this rank, from global routes.
pub(crate) fn exchange_plans(
    me: usize,
    n_ranks: usize,
    n_experts: usize,
    routes: &[redistribute::Route],
    expert_of_pair: &[u32],
    kept: &[bool],
) -> Result<(pack::PackPlan, pack::RecvPlan), LayerError> {
    let send: Vec<pack::SendRoute> = routes
        .iter()
        .filter(|r| r.source == me)
        .map(|r| pack::SendRoute {
            expert: r.expert,
            rank: r.rank,
            pairs: r.pairs,
        })
        .collect();
    let plan = pack::plan(expert_of_pair, kept, &send, n_ranks, n_experts)?;
    let mut blocks_from = vec![vec![0usize; n_experts]; n_ranks];
    for r in routes.iter().filter(|r| r.rank == me) {
        blocks_from[r.source][r.expert] += r.pairs as usize;
    }
    let recv = pack::receive_plan(&blocks_from, n_experts)?;
    Ok((plan, recv))
}

/// Appends `gate`, `up`, `down` to `out` (slice copies, not an element
/// iterator: these are whole experts' gradients on every call).
fn extend_flat<T: Real>(out: &mut Vec<T>, w: &ExpertWeights<T>) {
    out.extend_from_slice(&w.gate);
    out.extend_from_slice(&w.up);
    out.extend_from_slice(&w.down);
}

fn unflat<T: Real>(cfg: &MoeConfig, v: &[T]) -> ExpertWeights<T> {
    let hf = cfg.hidden * cfg.ffn;
    ExpertWeights {
        gate: v[..hf].to_vec(),
        up: v[hf..2 * hf].to_vec(),
        down: v[2 * hf..3 * hf].to_vec(),
    }
}

/// Executes the call's replica plan: every owner sends the weights of each
/// replicated expert to the replica's rank. Returns, per expert, the copy
/// this rank received (the instance computes with it in forward and
/// backward), `None` where this rank hosts no replica.
pub(crate) fn copy_replicas<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    placement: &Placement,
    params: &MoeParams<T>,
) -> Result<Vec<Option<ExpertWeights<T>>>, LayerError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let mut out = vec![None; cfg.n_experts];
    // No replica anywhere (the same on every rank): no exchange.
    if placement.replicas.iter().all(Vec::is_empty) {
        return Ok(out);
    }
    let routes = pack::ep::replica_routes(&placement.all_instances(), me, n);
    let size = 3 * cfg.hidden * cfg.ffn;
    let mut send = Vec::new();
    for &e in routes.send.iter().flatten() {
        extend_flat(&mut send, &params.experts[e]);
    }
    let counts: Vec<usize> = routes.send.iter().map(|l| l.len() * size).collect();
    let (recv, _) = all_to_all(comm, &send, &counts)?;
    for (i, &e) in routes.recv.iter().flatten().enumerate() {
        out[e] = Some(unflat(cfg, &recv[i * size..(i + 1) * size]));
    }
    Ok(out)
}

/// Sums the expert gradients into their owners — each replica's gradient
/// goes to its expert's owner — then hands every rank the owners' sums (the
/// model keeps every expert on every rank), and all-reduces the router's.
pub(crate) fn reduce_gradients<T: Real, X: Transport>(
    comm: &X,
    cfg: &MoeConfig,
    placement: &Placement,
    grads: &mut MoeParams<T>,
) -> Result<(), LayerError> {
    let (me, n) = (comm.rank(), comm.world_size());
    all_reduce_sum(comm, &mut grads.router)?;
    if n == 1 {
        return Ok(());
    }
    let size = 3 * cfg.hidden * cfg.ffn;
    // Replica gradients to the owners: the weights' routes, reversed.
    let routes = pack::ep::replica_routes(&placement.all_instances(), me, n);
    let mut send = Vec::new();
    for &e in routes.recv.iter().flatten() {
        extend_flat(&mut send, &grads.experts[e]);
    }
    let counts: Vec<usize> = routes.recv.iter().map(|l| l.len() * size).collect();
    let (recv, _) = all_to_all(comm, &send, &counts)?;
    let hf = cfg.hidden * cfg.ffn;
    for (i, &e) in routes.send.iter().flatten().enumerate() {
        let add = &recv[i * size..(i + 1) * size];
        let g = &mut grads.experts[e];
        for (dst, src) in [
            (&mut g.gate, &add[..hf]),
            (&mut g.up, &add[hf..2 * hf]),
            (&mut g.down, &add[2 * hf..]),
        ] {
            dst.iter_mut().zip(src).for_each(|(a, &b)| *a += b);
        }
    }
    // The owners' sums to every rank.
    let owned = |s: usize| (0..cfg.n_experts).filter(move |&e| placement.owner[e] == s);
    let mut mine: Vec<T> = Vec::with_capacity(owned(me).count() * size);
    for e in owned(me) {
        extend_flat(&mut mine, &grads.experts[e]);
    }
    let all = all_gather(comm, &mine)?;
    for (s, part) in all.iter().enumerate() {
        let experts: Vec<usize> = owned(s).collect();
        if part.len() != experts.len() * size {
            return Err(LayerError::Transport(TransportError::BadCounts {
                rank: me,
                message: format!(
                    "rank {s} sent {} gradient values for {} owned experts",
                    part.len(),
                    experts.len()
                ),
            }));
        }
        for (i, &e) in experts.iter().enumerate() {
            grads.experts[e] = unflat(cfg, &part[i * size..(i + 1) * size]);
        }
    }
    Ok(())
}
