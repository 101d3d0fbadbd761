//! Timed in-process ranks: what each rank would take on its own GPU.
//!
//! In-process ranks ([`crate::run_local_timed`]) that share one GPU take
//! turns: a rank holds the turn while it runs its own work and gives it up
//! whenever it waits for its peers (every collective of its
//! [`crate::LocalTransport`]), so no other rank's kernels run beside its
//! own. With a [`Clock`] ([`crate::LocalTransport::set_clock`]) every
//! boundary of the rank's work is a mark on its GPU's stream (a CUDA event,
//! no wait); before giving the turn up the rank waits for its GPU work and
//! reads each piece's device time between its two marks. So a piece is what
//! the rank's GPU took for it, host time included only where the GPU waited
//! for the host, as on a GPU of its own. Without a clock a piece is host
//! time. Each piece is one [`Entry::Work`] of the current phase
//! ([`crate::Transport::phase`]), or of a part of it
//! ([`crate::Transport::part`]: recorded as `"<phase>: <part>"`). Every
//! collective is recorded with the bytes this rank sent to each other rank
//! ([`Entry::Exchange`]) or summed ([`Entry::Reduce`]); where the executor
//! waits for an exchange it started beside other work (the NCCL path's
//! overlaps) the wait is recorded ([`Entry::Joined`]); and each step ends
//! with the most device memory the rank held at once ([`Entry::Held`], from
//! the clock's pool: while a rank holds the turn no other rank allocates or
//! frees, so the pool's changes are its own). A cluster model turns the
//! ranks' entries into the time N GPUs would take (`lrmoe`'s simulator):
//! work between two collectives ends with its slowest rank, a collective
//! takes what the links need for its bytes.
//!
//! Work in a phase whose name starts with `(` is bookkeeping of the
//! simulation itself (staging copies that NCCL would not make) and is
//! recorded but not counted.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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
        /// Seconds the rank's GPU took for it (host seconds without a
        /// [`Clock`]).
        seconds: f64,
        /// Seconds the rank's own thread spent between the piece's two
        /// boundaries (enqueueing, waiting for its GPU, host work such as
        /// planning): beside `seconds` it says where a piece is bound by the
        /// host (the two close) rather than by the GPU.
        host_seconds: f64,
    },
    /// An exchange: `bytes_to[d]` bytes to rank `d` (zero to itself).
    Exchange {
        /// The phase it belongs to.
        phase: String,
        /// Bytes to each rank.
        bytes_to: Vec<u64>,
    },
    /// The exchange recorded last is waited for here: the work recorded
    /// between it and this entry ran beside it on the NCCL path (the
    /// executor's overlaps: the dispatch with the experts on a rank's own
    /// rows, the backward's dX return with the weight gradients), so the
    /// simulator may overlap the two.
    Joined {
        /// The phase it belongs to.
        phase: String,
    },
    /// An element-wise sum over ranks of `bytes` per rank.
    Reduce {
        /// The phase it belongs to.
        phase: String,
        /// Bytes of the buffer each rank sums.
        bytes: u64,
    },
    /// The step's last entry with a [`Clock`]: the most device memory this
    /// rank held at once during the step, bytes (its buffers in the
    /// clock's pool since the clock was set; a buffer the ranks share,
    /// such as a workspace the GPU keeps, counts for the rank that
    /// allocated it).
    Held {
        /// Bytes.
        bytes: u64,
    },
}

impl Entry {
    /// The phase of the entry (empty for [`Entry::Held`]).
    pub fn phase(&self) -> &str {
        match self {
            Self::Work { phase, .. }
            | Self::Exchange { phase, .. }
            | Self::Joined { phase }
            | Self::Reduce { phase, .. } => phase,
            Self::Held { .. } => "",
        }
    }
}

/// Whether a phase is the simulation's own bookkeeping (not counted).
pub fn is_bookkeeping(phase: &str) -> bool {
    phase.starts_with('(')
}

/// How long a waiting in-process rank spins, yielding its core, before it
/// sleeps: a hand-off then takes microseconds, not a sleeping thread's
/// wake-up (tens of them, and every peer wakes at a release). The spinning
/// does not slow the rank that holds the turn: 16 ranks on the device
/// machine's 16 cores took the same simulated time with no spinning
/// (2026-12-04).
const SPIN: Duration = Duration::from_millis(1);

/// Spins, yielding, until `done()` or [`SPIN`] has passed; whether done.
pub(crate) fn spin(done: impl Fn() -> bool) -> bool {
    let until = Instant::now() + SPIN;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The one GPU's turn, held by at most one rank.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    holder: Mutex<Option<usize>>,
    cv: Condvar,
    /// Whether a rank holds the turn (read while spinning).
    held: AtomicBool,
}

impl Turns {
    /// Waits for the turn; gives up after `timeout`. (A rank gives the turn
    /// up whenever it waits and when it ends, failed or not, so a peer's
    /// failure never leaves the turn held; a failed group's next collective
    /// reports it.)
    pub(crate) fn acquire(&self, rank: usize, timeout: Duration) -> Result<(), TransportError> {
        let deadline = Instant::now() + timeout;
        spin(|| !self.held.load(Ordering::Acquire));
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
        self.held.store(true, Ordering::Release);
        Ok(())
    }

    /// Gives the turn up (a no-op for a rank that does not hold it).
    pub(crate) fn release(&self, rank: usize) {
        let mut h = self.holder.lock().unwrap_or_else(|p| p.into_inner());
        if *h == Some(rank) {
            *h = None;
            self.held.store(false, Ordering::Release);
            self.cv.notify_all();
        }
    }
}

/// A point in a rank's GPU work ([`Clock::mark`]).
pub type Tick = Box<dyn Any + Send>;

/// A rank's GPU as the timeline sees it (timed in-process ranks,
/// [`crate::LocalTransport::set_clock`]).
pub trait Clock: Send + Sync {
    /// Marks the work enqueued so far, without waiting.
    fn mark(&self) -> Result<Tick, String>;
    /// Seconds from `earlier` to `later` (both marks of this clock; waits
    /// for them).
    fn seconds(&self, earlier: &Tick, later: &Tick) -> Result<f64, String>;
    /// Waits for the work enqueued so far.
    fn wait(&self) -> Result<(), String>;
    /// The device pool's bytes in use now; resets its high-water mark to
    /// them.
    fn reset_peak(&self) -> Result<u64, String>;
    /// The device pool's bytes in use now and its high-water mark since the
    /// last [`Clock::reset_peak`].
    fn usage(&self) -> Result<(u64, u64), String>;
}

/// What a rank's clock has seen of its memory: the bytes it holds (the
/// pool's changes while it held the turn) and the most it held at once.
#[derive(Debug, Default, Clone, Copy)]
struct Memory {
    /// Bytes this rank holds (as of its last pause).
    own: i64,
    /// Every other rank's bytes while this rank holds the turn.
    others: i64,
    /// The most this rank held at once since the step began.
    peak: i64,
}

/// One rank's recorder.
pub(crate) struct Recorder {
    pub(crate) phase: String,
    pub(crate) since: Instant,
    pub(crate) entries: Vec<Entry>,
    clock: Option<Arc<dyn Clock>>,
    /// With a clock: this turn's marks, and the work entries waiting for
    /// theirs (entry, earlier mark, later mark).
    ticks: Vec<Tick>,
    pending: Vec<(usize, usize, usize)>,
    /// The first entry of the current phase not yet given to a part.
    unparted: usize,
    memory: Memory,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("phase", &self.phase)
            .field("entries", &self.entries.len())
            .field("clock", &self.clock.is_some())
            .finish()
    }
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self {
            phase: "start".into(),
            since: Instant::now(),
            entries: Vec::new(),
            clock: None,
            ticks: Vec::new(),
            pending: Vec::new(),
            unparted: 0,
            memory: Memory::default(),
        }
    }

    /// Times this rank's work with `clock` from the next
    /// [`Recorder::begin_turn`] on.
    pub(crate) fn set_clock(&mut self, clock: Arc<dyn Clock>) {
        self.clock = Some(clock);
    }

    /// Closes the current piece of work (a mark with a clock, host time
    /// without).
    pub(crate) fn close_work(&mut self) -> Result<(), String> {
        let host_seconds = self.since.elapsed().as_secs_f64();
        let seconds = match &self.clock {
            Some(c) if !self.ticks.is_empty() => {
                self.ticks.push(c.mark()?);
                let at = self.ticks.len() - 1;
                self.pending.push((self.entries.len(), at - 1, at));
                0.0
            }
            _ => host_seconds,
        };
        self.entries.push(Entry::Work {
            phase: self.phase.clone(),
            seconds,
            host_seconds,
        });
        self.since = Instant::now();
        Ok(())
    }

    /// The exchange recorded last is waited for: closes the current piece
    /// and records [`Entry::Joined`].
    pub(crate) fn joined(&mut self) -> Result<(), String> {
        self.close_work()?;
        self.entries.push(Entry::Joined {
            phase: self.phase.clone(),
        });
        Ok(())
    }

    /// Moves to phase `name` (closing the current piece). Bookkeeping in
    /// the middle of a phase leaves its parts open: the pieces before it
    /// still go to the part that ends after it.
    pub(crate) fn set_phase(&mut self, name: &str) -> Result<(), String> {
        if self.phase != name {
            self.close_work()?;
            if !is_bookkeeping(&self.phase) && !is_bookkeeping(name) {
                self.unparted = self.entries.len();
            }
            self.phase = name.to_string();
        }
        Ok(())
    }

    /// Closes the current piece and gives it, with every piece of the
    /// phase since the last part, to part `name` (`"<phase>: <name>"`).
    pub(crate) fn part(&mut self, name: &str) -> Result<(), String> {
        self.close_work()?;
        let label = format!("{}: {name}", self.phase);
        for e in &mut self.entries[self.unparted..] {
            if let Entry::Work { phase, .. } = e {
                if *phase == self.phase {
                    phase.clone_from(&label);
                }
            }
        }
        self.unparted = self.entries.len();
        Ok(())
    }

    /// The turn is taken: the first mark, and the other ranks' bytes.
    pub(crate) fn begin_turn(&mut self) -> Result<(), String> {
        self.since = Instant::now();
        if let Some(c) = &self.clock {
            self.ticks = vec![c.mark()?];
            let used = c.reset_peak()? as i64;
            self.memory.others = used - self.memory.own;
        }
        Ok(())
    }

    /// The turn ends: waits for the GPU, reads every piece's seconds and
    /// this turn's memory.
    pub(crate) fn end_turn(&mut self) -> Result<(), String> {
        let Some(c) = &self.clock else {
            return Ok(());
        };
        if self.ticks.is_empty() {
            return Ok(());
        }
        c.wait()?;
        for &(e, a, b) in &self.pending {
            let s = c.seconds(&self.ticks[a], &self.ticks[b])?;
            if let Some(Entry::Work { seconds, .. }) = self.entries.get_mut(e) {
                *seconds = s;
            }
        }
        self.pending.clear();
        let (used, high) = c.usage()?;
        let m = &mut self.memory;
        m.own = used as i64 - m.others;
        m.peak = m.peak.max(high as i64 - m.others);
        self.ticks.clear();
        Ok(())
    }

    /// Ends a step inside the turn: closes the current piece and, with a
    /// clock, settles the turn so far, begins the rest of it and returns
    /// the most this rank held during the step (the next step starts from
    /// what it holds now). The entries stay for the caller.
    fn end_step(&mut self) -> Result<Option<u64>, String> {
        self.close_work()?;
        self.unparted = 0;
        if self.clock.is_none() || self.ticks.is_empty() {
            return Ok(None);
        }
        self.end_turn()?;
        let held = self.memory.peak.max(0) as u64;
        self.memory.peak = self.memory.own;
        self.begin_turn()?;
        Ok(Some(held))
    }

    /// Closes the step and hands its entries over, [`Entry::Held`] last
    /// with a clock.
    pub(crate) fn take_step(&mut self) -> Result<Vec<Entry>, String> {
        if let Some(bytes) = self.end_step()? {
            self.entries.push(Entry::Held { bytes });
        }
        Ok(std::mem::take(&mut self.entries))
    }

    /// Drops the timeline so far (settling the turn's marks first).
    pub(crate) fn discard(&mut self) -> Result<(), String> {
        self.end_step()?;
        self.entries.clear();
        Ok(())
    }
}
