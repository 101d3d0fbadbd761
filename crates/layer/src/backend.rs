//! The backend contract: the primitives one MoE layer call needs, with the
//! buffers they work on, so that the layer's stages (`crate::stages`) are
//! written once over any backend.
//!
//! A backend is two things:
//!
//! * a [`Family`] — the types of its buffers (`Buf<E>` for elements `E`),
//!   its activation values (`V`: bf16 bits on the device), its router
//!   output, the expert backward's state between the data and the weight
//!   gradients, and its timeline marks. A family is a plain `'static` type,
//!   so saved state and weights are named by it ([`crate::stages::Saved`],
//!   [`crate::stages::Weights`]) without the lifetime of a borrowed
//!   device or transport;
//! * a [`Backend`] — one rank's handle (a GPU and its communicator): the
//!   primitives themselves. Each is one operation of the backend's own:
//!   route, count keys, group and gather rows by index maps (expanded from
//!   `pack::ep::Runs`), grouped GEMMs (forward, data and weight
//!   gradients), scores, selection, combine, and the collectives (counts
//!   all-gathered, row exchanges started beside the computation and
//!   finished later, sums over ranks).
//!
//! The contract of every index-reading primitive is its `# Safety`
//! section: a backend may not check an index (the device cannot), so the
//! caller states why each holds. The implementation for the device is
//! `crate::device::Device` (feature `cuda`), whose every primitive is one
//! `kernels::gpu::Gpu` operation or one `DeviceComm` collective.

use std::ops::Range;

use pack::ep::Runs;

use crate::config::Experts;
use crate::LayerError;

/// What a device buffer may hold (`u8`, `u16`, `u32`, `f32`, `f64`).
pub trait Elem: Copy + Default + Send + Sync + 'static + bytemuck::Pod + DeviceElem {}

impl Elem for u8 {}
impl Elem for u16 {}
impl Elem for u32 {}
impl Elem for f32 {}
impl Elem for f64 {}

/// What the CUDA build needs of an element as well (cudarc's traits);
/// nothing without CUDA.
#[cfg(feature = "cuda")]
pub trait DeviceElem: kernels::gpu::DeviceRepr + kernels::gpu::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: kernels::gpu::DeviceRepr + kernels::gpu::ValidAsZeroBits> DeviceElem for T {}
/// What the CUDA build needs of an element as well; nothing here.
#[cfg(not(feature = "cuda"))]
pub trait DeviceElem {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElem for T {}

/// A backend's scalar: routing weights, probabilities, norms, scores,
/// the router's gradient (`f32` on the device).
pub trait Scalar: Elem + PartialOrd {
    /// `v` rounded to the scalar.
    fn from_f64(v: f64) -> Self;
    /// The scalar, widened.
    fn to_f64(self) -> f64;
}

impl Scalar for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Scalar for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// A value the host backend computes in (`f32`, `f64`): the layer's
/// public entry points take it.
pub trait Value: kernels::cpu::Real + Scalar {}

impl<T: kernels::cpu::Real + Scalar> Value for T {}

/// The types of a backend's memory (see the module doc).
pub trait Family: 'static {
    /// An activation or weight value as stored (bf16 bits on the device).
    type V: Elem;
    /// Its scalar.
    type S: Scalar;
    /// A buffer of `E`.
    type Buf<E: Elem>: Clone;
    /// The router's output on one rank's tokens.
    type Routed;
    /// What the experts' data gradients keep for their weight gradients.
    type Rest;
    /// A point on the backend's timeline.
    type Mark;
}

/// A buffer of backend `B`'s family.
pub type Buf<B, E> = <<B as Backend>::F as Family>::Buf<E>;
/// Activation rows of backend `B`.
pub type Rows<B> = Buf<B, Val<B>>;
/// Backend `B`'s activation value.
pub type Val<B> = <<B as Backend>::F as Family>::V;
/// Backend `B`'s scalar.
pub type Sc<B> = <<B as Backend>::F as Family>::S;
/// Backend `B`'s router output.
pub type RoutedOf<B> = <<B as Backend>::F as Family>::Routed;
/// The three expert weight tensors an instance computes with.
pub type Wts<'a, B> = Experts<&'a Rows<B>>;

/// One rank's primitives (see the module doc).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub trait Backend {
    /// The buffers' family.
    type F: Family;
    /// An exchange started and not yet finished.
    type Flight<E: Elem>;
    /// A download started and not yet waited for.
    type Later<'a, E: Elem>
    where
        Self: 'a;

    /// Refuses a layer this backend cannot run (the device's alignments).
    fn check_layer(cfg: &crate::MoeConfig) -> Result<(), LayerError>;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;

    // ---- memory ----

    /// `v` in a new buffer.
    fn upload<E: Elem>(&self, v: &[E]) -> Result<Buf<Self, E>, LayerError>;
    /// The first `n` elements of `b`.
    fn download<E: Elem>(&self, b: &Buf<Self, E>, n: usize) -> Result<Vec<E>, LayerError>;
    /// Starts copying the first `n` elements of `b` out; [`Backend::wait`]
    /// reads them.
    fn download_later<E: Elem>(
        &self,
        b: &Buf<Self, E>,
        n: usize,
    ) -> Result<Self::Later<'_, E>, LayerError>;
    /// The elements a [`Backend::download_later`] copied.
    fn wait<E: Elem>(&self, later: Self::Later<'_, E>) -> Result<Vec<E>, LayerError>;
    /// `n` zeros.
    fn zeros<E: Elem>(&self, n: usize) -> Result<Buf<Self, E>, LayerError>;
    /// `n` elements, unwritten.
    ///
    /// # Safety
    ///
    /// Every element is written before it is read.
    unsafe fn uninit<E: Elem>(&self, n: usize) -> Result<Buf<Self, E>, LayerError>;
    /// Elements of `b`.
    fn len<E: Elem>(b: &Buf<Self, E>) -> usize;
    /// Copies `n` elements of `from` from `a` to `to` at `at`.
    fn copy<E: Elem>(
        &self,
        from: &Buf<Self, E>,
        a: usize,
        to: &mut Buf<Self, E>,
        at: usize,
        n: usize,
    ) -> Result<(), LayerError>;
    /// `to[at..at + n] += from[a..a + n]` (activation values).
    fn add_into(
        &self,
        to: &mut Rows<Self>,
        at: usize,
        from: &Rows<Self>,
        a: usize,
        n: usize,
    ) -> Result<(), LayerError>;
    /// A `pack::ep` index map, expanded.
    fn expand(&self, map: &Runs) -> Result<Buf<Self, u32>, LayerError>;

    // ---- index maps and row movers ----

    /// Stable grouping of `n` keys (below `groups`) into `out` rows: with
    /// `keep`, flagged rows only, each key's rows from `base[key]` on
    /// (`seg` the rows' own key partition when it helps); returns (row →
    /// grouped position or `DROPPED`, grouped position → row).
    ///
    /// # Safety
    ///
    /// `expert` and `keep` hold `n` entries below `groups`; `base` is the
    /// prefix sum of the (flagged) counts per key, which add up to `out`;
    /// `seg`, where given, partitions the `n` rows by key.
    unsafe fn group(
        &self,
        expert: &Buf<Self, u32>,
        keep: Option<&Buf<Self, u8>>,
        seg: Option<&Buf<Self, u32>>,
        base: &[u32],
        n: usize,
        out: usize,
        groups: usize,
    ) -> Result<(Buf<Self, u32>, Buf<Self, u32>), LayerError>;
    /// Row `j` of the result is row `pair[j] / div` of `src` (`width`
    /// values), times `scale[pair[j]]` where given.
    ///
    /// # Safety
    ///
    /// `pair` holds `n_out` indices whose `/ div` are rows of `src`, and
    /// entries of `scale`.
    unsafe fn gather_rows(
        &self,
        src: &Rows<Self>,
        pair: &Buf<Self, u32>,
        div: usize,
        scale: Option<&Buf<Self, Sc<Self>>>,
        n_out: usize,
        width: usize,
    ) -> Result<Rows<Self>, LayerError>;
    /// `src[idx[j]]` for `j < n` (4-byte elements on the device); an
    /// index of `DROPPED` yields all-ones bits (`DROPPED` for `u32`).
    ///
    /// # Safety
    ///
    /// `idx` holds `n` indices of `src` or `DROPPED`.
    unsafe fn gather32<E: Elem>(
        &self,
        src: &Buf<Self, E>,
        idx: &Buf<Self, u32>,
        n: usize,
    ) -> Result<Buf<Self, E>, LayerError>;
    /// `src[idx[j]]` for `j < n` (flags).
    ///
    /// # Safety
    ///
    /// `idx` holds `n` indices of `src`.
    unsafe fn gather_flags(
        &self,
        src: &Buf<Self, u8>,
        idx: &Buf<Self, u32>,
        n: usize,
    ) -> Result<Buf<Self, u8>, LayerError>;
    /// Token `t`'s row: `base[t] + Σ_k gate[t·k + j] · o[row[t·k + j]]`
    /// over its `top_k` pairs (a gate of 1 without `gates`, nothing
    /// without `base`; a row of `DROPPED` adds nothing).
    ///
    /// # Safety
    ///
    /// `row` holds `tokens · top_k` rows of `o` or `DROPPED`.
    unsafe fn combine_rows(
        &self,
        o: &Rows<Self>,
        row: &Buf<Self, u32>,
        gates: Option<&Buf<Self, Sc<Self>>>,
        base: Option<&Rows<Self>>,
        dims: (usize, usize, usize),
    ) -> Result<Rows<Self>, LayerError>;

    // ---- the router ----

    /// Router GEMM, the logit bias, softmax, top-k (on the selection-biased
    /// probabilities), the gates and the counts per expert;
    /// `dims = (tokens, hidden, experts, top_k)`.
    fn route(
        &self,
        router: &Rows<Self>,
        x: &Rows<Self>,
        bias: Option<&Buf<Self, Sc<Self>>>,
        sel_bias: Option<&Buf<Self, Sc<Self>>>,
        dims: (usize, usize, usize, usize),
        renormalize: bool,
    ) -> Result<RoutedOf<Self>, LayerError>;
    /// Routed pairs per expert (host).
    fn routed_counts(r: &RoutedOf<Self>) -> &[u32];
    /// The expert of each pair.
    fn routed_experts(r: &RoutedOf<Self>) -> &Buf<Self, u32>;
    /// The routing weight of each pair.
    fn routed_gates(r: &RoutedOf<Self>) -> &Buf<Self, Sc<Self>>;
    /// The router probabilities, `tokens × experts`.
    fn routed_probs(r: &RoutedOf<Self>) -> &Buf<Self, Sc<Self>>;
    /// Tokens routed.
    fn routed_tokens(r: &RoutedOf<Self>) -> usize;
    /// Column means of `t × e` values.
    fn col_mean(
        &self,
        x: &Buf<Self, Sc<Self>>,
        t: usize,
        e: usize,
    ) -> Result<Buf<Self, Sc<Self>>, LayerError>;
    /// The router's backward from every pair's output (`o[row[pair]]`):
    /// its weight gradient (scalars) and its part of `dX`.
    ///
    /// # Safety
    ///
    /// `row` holds a row of `o` for every pair of `r`.
    unsafe fn router_backward(
        &self,
        r: &RoutedOf<Self>,
        aux_dp: Option<&Buf<Self, Sc<Self>>>,
        router: &Rows<Self>,
        x: &Rows<Self>,
        dy: &Rows<Self>,
        o: &Rows<Self>,
        row: &Buf<Self, u32>,
        h: usize,
    ) -> Result<(Buf<Self, Sc<Self>>, Rows<Self>), LayerError>;

    // ---- scores and selection ----

    /// `Σ x²` of each of `n` rows of `d` values.
    fn row_sq(&self, x: &Rows<Self>, n: usize, d: usize)
        -> Result<Buf<Self, Sc<Self>>, LayerError>;
    /// `g² · ‖δ‖² · ‖h‖²` of `n` rows (row `j` is pair `src[j]`, token
    /// `src[j] / k`).
    ///
    /// # Safety
    ///
    /// `src` holds `n` pairs of `gates`, `h_sq` `n` entries.
    unsafe fn scores_from_norms(
        &self,
        gates: &Buf<Self, Sc<Self>>,
        dy_sq: &Buf<Self, Sc<Self>>,
        h_sq: &Buf<Self, Sc<Self>>,
        src: &Buf<Self, u32>,
        n: usize,
        k: usize,
    ) -> Result<Buf<Self, Sc<Self>>, LayerError>;
    /// Per segment `g` of `offsets` (`quotas.len() + 1` ascending
    /// offsets ending at the rows' count), the rule's choice of
    /// `quotas[g]` rows by score, ties to the smaller id; the sampling
    /// rules draw from `(seed, id)`. Returns each row's kept flag and, for
    /// the unbiased rules, its weight (0 where dropped). A non-finite score
    /// sets `err` (the flags are then meaningless). A backend may refuse a
    /// rule it cannot run.
    ///
    /// # Safety
    ///
    /// `scores` and `ids` hold one entry per row.
    unsafe fn select(
        &self,
        scores: &Buf<Self, Sc<Self>>,
        ids: &Buf<Self, u32>,
        offsets: &[u32],
        quotas: &[u32],
        rule: (lrm_score::Rule, u64),
        err: &mut Buf<Self, u32>,
    ) -> Result<(Buf<Self, u8>, Option<Buf<Self, Sc<Self>>>), LayerError>;
    /// `a ⊙ b` of `n` values.
    fn mul(
        &self,
        a: &Buf<Self, Sc<Self>>,
        b: &Buf<Self, Sc<Self>>,
        n: usize,
    ) -> Result<Buf<Self, Sc<Self>>, LayerError>;
    /// Flagged rows per key (keys below `groups`).
    fn kept_counts(
        &self,
        key: &Buf<Self, u32>,
        keep: &Buf<Self, u8>,
        n: usize,
        groups: usize,
    ) -> Result<Buf<Self, u32>, LayerError>;

    // ---- the experts ----

    /// The SwiGLU experts on rows `rows` of `x` grouped by `offsets`: each
    /// row's output and `‖h‖²`, and with `keep` its projections
    /// `x·W_gate`, `x·W_up`.
    fn experts_forward(
        &self,
        offsets: &[u32],
        x: &Rows<Self>,
        rows: Range<usize>,
        w: Wts<'_, Self>,
        dims: (usize, usize),
        keep: bool,
    ) -> Result<
        (
            Rows<Self>,
            Buf<Self, Sc<Self>>,
            Option<(Rows<Self>, Rows<Self>)>,
        ),
        LayerError,
    >;
    /// The experts' data gradient of grouped rows `x` with output
    /// gradients `dd` (recomputing the projections, or from `ab` where
    /// the forward kept them), and what the weight gradients need.
    fn experts_backward_data(
        &self,
        offsets: &[u32],
        x: &Rows<Self>,
        ab: Option<(&Rows<Self>, &Rows<Self>)>,
        dd: &Rows<Self>,
        w: Wts<'_, Self>,
        dims: (usize, usize),
    ) -> Result<(Rows<Self>, <Self::F as Family>::Rest), LayerError>;
    /// The experts' weight gradients (gate, up, down).
    fn experts_backward_weights(
        &self,
        rest: <Self::F as Family>::Rest,
        x: &Rows<Self>,
        dd: &Rows<Self>,
    ) -> Result<Experts<Rows<Self>>, LayerError>;

    // ---- collectives ----

    /// Every rank's counts, rank order.
    fn all_gather_counts(&self, mine: &[u32]) -> Result<Vec<Vec<u32>>, LayerError>;
    /// An all-to-all of `send` (`send_counts` elements to each rank,
    /// `recv_counts` from each), waited for. One rank: `send` itself.
    fn exchange<E: Elem>(
        &self,
        send: Buf<Self, E>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Buf<Self, E>, LayerError>;
    /// Starts an exchange beside the computation: `sends[b][off..off + n]`
    /// to rank `d` for `send_parts[d] = (b, off, n)`, `recv_parts[s] =
    /// (off, n)` into `recv` from rank `s`; the message to self never
    /// travels.
    fn start<E: Elem>(
        &self,
        sends: Vec<Buf<Self, E>>,
        send_parts: &[(usize, usize, usize)],
        recv: Buf<Self, E>,
        recv_parts: &[(usize, usize)],
    ) -> Result<Self::Flight<E>, LayerError>;
    /// An exchange with nothing to do: `recv` and `sends` as they are.
    fn handed<E: Elem>(&self, recv: Buf<Self, E>, sends: Vec<Buf<Self, E>>) -> Self::Flight<E>;
    /// The first buffer going out (one rank: the rows handed through).
    fn outgoing<E: Elem>(f: &Self::Flight<E>) -> Result<&Buf<Self, E>, LayerError>;
    /// The send buffers and the receive buffer of an exchange in flight.
    fn flight_buffers<E: Elem>(
        f: &mut Self::Flight<E>,
    ) -> Result<(&[Buf<Self, E>], &mut Buf<Self, E>), LayerError>;
    /// Orders the computation after the exchange: the receive buffer and
    /// the send buffers.
    fn finish<E: Elem>(
        &self,
        f: Self::Flight<E>,
    ) -> Result<(Buf<Self, E>, Vec<Buf<Self, E>>), LayerError>;
    /// Starts the sum of `buf` over ranks beside the computation.
    fn start_sum(&self, buf: Buf<Self, Sc<Self>>) -> Result<Self::Flight<Sc<Self>>, LayerError>;
    /// Waits, with the collectives' deadline, for every collective started
    /// so far.
    fn settle(&self) -> Result<(), LayerError>;
    /// Whether the grouped GEMMs leave room for an exchange running beside
    /// them (on while the stages overlap an exchange with them).
    fn reserve_for_exchange(&self, on: bool);

    // ---- the timeline (`LRMOE_EP_PROFILE=1`, timed in-process ranks) ----

    /// Timed in-process ranks: the work since the last part is part `name`
    /// of the current phase ([`crate::Transport::part`]). Elsewhere
    /// nothing.
    fn part(&self, name: &'static str) -> Result<(), LayerError>;

    /// Timed in-process ranks: the exchange started last before the work
    /// since is waited for here — the NCCL path runs that work beside it
    /// ([`crate::Transport::joined`]). Elsewhere nothing.
    fn joined(&self) -> Result<(), LayerError>;

    /// A mark on the computation's timeline.
    fn mark(&self) -> Result<<Self::F as Family>::Mark, LayerError>;
    /// A mark on the collectives' timeline (none where they do not run
    /// beside the computation).
    fn comm_mark(&self) -> Result<Option<<Self::F as Family>::Mark>, LayerError>;
    /// Milliseconds from `earlier` to `later`.
    fn ms_between(
        &self,
        earlier: &<Self::F as Family>::Mark,
        later: &<Self::F as Family>::Mark,
    ) -> Result<f64, LayerError>;
}

/// Leaves room in the grouped GEMMs for an exchange running beside them
/// while it lives; [`Overlap::end`] closes it where the exchange is waited
/// for, which timed ranks record ([`Backend::joined`]) so the simulator
/// overlaps exactly this work with the exchange.
pub(crate) struct Overlap<'a, B: Backend>(&'a B);

impl<'a, B: Backend> Overlap<'a, B> {
    pub(crate) fn new(b: &'a B) -> Self {
        b.reserve_for_exchange(true);
        Self(b)
    }

    /// The exchange has been waited for (after `finish`): the GEMMs get
    /// every SM back, and the timeline marks the end of the overlap.
    pub(crate) fn end(self) -> Result<(), LayerError> {
        let b = self.0;
        drop(self);
        b.joined()
    }
}

impl<B: Backend> Drop for Overlap<'_, B> {
    fn drop(&mut self) {
        self.0.reserve_for_exchange(false);
    }
}
