//! Small helpers every stage uses: shapes, scans, row permutations, run
//! expansion, per-expert blocks, row exchanges, the phase clock.

use pack::ep::{experts_per_rank, Runs};

use crate::backend::{Backend, Buf, Elem, Family, Rows};
use crate::config::at_least;
use crate::config::MoeConfig;
use crate::LayerError;

/// The projections `x·W_gate`, `x·W_up` of expert rows (`rows × F` each).
pub(crate) type Projections<B> = (Rows<B>, Rows<B>);

/// An owner's forward rows kept for the backward (calls without replicas).
pub(crate) struct OwnedRows<F: Family> {
    /// The rows as they arrived (source-major).
    pub(crate) x: F::Buf<F::V>,
    /// Their projections in the same order, when the call keeps them
    /// ([`crate::DevicePlanner::keep_projections`], one rank).
    #[allow(clippy::type_complexity)]
    pub(crate) ab: Option<(F::Buf<F::V>, F::Buf<F::V>)>,
    /// Expert-major row → arrival row (`None`: the identity).
    pub(crate) perm: Option<F::Buf<u32>>,
    pub(crate) expert: F::Buf<u32>,
    pub(crate) offsets: F::Buf<u32>,
    /// This rank's experts' range in the global expert-major order.
    pub(crate) global: (usize, usize),
}

/// An owner's forward rows as the backward holds them: borrowed from the
/// saved state (which stays whole, for another backward of the same
/// forward), or taken from it (released as soon as the kept rows are
/// gathered from them, as autograd frees a saved tensor once its backward
/// has read it).
pub(crate) enum Held<'a, F: Family> {
    Borrowed(&'a OwnedRows<F>),
    /// The device executor's `backward_releasing`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Taken(Box<OwnedRows<F>>),
}

impl<F: Family> std::ops::Deref for Held<'_, F> {
    type Target = OwnedRows<F>;
    fn deref(&self) -> &OwnedRows<F> {
        match self {
            Held::Borrowed(r) => r,
            Held::Taken(r) => r,
        }
    }
}

/// The timeline of one call, logged when `LRMOE_EP_PROFILE=1`: a mark on
/// the computation's timeline after each phase, and for each exchange the
/// computation's mark where it was started and the collectives' mark where
/// it ended. Nothing is synchronised until the log, so overlapping phases
/// show as overlapping intervals (ms from the call's start); beside each
/// compute mark, the host's ms from the call's start when it enqueued the
/// mark (a host far ahead of the device is never waited on; a device mark
/// close behind the host's is a device that waited for the host).
pub(crate) struct Laps<F: Family> {
    start: Option<F::Mark>,
    /// Whether [`Laps::print`] logs (`LRMOE_EP_PROFILE=1`).
    log: bool,
    host0: std::time::Instant,
    compute: Vec<(&'static str, F::Mark, f64)>,
    comm: Vec<(&'static str, F::Mark, F::Mark)>,
}

impl<F: Family> Laps<F> {
    /// Records when `LRMOE_EP_PROFILE=1`, or when `always`.
    pub(crate) fn new<B: Backend<F = F>>(b: &B, always: bool) -> Result<Self, LayerError> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let log = *ON.get_or_init(|| std::env::var("LRMOE_EP_PROFILE").as_deref() == Ok("1"));
        Ok(Self {
            start: if log || always { Some(b.mark()?) } else { None },
            log,
            host0: std::time::Instant::now(),
            compute: Vec::new(),
            comm: Vec::new(),
        })
    }
    pub(crate) fn lap<B: Backend<F = F>>(
        &mut self,
        b: &B,
        name: &'static str,
    ) -> Result<(), LayerError> {
        b.part(name)?;
        if self.start.is_some() {
            let host = self.host0.elapsed().as_secs_f64() * 1e3;
            self.compute.push((name, b.mark()?, host));
        }
        Ok(())
    }
    /// An exchange `name` was just started.
    pub(crate) fn sent<B: Backend<F = F>>(
        &mut self,
        b: &B,
        name: &'static str,
    ) -> Result<(), LayerError> {
        if self.start.is_some() {
            if let Some(end) = b.comm_mark()? {
                self.comm.push((name, b.mark()?, end));
            }
        }
        Ok(())
    }
    /// Each compute phase's milliseconds, in order (none unless
    /// recording).
    pub(crate) fn intervals<B: Backend<F = F>>(
        &self,
        b: &B,
    ) -> Result<Vec<(&'static str, f64)>, LayerError> {
        let Some(t0) = &self.start else {
            return Ok(Vec::new());
        };
        let mut at = 0.0;
        let mut out = Vec::with_capacity(self.compute.len());
        for (n, m, _) in &self.compute {
            let t = b.ms_between(t0, m)?;
            out.push((*n, t - at));
            at = t;
        }
        Ok(out)
    }
    pub(crate) fn print<B: Backend<F = F>>(&self, b: &B, what: &str) -> Result<(), LayerError> {
        let Some(t0) = self.start.as_ref().filter(|_| self.log) else {
            return Ok(());
        };
        let mut parts = Vec::new();
        let mut at = 0.0;
        for (n, m, host) in &self.compute {
            let t = b.ms_between(t0, m)?;
            parts.push(format!("{n} {at:.2}-{t:.2} (host {host:.2})"));
            at = t;
        }
        let mut comm = Vec::new();
        for (n, s, e) in &self.comm {
            comm.push(format!(
                "{n} {:.2}-{:.2}",
                b.ms_between(t0, s)?,
                b.ms_between(t0, e)?
            ));
        }
        tracing::info!(
            rank = b.rank(),
            phase = what,
            "EP timeline (device ms): compute: {}; comm: {}",
            parts.join(", "),
            comm.join(", ")
        );
        Ok(())
    }
}

/// This rank, the ranks, and the experts each rank owns.
pub(crate) fn world_of<B: Backend>(
    b: &B,
    cfg: &MoeConfig,
) -> Result<(usize, usize, usize), LayerError> {
    B::check_layer(cfg)?;
    let (rank, world) = (b.rank(), b.world_size());
    Ok((rank, world, experts_per_rank(cfg.n_experts, world)?))
}

pub(crate) fn elems(rows: &[usize], width: usize) -> Vec<usize> {
    rows.iter().map(|r| r * width).collect()
}

/// Rows this rank sends to other ranks under `send` counts.
pub(crate) fn off_rank(send: &[usize], rank: usize) -> usize {
    send.iter().sum::<usize>() - send[rank]
}

/// Starts of consecutive parts of `counts` (`len + 1` entries, from 0).
pub(crate) fn exclusive_scan<T: Copy + Default + std::ops::Add<Output = T>>(
    counts: &[T],
) -> Vec<T> {
    let mut v = Vec::with_capacity(counts.len() + 1);
    let mut s = T::default();
    v.push(s);
    for &c in counts {
        s = s + c;
        v.push(s);
    }
    v
}

/// `rows[perm[j]]` for the `perm.len()` rows of `width` of `rows`; the
/// buffer itself when `perm` is the identity (one rank's layouts). Every
/// `perm` here is a `pack::ep` layout's (`recv.perm`, `recv.inv`,
/// `send_inv`, `send_order`): a permutation of `0..perm.len()`, which
/// `pack` proptests, so only the row count is checked here.
pub(crate) fn permute_rows<B: Backend>(
    b: &B,
    rows: Rows<B>,
    perm: &Runs,
    width: usize,
) -> Result<Rows<B>, LayerError> {
    if perm.is_identity() {
        return Ok(rows);
    }
    let n = perm.len;
    at_least("rows to permute", n * width, B::len(&rows))?;
    let pd = b.expand(perm)?;
    // SAFETY: perm is a permutation of 0..n (a `pack::ep` layout) and rows
    // holds n rows (checked above).
    unsafe { b.gather_rows(&rows, &pd, 1, None, n, width) }
}

/// `vals[perm[j]]` (4-byte values); the buffer itself for the identity.
/// `perm` as in [`permute_rows`].
pub(crate) fn permute4<B: Backend, E: Elem>(
    b: &B,
    vals: Buf<B, E>,
    perm: &Runs,
) -> Result<Buf<B, E>, LayerError> {
    if perm.is_identity() {
        return Ok(vals);
    }
    at_least("values to permute", perm.len, B::len(&vals))?;
    let pd = b.expand(perm)?;
    // SAFETY: perm is a permutation of 0..perm.len (a `pack::ep` layout)
    // over as many values (checked above).
    unsafe { b.gather32(&vals, &pd, perm.len) }
}

/// Block moves `(from, to)` merged into runs `(from, to, blocks)` where
/// both sides continue consecutively (a pair repeated, or out of order,
/// starts a new run), so that each run is one copy.
pub(crate) fn block_runs(
    moves: impl IntoIterator<Item = (usize, usize)>,
) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (from, to) in moves {
        match runs.last_mut() {
            Some((f, t, n)) if *f + *n == from && *t + *n == to => *n += 1,
            _ => runs.push((from, to, 1)),
        }
    }
    runs
}

/// The blocks of `width` elements of `src` at the listed block indices,
/// packed into one buffer in that order (a run of consecutive blocks is
/// one copy).
pub(crate) fn pack_blocks<B: Backend>(
    b: &B,
    src: &Rows<B>,
    blocks: &[usize],
    width: usize,
) -> Result<Rows<B>, LayerError> {
    pack_tensor_blocks(b, &[src], blocks, &[blocks.len()], width)
}

/// Where tensor `t`'s copy of listed block `j` lies in a buffer that
/// [`pack_tensor_blocks`] packed from `tensors` tensors, `starts` the
/// parts' first blocks ([`exclusive_scan`] of their counts): parts one
/// after another, within a part each tensor's blocks in turn. The same
/// layout arrives at the receiver, parts by source.
pub(crate) fn tensor_block(starts: &[usize], tensors: usize, t: usize, j: usize) -> usize {
    // The part holding `j` (the last one starting at or before it).
    let d = starts.partition_point(|&x| x <= j) - 1;
    let count = starts[d + 1] - starts[d];
    tensors * starts[d] + t * count + (j - starts[d])
}

/// The listed blocks (`blocks`, in parts of `counts`) of every tensor of
/// `tensors`, packed for one exchange of them all: part by part (one part
/// per destination), within a part each tensor's blocks in turn
/// ([`tensor_block`]). A run of consecutive blocks is one copy.
pub(crate) fn pack_tensor_blocks<B: Backend>(
    b: &B,
    tensors: &[&Rows<B>],
    blocks: &[usize],
    counts: &[usize],
    width: usize,
) -> Result<Rows<B>, LayerError> {
    let starts = exclusive_scan(counts);
    crate::config::shape("blocks of the parts", starts[counts.len()], blocks.len())?;
    // SAFETY: every block of the output is written by the copies below
    // (each part's blocks of each tensor).
    let mut out = unsafe { b.uninit(tensors.len() * blocks.len() * width) }?;
    for (t, &src) in tensors.iter().enumerate() {
        let moves = (blocks.iter().enumerate())
            .map(|(j, &blk)| (blk, tensor_block(&starts, tensors.len(), t, j)));
        for (from, to, n) in block_runs(moves) {
            if (from + n) * width > B::len(src) {
                return Err(LayerError::Config("a weight block past its tensor".into()));
            }
            b.copy(src, from * width, &mut out, to * width, n * width)?;
        }
    }
    Ok(out)
}

/// The parts of an exchange of rows of `width` from one packed buffer
/// (`send[d]` rows to rank `d`, consecutive) into one packed buffer
/// (`recv[s]` rows from rank `s`, consecutive), the own rank's message
/// left out of both (its region of the receive buffer is the caller's).
#[allow(clippy::type_complexity)]
pub(crate) fn packed_parts(
    send: &[usize],
    recv: &[usize],
    rank: usize,
    width: usize,
) -> (Vec<(usize, usize, usize)>, Vec<(usize, usize)>) {
    let (so, ro) = (exclusive_scan(send), exclusive_scan(recv));
    let sp = (0..send.len())
        .map(|d| {
            let n = if d == rank { 0 } else { send[d] * width };
            (0, so[d] * width, n)
        })
        .collect();
    let rp = (0..recv.len())
        .map(|s| {
            let n = if s == rank { 0 } else { recv[s] * width };
            (ro[s] * width, n)
        })
        .collect();
    (sp, rp)
}

/// Starts an exchange of the packed rows `send` (`send_rows[d]` rows of
/// `width` to rank `d`) into a fresh packed buffer (`recv_rows[s]` rows from
/// rank `s`); the own rows are copied beside it when `copy_own` (else their
/// region stays unwritten). One rank: every row is its own, and `send` is
/// handed through as the received rows.
pub(crate) fn exchange_rows<B: Backend, E: Elem>(
    b: &B,
    send: Buf<B, E>,
    (send_rows, recv_rows): (&[usize], &[usize]),
    width: usize,
    copy_own: bool,
) -> Result<B::Flight<E>, LayerError> {
    if b.world_size() == 1 {
        return Ok(b.handed(send, Vec::new()));
    }
    let rank = b.rank();
    let (sp, rp) = packed_parts(send_rows, recv_rows, rank, width);
    let total: usize = recv_rows.iter().sum();
    // SAFETY: the exchange writes every other rank's region and the copy
    // below the own one; without `copy_own` the caller reads no row of it.
    let recv = unsafe { b.uninit::<E>(total * width) }?;
    let mut fl = b.start(vec![send], &sp, recv, &rp)?;
    if copy_own {
        let (a, c) = (
            exclusive_scan(send_rows)[rank],
            exclusive_scan(recv_rows)[rank],
        );
        let (sends, recv) = B::flight_buffers(&mut fl)?;
        copy_rows(b, &sends[0], a, recv, c, (send_rows[rank], width))?;
    }
    Ok(fl)
}

/// Copies `rows` rows of `width` from row `a` of `from` to row `at` of `to`
/// (the message to self of an exchange).
pub(crate) fn copy_rows<B: Backend, E: Elem>(
    b: &B,
    from: &Buf<B, E>,
    a: usize,
    to: &mut Buf<B, E>,
    at: usize,
    (rows, width): (usize, usize),
) -> Result<(), LayerError> {
    if rows == 0 {
        return Ok(());
    }
    at_least("rows to copy", (a + rows) * width, B::len(from))?;
    at_least("rows to copy into", (at + rows) * width, B::len(to))?;
    b.copy(from, a * width, to, at * width, rows * width)
}
