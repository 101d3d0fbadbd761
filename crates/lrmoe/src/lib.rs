//! # lrmoe — the top crate
//!
//! Re-exports the pipeline crates under one name and holds what composes
//! them for a user: the `lrmoe` binary and its commands. Today that is
//! [`plan`] — read a planning problem (routed counts with budgets, or kept
//! counts), run the controller (`quota`) when asked, then the redistribution
//! (`redistribute`), and return one JSON-serialisable [`plan::PlanReport`].
//!
//! The JSON schemas are documented in `docs/formats.md`, with examples under
//! `examples/`.
//!
//! ## Not here
//!
//! No algorithm lives here: a policy or solver belongs in its crate. This
//! crate parses, validates, composes and reports.

#![deny(missing_docs)]

pub use kernels;
pub use layer;
pub use lrm_score;
pub use pack;
pub use quota;
pub use redistribute;

pub mod compare;
pub mod data;
pub mod fsutil;
pub mod gpu_moe;
pub mod launch;
pub mod layer_grad;
pub mod model;
pub mod optim;
pub mod plan;
pub mod replay;
pub mod svgplot;
pub mod tensorfile;
pub mod train;
