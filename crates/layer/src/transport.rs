//! The collective operations the layer needs, and an in-process
//! implementation in which every rank is a thread.
//!
//! The NCCL implementation (issue #5) implements the same [`Transport`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kernels::cpu::Real;

use crate::timeline::{Clock, Entry, Recorder, Turns};

/// Errors of a collective.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// A peer did not reach the collective in time.
    #[error("rank {rank}: peers did not reach the collective within {timeout_ms} ms")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The configured timeout.
        timeout_ms: u64,
    },
    /// Another rank failed and aborted the group.
    #[error("rank {rank}: a peer failed ({reason})")]
    PeerFailed {
        /// The rank that noticed.
        rank: usize,
        /// What the failing peer reported.
        reason: String,
    },
    /// Counts are inconsistent with the buffers or the world size.
    #[error("rank {rank}: {message}")]
    BadCounts {
        /// The rank.
        rank: usize,
        /// What is wrong.
        message: String,
    },
}

/// Collectives over a fixed group of ranks. Every rank must call the same
/// collectives in the same order.
pub trait Transport: Sync {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Variable all-to-all of bytes: `send` holds the messages for ranks
    /// `0..world` back to back, `send_counts[d]` bytes each. Returns the
    /// received messages back to back in source order, and their lengths.
    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), TransportError>;
    /// Every rank's `local`, in rank order.
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, TransportError>;
    /// Bytes this rank has sent to *other* ranks so far.
    fn bytes_sent(&self) -> u64;
    /// Element-wise sum of `buf` over all ranks, the same bits on every
    /// rank. The default all-gathers and sums in rank order.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), TransportError> {
        sum_by_gather(self, buf)
    }
    /// Timed in-process ranks ([`run_local_timed`]): the phase the work
    /// from here on belongs to (closes the current one). Elsewhere a no-op.
    fn phase(&self, _name: &str) -> Result<(), TransportError> {
        Ok(())
    }
    /// Timed in-process ranks: the work since the last part of the current
    /// phase (or its start) is part `name` of it (recorded as
    /// `"<phase>: <name>"`). Elsewhere a no-op.
    fn part(&self, _name: &str) -> Result<(), TransportError> {
        Ok(())
    }
    /// Timed in-process ranks: the exchange this rank started last is
    /// waited for here, and the work recorded since it ran beside it on the
    /// NCCL path (recorded as [`crate::timeline::Entry::Joined`]; the
    /// simulator overlaps that work with the exchange). Elsewhere a no-op.
    fn joined(&self) -> Result<(), TransportError> {
        Ok(())
    }
    /// Timed in-process ranks: work from here on (`true`) is the
    /// simulation's own bookkeeping, not counted, until `false` returns to
    /// the phase before. Elsewhere a no-op.
    fn bookkeeping(&self, _on: bool) -> Result<(), TransportError> {
        Ok(())
    }
    /// Ranks in one process (one address space, one CUDA context per
    /// device): swaps `(address, bytes)` offers, one per destination rank,
    /// and returns the offers addressed to this rank, by source; the swap
    /// is recorded as an exchange of `bytes` to each rank. `None` where the
    /// ranks do not share memory.
    fn swap_offers(
        &self,
        _offers: &[(u64, u64)],
    ) -> Option<Result<Vec<(u64, u64)>, TransportError>> {
        None
    }
    /// Ranks in one process: every rank's `addresses` (rank order), the
    /// swap recorded as an element-wise sum over ranks of `bytes` per rank
    /// (the buffers behind the addresses, summed by the caller). `None`
    /// where the ranks do not share memory.
    fn swap_sum_addresses(
        &self,
        _addresses: &[u64],
        _bytes: u64,
    ) -> Option<Result<Vec<Vec<u64>>, TransportError>> {
        None
    }
    /// Waits until every rank has reached this point (not recorded).
    fn fence(&self) -> Result<(), TransportError> {
        self.all_gather_bytes(&[]).map(|_| ())
    }
    /// Timed in-process ranks: hands this rank's timeline since the last
    /// call over as step `step`'s ([`Transport::take_step`]). Elsewhere a
    /// no-op.
    fn close_step(&self, _step: usize) -> Result<(), TransportError> {
        Ok(())
    }
    /// Timed in-process ranks: drops this rank's timeline so far (what lies
    /// between two timed steps). Elsewhere a no-op.
    fn discard_timeline(&self) -> Result<(), TransportError> {
        Ok(())
    }
    /// Timed in-process ranks: every rank's timeline of step `step`, once
    /// every rank has closed it (each step is taken once). Elsewhere `None`.
    fn take_step(&self, _step: usize) -> Option<Vec<Vec<crate::timeline::Entry>>> {
        None
    }
}

/// Typed variable all-to-all: `counts` are in elements.
pub fn all_to_all<T: bytemuck::Pod, X: Transport + ?Sized>(
    comm: &X,
    send: &[T],
    send_counts: &[usize],
) -> Result<(Vec<T>, Vec<usize>), TransportError> {
    let size = std::mem::size_of::<T>();
    let byte_counts: Vec<usize> = send_counts.iter().map(|c| c * size).collect();
    let (bytes, counts) = comm.all_to_all_bytes(bytemuck::cast_slice(send), &byte_counts)?;
    let out: Vec<T> = bytes
        .chunks_exact(size)
        .map(bytemuck::pod_read_unaligned)
        .collect();
    Ok((out, counts.iter().map(|c| c / size).collect()))
}

/// Every rank's `local` vector, in rank order.
pub fn all_gather<T: bytemuck::Pod, X: Transport + ?Sized>(
    comm: &X,
    local: &[T],
) -> Result<Vec<Vec<T>>, TransportError> {
    Ok(comm
        .all_gather_bytes(bytemuck::cast_slice(local))?
        .iter()
        .map(|b| {
            b.chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect()
        })
        .collect())
}

/// Sums `buf` element-wise over all ranks; every rank gets bit-identical
/// results. `f32` goes through [`Transport::all_reduce_sum_f32`] (NCCL's
/// all-reduce on the NCCL transport); other types are all-gathered and
/// summed in rank order.
pub fn all_reduce_sum<T: Real, X: Transport + ?Sized>(
    comm: &X,
    buf: &mut [T],
) -> Result<(), TransportError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        return comm.all_reduce_sum_f32(bytemuck::cast_slice_mut(buf));
    }
    sum_by_gather(comm, buf)
}

/// The portable all-reduce: all-gather, then a sum in rank order.
pub fn sum_by_gather<T: Real, X: Transport + ?Sized>(
    comm: &X,
    buf: &mut [T],
) -> Result<(), TransportError> {
    let all = all_gather(comm, buf)?;
    sum_in_rank_order(comm.rank(), &all, buf)
}

/// `buf` = the sum of every rank's `parts` (rank order, from zero): the
/// same bits on every rank.
fn sum_in_rank_order<T: Real>(
    rank: usize,
    parts: &[Vec<T>],
    buf: &mut [T],
) -> Result<(), TransportError> {
    buf.fill(T::zero());
    for part in parts {
        if part.len() != buf.len() {
            return Err(TransportError::BadCounts {
                rank,
                message: format!("all-reduce lengths differ: {} vs {}", part.len(), buf.len()),
            });
        }
        for (b, &p) in buf.iter_mut().zip(part) {
            *b += p;
        }
    }
    Ok(())
}

/// A barrier that times out and can be aborted.
#[derive(Debug)]
struct Barrier {
    state: Mutex<BarrierState>,
    cv: Condvar,
    n: usize,
    /// The state's generation and whether it is aborted, read while
    /// spinning ([`crate::timeline::spin`]).
    generation: AtomicU64,
    aborted: AtomicBool,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
}

impl Barrier {
    fn wait(&self, rank: usize, timeout: Duration) -> Result<(), TransportError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &s.aborted {
            return Err(TransportError::PeerFailed {
                rank,
                reason: reason.clone(),
            });
        }
        let gen = s.generation;
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.generation.store(s.generation, Ordering::Release);
            self.cv.notify_all();
            return Ok(());
        }
        drop(s);
        crate::timeline::spin(|| {
            self.generation.load(Ordering::Acquire) != gen || self.aborted.load(Ordering::Acquire)
        });
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.generation == gen {
            if let Some(reason) = &s.aborted {
                return Err(TransportError::PeerFailed {
                    rank,
                    reason: reason.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let reason = format!("rank {rank} timed out");
                s.aborted = Some(reason);
                self.aborted.store(true, Ordering::Release);
                self.cv.notify_all();
                return Err(TransportError::Timeout {
                    rank,
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    fn abort(&self, reason: String) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.aborted.get_or_insert(reason);
        self.aborted.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

#[derive(Debug)]
struct Shared {
    n: usize,
    slots: Mutex<Vec<Vec<u8>>>,
    barrier: Barrier,
    timeout: Duration,
    /// Timed groups: the one GPU's turn.
    turns: Option<Turns>,
    /// Timed groups: each closed step's entries, per rank.
    published: Mutex<BTreeMap<usize, Vec<Option<Vec<Entry>>>>>,
}

/// One rank of an in-process group (see [`run_local`]).
#[derive(Debug)]
pub struct LocalTransport {
    rank: usize,
    shared: Arc<Shared>,
    sent: AtomicU64,
    /// Timed groups ([`run_local_timed`]): this rank's timeline.
    recorder: Option<Mutex<Recorder>>,
    /// The phase before [`Transport::bookkeeping`] began.
    resume_phase: Mutex<Option<String>>,
}

/// What a collective is recorded as.
enum Record {
    /// `bytes_to[d]` to each rank `d`.
    Exchange(Vec<u64>),
    /// A sum over ranks of this many bytes per rank.
    Reduce(u64),
    /// Not recorded (the simulation's own synchronisation).
    Quiet,
}

impl LocalTransport {
    fn recorder(&self) -> Option<std::sync::MutexGuard<'_, Recorder>> {
        self.recorder
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn sync_failed(&self, message: String) -> TransportError {
        self.shared
            .barrier
            .abort(format!("rank {}: {message}", self.rank));
        TransportError::BadCounts {
            rank: self.rank,
            message,
        }
    }

    /// Timed: closes this rank's work, records the collective, settles the
    /// turn's marks and gives the GPU's turn up.
    fn pause(&self, record: Record) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.close_work().map_err(|m| self.sync_failed(m))?;
            let phase = r.phase.clone();
            match record {
                Record::Exchange(bytes_to) => r.entries.push(Entry::Exchange { phase, bytes_to }),
                Record::Reduce(bytes) => r.entries.push(Entry::Reduce { phase, bytes }),
                Record::Quiet => {}
            }
            r.end_turn().map_err(|m| self.sync_failed(m))?;
        }
        if let Some(t) = &self.shared.turns {
            t.release(self.rank);
        }
        Ok(())
    }

    /// Timed: takes the GPU's turn back.
    fn resume(&self) -> Result<(), TransportError> {
        if let Some(t) = &self.shared.turns {
            t.acquire(self.rank, self.shared.timeout)?;
        }
        if let Some(mut r) = self.recorder() {
            r.begin_turn().map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    /// Timed: this rank's work is timed on `clock` (its GPU's stream) from
    /// here on, and its memory read from `clock`'s pool. Call it from the
    /// rank's own thread (which holds the turn), before its first device
    /// buffer if its memory is to be counted from the start.
    pub fn set_clock(&self, clock: Arc<dyn Clock>) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.close_work().map_err(|m| self.sync_failed(m))?;
            r.set_clock(clock);
            r.begin_turn().map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    /// Whether this rank belongs to a timed group.
    pub fn timed(&self) -> bool {
        self.recorder.is_some()
    }

    fn post_and_collect(
        &self,
        outgoing: Vec<Vec<u8>>,
        record: Record,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        self.pause(record)?;
        let got = self.post_and_collect_untimed(outgoing);
        self.resume()?;
        got
    }

    fn post_and_collect_untimed(
        &self,
        outgoing: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let n = self.shared.n;
        {
            let mut slots = self.shared.slots.lock().unwrap_or_else(|p| p.into_inner());
            for (d, msg) in outgoing.into_iter().enumerate() {
                if d != self.rank {
                    self.sent.fetch_add(msg.len() as u64, Ordering::Relaxed);
                }
                slots[self.rank * n + d] = msg;
            }
        }
        self.shared.barrier.wait(self.rank, self.shared.timeout)?;
        let incoming = {
            let mut slots = self.shared.slots.lock().unwrap_or_else(|p| p.into_inner());
            (0..n)
                .map(|s| std::mem::take(&mut slots[s * n + self.rank]))
                .collect()
        };
        // Nobody may post the next round before everyone has collected.
        self.shared.barrier.wait(self.rank, self.shared.timeout)?;
        Ok(incoming)
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), TransportError> {
        let n = self.shared.n;
        if send_counts.len() != n || send_counts.iter().sum::<usize>() != send.len() {
            let message = format!(
                "all-to-all: {} counts summing to {} for a {}-byte buffer and {n} ranks",
                send_counts.len(),
                send_counts.iter().sum::<usize>(),
                send.len()
            );
            self.shared.barrier.abort(message.clone());
            return Err(TransportError::BadCounts {
                rank: self.rank,
                message,
            });
        }
        let mut at = 0;
        let outgoing = send_counts
            .iter()
            .map(|&c| {
                let m = send[at..at + c].to_vec();
                at += c;
                m
            })
            .collect();
        let bytes_to = self.others(send_counts.iter().map(|&c| c as u64));
        let incoming = self.post_and_collect(outgoing, Record::Exchange(bytes_to))?;
        let counts = incoming.iter().map(Vec::len).collect();
        Ok((incoming.concat(), counts))
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        let n = self.shared.n;
        let bytes_to = self.others(std::iter::repeat_n(local.len() as u64, n));
        self.post_and_collect(vec![local.to_vec(); n], Record::Exchange(bytes_to))
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), TransportError> {
        // Recorded as the sum it is (a ring all-reduce on GPUs), carried
        // out as a gather.
        self.pause(Record::Reduce(std::mem::size_of_val(buf) as u64))?;
        let all =
            self.post_and_collect_untimed(vec![bytemuck::cast_slice(buf).to_vec(); self.shared.n]);
        self.resume()?;
        let all = all?;
        if let Some(part) = all.iter().find(|b| b.len() != std::mem::size_of_val(buf)) {
            return Err(TransportError::BadCounts {
                rank: self.rank,
                message: format!(
                    "all-reduce lengths differ: {} vs {} bytes",
                    part.len(),
                    std::mem::size_of_val(buf)
                ),
            });
        }
        let parts: Vec<Vec<f32>> = all
            .iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(bytemuck::pod_read_unaligned)
                    .collect()
            })
            .collect();
        sum_in_rank_order(self.rank, &parts, buf)
    }

    fn phase(&self, name: &str) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.set_phase(name).map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    fn part(&self, name: &str) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.part(name).map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    fn joined(&self) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.joined().map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    fn bookkeeping(&self, on: bool) -> Result<(), TransportError> {
        if self.recorder.is_none() {
            return Ok(());
        }
        let mut back = self.resume_phase.lock().unwrap_or_else(|p| p.into_inner());
        if on {
            let current = self.recorder().map(|r| r.phase.clone());
            if back.is_none() {
                *back = current;
            }
            drop(back);
            self.phase("(staging)")
        } else {
            let to = back.take();
            drop(back);
            match to {
                Some(p) => self.phase(&p),
                None => Ok(()),
            }
        }
    }

    fn swap_offers(
        &self,
        offers: &[(u64, u64)],
    ) -> Option<Result<Vec<(u64, u64)>, TransportError>> {
        let n = self.shared.n;
        if offers.len() != n {
            return Some(Err(TransportError::BadCounts {
                rank: self.rank,
                message: format!("{} offers for {n} ranks", offers.len()),
            }));
        }
        let bytes_to = self.others(offers.iter().map(|o| o.1));
        let outgoing = offers
            .iter()
            .map(|&(a, b)| [a.to_le_bytes(), b.to_le_bytes()].concat())
            .collect();
        Some(
            self.post_and_collect(outgoing, Record::Exchange(bytes_to))
                .and_then(|got| {
                    got.iter()
                        .map(|m| {
                            let word = |i: usize| {
                                m.get(i * 8..i * 8 + 8)
                                    .and_then(|b| b.try_into().ok())
                                    .map(u64::from_le_bytes)
                            };
                            word(0).zip(word(1)).ok_or(TransportError::BadCounts {
                                rank: self.rank,
                                message: "a malformed offer".into(),
                            })
                        })
                        .collect()
                }),
        )
    }

    fn close_step(&self, step: usize) -> Result<(), TransportError> {
        let Some(mut r) = self.recorder() else {
            return Ok(());
        };
        let entries = r.take_step().map_err(|m| self.sync_failed(m))?;
        drop(r);
        let mut p = self
            .shared
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        p.entry(step).or_insert_with(|| vec![None; self.shared.n])[self.rank] = Some(entries);
        Ok(())
    }

    fn take_step(&self, step: usize) -> Option<Vec<Vec<Entry>>> {
        let mut p = self
            .shared
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if p.get(&step)?.iter().any(Option::is_none) {
            return None;
        }
        p.remove(&step).map(|v| v.into_iter().flatten().collect())
    }

    fn discard_timeline(&self) -> Result<(), TransportError> {
        if let Some(mut r) = self.recorder() {
            r.discard().map_err(|m| self.sync_failed(m))?;
        }
        Ok(())
    }

    fn swap_sum_addresses(
        &self,
        addresses: &[u64],
        bytes: u64,
    ) -> Option<Result<Vec<Vec<u64>>, TransportError>> {
        let mine: Vec<u8> = addresses.iter().flat_map(|a| a.to_le_bytes()).collect();
        let n = self.shared.n;
        Some(
            self.post_and_collect(vec![mine; n], Record::Reduce(bytes))
                .map(|all| {
                    all.iter()
                        .map(|m| {
                            m.chunks_exact(8)
                                .map(|c| {
                                    u64::from_le_bytes([
                                        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
                                    ])
                                })
                                .collect()
                        })
                        .collect()
                }),
        )
    }

    fn fence(&self) -> Result<(), TransportError> {
        self.pause(Record::Quiet)?;
        let r = self.shared.barrier.wait(self.rank, self.shared.timeout);
        self.resume()?;
        r
    }
}

impl LocalTransport {
    /// `per_rank` with this rank's own entry zeroed: bytes to other ranks.
    fn others(&self, per_rank: impl Iterator<Item = u64>) -> Vec<u64> {
        per_rank
            .enumerate()
            .map(|(d, b)| if d == self.rank { 0 } else { b })
            .collect()
    }
}

/// Runs `f` on `n` in-process ranks (one thread each) and returns their
/// results in rank order. A rank that returns an error or panics aborts the
/// group, so its peers fail with [`TransportError::PeerFailed`] instead of
/// waiting; a rank that never arrives makes the others time out.
pub fn run_local<R, E, F>(n: usize, timeout: Duration, f: F) -> Vec<Result<R, E>>
where
    R: Send,
    E: Send + std::fmt::Display + From<TransportError>,
    F: Fn(&LocalTransport) -> Result<R, E> + Sync,
{
    run_group(n, timeout, false, f)
}

/// [`run_local`] with the ranks taking turns on one GPU and recording their
/// timelines (see [`crate::timeline`]): each rank holds the turn from its
/// start, gives it up at every collective and at its end.
pub fn run_local_timed<R, E, F>(n: usize, timeout: Duration, f: F) -> Vec<Result<R, E>>
where
    R: Send,
    E: Send + std::fmt::Display + From<TransportError>,
    F: Fn(&LocalTransport) -> Result<R, E> + Sync,
{
    run_group(n, timeout, true, f)
}

fn run_group<R, E, F>(n: usize, timeout: Duration, timed: bool, f: F) -> Vec<Result<R, E>>
where
    R: Send,
    E: Send + std::fmt::Display + From<TransportError>,
    F: Fn(&LocalTransport) -> Result<R, E> + Sync,
{
    let shared = Arc::new(Shared {
        n,
        slots: Mutex::new(vec![Vec::new(); n * n]),
        barrier: Barrier {
            state: Mutex::default(),
            cv: Condvar::new(),
            n,
            generation: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
        },
        timeout,
        turns: timed.then(Turns::default),
        published: Mutex::default(),
    });
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let t = LocalTransport {
                    rank,
                    shared: Arc::clone(&shared),
                    sent: AtomicU64::new(0),
                    recorder: timed.then(|| Mutex::new(Recorder::new())),
                    resume_phase: Mutex::new(None),
                };
                let f = &f;
                scope.spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        t.resume()?;
                        f(&t)
                    }));
                    if let Some(turns) = &t.shared.turns {
                        turns.release(rank);
                    }
                    match r {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            t.shared.barrier.abort(format!("rank {rank}: {e}"));
                            Err(e)
                        }
                        Err(_) => {
                            let reason = format!("rank {rank} panicked");
                            t.shared.barrier.abort(reason.clone());
                            Err(E::from(TransportError::PeerFailed { rank, reason }))
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(E::from(TransportError::PeerFailed {
                        rank,
                        reason: "thread lost".into(),
                    }))
                })
            })
            .collect()
    })
}

/// The suite every [`Transport`] must pass: the in-process one runs it in
/// CI, the NCCL one on GPUs (`layer/tests/nccl.rs`). Every rank calls it;
/// it returns what went wrong instead of panicking, so a failure on one rank
/// cannot leave its peers waiting.
pub fn conformance<X: Transport + ?Sized>(t: &X) -> Result<(), String> {
    let (r, n) = (t.rank(), t.world_size());
    let fail = |what: String| Err(format!("rank {r}: {what}"));
    // Rank r sends (r + 1) · d copies of the value 100·r + d to rank d.
    let mut send = vec![];
    let mut counts = vec![];
    for d in 0..n {
        let c = (r + 1) * d;
        send.extend(std::iter::repeat_n((100 * r + d) as u32, c));
        counts.push(c);
    }
    let before = t.bytes_sent();
    let (recv, rc) = all_to_all(t, &send, &counts).map_err(|e| e.to_string())?;
    let off_rank: usize = (0..n).filter(|&d| d != r).map(|d| counts[d] * 4).sum();
    if t.bytes_sent() - before != off_rank as u64 {
        return fail(format!(
            "bytes_sent grew by {}, expected {off_rank}",
            t.bytes_sent() - before
        ));
    }
    let mut at = 0;
    for (s, &c) in rc.iter().enumerate() {
        if c != (s + 1) * r {
            return fail(format!(
                "received {c} elements from {s}, expected {}",
                (s + 1) * r
            ));
        }
        if !recv[at..at + c].iter().all(|&v| v == (100 * s + r) as u32) {
            return fail(format!("wrong values from rank {s}"));
        }
        at += c;
    }
    // Large messages (1 MiB per peer) arrive intact.
    const BIG: usize = 1 << 18;
    let big: Vec<u32> = (0..n * (BIG))
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ r as u32)
        .collect();
    let (got, bc) = all_to_all(t, &big, &vec![BIG; n]).map_err(|e| e.to_string())?;
    for s in 0..n {
        let part = &got[s * (BIG)..(s + 1) * (BIG)];
        let ok = bc[s] == BIG
            && part.iter().enumerate().all(|(j, &v)| {
                v == ((r * (BIG) + j) as u32).wrapping_mul(2_654_435_761) ^ s as u32
            });
        if !ok {
            return fail(format!("large message from rank {s} corrupted"));
        }
    }
    collectives(t)
}

/// The suite's all-gathers, all-reduces and bad-input cases.
fn collectives<X: Transport + ?Sized>(t: &X) -> Result<(), String> {
    let (r, n) = (t.rank(), t.world_size());
    let fail = |what: String| Err(format!("rank {r}: {what}"));
    let g = all_gather(t, &[r as u64, 7]).map_err(|e| e.to_string())?;
    if g != (0..n).map(|s| vec![s as u64, 7]).collect::<Vec<_>>() {
        return fail(format!("all-gather gave {g:?}"));
    }
    // Ragged all-gather: rank s contributes s bytes.
    let g = all_gather(t, &vec![r as u8; r]).map_err(|e| e.to_string())?;
    if g != (0..n).map(|s| vec![s as u8; s]).collect::<Vec<_>>() {
        return fail("ragged all-gather".into());
    }
    let mut buf = vec![r as f64, 1.0];
    all_reduce_sum(t, &mut buf).map_err(|e| e.to_string())?;
    if buf != vec![(n * (n - 1) / 2) as f64, n as f64] {
        return fail(format!("all-reduce gave {buf:?}"));
    }
    // f32 (the transport's own all-reduce), 1 Mi elements of small integers
    // so any summation order gives the same exact answer.
    let mut buf: Vec<f32> = (0..1 << 20).map(|i| ((i % 7) * (r + 1)) as f32).collect();
    all_reduce_sum(t, &mut buf).map_err(|e| e.to_string())?;
    let total = (n * (n + 1) / 2) as f32;
    if buf
        .iter()
        .enumerate()
        .any(|(i, &v)| v != (i % 7) as f32 * total)
    {
        return fail("f32 all-reduce".into());
    }
    // Zero-size messages are ordinary.
    let (recv, rc) = all_to_all::<f32, _>(t, &[], &vec![0; n]).map_err(|e| e.to_string())?;
    if !recv.is_empty() || rc.iter().any(|&c| c != 0) {
        return fail("empty all-to-all returned data".into());
    }
    // Wrong counts are an error on the caller's side, not a hang.
    if all_to_all(t, &[1u8, 2], &vec![0; n]).is_ok() {
        return fail("inconsistent counts were accepted".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_transport_passes_the_suite() {
        for n in [1, 2, 3, 8] {
            let res = run_local(n, Duration::from_secs(10), |t| {
                conformance(t).map_err(|m| TransportError::BadCounts {
                    rank: t.rank(),
                    message: m,
                })
            });
            assert!(res.iter().all(Result::is_ok), "n = {n}");
        }
    }

    #[test]
    fn timed_ranks_pass_the_suite_and_take_turns() {
        use std::sync::atomic::AtomicBool;
        for n in [1, 2, 3] {
            let res = run_local_timed(n, Duration::from_secs(10), |t| {
                conformance(t).map_err(|m| TransportError::BadCounts {
                    rank: t.rank(),
                    message: m,
                })
            });
            for r in &res {
                if let Err(e) = r {
                    panic!("n = {n}: {e}");
                }
            }
        }
        // Work between collectives never overlaps another rank's.
        let inside = AtomicBool::new(false);
        let overlaps = AtomicU64::new(0);
        let res = run_local_timed(3, Duration::from_secs(10), |t| {
            let work = |ms: u64| {
                if inside.swap(true, Ordering::SeqCst) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(ms));
                inside.store(false, Ordering::SeqCst);
            };
            t.phase("a")?;
            work(20 + 10 * t.rank() as u64);
            let send = vec![7u8; 3 * (t.rank() + 1)];
            all_to_all(t, &send, &[t.rank() + 1; 3])?;
            t.phase("b")?;
            work(5);
            t.bookkeeping(true)?;
            work(30);
            t.bookkeeping(false)?;
            let mut buf = vec![1.0f32; 10];
            t.all_reduce_sum_f32(&mut buf)?;
            t.close_step(0)?;
            t.fence()?;
            Ok::<_, TransportError>(t.take_step(0))
        });
        assert_eq!(overlaps.load(Ordering::SeqCst), 0);
        let all = res.into_iter().map(Result::unwrap).find_map(|x| x).unwrap();
        assert_eq!(all.len(), 3);
        for (r, entries) in all.iter().enumerate() {
            let work = |phase: &str| -> f64 {
                entries
                    .iter()
                    .filter_map(|e| match e {
                        Entry::Work {
                            phase: p, seconds, ..
                        } if p == phase => Some(*seconds),
                        _ => None,
                    })
                    .sum()
            };
            assert!(work("a") >= (0.020 + 0.010 * r as f64), "{entries:?}");
            assert!(work("a") < 0.5, "waiting was counted as work: {entries:?}");
            assert!(work("(staging)") >= 0.030);
            assert!(work("b") >= 0.005 && work("b") < 0.029, "{entries:?}");
            let ex: Vec<&Entry> = entries
                .iter()
                .filter(|e| !matches!(e, Entry::Work { .. }))
                .collect();
            let want: Vec<u64> = (0..3)
                .map(|d| if d == r { 0 } else { r as u64 + 1 })
                .collect();
            assert_eq!(
                ex,
                vec![
                    &Entry::Exchange {
                        phase: "a".into(),
                        bytes_to: want
                    },
                    &Entry::Reduce {
                        phase: "b".into(),
                        bytes: 40
                    }
                ]
            );
        }
    }

    /// A host stand-in for a GPU clock: marks are instants, the pool a
    /// counter the ranks move.
    #[derive(Default)]
    struct FakePool {
        used: AtomicU64,
        high: AtomicU64,
    }

    impl FakePool {
        fn alloc(&self, n: u64) {
            let u = self.used.fetch_add(n, Ordering::SeqCst) + n;
            self.high.fetch_max(u, Ordering::SeqCst);
        }
        fn free(&self, n: u64) {
            self.used.fetch_sub(n, Ordering::SeqCst);
        }
    }

    impl crate::timeline::Clock for Arc<FakePool> {
        fn mark(&self) -> Result<crate::timeline::Tick, String> {
            Ok(Box::new(Instant::now()))
        }
        fn seconds(
            &self,
            a: &crate::timeline::Tick,
            b: &crate::timeline::Tick,
        ) -> Result<f64, String> {
            let t = |x: &crate::timeline::Tick| x.downcast_ref::<Instant>().copied();
            match (t(a), t(b)) {
                (Some(a), Some(b)) => Ok(b.duration_since(a).as_secs_f64()),
                _ => Err("not a mark of this clock".into()),
            }
        }
        fn wait(&self) -> Result<(), String> {
            Ok(())
        }
        fn reset_peak(&self) -> Result<u64, String> {
            let u = self.used.load(Ordering::SeqCst);
            self.high.store(u, Ordering::SeqCst);
            Ok(u)
        }
        fn usage(&self) -> Result<(u64, u64), String> {
            Ok((
                self.used.load(Ordering::SeqCst),
                self.high.load(Ordering::SeqCst),
            ))
        }
    }

    #[test]
    fn a_clock_times_parts_and_counts_each_ranks_own_memory() {
        let pool = Arc::new(FakePool::default());
        pool.alloc(1000); // held before the ranks start: nobody's
        let res = run_local_timed(2, Duration::from_secs(10), |t| {
            let r = t.rank() as u64;
            t.set_clock(Arc::new(Arc::clone(&pool)))?;
            pool.alloc(10 * (r + 1));
            t.phase("a")?;
            std::thread::sleep(Duration::from_millis(5));
            t.part("x")?;
            std::thread::sleep(Duration::from_millis(2));
            if r == 1 {
                pool.alloc(100);
            }
            all_gather(t, &[1u8])?;
            t.bookkeeping(true)?;
            std::thread::sleep(Duration::from_millis(1));
            t.bookkeeping(false)?;
            std::thread::sleep(Duration::from_millis(3));
            t.part("y")?;
            if r == 1 {
                pool.free(100);
            }
            all_gather(t, &[1u8])?;
            t.close_step(0)?;
            // The next step starts from what the rank holds now.
            all_gather(t, &[1u8])?;
            t.close_step(1)?;
            t.fence()?;
            Ok::<_, TransportError>((t.take_step(0), t.take_step(1)))
        });
        let (mut s0, mut s1) = (None, None);
        for r in res {
            let (a, b) = r.unwrap();
            s0 = s0.or(a);
            s1 = s1.or(b);
        }
        let (s0, s1) = (s0.unwrap(), s1.unwrap());
        let held = |v: &Vec<Entry>| match v.last() {
            Some(Entry::Held { bytes }) => *bytes,
            other => panic!("ends with {other:?}"),
        };
        assert_eq!(s0.iter().map(held).collect::<Vec<_>>(), vec![10, 120]);
        assert_eq!(s1.iter().map(held).collect::<Vec<_>>(), vec![10, 20]);
        for v in &s0 {
            let work = |p: &str| -> f64 {
                v.iter()
                    .filter_map(|e| match e {
                        Entry::Work { phase, seconds, .. } if phase == p => Some(*seconds),
                        _ => None,
                    })
                    .sum()
            };
            assert!(work("a: x") >= 0.005 && work("a: x") < 0.5, "{v:?}");
            // y: before and after the first exchange and the bookkeeping
            // (neither counted in it).
            assert!(work("a: y") >= 0.005 && work("a: y") < 0.5, "{v:?}");
            assert!(work("(staging)") >= 0.001, "{v:?}");
            let y_pieces = v.iter().filter(|e| e.phase() == "a: y").count();
            assert_eq!(y_pieces, 3, "{v:?}");
            // After the last part: the phase's own tail.
            assert!(work("a") < 0.002, "the parts took the work: {v:?}");
            let ex: Vec<&str> = v
                .iter()
                .filter(|e| matches!(e, Entry::Exchange { .. }))
                .map(Entry::phase)
                .collect();
            assert_eq!(ex, vec!["a", "a"], "collectives keep the phase");
        }
    }

    #[test]
    fn a_failing_rank_ends_every_rank_with_an_error() {
        let res: Vec<Result<(), TransportError>> = run_local(3, Duration::from_secs(30), |t| {
            if t.rank() == 1 {
                return Err(TransportError::BadCounts {
                    rank: 1,
                    message: "boom".into(),
                });
            }
            all_gather(t, &[1u8]).map(|_| ())
        });
        assert!(res.iter().all(Result::is_err));
        assert!(matches!(&res[0], Err(TransportError::PeerFailed { .. })));
    }

    #[test]
    fn a_missing_peer_times_out() {
        let start = Instant::now();
        let res: Vec<Result<(), TransportError>> = run_local(2, Duration::from_millis(200), |t| {
            if t.rank() == 0 {
                std::thread::sleep(Duration::from_millis(600));
                return Ok(());
            }
            all_gather(t, &[1u8]).map(|_| ())
        });
        assert!(matches!(
            res[1],
            Err(TransportError::Timeout { rank: 1, .. })
        ));
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn bad_counts_are_errors() {
        let res: Vec<Result<(), TransportError>> = run_local(2, Duration::from_secs(5), |t| {
            all_to_all(t, &[1u8, 2], &[1, 0]).map(|_| ())
        });
        assert!(res.iter().all(Result::is_err));
    }
}
