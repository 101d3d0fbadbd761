//! The layer's stages, written once over any [`crate::backend::Backend`]:
//! forward = route → group (and cap) → plan → replica weights → rows out →
//! experts → outputs back → combine ([`forward`]); backward = scores →
//! select → redistribute → pack and send the kept rows → expert gradients
//! → `dX` back and scatter → replica gradients to their owners
//! ([`backward`]). The plan comes from a [`crate::DevicePlanner`]; index
//! layouts from `pack::ep`. Each file depends only on those before it:
//! `common`, `weights`, `forward`, `backward`.
//!
//! Today the device executor (`crate::device`) runs them; the host
//! executor (`crate::forward`, `crate::backward`) is still its own code
//! (issue 29: a host backend is the next step).

// Without CUDA no backend implements the contract yet: the stages are
// type-checked, not called.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

pub(crate) mod backward;
pub(crate) mod common;
pub(crate) mod forward;
pub(crate) mod weights;

pub use backward::{Grads, GradsOf};
pub use forward::Saved;
pub use weights::Weights;
