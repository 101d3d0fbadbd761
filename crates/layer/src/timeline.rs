//! Timed in-process ranks: what each rank would take on its own GPU.
//!
//! In-process ranks ([`crate::run_local_timed`]) that share one GPU take
//! turns: a rank holds the turn while it runs its own work and gives it up
//! whenever it waits for its peers (every collective of its
//! [`crate::LocalTransport`]), so no other rank's kernels run beside its
//! own. Before giving the turn up it waits for its GPU work (the sync hook,
//! [`crate::LocalTransport::on_pause`]); the time from taking the turn to
//! that point is one [`Entry::Work`] of the current phase
//! ([`crate::Transport::phase`]). Every collective is recorded with
//! the bytes this rank sent to each other rank ([`Entry::Exchange`]) or
//! summed ([`Entry::Reduce`]). A cluster model turns the ranks' entries
//! into the time N GPUs would take (`lrmoe`'s simulator): work between two
//! collectives ends with its slowest rank, a collective takes what the
//! links need for its bytes.
//!
//! Work in a phase whose name starts with `(` is bookkeeping of the
//! simulation itself (staging copies that NCCL would not make) and is
//! recorded but not counted.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::TransportError;

/// One recorded piece of a rank's timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Entry {
    /// This rank's own work, measured with the GPU to itself.
    Work {
        /// The phase it belongs to.
        phase: String,
        /// Seconds from taking the turn (or the phase's start) to the
        /// GPU's completion.
        seconds: f64,
    },
    /// An exchange: `bytes_to[d]` bytes to rank `d` (zero to itself).
    Exchange {
        /// The phase it belongs to.
        phase: String,
        /// Bytes to each rank.
        bytes_to: Vec<u64>,
    },
    /// An element-wise sum over ranks of `bytes` per rank.
    Reduce {
        /// The phase it belongs to.
        phase: String,
        /// Bytes of the buffer each rank sums.
        bytes: u64,
    },
}

impl Entry {
    /// The phase of the entry.
    pub fn phase(&self) -> &str {
        match self {
            Self::Work { phase, .. }
            | Self::Exchange { phase, .. }
            | Self::Reduce { phase, .. } => phase,
        }
    }
}

/// Whether a phase is the simulation's own bookkeeping (not counted).
pub fn is_bookkeeping(phase: &str) -> bool {
    phase.starts_with('(')
}

/// The one GPU's turn, held by at most one rank.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    holder: Mutex<Option<usize>>,
    cv: Condvar,
}

impl Turns {
    /// Waits for the turn; gives up after `timeout`. (A rank gives the turn
    /// up whenever it waits and when it ends, failed or not, so a peer's
    /// failure never leaves the turn held; a failed group's next collective
    /// reports it.)
    pub(crate) fn acquire(&self, rank: usize, timeout: Duration) -> Result<(), TransportError> {
        let deadline = Instant::now() + timeout;
        let mut h = self.holder.lock().unwrap_or_else(|p| p.into_inner());
        while h.is_some() {
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    rank,
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            let wait = deadline - now;
            h = self
                .cv
                .wait_timeout(h, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *h = Some(rank);
        Ok(())
    }

    /// Gives the turn up (a no-op for a rank that does not hold it).
    pub(crate) fn release(&self, rank: usize) {
        let mut h = self.holder.lock().unwrap_or_else(|p| p.into_inner());
        if *h == Some(rank) {
            *h = None;
            self.cv.notify_all();
        }
    }
}

/// A hook that waits for a rank's GPU work.
pub type SyncHook = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// One rank's recorder.
pub(crate) struct Recorder {
    pub(crate) phase: String,
    pub(crate) since: Instant,
    pub(crate) entries: Vec<Entry>,
    pub(crate) sync: Option<SyncHook>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("phase", &self.phase)
            .field("entries", &self.entries.len())
            .finish()
    }
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self {
            phase: "start".into(),
            since: Instant::now(),
            entries: Vec::new(),
            sync: None,
        }
    }

    /// Waits for the GPU and closes the current piece of work.
    pub(crate) fn close_work(&mut self) -> Result<(), String> {
        if let Some(sync) = &self.sync {
            sync()?;
        }
        let seconds = self.since.elapsed().as_secs_f64();
        self.entries.push(Entry::Work {
            phase: self.phase.clone(),
            seconds,
        });
        self.since = Instant::now();
        Ok(())
    }
}
