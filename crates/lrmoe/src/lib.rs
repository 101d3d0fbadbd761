//! # lrmoe — the top crate
//!
//! Re-exports the pipeline crates under one name and holds what composes
//! them for a user: the `lrmoe` binary and its commands —
//!
//! * [`plan`]: a planning problem → controller → redistribution → one
//!   JSON-serialisable [`plan::PlanReport`];
//! * [`model`], [`optim`], [`data`], [`train`], [`compare`]: the MoE
//!   transformer LM (the classic or the Qwen3-MoE block; CPU dense parts,
//!   MoE layers on the CPU layer over a transport, their expert GEMMs
//!   optionally on the GPU) — and [`device_model`], the same model
//!   resident on the GPU (one, or launched ranks with experts sharded; its
//!   MoE layers through the layer crate's device executor), held to
//!   [`model`] by device tests; both are backends of one definition of
//!   the block and the pass (`block`, crate-private: forward and
//!   backward written once over a `Dense` contract),
//!   AdamW, the corpus, the training loop (in-process ranks, or one NCCL
//!   rank per launched process) and the time-to-target comparison (its
//!   table and plots drawn again, or comparisons trained in parts joined,
//!   from `compare.json`; each run's crossing of the target interpolated
//!   between evaluations, [`compare::crossing`]; many comparisons in one
//!   table, [`compare::summary`], with an optional count of where LRMoE
//!   meets [`compare::Bounds`] and of where its memory is within reach of
//!   a bound, and per setting the budget or rule that came closest with how
//!   many settings meet each bound (and how many of a setting's runs meet
//!   both time bounds), and per budget or rule how many
//!   comparisons meet both time bounds (a figure beside its bound printed
//!   with the decimals that tell a miss from the bound); a
//!   comparison's folder stands for its `compare.json`,
//!   [`compare::comparison_files`]);
//!   [`train::layer_call_config`] and [`train::moe_section_from_json`] make
//!   one layer call's settings from an `[moe]` section, as the trainer and
//!   the Python package (`python/`) do;
//! * [`hf_config`]: a Hugging Face Qwen3-MoE `config.json` → the model
//!   section (`--model-config`);
//! * [`stop`]: the collective stop (steps, time cap, target, signal),
//!   decided by every rank from gathered figures, and the signal handlers;
//! * [`launch`]: `lrmoe launch`, the local ranks of a multi-process run;
//! * [`replay`], [`layer_grad`]: trace replay and one layer's gradients;
//! * [`simulate`]: N GPUs from N ranks timed on one GPU, through the
//!   `cluster` model (GPU and host seconds per phase; a host probe; the
//!   executor's overlaps where the timelines mark them);
//! * [`tensorfile`], [`plots`], [`fsutil`]: safetensors, charts (plotters),
//!   atomic writes; [`strict`]: JSON/TOML objects that must be objects;
//!   [`errline`], [`progress`]: one-line errors, log lines above the
//!   progress bar.
//!
//! File formats are documented in `docs/formats.md`, with examples under
//! `examples/`.
//!
//! ## Not here
//!
//! No algorithm lives here: a policy or solver belongs in its crate. This
//! crate parses, validates, composes and reports.

#![deny(missing_docs)]

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use cluster;
pub use kernels;
pub use layer;
pub use lrm_score;
pub use pack;
pub use quota;
pub use redistribute;

mod block;
pub mod compare;
pub mod data;
pub mod device_model;
pub mod errline;
pub mod fsutil;
pub mod hf_config;
pub mod launch;
pub mod layer_grad;
pub mod model;
pub mod optim;
pub mod plan;
pub mod plots;
pub mod progress;
pub mod replay;
pub mod simulate;
pub mod stop;
pub mod strict;
pub mod tensorfile;
pub mod train;

/// Keeps freed heap memory in the process (glibc: no `mmap` per large
/// buffer, no trimming): the device executor builds index layouts of a few
/// hundred KiB on the host every layer call, and fresh pages for each
/// (one page fault per 4 KiB, and an `munmap` after) cost more than the
/// layouts themselves. A no-op where the C library is not glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before the
    // process allocates from other threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
