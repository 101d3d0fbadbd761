//! The layer's stages, written once over any [`crate::backend::Backend`]:
//! forward = route → group (and cap) → plan → replica weights → rows out →
//! experts → outputs back → combine (`forward::forward`); backward =
//! scores → select → redistribute → pack and send the kept rows → expert
//! gradients → `dX` back and scatter → replica gradients to their owners
//! (`backward::backward`). The plan comes from a [`crate::DevicePlanner`];
//! index layouts from `pack::ep`. Each file depends only on those before
//! it: `common`, `weights`, `forward`, `backward`.
//!
//! The host executor ([`crate::forward`], [`crate::backward`]: the host
//! backend, `crate::host`) and the device executor (`crate::device`: the
//! device backend) both run them; the rules of a call (the capacity
//! factor, replica weights out and their gradients back, the
//! one-instance split, the auxiliary loss, the balancing bias) live here
//! or in the plan, once.

pub(crate) mod backward;
pub(crate) mod common;
pub(crate) mod forward;
pub(crate) mod weights;

pub use backward::{Grads, GradsOf};
pub use forward::Saved;
pub use weights::Weights;
