//! # layer — the MoE layer with the LRMoE backward (contract only, issue #3)
//!
//! This crate will glue the pipeline into one MoE layer: router, top-k,
//! complete forward over every routed pair; backward in the LRMoE order —
//! quotas fixed at forward time (`quota`), LRM scores of the down
//! projection (`lrm-score`), per-expert top-q selection, redistribution over
//! existing instances (`redistribute`), compaction into dense per-destination,
//! per-expert blocks (`pack`), grouped GEMMs on the compacted rows only, and
//! scatter back — over a transport trait (in-process ranks now, NCCL later).
//!
//! **Status:** not implemented yet; this crate exposes only [`LayerError`].

#![deny(missing_docs)]

/// Errors of the layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayerError {
    /// The layer is not implemented in this build.
    #[error("the MoE layer is not implemented yet (issue #3)")]
    NotImplemented,
}
