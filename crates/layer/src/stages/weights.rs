//! A rank's weights in its backend's memory ([`Weights`]) and the replica
//! weights a call sends out.

use pack::ep::replica_traffic;

use crate::backend::{Backend, Family, Rows, Wts};
use crate::config::{Experts, MoeConfig};
use crate::plan::{one_instance_each, EpPlan};
use crate::LayerError;

use super::common::{elems, pack_blocks};

/// One rank's weights: the router `H × E` (every rank holds it) and the
/// rank's own experts, `E_l × H × F` (gate, up) and `E_l × F × H` (down),
/// with the router's optional biases.
pub struct Weights<F: Family> {
    pub(crate) router: F::Buf<F::V>,
    /// A constant added to the router logits of each expert (the forced
    /// hot-expert workload), if any.
    pub(crate) bias: Option<F::Buf<F::S>>,
    /// The balancing bias added to the router probabilities for the top-k
    /// choice only (`CallConfig::expert_bias`), if any.
    pub(crate) sel_bias: Option<F::Buf<F::S>>,
    pub(crate) experts: Experts<F::Buf<F::V>>,
}

/// The weights of this rank's instances in one call (its own experts and
/// the replicas it received), in the order of its local expert list.
pub(crate) type LocalWeights<F> = Experts<<F as Family>::Buf<<F as Family>::V>>;

/// The weights of this rank's instances for `plan`: owners send every
/// replicated expert's weights to the replicas' ranks (one all-to-all per
/// tensor); `None` where this rank holds only its own block (no plan yet,
/// or one instance per expert).
#[allow(clippy::type_complexity)]
pub(crate) fn replica_weights<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    w: &Weights<B::F>,
    plan: Option<&EpPlan>,
    local: &[Vec<usize>],
    el: usize,
) -> Result<(Option<LocalWeights<B::F>>, usize), LayerError> {
    let rank = b.rank();
    let Some(plan) = plan.filter(|plan| !one_instance_each(&plan.instances)) else {
        return Ok((None, 0));
    };
    let hf = cfg.hidden * cfg.ffn;
    let traffic = replica_traffic(&plan.instances, local, rank, el);
    let mut got = Vec::with_capacity(3);
    for t in [&w.experts.gate, &w.experts.up, &w.experts.down] {
        let packed = pack_blocks(b, t, &traffic.weights_out, hf)?;
        got.push(b.exchange(
            packed,
            &elems(&traffic.weights_send, hf),
            &elems(&traffic.weights_recv, hf),
        )?);
    }
    let bytes = traffic.weights_out.len() * 3 * hf * 2;
    let n_in: usize = traffic.weights_recv.iter().sum();
    if n_in == 0 {
        return Ok((None, bytes));
    }
    // This rank's instances, ascending: replicas below its block, its
    // block, replicas above.
    let below = traffic.below;
    let nl = local[rank].len();
    let build = |own: &Rows<B>, rep: &Rows<B>| {
        // SAFETY: the three copies below write all nl blocks.
        let mut t = unsafe { b.uninit(nl * hf) }?;
        let parts = [
            (rep, 0, below, 0),
            (own, 0, el, below),
            (rep, below, n_in, below + el),
        ];
        for (from, lo, hi, at) in parts {
            if hi > lo {
                b.copy(from, lo * hf, &mut t, at * hf, (hi - lo) * hf)?;
            }
        }
        Ok::<_, LayerError>(t)
    };
    Ok((
        Some(LocalWeights::<B::F> {
            gate: build(&w.experts.gate, &got[0])?,
            up: build(&w.experts.up, &got[1])?,
            down: build(&w.experts.down, &got[2])?,
        }),
        bytes,
    ))
}

/// The expert weights this rank's instances compute with: the replica
/// copies it received, or its own block.
pub(crate) fn local_weights<'a, B: Backend>(
    w: &'a Weights<B::F>,
    received: &'a Option<LocalWeights<B::F>>,
) -> Wts<'a, B> {
    match received {
        Some(lw) => lw.as_ref(),
        None => w.experts.as_ref(),
    }
}
