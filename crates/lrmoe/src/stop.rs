//! Stopping a run cleanly: SIGINT/SIGTERM and the collective stop.
//!
//! A training run stops for one of four reasons ([`StopReason`]): its step
//! count, its wall-time cap, its target validation loss, or a signal. Every
//! rank must stop at the same step, or the ranks fall out of step and the
//! next collective fails. So no rank decides alone: each step ends with one
//! all-gather of every rank's local view (its step time and whether it saw a
//! signal), and every rank computes the same decision from the same
//! gathered figures (see `train`).
//!
//! Signals: [`install_for_run`] makes the first SIGINT or SIGTERM raise a
//! [`StopFlag`] that the training loop reads at its next step boundary (it
//! then writes its checkpoint and summary and exits 0); a second signal
//! aborts the process with status 130. [`install_for_launcher`] only counts
//! signals: `lrmoe launch` forwards the first to its ranks and kills them on
//! the second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// It ran its configured steps.
    Steps,
    /// An evaluation reached the target validation loss.
    Target,
    /// The wall-time cap (`run.max_minutes`) was reached.
    Time,
    /// SIGINT or SIGTERM.
    Signal,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::Steps => "step count reached",
            StopReason::Target => "target validation loss reached",
            StopReason::Time => "time cap reached",
            StopReason::Signal => "stopped by signal",
        })
    }
}

/// A shared request to stop at the next step boundary: raised by a signal
/// handler (or by a caller, e.g. a test), read by every in-process rank.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicUsize>);

impl StopFlag {
    /// A flag nobody has raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop at the next step boundary (what a signal does).
    pub fn raise(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether a stop was asked for.
    pub fn is_raised(&self) -> bool {
        self.count() > 0
    }

    /// How many times a stop was asked for.
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Errors installing the handlers.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the SIGINT/SIGTERM handler: {0}")]
pub struct SignalError(String);

/// For `lrmoe train`: the first SIGINT/SIGTERM raises the returned flag;
/// the second ends the process at once with status 130.
pub fn install_for_run() -> Result<StopFlag, SignalError> {
    let flag = StopFlag::new();
    let f = flag.clone();
    ctrlc::set_handler(move || {
        f.raise();
        if f.count() >= 2 {
            tracing::warn!("second signal: aborting without a checkpoint");
            std::process::exit(130);
        }
        tracing::warn!(
            "stopping at the next step boundary (checkpoint and summary follow); signal again to abort"
        );
    })
    .map_err(|e| SignalError(e.to_string()))?;
    Ok(flag)
}

/// For `lrmoe launch`: every SIGINT/SIGTERM raises the returned flag once
/// more; the launcher decides what to do with the count.
pub fn install_for_launcher() -> Result<StopFlag, SignalError> {
    let flag = StopFlag::new();
    let f = flag.clone();
    ctrlc::set_handler(move || f.raise()).map_err(|e| SignalError(e.to_string()))?;
    Ok(flag)
}

/// The agreed decision at a step boundary. Every argument must be the same
/// on every rank (derived from gathered figures), so every rank returns the
/// same answer.
pub fn decide(
    step: usize,
    steps: usize,
    reached_target: bool,
    wall_s: f64,
    max_s: Option<f64>,
    any_signal: bool,
) -> Option<StopReason> {
    if reached_target {
        Some(StopReason::Target)
    } else if any_signal {
        Some(StopReason::Signal)
    } else if step >= steps {
        Some(StopReason::Steps)
    } else if max_s.is_some_and(|m| wall_s >= m) {
        Some(StopReason::Time)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_in_priority_order() {
        assert_eq!(decide(1, 10, false, 0.0, None, false), None);
        assert_eq!(
            decide(10, 10, false, 0.0, None, false),
            Some(StopReason::Steps)
        );
        assert_eq!(
            decide(3, 10, true, 0.0, None, true),
            Some(StopReason::Target)
        );
        assert_eq!(
            decide(3, 10, false, 0.0, None, true),
            Some(StopReason::Signal)
        );
        assert_eq!(
            decide(3, 10, false, 5.0, Some(5.0), false),
            Some(StopReason::Time)
        );
        assert_eq!(decide(3, 10, false, 4.9, Some(5.0), false), None);
    }

    #[test]
    fn flag_counts() {
        let f = StopFlag::new();
        assert!(!f.is_raised());
        f.raise();
        let g = f.clone();
        assert!(g.is_raised());
        g.raise();
        assert_eq!(f.count(), 2);
    }
}
