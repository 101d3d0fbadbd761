//! A rank's weights in its backend's memory ([`Weights`]) and the replica
//! weights a call sends out.

use pack::ep::replica_traffic;

use crate::backend::{Backend, Family, Wts};
use crate::config::{Experts, MoeConfig};
use crate::plan::one_instance_each;
use crate::LayerError;

use super::common::{block_runs, elems, exclusive_scan, pack_tensor_blocks, tensor_block};

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

/// The weights of this rank's instances in this call (`instances`: each
/// expert's ranks, its owner first): owners send every
/// replicated expert's weights to the replicas' ranks (one all-to-all of
/// the three tensors); `None` where this rank holds only its own block (no plan yet,
/// or one instance per expert).
#[allow(clippy::type_complexity)]
pub(crate) fn replica_weights<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
    w: &Weights<B::F>,
    instances: Option<&[Vec<usize>]>,
    local: &[Vec<usize>],
    el: usize,
) -> Result<(Option<LocalWeights<B::F>>, usize), LayerError> {
    let rank = b.rank();
    let Some(instances) = instances.filter(|i| !one_instance_each(i)) else {
        return Ok((None, 0));
    };
    let hf = cfg.hidden * cfg.ffn;
    let traffic = replica_traffic(instances, local, rank, el);
    let tensors = [&w.experts.gate, &w.experts.up, &w.experts.down];
    // One exchange of the three tensors' blocks, each destination's in turn.
    let packed = pack_tensor_blocks(b, &tensors, &traffic.weights_out, &traffic.weights_send, hf)?;
    let got = b.exchange(
        packed,
        &elems(&traffic.weights_send, 3 * hf),
        &elems(&traffic.weights_recv, 3 * hf),
    )?;
    let bytes = traffic.weights_out.len() * 3 * hf * 2;
    let n_in: usize = traffic.weights_recv.iter().sum();
    if n_in == 0 {
        return Ok((None, bytes));
    }
    // This rank's instances, ascending: replicas below its block, its
    // block, replicas above; the `j`-th block received (source by source)
    // is tensor `t`'s at `tensor_block` of `got`.
    let (below, nl) = (traffic.below, local[rank].len());
    let starts = exclusive_scan(&traffic.weights_recv);
    let build = |t: usize| {
        // SAFETY: the copies below write all nl blocks: every received
        // block and the own block.
        let mut out = unsafe { b.uninit(nl * hf) }?;
        b.copy(tensors[t], 0, &mut out, below * hf, el * hf)?;
        let moves = (0..n_in).map(|j| {
            let at = if j < below { j } else { j + el };
            (tensor_block(&starts, 3, t, j), at)
        });
        for (from, to, n) in block_runs(moves) {
            b.copy(&got, from * hf, &mut out, to * hf, n * hf)?;
        }
        Ok::<_, LayerError>(out)
    };
    Ok((
        Some(LocalWeights::<B::F> {
            gate: build(0)?,
            up: build(1)?,
            down: build(2)?,
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
