//! NCCL collectives between processes, one GPU each (feature `nccl`).
//!
//! A [`NcclComm`] is one rank of an NCCL communicator created from a unique id
//! that rank 0 made with [`unique_id`] and passed to the others (the `layer`
//! crate's rendezvous does that over TCP). Every wait has a deadline: set-up
//! runs on a helper thread the caller stops waiting for; a watchdog thread
//! aborts the communicator when a host call into NCCL overruns; and
//! `NcclComm::synchronize` polls the stream and NCCL's asynchronous error
//! state. A peer that died or never arrives therefore ends the wait with
//! [`KernelError::CommTimeout`] (or the error NCCL reported) after the
//! configured timeout, and the communicator is aborted — never a hang. (The
//! communicator itself is NCCL's blocking kind: its non-blocking kind, which
//! would make the deadline simpler, measured 0.5–0.9× PyTorch's all-to-all
//! on small messages here, the blocking kind 1.0–1.16×.)
//!
//! Operations:
//! * device-resident: variable all-to-all as one group of `ncclSend` /
//!   `ncclRecv` (zero-size messages are skipped; the message to self is a
//!   send/receive pair too, so NCCL overlaps it with the remote transfers),
//!   sum all-reduce of `f32`, all-gather of bytes;
//! * host convenience used by the `layer` transport: the same collectives on
//!   host slices (staged through device buffers), where receive sizes are
//!   learned with an all-gather of the send counts first;
//! * `bench_all_to_all`: the bandwidth peer of `torch.distributed`'s
//!   `all_to_all_single` (equal splits, CUDA events, median of 20 after 3
//!   warm-ups).
//!
//! Without the feature the same API exists and returns
//! [`KernelError::NotCompiledWithNccl`].

#[cfg(not(feature = "nccl"))]
use std::time::Duration;

use crate::KernelError;

#[cfg(feature = "nccl")]
pub use imp::{unique_id, version, InFlight, NcclComm};

/// Whether this build has NCCL.
pub const COMPILED: bool = cfg!(feature = "nccl");

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Stand-in without NCCL: creating a communicator is an error.
#[cfg(not(feature = "nccl"))]
pub fn unique_id() -> Result<[u8; ID_BYTES], KernelError> {
    Err(KernelError::NotCompiledWithNccl)
}

/// Stand-in without NCCL.
#[cfg(not(feature = "nccl"))]
pub fn version() -> Result<String, KernelError> {
    Err(KernelError::NotCompiledWithNccl)
}

/// Stand-in without NCCL (never constructed).
#[cfg(not(feature = "nccl"))]
#[derive(Debug)]
pub struct NcclComm(());

#[cfg(not(feature = "nccl"))]
impl NcclComm {
    /// See the NCCL build.
    pub fn init(
        _device: usize,
        _rank: usize,
        _world: usize,
        _id: &[u8; ID_BYTES],
        _timeout: Duration,
    ) -> Result<Self, KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
    /// See the NCCL build.
    pub fn rank(&self) -> usize {
        0
    }
    /// See the NCCL build.
    pub fn world_size(&self) -> usize {
        1
    }
    /// See the NCCL build.
    pub fn all_to_all_host(
        &self,
        _send: &[u8],
        _send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
    /// See the NCCL build.
    pub fn all_gather_host(&self, _local: &[u8]) -> Result<Vec<Vec<u8>>, KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
    /// See the NCCL build.
    pub fn all_reduce_sum_f32_host(&self, _buf: &mut [f32]) -> Result<(), KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
    /// See the NCCL build.
    pub fn bench_all_to_all(&self, _total_bytes: usize) -> Result<f64, KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
    /// See the NCCL build.
    pub fn bench_all_to_all_counts(
        &self,
        _send_counts: &[usize],
        _recv_counts: &[usize],
    ) -> Result<f64, KernelError> {
        Err(KernelError::NotCompiledWithNccl)
    }
}

/// Checks `counts` (one per rank) against `len`, their total (in the
/// caller's unit: bytes or elements).
pub fn check_counts(
    what: &'static str,
    counts: &[usize],
    world: usize,
    len: usize,
) -> Result<(), KernelError> {
    if counts.len() != world {
        return Err(KernelError::Shape {
            what,
            expected: world,
            got: counts.len(),
        });
    }
    let total: usize = counts.iter().sum();
    if total != len {
        return Err(KernelError::Shape {
            what,
            expected: total,
            got: len,
        });
    }
    Ok(())
}

#[cfg(feature = "nccl")]
mod imp {
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
    use cudarc::nccl::sys;

    use super::{check_counts, ID_BYTES};
    use crate::KernelError;

    fn cuda(e: impl std::fmt::Debug) -> KernelError {
        KernelError::Cuda(format!("{e:?}"))
    }

    fn nccl_present() -> Result<(), KernelError> {
        // SAFETY: presence probes (dlopen only).
        // SAFETY: only tries to load libcuda; no other precondition.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::Cuda(
                "the CUDA driver library (libcuda.so) was not found: is this a GPU machine with a driver?".into(),
            ));
        }
        // SAFETY: only tries to load libnccl; no other precondition.
        if !unsafe { sys::is_culib_present() } {
            return Err(KernelError::Comm(
                "the NCCL library (libnccl.so) was not found: install NCCL or add it to LD_LIBRARY_PATH".into(),
            ));
        }
        Ok(())
    }

    fn describe(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
        // SAFETY: both return static or comm-owned C strings (or null).
        let text = |p: *const std::ffi::c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null; NCCL returns NUL-terminated static or
                // per-communicator strings that outlive this call.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        };
        // SAFETY: takes any result code, returns a static string.
        let base = text(unsafe { sys::ncclGetErrorString(r) });
        // SAFETY: `comm` is this communicator (or null, which NCCL accepts).
        let last = text(unsafe { sys::ncclGetLastError(comm) });
        if last.is_empty() {
            format!("NCCL: {base}")
        } else {
            format!("NCCL: {base} ({last})")
        }
    }

    /// The loaded NCCL's version, e.g. `"2.27.7"`.
    pub fn version() -> Result<String, KernelError> {
        nccl_present()?;
        let mut v = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::ncclGetVersion(&mut v) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(KernelError::Comm(describe(r, std::ptr::null_mut())));
        }
        Ok(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    }

    /// A fresh NCCL unique id (rank 0 makes it; the others receive it).
    pub fn unique_id() -> Result<[u8; ID_BYTES], KernelError> {
        nccl_present()?;
        let mut id = sys::ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        // SAFETY: `id` is a valid out-pointer.
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(KernelError::Comm(describe(r, std::ptr::null_mut())));
        }
        Ok(id.internal.map(|c| c as u8))
    }

    /// The communicator handle and the watchdog's state, shared with the
    /// watchdog thread.
    struct Watch {
        state: Mutex<WatchState>,
        cv: Condvar,
    }

    struct WatchState {
        /// The live communicator (null once aborted).
        comm: sys::ncclComm_t,
        /// When the call now in NCCL must be over.
        deadline: Option<Instant>,
        /// The watchdog aborted the communicator.
        fired: bool,
        stop: bool,
    }

    // SAFETY: the raw communicator is only passed to NCCL under the mutex
    // (abort) or by the owning rank's thread (enqueues), never concurrently
    // with its destruction.
    unsafe impl Send for WatchState {}

    impl Watch {
        fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
            self.state.lock().unwrap_or_else(|p| p.into_inner())
        }

        /// Aborts the communicator once; later calls see a null handle.
        fn abort(&self) {
            let mut s = self.lock();
            if !s.comm.is_null() {
                // SAFETY: a live communicator, aborted exactly once.
                unsafe { sys::ncclCommAbort(s.comm) };
                s.comm = std::ptr::null_mut();
            }
        }

        /// The watchdog: aborts the communicator when an armed deadline
        /// passes, which unblocks a host call stuck on a dead peer.
        fn run(&self) {
            let mut s = self.lock();
            loop {
                if s.stop {
                    return;
                }
                match s.deadline {
                    None => {
                        s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
                    }
                    Some(d) if Instant::now() >= d => {
                        if !s.comm.is_null() {
                            // SAFETY: a live communicator, aborted once.
                            unsafe { sys::ncclCommAbort(s.comm) };
                            s.comm = std::ptr::null_mut();
                        }
                        s.fired = true;
                        s.deadline = None;
                    }
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        s = self
                            .cv
                            .wait_timeout(s, left)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                }
            }
        }
    }

    /// One rank of an NCCL communicator on one GPU.
    pub struct NcclComm {
        watch: Arc<Watch>,
        watchdog: Option<std::thread::JoinHandle<()>>,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        timeout: Duration,
    }

    impl std::fmt::Debug for NcclComm {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NcclComm")
                .field("rank", &self.rank)
                .field("world", &self.world)
                .field("timeout", &self.timeout)
                .finish()
        }
    }

    const UNDEF: i32 = i32::MIN;

    /// Success, or accepted and still running (non-blocking communicator).
    fn ok(r: sys::ncclResult_t) -> bool {
        matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        )
    }

    type P2p = unsafe fn(
        *const std::ffi::c_void,
        usize,
        sys::ncclDataType_t,
        i32,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> sys::ncclResult_t;

    /// One `ncclSend` or `ncclRecv` of `count` bytes at device address
    /// `ptr`; zero bytes enqueue nothing.
    ///
    /// # Safety
    /// `ptr .. ptr + count` lies in a live device buffer; `comm` is live.
    unsafe fn p2p(
        op: P2p,
        ptr: u64,
        count: usize,
        peer: usize,
        comm: sys::ncclComm_t,
        stream: sys::cudaStream_t,
    ) -> sys::ncclResult_t {
        if count == 0 {
            return sys::ncclResult_t::ncclSuccess;
        }
        // SAFETY: the caller's contract.
        unsafe {
            op(
                ptr as *const std::ffi::c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                comm,
                stream,
            )
        }
    }

    /// An `ncclSend` of `send = (address, bytes)` and an `ncclRecv` into
    /// `recv` with `peer` (zero bytes enqueue nothing).
    ///
    /// # Safety
    /// Both ranges lie in live device buffers; `comm` is live.
    unsafe fn send_recv(
        send: (u64, usize),
        recv: (u64, usize),
        peer: usize,
        comm: sys::ncclComm_t,
        stream: sys::cudaStream_t,
    ) -> sys::ncclResult_t {
        // SAFETY: the caller's contract.
        let r = unsafe { p2p(sys::ncclSend, send.0, send.1, peer, comm, stream) };
        if !ok(r) {
            return r;
        }
        // SAFETY: the caller's contract.
        unsafe {
            p2p(
                |b, n, t, p, c, s| sys::ncclRecv(b as *mut _, n, t, p, c, s),
                recv.0,
                recv.1,
                peer,
                comm,
                stream,
            )
        }
    }

    struct SendComm(sys::ncclComm_t);
    // SAFETY: handed from the set-up thread to its owner exactly once.
    unsafe impl Send for SendComm {}

    impl NcclComm {
        /// Joins the communicator `id` as `rank` of `world` on device
        /// `device` and connects every peer. Fails with
        /// [`KernelError::CommTimeout`] if that does not finish within
        /// `timeout` (a peer missing or dead).
        ///
        /// The communicator is *blocking* (enqueues are synchronous, which
        /// measured 1.0–1.16× PyTorch's all-to-all where the non-blocking
        /// mode reached 0.5–0.9× on small messages); what keeps a dead peer
        /// from hanging the process is the deadline: set-up runs on a helper
        /// thread the caller stops waiting for, a watchdog thread aborts
        /// the communicator when a host call overruns, and
        /// [`synchronize`](Self::synchronize) polls the stream.
        pub fn init(
            device: usize,
            rank: usize,
            world: usize,
            id: &[u8; ID_BYTES],
            timeout: Duration,
        ) -> Result<Self, KernelError> {
            nccl_present()?;
            if world == 0 || rank >= world {
                return Err(KernelError::Comm(format!(
                    "rank {rank} is outside a world of {world}"
                )));
            }
            let ctx = CudaContext::new(device).map_err(cuda)?;
            let stream = ctx.new_stream().map_err(cuda)?;
            let uid = sys::ncclUniqueId {
                internal: id.map(|b| b as std::ffi::c_char),
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let init_ctx = ctx.clone();
            std::thread::spawn(move || {
                let mut config = sys::ncclConfig_t {
                    size: std::mem::size_of::<sys::ncclConfig_t>(),
                    magic: 0xcafe_beef,
                    // Declared as a 2.14 config: NCCL reads `blocking` and
                    // gives every later field its default, whatever its own
                    // version.
                    version: 21400,
                    blocking: 1,
                    cgaClusterSize: UNDEF,
                    minCTAs: UNDEF,
                    maxCTAs: UNDEF,
                    netName: std::ptr::null(),
                    splitShare: UNDEF,
                    trafficClass: UNDEF,
                    commName: std::ptr::null(),
                    collnetEnable: UNDEF,
                    CTAPolicy: UNDEF,
                    shrinkShare: UNDEF,
                    nvlsCTAs: UNDEF,
                    nChannelsPerNetPeer: UNDEF,
                    nvlinkCentricSched: UNDEF,
                    graphUsageMode: UNDEF,
                    numRmaCtx: UNDEF,
                    maxP2pPeers: UNDEF,
                };
                let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                let r = init_ctx.bind_to_thread().map_err(cuda).and_then(|()| {
                    // SAFETY: valid out-pointer and config; a 128-byte id.
                    let r = unsafe {
                        sys::ncclCommInitRankConfig(
                            &mut comm,
                            world as i32,
                            uid,
                            rank as i32,
                            &mut config,
                        )
                    };
                    if r == sys::ncclResult_t::ncclSuccess {
                        Ok(SendComm(comm))
                    } else {
                        Err(KernelError::Comm(describe(r, comm)))
                    }
                });
                // If the caller gave up, the communicator is leaked with
                // this thread: the process is about to report the timeout.
                let _ = tx.send(r);
            });
            let comm = match rx.recv_timeout(timeout) {
                Ok(r) => r?.0,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err(KernelError::CommTimeout {
                        rank,
                        timeout_ms: timeout.as_millis() as u64,
                    })
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(KernelError::Comm(format!(
                        "rank {rank}: the NCCL set-up thread ended without a result"
                    )))
                }
            };
            let watch = Arc::new(Watch {
                state: Mutex::new(WatchState {
                    comm,
                    deadline: None,
                    fired: false,
                    stop: false,
                }),
                cv: Condvar::new(),
            });
            let w = watch.clone();
            let watchdog = std::thread::Builder::new()
                .name(format!("nccl-watchdog-{rank}"))
                .spawn(move || w.run())
                .map_err(|e| KernelError::Comm(format!("cannot start the watchdog: {e}")))?;
            let this = Self {
                watch,
                watchdog: Some(watchdog),
                ctx,
                stream,
                rank,
                world,
                timeout,
            };
            // Connect every peer now (NCCL connects lazily), under the
            // deadline, so later calls do not pay for it.
            let one = vec![1usize; world];
            let send = this.upload(&vec![0u8; world])?;
            let mut recv = this.stream.alloc_zeros::<u8>(world).map_err(cuda)?;
            this.all_to_all_v(&send, &one, &mut recv, &one)?;
            this.synchronize()?;
            Ok(this)
        }

        /// This rank.
        pub fn rank(&self) -> usize {
            self.rank
        }

        /// Number of ranks.
        pub fn world_size(&self) -> usize {
            self.world
        }

        /// A timed mark of the collectives enqueued so far (no wait).
        pub fn mark(&self) -> Result<crate::gpu::Mark, KernelError> {
            crate::gpu::Mark::on(&self.ctx, &self.stream)
        }

        /// The stream every collective of this communicator runs on.
        pub fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }

        fn fail(&self, err: KernelError) -> KernelError {
            // Abort so in-flight kernels exit and later calls fail fast.
            self.watch.abort();
            err
        }

        fn live(&self) -> Result<sys::ncclComm_t, KernelError> {
            let s = self.watch.lock();
            if s.fired {
                return Err(self.timed_out());
            }
            if s.comm.is_null() {
                Err(KernelError::Comm(format!(
                    "rank {}: the communicator was aborted after an earlier failure",
                    self.rank
                )))
            } else {
                Ok(s.comm)
            }
        }

        /// Fails (and aborts) if NCCL reports an asynchronous error. The
        /// communicator is blocking, so there is nothing to wait for here;
        /// waits on the stream are [`synchronize`](Self::synchronize)'s.
        fn check_async(&self) -> Result<(), KernelError> {
            let comm = self.live()?;
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: valid communicator and out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(self.fail(KernelError::Comm(describe(r, comm))));
            }
            if ok(state) {
                Ok(())
            } else {
                Err(self.fail(KernelError::Comm(describe(state, comm))))
            }
        }

        fn timed_out(&self) -> KernelError {
            KernelError::CommTimeout {
                rank: self.rank,
                timeout_ms: self.timeout.as_millis() as u64,
            }
        }

        /// Waits for every collective enqueued so far: polls the stream, the
        /// communicator's error state and the deadline. On an error or the
        /// deadline the communicator is aborted.
        pub fn synchronize(&self) -> Result<(), KernelError> {
            self.check_async()?;
            let comm = self.live()?;
            let ev = self.ctx.new_event(None).map_err(cuda)?;
            ev.record(&self.stream).map_err(cuda)?;
            let deadline = Instant::now() + self.timeout;
            let mut spins = 0u32;
            loop {
                if ev.try_is_complete().map_err(cuda)? {
                    return Ok(());
                }
                let mut state = sys::ncclResult_t::ncclSuccess;
                // SAFETY: valid communicator and out-pointer.
                unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
                if !matches!(
                    state,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                ) {
                    return Err(self.fail(KernelError::Comm(describe(state, comm))));
                }
                if Instant::now() >= deadline {
                    return Err(self.fail(self.timed_out()));
                }
                spins += 1;
                if spins > 1000 {
                    std::thread::sleep(Duration::from_micros(20));
                } else {
                    std::hint::spin_loop();
                }
            }
        }

        fn group<F>(&self, body: F) -> Result<(), KernelError>
        where
            F: FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
        {
            let comm = self.live()?;
            self.ctx.bind_to_thread().map_err(cuda)?;
            let stream = self.stream.cu_stream() as sys::cudaStream_t;
            {
                let mut s = self.watch.lock();
                s.deadline = Some(Instant::now() + self.timeout);
                self.watch.cv.notify_all();
            }
            // SAFETY: group calls bracket enqueues on a live communicator.
            unsafe { sys::ncclGroupStart() };
            let r = body(comm, stream);
            // SAFETY: closes the group opened above.
            let end = unsafe { sys::ncclGroupEnd() };
            let fired = {
                let mut s = self.watch.lock();
                s.deadline = None;
                s.fired
            };
            if fired {
                return Err(self.timed_out());
            }
            for r in [r, end] {
                if !ok(r) {
                    return Err(self.fail(KernelError::Comm(describe(r, comm))));
                }
            }
            self.check_async()
        }

        /// Enqueues a variable all-to-all on device buffers of any element
        /// type: `send_counts[d]` elements to rank `d`, back to back in
        /// `send`; `recv_counts[s]` elements from rank `s`, back to back in
        /// `recv`. Both sides must agree on every count. Call
        /// [`synchronize`](Self::synchronize) before reading `recv` on the
        /// host; kernels on other streams of the context are ordered by
        /// cudarc's per-buffer events.
        pub fn all_to_all_v<T: cudarc::driver::DeviceRepr>(
            &self,
            send: &CudaSlice<T>,
            send_counts: &[usize],
            recv: &mut CudaSlice<T>,
            recv_counts: &[usize],
        ) -> Result<(), KernelError> {
            let size = std::mem::size_of::<T>();
            let sent: usize = send_counts.iter().sum();
            let got: usize = recv_counts.iter().sum();
            check_counts("all-to-all send counts", send_counts, self.world, sent)?;
            check_counts("all-to-all receive counts", recv_counts, self.world, got)?;
            if sent > send.len() || got > recv.len() {
                return Err(KernelError::Shape {
                    what: "all-to-all buffers",
                    expected: sent.max(got),
                    got: send.len().min(recv.len()),
                });
            }
            let stream = self.stream.clone();
            let (sp, _gs) = send.device_ptr(&stream);
            let (rp, _gr) = recv.device_ptr_mut(&stream);
            if send_counts[self.rank] != recv_counts[self.rank] {
                return Err(KernelError::Shape {
                    what: "all-to-all message to self",
                    expected: send_counts[self.rank],
                    got: recv_counts[self.rank],
                });
            }
            self.group(|comm, st| {
                let (mut so, mut ro) = (0usize, 0usize);
                for peer in 0..self.world {
                    // Self included: NCCL copies it inside the same kernel,
                    // overlapped with the remote transfers.
                    let (sc, rc) = (send_counts[peer] * size, recv_counts[peer] * size);
                    // SAFETY: in-bounds ranges of live device buffers.
                    let r = unsafe {
                        send_recv((sp + so as u64, sc), (rp + ro as u64, rc), peer, comm, st)
                    };
                    if !ok(r) {
                        return r;
                    }
                    so += sc;
                    ro += rc;
                }
                sys::ncclResult_t::ncclSuccess
            })
        }

        /// Starts a variable all-to-all that runs beside the compute stream
        /// of `gpu`: the communicator's stream waits for the work `gpu` has
        /// enqueued so far, sends `sends[b][off .. off + n]` to each peer
        /// `d` for `send_parts[d] = (b, off, n)` and receives `recv_parts[s]
        /// = (off, n)` elements from each peer `s` into `recv` (regions
        /// need not be packed). The message to self is not sent (its two
        /// counts must be zero): the caller has its rows. The host does not
        /// wait; [`InFlight::finish`] orders `gpu`'s stream after the
        /// exchange and hands the buffers back. The deadline still holds:
        /// before the host waits on `gpu`'s stream it calls
        /// [`synchronize`](Self::synchronize).
        pub fn start_all_to_all<T: cudarc::driver::DeviceRepr>(
            &self,
            gpu: &crate::gpu::Gpu,
            sends: Vec<CudaSlice<T>>,
            send_parts: &[(usize, usize, usize)],
            recv: CudaSlice<T>,
            recv_parts: &[(usize, usize)],
        ) -> Result<InFlight<T>, KernelError> {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let size = std::mem::size_of::<T>();
            let shape = |what, expected, got| KernelError::Shape {
                what,
                expected,
                got,
            };
            if send_parts.len() != self.world || recv_parts.len() != self.world {
                return Err(shape(
                    "all-to-all parts (one per rank)",
                    self.world,
                    send_parts.len().min(recv_parts.len()),
                ));
            }
            for &(b, off, n) in send_parts {
                if n > 0 && (b >= sends.len() || off + n > sends[b].len()) {
                    return Err(shape("all-to-all send part", off + n, sends.len()));
                }
            }
            for &(off, n) in recv_parts {
                if n > 0 && off + n > recv.len() {
                    return Err(shape("all-to-all receive part", off + n, recv.len()));
                }
            }
            if send_parts[self.rank].2 != 0 || recv_parts[self.rank].1 != 0 {
                return Err(shape(
                    "all-to-all message to self (not sent)",
                    0,
                    send_parts[self.rank].2.max(recv_parts[self.rank].1),
                ));
            }
            let compute = self.wait_for(gpu)?;
            let mut recv = recv;
            let stream = self.stream.clone();
            let send_ptrs: Vec<u64> = sends.iter().map(|b| b.device_ptr(&stream).0).collect();
            let rp = recv.device_ptr_mut(&stream).0;
            self.group(|comm, st| {
                for peer in 0..self.world {
                    if peer == self.rank {
                        continue;
                    }
                    let (b, off, n) = send_parts[peer];
                    let from = if n > 0 {
                        send_ptrs[b] + (off * size) as u64
                    } else {
                        0
                    };
                    let (roff, rn) = recv_parts[peer];
                    // SAFETY: ranges of the live send and receive buffers
                    // (checked above; zero bytes enqueue nothing).
                    let r = unsafe {
                        send_recv(
                            (from, n * size),
                            (rp + (roff * size) as u64, rn * size),
                            peer,
                            comm,
                            st,
                        )
                    };
                    if !ok(r) {
                        return r;
                    }
                }
                sys::ncclResult_t::ncclSuccess
            })?;
            self.in_flight(compute, sends, recv)
        }

        /// Orders this communicator's stream after the work enqueued on
        /// `gpu`'s compute stream so far; returns that stream.
        fn wait_for(&self, gpu: &crate::gpu::Gpu) -> Result<Arc<CudaStream>, KernelError> {
            let compute = gpu.compute_stream().clone();
            let ready = self.ctx.new_event(None).map_err(cuda)?;
            ready.record(&compute).map_err(cuda)?;
            self.stream.wait(&ready).map_err(cuda)?;
            Ok(compute)
        }

        /// The handle of the collective just enqueued.
        fn in_flight<T>(
            &self,
            compute: Arc<CudaStream>,
            sends: Vec<CudaSlice<T>>,
            recv: CudaSlice<T>,
        ) -> Result<InFlight<T>, KernelError> {
            let done = self.ctx.new_event(None).map_err(cuda)?;
            done.record(&self.stream).map_err(cuda)?;
            Ok(InFlight {
                sends,
                recv: Some(recv),
                done,
                compute,
            })
        }

        /// Starts an in-place sum all-reduce of `buf` beside the compute
        /// stream of `gpu` (after the work enqueued there so far), as
        /// [`start_all_to_all`](Self::start_all_to_all): `finish` returns
        /// the summed buffer.
        pub fn start_all_reduce_sum_f32(
            &self,
            gpu: &crate::gpu::Gpu,
            mut buf: CudaSlice<f32>,
        ) -> Result<InFlight<f32>, KernelError> {
            let compute = self.wait_for(gpu)?;
            self.all_reduce_sum_f32(&mut buf)?;
            self.in_flight(compute, Vec::new(), buf)
        }

        /// Enqueues an in-place sum all-reduce of `buf`.
        pub fn all_reduce_sum_f32(&self, buf: &mut CudaSlice<f32>) -> Result<(), KernelError> {
            let n = buf.len();
            let stream = self.stream.clone();
            let (p, _g) = buf.device_ptr_mut(&stream);
            self.group(|comm, st| unsafe {
                // SAFETY: in-place on a live device buffer of `n` floats.
                sys::ncclAllReduce(
                    p as *const std::ffi::c_void,
                    p as *mut std::ffi::c_void,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    st,
                )
            })
        }

        /// Enqueues an all-gather: `recv` gets every rank's `send` (equal
        /// lengths) in rank order.
        pub fn all_gather<T: cudarc::driver::DeviceRepr>(
            &self,
            send: &CudaSlice<T>,
            recv: &mut CudaSlice<T>,
        ) -> Result<(), KernelError> {
            let n = send.len();
            if recv.len() != n * self.world {
                return Err(KernelError::Shape {
                    what: "all-gather receive buffer",
                    expected: n * self.world,
                    got: recv.len(),
                });
            }
            let stream = self.stream.clone();
            let (sp, _gs) = send.device_ptr(&stream);
            let (rp, _gr) = recv.device_ptr_mut(&stream);
            self.group(|comm, st| unsafe {
                // SAFETY: buffers checked above.
                sys::ncclAllGather(
                    sp as *const std::ffi::c_void,
                    rp as *mut std::ffi::c_void,
                    n * std::mem::size_of::<T>(),
                    sys::ncclDataType_t::ncclUint8,
                    comm,
                    st,
                )
            })
        }

        fn upload(&self, host: &[u8]) -> Result<CudaSlice<u8>, KernelError> {
            if host.is_empty() {
                return self.stream.alloc_zeros::<u8>(1).map_err(cuda);
            }
            self.stream.clone_htod(host).map_err(cuda)
        }

        fn download(&self, dev: &CudaSlice<u8>, n: usize) -> Result<Vec<u8>, KernelError> {
            self.synchronize()?;
            let mut v = self.stream.clone_dtoh(dev).map_err(cuda)?;
            v.truncate(n);
            Ok(v)
        }

        /// Host all-gather of possibly different lengths: lengths first,
        /// then the bytes padded to the longest.
        pub fn all_gather_host(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, KernelError> {
            let lens = self.gather_fixed(&(local.len() as u64).to_le_bytes())?;
            let lens: Vec<usize> = lens
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize)
                .collect();
            let max = lens.iter().copied().max().unwrap_or(0);
            if max == 0 {
                return Ok(vec![Vec::new(); self.world]);
            }
            let mut padded = local.to_vec();
            padded.resize(max, 0);
            let all = self.gather_fixed(&padded)?;
            Ok(all
                .chunks_exact(max)
                .zip(&lens)
                .map(|(c, &l)| c[..l].to_vec())
                .collect())
        }

        fn gather_fixed(&self, local: &[u8]) -> Result<Vec<u8>, KernelError> {
            if local.is_empty() {
                return Ok(Vec::new());
            }
            let send = self.upload(local)?;
            let mut recv = self
                .stream
                .alloc_zeros::<u8>(local.len() * self.world)
                .map_err(cuda)?;
            self.all_gather(&send, &mut recv)?;
            self.download(&recv, local.len() * self.world)
        }

        /// Host sum all-reduce of `f32` through NCCL's all-reduce (every
        /// rank gets the same bits).
        pub fn all_reduce_sum_f32_host(&self, buf: &mut [f32]) -> Result<(), KernelError> {
            if buf.is_empty() {
                return Ok(());
            }
            let mut dev = self.stream.clone_htod(buf).map_err(cuda)?;
            self.all_reduce_sum_f32(&mut dev)?;
            self.synchronize()?;
            self.stream.memcpy_dtoh(&dev, buf).map_err(cuda)?;
            self.stream.synchronize().map_err(cuda)
        }

        /// Host variable all-to-all: the receive counts are learned with an
        /// all-gather of every rank's send counts, then the bytes move in one
        /// grouped send/receive through device buffers.
        pub fn all_to_all_host(
            &self,
            send: &[u8],
            send_counts: &[usize],
        ) -> Result<(Vec<u8>, Vec<usize>), KernelError> {
            check_counts(
                "all-to-all send counts",
                send_counts,
                self.world,
                send.len(),
            )?;
            let mine: Vec<u8> = send_counts
                .iter()
                .flat_map(|&c| (c as u64).to_le_bytes())
                .collect();
            let all = self.gather_fixed(&mine)?;
            let recv_counts: Vec<usize> = (0..self.world)
                .map(|s| {
                    let at = (s * self.world + self.rank) * 8;
                    u64::from_le_bytes(all[at..at + 8].try_into().unwrap_or([0; 8])) as usize
                })
                .collect();
            let total: usize = recv_counts.iter().sum();
            let dsend = self.upload(send)?;
            let mut drecv = self.stream.alloc_zeros::<u8>(total.max(1)).map_err(cuda)?;
            self.all_to_all_v(&dsend, send_counts, &mut drecv, &recv_counts)?;
            let out = self.download(&drecv, total)?;
            Ok((out, recv_counts))
        }

        /// Median milliseconds of a device all-to-all with the given byte
        /// counts (both sides must pass matching counts), CUDA events around
        /// each of 20 runs after 3 warm-ups, like the PyTorch peer.
        pub fn bench_all_to_all_counts(
            &self,
            send_counts: &[usize],
            recv_counts: &[usize],
        ) -> Result<f64, KernelError> {
            let ns: usize = send_counts.iter().sum();
            let nr: usize = recv_counts.iter().sum();
            let send = self.upload(&vec![0x3Fu8; ns.max(1)])?;
            let mut recv = self.stream.alloc_zeros::<u8>(nr.max(1)).map_err(cuda)?;
            for _ in 0..3 {
                self.all_to_all_v(&send, send_counts, &mut recv, recv_counts)?;
            }
            self.synchronize()?;
            let mut ts = Vec::with_capacity(20);
            for _ in 0..20 {
                let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                let a = self.ctx.new_event(timing).map_err(cuda)?;
                let b = self.ctx.new_event(timing).map_err(cuda)?;
                a.record(&self.stream).map_err(cuda)?;
                self.all_to_all_v(&send, send_counts, &mut recv, recv_counts)?;
                b.record(&self.stream).map_err(cuda)?;
                self.synchronize()?;
                ts.push(f64::from(a.elapsed_ms(&b).map_err(cuda)?));
            }
            ts.sort_by(f64::total_cmp);
            Ok(ts[ts.len() / 2])
        }

        /// `torch.distributed.all_to_all_single` peer: a buffer of
        /// `total_bytes` split equally over the ranks. Median ms.
        pub fn bench_all_to_all(&self, total_bytes: usize) -> Result<f64, KernelError> {
            let per = total_bytes / self.world;
            let counts = vec![per; self.world];
            self.bench_all_to_all_counts(&counts, &counts)
        }
    }

    /// An exchange started by [`NcclComm::start_all_to_all`]: owns its
    /// buffers until the compute stream is ordered after it.
    pub struct InFlight<T> {
        sends: Vec<CudaSlice<T>>,
        /// The receive buffer; `None` once finished.
        recv: Option<CudaSlice<T>>,
        done: cudarc::driver::CudaEvent,
        compute: Arc<CudaStream>,
    }

    impl<T> InFlight<T> {
        /// The send buffers (the exchange reads them; reading them on the
        /// compute stream meanwhile is fine).
        pub fn sends(&self) -> &[CudaSlice<T>] {
            &self.sends
        }

        /// The send buffers and the receive buffer, for work on the compute
        /// stream meanwhile: reading the sends, writing regions of the
        /// receive buffer the exchange does not receive into (the message
        /// to self).
        #[allow(clippy::type_complexity)]
        pub fn buffers_mut(&mut self) -> Result<(&[CudaSlice<T>], &mut CudaSlice<T>), KernelError> {
            match self.recv.as_mut() {
                Some(r) => Ok((&self.sends, r)),
                None => Err(KernelError::Comm("an exchange finished twice".into())),
            }
        }

        /// Orders the compute stream after the exchange (the host does not
        /// wait) and returns the receive buffer and the send buffers.
        pub fn finish(mut self) -> Result<(CudaSlice<T>, Vec<CudaSlice<T>>), KernelError> {
            self.compute.wait(&self.done).map_err(cuda)?;
            let sends = std::mem::take(&mut self.sends);
            match self.recv.take() {
                Some(r) => Ok((r, sends)),
                None => Err(KernelError::Comm("an exchange finished twice".into())),
            }
        }
    }

    impl<T> Drop for InFlight<T> {
        fn drop(&mut self) {
            // Unfinished (an error path): the buffers are freed on the
            // compute stream, so order it after the exchange first.
            if self.recv.is_some() {
                let _ = self.compute.wait(&self.done);
            }
        }
    }

    impl Drop for NcclComm {
        fn drop(&mut self) {
            // Abort rather than finalize: finalizing waits for every peer,
            // and a dropped communicator must never hang its process.
            self.watch.abort();
            self.watch.lock().stop = true;
            self.watch.cv.notify_all();
            if let Some(h) = self.watchdog.take() {
                let _ = h.join();
            }
        }
    }
}
