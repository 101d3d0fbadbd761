//! The host backend: the [`Backend`] contract on CPU rows of `f32` or
//! `f64` over any [`Transport`]. Buffers are `Vec`s, every exchange is
//! finished when it starts, and every index a primitive reads is checked
//! (an index out of range is an error, not undefined behaviour). The
//! expert GEMMs run on the CPU in the layer's precision
//! (`kernels::cpu::matmul`).

use std::marker::PhantomData;
use std::ops::Range;
use std::time::Instant;

use kernels::cpu::{matmul, silu, swiglu_backward, Op, Real, DROPPED};
use pack::ep::Runs;
use rayon::prelude::*;

use crate::backend::{Backend, Elem, Family, Scalar, Wts};
use crate::config::{at_least, Experts};
use crate::experts::ExpertBackend;
use crate::transport::{all_gather, all_reduce_sum, all_to_all, Transport};
use crate::LayerError;

/// CPU memory holding values `T` (`f32` or `f64`).
pub struct HostMem<T>(PhantomData<T>);

/// A host buffer: a `Vec` whose bytes are metered on its thread (the
/// host backward's peak of live buffers, `BackwardStats::buffer_bytes`).
#[derive(Debug)]
pub struct HostBuf<E> {
    v: Vec<E>,
}

thread_local! {
    static LIVE: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
    static PEAK: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
}

fn meter(delta: i64) {
    // `try_with`: a thread being torn down frees without counting.
    let _ = LIVE.try_with(|l| {
        l.set(l.get() + delta);
        let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
    });
}

/// Runs an exchange that receives `n` elements of `E`, metering the
/// received bytes the transport hands over before they are typed (both
/// copies live at once).
fn received_as_bytes<E, R>(n: usize, f: impl FnOnce() -> R) -> R {
    let bytes = (n * std::mem::size_of::<E>()) as i64;
    meter(bytes);
    let r = f();
    meter(-bytes);
    r
}

/// The bytes of host buffers live on this thread now; the peak restarts
/// from here.
pub(crate) fn meter_start() -> i64 {
    let live = LIVE.with(std::cell::Cell::get);
    PEAK.with(|p| p.set(live));
    live
}

/// The most bytes of host buffers live on this thread since
/// [`meter_start`] returned `base`, above `base`.
pub(crate) fn meter_peak_since(base: i64) -> u64 {
    (PEAK.with(std::cell::Cell::get) - base).max(0) as u64
}

impl<E> HostBuf<E> {
    fn bytes(&self) -> i64 {
        (self.v.capacity() * std::mem::size_of::<E>()) as i64
    }
    /// The values.
    pub fn into_vec(mut self) -> Vec<E> {
        meter(-self.bytes());
        std::mem::take(&mut self.v)
    }
}

impl<E> From<Vec<E>> for HostBuf<E> {
    fn from(v: Vec<E>) -> Self {
        let b = Self { v };
        meter(b.bytes());
        b
    }
}

impl<E> FromIterator<E> for HostBuf<E> {
    fn from_iter<I: IntoIterator<Item = E>>(iter: I) -> Self {
        Self::from(iter.into_iter().collect::<Vec<E>>())
    }
}

impl<E> Drop for HostBuf<E> {
    fn drop(&mut self) {
        meter(-self.bytes());
    }
}

impl<E: Clone> Clone for HostBuf<E> {
    fn clone(&self) -> Self {
        Self::from(self.v.clone())
    }
}

impl<E> std::ops::Deref for HostBuf<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.v
    }
}

impl<E> std::ops::DerefMut for HostBuf<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.v
    }
}

/// The router's output on the host.
#[derive(Debug, Clone)]
pub struct HostRouted<T> {
    /// Router probabilities, `tokens × experts`.
    pub probs: HostBuf<T>,
    /// Expert of each pair, `tokens · top_k`.
    pub idx: HostBuf<u32>,
    /// Routing weight of each pair.
    pub gates: HostBuf<T>,
    /// Routed pairs per expert.
    pub counts: Vec<u32>,
    /// Tokens routed.
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Whether the top-k weights were renormalised.
    pub renormalize: bool,
}

impl<T: Real + Scalar> Family for HostMem<T> {
    type V = T;
    type S = T;
    type Buf<E: Elem> = HostBuf<E>;
    type Routed = HostRouted<T>;
    /// The host computes the weight gradients with the data gradient.
    type Rest = Experts<HostBuf<T>>;
    type Mark = Instant;
}

/// One rank of the host executor: its transport, and where its expert
/// GEMMs run.
pub struct Host<'a, T> {
    t: &'a dyn Transport,
    experts: ExpertBackend,
    _values: PhantomData<T>,
}

impl<'a, T> Host<'a, T> {
    /// The backend of the rank `t` is, its experts on the CPU.
    pub fn new(t: &'a dyn Transport) -> Self {
        Self::with_experts(t, ExpertBackend::Cpu)
    }
    /// The backend of the rank `t` is, its experts on `experts`.
    pub fn with_experts(t: &'a dyn Transport, experts: ExpertBackend) -> Self {
        Self {
            t,
            experts,
            _values: PhantomData,
        }
    }
}

/// `v[i]`, or the shape error naming `what`.
fn at<E: Copy>(v: &[E], i: usize, what: &'static str) -> Result<E, LayerError> {
    v.get(i).copied().ok_or_else(|| LayerError::Shape {
        what: what.into(),
        expected: i + 1,
        got: v.len(),
    })
}

fn transport(e: crate::TransportError) -> LayerError {
    LayerError::Transport(e)
}

/// `x · W` of the `n` rows of `x` (`n × k`) and `W` (`k × m`).
fn mm<T: Real>(
    x: &[T],
    w: &[T],
    (n, k, m): (usize, usize, usize),
    op: Op,
) -> Result<Vec<T>, LayerError> {
    let mut out = vec![T::zero(); n * m];
    if n > 0 {
        matmul(&mut out, x, Op::N, w, op, (n, k, m), false)?;
    }
    Ok(out)
}

impl<T: Real + Scalar> Backend for Host<'_, T> {
    type F = HostMem<T>;
    type Flight<E: Elem> = (HostBuf<E>, Vec<HostBuf<E>>);
    type Later<'b, E: Elem>
        = Vec<E>
    where
        Self: 'b;

    fn check_layer(cfg: &crate::MoeConfig) -> Result<(), LayerError> {
        cfg.validate()
    }
    fn rank(&self) -> usize {
        self.t.rank()
    }
    fn world_size(&self) -> usize {
        self.t.world_size()
    }

    fn upload<E: Elem>(&self, v: &[E]) -> Result<HostBuf<E>, LayerError> {
        Ok(v.to_vec().into())
    }
    fn download<E: Elem>(&self, b: &HostBuf<E>, n: usize) -> Result<Vec<E>, LayerError> {
        at_least("elements to download", n, b.len())?;
        Ok(b[..n].to_vec())
    }
    fn download_later<E: Elem>(&self, b: &HostBuf<E>, n: usize) -> Result<Vec<E>, LayerError> {
        self.download(b, n)
    }
    fn wait<E: Elem>(&self, later: Vec<E>) -> Result<Vec<E>, LayerError> {
        Ok(later)
    }
    fn zeros<E: Elem>(&self, n: usize) -> Result<HostBuf<E>, LayerError> {
        Ok(vec![E::default(); n].into())
    }
    unsafe fn uninit<E: Elem>(&self, n: usize) -> Result<HostBuf<E>, LayerError> {
        self.zeros(n)
    }
    fn len<E: Elem>(b: &HostBuf<E>) -> usize {
        b.len()
    }
    fn copy<E: Elem>(
        &self,
        from: &HostBuf<E>,
        a: usize,
        to: &mut HostBuf<E>,
        at: usize,
        n: usize,
    ) -> Result<(), LayerError> {
        at_least("elements to copy", a + n, from.len())?;
        at_least("elements to copy into", at + n, to.len())?;
        to[at..at + n].copy_from_slice(&from[a..a + n]);
        Ok(())
    }
    fn add_into(
        &self,
        to: &mut HostBuf<T>,
        at: usize,
        from: &HostBuf<T>,
        a: usize,
        n: usize,
    ) -> Result<(), LayerError> {
        at_least("elements to add", a + n, from.len())?;
        at_least("elements to add into", at + n, to.len())?;
        for (d, &s) in to[at..at + n].iter_mut().zip(&from[a..a + n]) {
            *d += s;
        }
        Ok(())
    }
    fn expand(&self, map: &Runs) -> Result<HostBuf<u32>, LayerError> {
        Ok(map.expand().into())
    }

    unsafe fn group(
        &self,
        expert: &HostBuf<u32>,
        keep: Option<&HostBuf<u8>>,
        _seg: Option<&HostBuf<u32>>,
        base: &[u32],
        n: usize,
        out: usize,
        groups: usize,
    ) -> Result<(HostBuf<u32>, HostBuf<u32>), LayerError> {
        at_least("group bases", groups, base.len())?;
        let mut next: Vec<u32> = base[..groups].to_vec();
        let (mut dst, mut src) = (vec![DROPPED; n], vec![0u32; out]);
        for (i, d) in dst.iter_mut().enumerate() {
            if let Some(k) = keep {
                if at(k, i, "group flags")? == 0 {
                    continue;
                }
            }
            let e = at(expert, i, "group keys")? as usize;
            let pos = *next
                .get(e)
                .ok_or_else(|| LayerError::Config(format!("group key {e} of {groups}")))?;
            *src.get_mut(pos as usize)
                .ok_or_else(|| LayerError::Config(format!("grouped position {pos} of {out}")))? =
                i as u32;
            *d = pos;
            next[e] += 1;
        }
        Ok((dst.into(), src.into()))
    }
    unsafe fn gather_rows(
        &self,
        src: &HostBuf<T>,
        pair: &HostBuf<u32>,
        div: usize,
        scale: Option<&HostBuf<T>>,
        n_out: usize,
        width: usize,
    ) -> Result<HostBuf<T>, LayerError> {
        at_least("gathered pairs", n_out, pair.len())?;
        let pair = &pair[..n_out];
        if let Some(&p) = pair.iter().max() {
            at_least(
                "gathered rows",
                (p as usize / div.max(1) + 1) * width,
                src.len(),
            )?;
            if let Some(sc) = scale {
                at_least("gather scales", p as usize + 1, sc.len())?;
            }
        }
        let mut out = vec![T::zero(); n_out * width];
        if width > 0 {
            out.par_chunks_mut(width).zip(pair).for_each(|(row, &p)| {
                let r = p as usize / div.max(1);
                let from = &src[r * width..(r + 1) * width];
                match scale {
                    Some(sc) => {
                        let s = sc[p as usize];
                        row.iter_mut().zip(from).for_each(|(d, &v)| *d = v * s);
                    }
                    None => row.copy_from_slice(from),
                }
            });
        }
        Ok(out.into())
    }
    unsafe fn gather32<E: Elem>(
        &self,
        src: &HostBuf<E>,
        idx: &HostBuf<u32>,
        n: usize,
    ) -> Result<HostBuf<E>, LayerError> {
        at_least("gather indices", n, idx.len())?;
        let idx = &idx[..n];
        if let Some(&i) = idx.iter().filter(|&&i| i != DROPPED).max() {
            at_least("gathered values", i as usize + 1, src.len())?;
        }
        let mut dropped = E::default();
        bytemuck::bytes_of_mut(&mut dropped).fill(0xFF);
        Ok(idx
            .iter()
            .map(|&i| {
                if i == DROPPED {
                    dropped
                } else {
                    src[i as usize]
                }
            })
            .collect())
    }
    unsafe fn gather_flags(
        &self,
        src: &HostBuf<u8>,
        idx: &HostBuf<u32>,
        n: usize,
    ) -> Result<HostBuf<u8>, LayerError> {
        // SAFETY: checked like any host gather.
        unsafe { self.gather32(src, idx, n) }
    }
    unsafe fn combine_rows(
        &self,
        o: &HostBuf<T>,
        row: &HostBuf<u32>,
        gates: Option<&HostBuf<T>>,
        base: Option<&HostBuf<T>>,
        (tokens, h, k): (usize, usize, usize),
    ) -> Result<HostBuf<T>, LayerError> {
        let p = tokens * k;
        at_least("combine rows", p, row.len())?;
        if let Some(&r) = row[..p].iter().filter(|&&r| r != DROPPED).max() {
            at_least("combined rows", (r as usize + 1) * h, o.len())?;
        }
        if let Some(g) = gates {
            at_least("combine gates", p, g.len())?;
        }
        let mut y = match base {
            Some(b) => {
                at_least("combine base", tokens * h, b.len())?;
                b[..tokens * h].to_vec()
            }
            None => vec![T::zero(); tokens * h],
        };
        if h > 0 {
            y.par_chunks_mut(h).enumerate().for_each(|(t, yt)| {
                for j in 0..k {
                    let r = row[t * k + j];
                    if r == DROPPED {
                        continue;
                    }
                    let g = gates.map_or(T::one(), |g| g[t * k + j]);
                    let from = &o[r as usize * h..(r as usize + 1) * h];
                    yt.iter_mut().zip(from).for_each(|(d, &v)| *d += g * v);
                }
            });
        }
        Ok(y.into())
    }

    fn route(
        &self,
        router: &HostBuf<T>,
        x: &HostBuf<T>,
        bias: Option<&HostBuf<T>>,
        sel_bias: Option<&HostBuf<T>>,
        (tokens, h, e, k): (usize, usize, usize, usize),
        renormalize: bool,
    ) -> Result<HostRouted<T>, LayerError> {
        at_least("router input", tokens * h, x.len())?;
        let mut probs = mm(&x[..tokens * h], router, (tokens, h, e), Op::N)?;
        if let Some(b) = bias {
            for row in probs.chunks_exact_mut(e) {
                row.iter_mut().zip(b.iter()).for_each(|(v, &bb)| *v += bb);
            }
        }
        crate::router::softmax_rows(&mut probs, e);
        let (mut idx, mut gates) = (vec![0u32; tokens * k], vec![T::zero(); tokens * k]);
        let mut biased = vec![T::zero(); e];
        for t in 0..tokens {
            let row = &probs[t * e..(t + 1) * e];
            let sel = &mut idx[t * k..(t + 1) * k];
            match sel_bias {
                Some(b) => {
                    for ((o, &p), &bb) in biased.iter_mut().zip(row).zip(b.iter()) {
                        *o = p + bb;
                    }
                    crate::router::top_k(&biased, k, sel);
                }
                None => crate::router::top_k(row, k, sel),
            }
            let g = &mut gates[t * k..(t + 1) * k];
            for (gj, &ex) in g.iter_mut().zip(sel.iter()) {
                *gj = row[ex as usize];
            }
            if renormalize {
                let s: T = g.iter().copied().sum();
                g.iter_mut().for_each(|v| *v = *v / s);
            }
        }
        let mut counts = vec![0u32; e];
        for &ex in &idx {
            counts[ex as usize] += 1;
        }
        Ok(HostRouted {
            probs: probs.into(),
            idx: idx.into(),
            gates: gates.into(),
            counts,
            tokens,
            top_k: k,
            renormalize,
        })
    }
    fn routed_counts(r: &HostRouted<T>) -> &[u32] {
        &r.counts
    }
    fn routed_experts(r: &HostRouted<T>) -> &HostBuf<u32> {
        &r.idx
    }
    fn routed_gates(r: &HostRouted<T>) -> &HostBuf<T> {
        &r.gates
    }
    fn routed_probs(r: &HostRouted<T>) -> &HostBuf<T> {
        &r.probs
    }
    fn routed_tokens(r: &HostRouted<T>) -> usize {
        r.tokens
    }
    fn col_mean(&self, x: &HostBuf<T>, t: usize, e: usize) -> Result<HostBuf<T>, LayerError> {
        at_least("column values", t * e, x.len())?;
        let mut m = vec![0f64; e];
        for row in x[..t * e].chunks_exact(e.max(1)) {
            for (a, &v) in m.iter_mut().zip(row) {
                *a += v.wide();
            }
        }
        Ok(m.into_iter().map(|v| T::of(v / t.max(1) as f64)).collect())
    }
    unsafe fn router_backward(
        &self,
        r: &HostRouted<T>,
        aux_dp: Option<&HostBuf<T>>,
        router: &HostBuf<T>,
        x: &HostBuf<T>,
        dy: &HostBuf<T>,
        o: &HostBuf<T>,
        row: &HostBuf<u32>,
        h: usize,
    ) -> Result<(HostBuf<T>, HostBuf<T>), LayerError> {
        let (n_tok, k) = (r.tokens, r.top_k);
        let e = r.counts.len();
        at_least("router dy", n_tok * h, dy.len())?;
        let mut dlogits = vec![T::zero(); n_tok * e];
        let mut dp = vec![T::zero(); e];
        for t in 0..n_tok {
            let dyt = &dy[t * h..(t + 1) * h];
            let mut dg = vec![T::zero(); k];
            for (j, d) in dg.iter_mut().enumerate() {
                let rr = at(row, t * k + j, "router rows")? as usize;
                at_least("router outputs", (rr + 1) * h, o.len())?;
                *d = dyt
                    .iter()
                    .zip(&o[rr * h..(rr + 1) * h])
                    .map(|(&a, &b)| a * b)
                    .sum();
            }
            let p = &r.probs[t * e..(t + 1) * e];
            dp.iter_mut().for_each(|v| *v = T::zero());
            let sel = &r.idx[t * k..(t + 1) * k];
            if r.renormalize {
                let s: T = sel.iter().map(|&ex| p[ex as usize]).sum();
                let g = &r.gates[t * k..(t + 1) * k];
                let dot: T = dg.iter().zip(g).map(|(&a, &b)| a * b).sum();
                for (j, &ex) in sel.iter().enumerate() {
                    dp[ex as usize] = (dg[j] - dot) / s;
                }
            } else {
                for (j, &ex) in sel.iter().enumerate() {
                    dp[ex as usize] = dg[j];
                }
            }
            if let Some(a) = aux_dp {
                for (d, &c) in dp.iter_mut().zip(a.iter()) {
                    *d += c;
                }
            }
            let dot: T = p.iter().zip(&dp).map(|(&a, &b)| a * b).sum();
            for (i, dl) in dlogits[t * e..(t + 1) * e].iter_mut().enumerate() {
                *dl = p[i] * (dp[i] - dot);
            }
        }
        let mut d_router = vec![T::zero(); h * e];
        if n_tok > 0 {
            let xs = &x[..n_tok * h];
            matmul(
                &mut d_router,
                xs,
                Op::T,
                &dlogits,
                Op::N,
                (h, n_tok, e),
                false,
            )?;
        }
        let dx = mm(&dlogits, router, (n_tok, e, h), Op::T)?;
        Ok((d_router.into(), dx.into()))
    }

    fn row_sq(&self, x: &HostBuf<T>, n: usize, d: usize) -> Result<HostBuf<T>, LayerError> {
        at_least("rows to square", n * d, x.len())?;
        Ok(x[..n * d]
            .chunks_exact(d.max(1))
            .map(|r| T::of(r.iter().map(|&v| v.wide() * v.wide()).sum()))
            .collect())
    }
    unsafe fn scores_from_norms(
        &self,
        gates: &HostBuf<T>,
        dy_sq: &HostBuf<T>,
        h_sq: &HostBuf<T>,
        src: &HostBuf<u32>,
        n: usize,
        k: usize,
    ) -> Result<HostBuf<T>, LayerError> {
        at_least("score pairs", n, src.len().min(h_sq.len()))?;
        if let Some(&p) = src[..n].iter().max() {
            at_least("score gates", p as usize + 1, gates.len())?;
            at_least("score dy norms", p as usize / k.max(1) + 1, dy_sq.len())?;
        }
        Ok((src[..n].iter().zip(&h_sq[..n]))
            .map(|(&p, &hs)| {
                let g = gates[p as usize].wide();
                T::of(g * g * dy_sq[p as usize / k.max(1)].wide() * hs.wide())
            })
            .collect())
    }
    unsafe fn select(
        &self,
        scores: &HostBuf<T>,
        ids: &HostBuf<u32>,
        offsets: &[u32],
        quotas: &[u32],
        (rule, seed): (lrm_score::Rule, u64),
        err: &mut HostBuf<u32>,
    ) -> Result<(HostBuf<u8>, Option<HostBuf<T>>), LayerError> {
        let groups = quotas.len();
        crate::config::shape("selection offsets", groups + 1, offsets.len())?;
        let n = offsets[groups] as usize;
        at_least("selection scores", n, scores.len().min(ids.len()))?;
        let mut expert = Vec::with_capacity(n);
        for (g, seg) in offsets.windows(2).enumerate() {
            if seg[1] < seg[0] || seg[1] as usize > n {
                return Err(LayerError::Config("selection offsets not ascending".into()));
            }
            expert.extend(std::iter::repeat_n(g as u32, (seg[1] - seg[0]) as usize));
        }
        let score: Vec<f32> = scores[..n].iter().map(|v| v.wide() as f32).collect();
        let id: Vec<u64> = ids[..n].iter().map(|&i| u64::from(i)).collect();
        let quotas: Vec<usize> = quotas.iter().map(|&q| q as usize).collect();
        let (mut kept, mut weight) = (vec![false; n], vec![0f32; n]);
        let candidates = lrm_score::Candidates {
            expert: &expert,
            id: &id,
            score: &score,
        };
        match lrm_score::select(candidates, &quotas, rule, seed, &mut kept, &mut weight) {
            Ok(_) => {}
            Err(lrm_score::ScoreError::NonFinite { .. }) => {
                if let Some(e0) = err.first_mut() {
                    *e0 = 1;
                }
            }
            Err(e) => return Err(e.into()),
        }
        let flags = kept.iter().map(|&k| u8::from(k)).collect();
        let weights = (rule != lrm_score::Rule::TopQ)
            .then(|| weight.iter().map(|&w| T::of(f64::from(w))).collect());
        Ok((flags, weights))
    }
    fn mul(&self, a: &HostBuf<T>, b: &HostBuf<T>, n: usize) -> Result<HostBuf<T>, LayerError> {
        at_least("factors", n, a.len().min(b.len()))?;
        Ok(a[..n].iter().zip(&b[..n]).map(|(&x, &y)| x * y).collect())
    }
    fn kept_counts(
        &self,
        key: &HostBuf<u32>,
        keep: &HostBuf<u8>,
        n: usize,
        groups: usize,
    ) -> Result<HostBuf<u32>, LayerError> {
        at_least("counted keys", n, key.len().min(keep.len()))?;
        let mut c = vec![0u32; groups];
        for (&k, &f) in key[..n].iter().zip(&keep[..n]) {
            if f != 0 {
                *c.get_mut(k as usize)
                    .ok_or_else(|| LayerError::Config(format!("key {k} of {groups}")))? += 1;
            }
        }
        Ok(c.into())
    }

    fn experts_forward(
        &self,
        offsets: &[u32],
        x: &HostBuf<T>,
        rows: Range<usize>,
        w: Wts<'_, Self>,
        (h, f): (usize, usize),
        keep: bool,
    ) -> Result<(HostBuf<T>, HostBuf<T>, Option<(HostBuf<T>, HostBuf<T>)>), LayerError> {
        at_least("expert rows", rows.end, x.len())?;
        let x = &x[rows];
        if let ExpertBackend::Bf16(ops) = &self.experts {
            let w = slices(w);
            let (o, h_sq) = crate::experts::bf16_forward(ops.as_ref(), offsets, x, w, (h, f))?;
            return Ok((o.into(), h_sq.into(), None));
        }
        let n = x.len() / h;
        let (mut o, mut h_sq) = (vec![T::zero(); n * h], vec![T::zero(); n]);
        let (mut ka, mut kb) = if keep {
            (vec![T::zero(); n * f], vec![T::zero(); n * f])
        } else {
            (Vec::new(), Vec::new())
        };
        for (g, lo, hi) in non_empty(offsets) {
            let m = hi - lo;
            let (wg, wu, wd) = blocks(w, g, (h, f))?;
            let xs = &x[lo * h..hi * h];
            let (a, b) = projections(xs, (wg, wu), (m, h, f))?;
            let hh = swiglu_rows(&a, &b);
            for (s, r) in h_sq[lo..hi].iter_mut().zip(hh.chunks_exact(f)) {
                *s = r.iter().map(|&v| v * v).sum();
            }
            o[lo * h..hi * h].copy_from_slice(&mm(&hh, wd, (m, f, h), Op::N)?);
            if keep {
                ka[lo * f..hi * f].copy_from_slice(&a);
                kb[lo * f..hi * f].copy_from_slice(&b);
            }
        }
        Ok((o.into(), h_sq.into(), keep.then(|| (ka.into(), kb.into()))))
    }
    fn experts_backward_data(
        &self,
        offsets: &[u32],
        x: &HostBuf<T>,
        ab: Option<(&HostBuf<T>, &HostBuf<T>)>,
        dd: &HostBuf<T>,
        w: Wts<'_, Self>,
        (h, f): (usize, usize),
    ) -> Result<(HostBuf<T>, Experts<HostBuf<T>>), LayerError> {
        let groups = offsets.len().saturating_sub(1);
        let n = offsets.last().copied().unwrap_or(0) as usize;
        at_least("expert rows", n * h, x.len().min(dd.len()))?;
        if let ExpertBackend::Bf16(ops) = &self.experts {
            let (xs, ds) = (&x[..n * h], &dd[..n * h]);
            let (dx, g) =
                crate::experts::bf16_backward(ops.as_ref(), offsets, (xs, ds), slices(w), (h, f))?;
            let g = Experts {
                gate: g.gate.into(),
                up: g.up.into(),
                down: g.down.into(),
            };
            return Ok((dx.into(), g));
        }
        let mut dx = vec![T::zero(); n * h];
        let mut gr = Experts {
            gate: vec![T::zero(); groups * h * f],
            up: vec![T::zero(); groups * h * f],
            down: vec![T::zero(); groups * f * h],
        };
        for (g, lo, hi) in non_empty(offsets) {
            let m = hi - lo;
            let (wg, wu, wd) = blocks(w, g, (h, f))?;
            let (xs, ds) = (&x[lo * h..hi * h], &dd[lo * h..hi * h]);
            // The forward's projections where kept, else recomputed.
            let recomputed;
            let (a, b): (&[T], &[T]) = match ab {
                Some((pa, pb)) => {
                    at_least("kept projections", hi * f, pa.len().min(pb.len()))?;
                    (&pa[lo * f..hi * f], &pb[lo * f..hi * f])
                }
                None => {
                    recomputed = projections(xs, (wg, wu), (m, h, f))?;
                    (&recomputed.0, &recomputed.1)
                }
            };
            let hh = swiglu_rows(a, b);
            let dh = HostBuf::from(mm(ds, wd, (m, h, f), Op::T)?);
            let (mut da, mut db) = (
                HostBuf::from(vec![T::zero(); m * f]),
                HostBuf::from(vec![T::zero(); m * f]),
            );
            swiglu_backward(a, b, &dh, &mut da, &mut db)?;
            let (rg, rd) = (g * h * f..(g + 1) * h * f, g * f * h..(g + 1) * f * h);
            let ru = rg.clone();
            matmul(&mut gr.down[rd], &hh, Op::T, ds, Op::N, (f, m, h), false)?;
            matmul(&mut gr.gate[rg], xs, Op::T, &da, Op::N, (h, m, f), false)?;
            matmul(&mut gr.up[ru], xs, Op::T, &db, Op::N, (h, m, f), false)?;
            let dxs = &mut dx[lo * h..hi * h];
            matmul(dxs, &da, Op::N, wg, Op::T, (m, f, h), false)?;
            matmul(dxs, &db, Op::N, wu, Op::T, (m, f, h), true)?;
        }
        let gr = Experts {
            gate: gr.gate.into(),
            up: gr.up.into(),
            down: gr.down.into(),
        };
        Ok((dx.into(), gr))
    }
    fn experts_backward_weights(
        &self,
        rest: Experts<HostBuf<T>>,
        _x: &HostBuf<T>,
        _dd: &HostBuf<T>,
    ) -> Result<Experts<HostBuf<T>>, LayerError> {
        Ok(rest)
    }

    fn all_gather_counts(&self, mine: &[u32]) -> Result<Vec<Vec<u32>>, LayerError> {
        let all = all_gather(self.t, mine).map_err(transport)?;
        if all.len() != self.t.world_size() || all.iter().any(|c| c.len() != mine.len()) {
            return Err(LayerError::Config(
                "counts of another shape from a peer".into(),
            ));
        }
        Ok(all)
    }
    fn exchange<E: Elem>(
        &self,
        send: HostBuf<E>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<HostBuf<E>, LayerError> {
        if self.t.world_size() == 1 {
            return Ok(send);
        }
        let incoming: usize = recv_counts.iter().sum();
        let (got, counts) = received_as_bytes::<E, _>(incoming, || {
            all_to_all(self.t, &send, send_counts).map_err(transport)
        })?;
        let got = HostBuf::from(got);
        if counts != recv_counts {
            return Err(LayerError::Config(format!(
                "rank {}: received {counts:?} elements, the plan says {recv_counts:?}",
                self.t.rank()
            )));
        }
        Ok(got)
    }
    fn start<E: Elem>(
        &self,
        sends: Vec<HostBuf<E>>,
        send_parts: &[(usize, usize, usize)],
        mut recv: HostBuf<E>,
        recv_parts: &[(usize, usize)],
    ) -> Result<(HostBuf<E>, Vec<HostBuf<E>>), LayerError> {
        let (rank, world) = (self.t.rank(), self.t.world_size());
        if world == 1 {
            return Ok((recv, sends));
        }
        if send_parts.len() != world || recv_parts.len() != world {
            return Err(LayerError::Config("all-to-all parts: one per rank".into()));
        }
        let (mut out, mut counts) = (Vec::new(), Vec::with_capacity(world));
        for (d, &(b, off, n)) in send_parts.iter().enumerate() {
            let n = if d == rank { 0 } else { n };
            if n > 0 {
                let buf = sends.get(b).ok_or_else(|| {
                    LayerError::Config("an all-to-all part names no send buffer".into())
                })?;
                at_least("all-to-all send part", off + n, buf.len())?;
                out.extend_from_slice(&buf[off..off + n]);
            }
            counts.push(n);
        }
        // The copies going out and coming in are this backend's buffers too.
        let out = HostBuf::from(out);
        let incoming: usize = recv_parts.iter().map(|&(_, n)| n).sum();
        let (got, got_counts) = received_as_bytes::<E, _>(incoming, || {
            all_to_all(self.t, &out, &counts).map_err(transport)
        })?;
        let got = HostBuf::from(got);
        drop(out);
        let mut from = 0;
        for (s, (&(off, n), &c)) in recv_parts.iter().zip(&got_counts).enumerate() {
            let want = if s == rank { 0 } else { n };
            if c != want {
                return Err(LayerError::Config(format!(
                    "rank {rank}: {c} elements from rank {s}, the plan says {want}"
                )));
            }
            at_least("all-to-all receive part", off + c, recv.len())?;
            recv[off..off + c].copy_from_slice(&got[from..from + c]);
            from += c;
        }
        Ok((recv, sends))
    }
    fn handed<E: Elem>(
        &self,
        recv: HostBuf<E>,
        sends: Vec<HostBuf<E>>,
    ) -> (HostBuf<E>, Vec<HostBuf<E>>) {
        (recv, sends)
    }
    fn outgoing<E: Elem>(f: &(HostBuf<E>, Vec<HostBuf<E>>)) -> Result<&HostBuf<E>, LayerError> {
        Ok(f.1.first().unwrap_or(&f.0))
    }
    fn flight_buffers<E: Elem>(
        f: &mut (HostBuf<E>, Vec<HostBuf<E>>),
    ) -> Result<(&[HostBuf<E>], &mut HostBuf<E>), LayerError> {
        Ok((&f.1, &mut f.0))
    }
    fn finish<E: Elem>(
        &self,
        f: (HostBuf<E>, Vec<HostBuf<E>>),
    ) -> Result<(HostBuf<E>, Vec<HostBuf<E>>), LayerError> {
        Ok(f)
    }
    fn start_sum(&self, mut buf: HostBuf<T>) -> Result<(HostBuf<T>, Vec<HostBuf<T>>), LayerError> {
        all_reduce_sum(self.t, &mut buf).map_err(transport)?;
        Ok((buf, Vec::new()))
    }
    fn settle(&self) -> Result<(), LayerError> {
        Ok(())
    }
    fn reserve_for_exchange(&self, _on: bool) {}

    fn part(&self, name: &'static str) -> Result<(), LayerError> {
        self.t.part(name).map_err(transport)
    }
    fn joined(&self) -> Result<(), LayerError> {
        self.t.joined().map_err(transport)
    }
    fn mark(&self) -> Result<Instant, LayerError> {
        Ok(Instant::now())
    }
    fn comm_mark(&self) -> Result<Option<Instant>, LayerError> {
        Ok(None)
    }
    fn ms_between(&self, earlier: &Instant, later: &Instant) -> Result<f64, LayerError> {
        Ok(later.saturating_duration_since(*earlier).as_secs_f64() * 1e3)
    }
}

/// The instances' weights as slices.
fn slices<T>(w: Experts<&HostBuf<T>>) -> Experts<&[T]> {
    Experts {
        gate: w.gate,
        up: w.up,
        down: w.down,
    }
}

/// The non-empty groups of `offsets`: (group, first row, end row).
fn non_empty(offsets: &[u32]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (offsets.windows(2).enumerate())
        .map(|(g, s)| (g, s[0] as usize, s[1] as usize))
        .filter(|&(_, lo, hi)| hi > lo)
}

/// Instance `g`'s gate, up and down blocks of the stacked weights.
#[allow(clippy::type_complexity)]
fn blocks<'a, T>(
    w: Wts<'a, Host<'_, T>>,
    g: usize,
    (h, f): (usize, usize),
) -> Result<(&'a [T], &'a [T], &'a [T]), LayerError>
where
    T: Real + Scalar,
{
    Ok((
        block(w.gate, g, h * f)?,
        block(w.up, g, h * f)?,
        block(w.down, g, f * h)?,
    ))
}

/// `a = x·W_gate` and `b = x·W_up` of `m` rows.
fn projections<T: Real>(
    xs: &[T],
    (wg, wu): (&[T], &[T]),
    (m, h, f): (usize, usize, usize),
) -> Result<(HostBuf<T>, HostBuf<T>), LayerError> {
    Ok((
        mm(xs, wg, (m, h, f), Op::N)?.into(),
        mm(xs, wu, (m, h, f), Op::N)?.into(),
    ))
}

/// `h = silu(a) ⊙ b`.
fn swiglu_rows<T: Real>(a: &[T], b: &[T]) -> HostBuf<T> {
    a.iter().zip(b).map(|(&p, &q)| silu(p) * q).collect()
}

/// Block `g` of `size` values of a stacked expert tensor.
fn block<T>(w: &[T], g: usize, size: usize) -> Result<&[T], LayerError> {
    w.get(g * size..(g + 1) * size)
        .ok_or_else(|| LayerError::Config(format!("expert block {g} past its weights")))
}

/// Forward state of the host backend.
pub type HostSaved<T> = crate::stages::Saved<HostMem<T>>;
/// One rank's weights on the host.
pub type HostWeights<T> = crate::stages::Weights<HostMem<T>>;

/// Rank `rank`'s weights of `world` from the whole layer's: the router,
/// its block of experts (`E / world` of them, stacked) and the call's
/// router biases (the forced workloads' logit bias, the balancing bias).
pub fn rank_weights<T: Real + Scalar>(
    cfg: &crate::MoeConfig,
    call: &crate::CallConfig,
    params: &crate::MoeParams<T>,
    (rank, world): (usize, usize),
) -> Result<HostWeights<T>, LayerError> {
    params.validate(cfg)?;
    let el = pack::ep::experts_per_rank(cfg.n_experts, world)?;
    let own = params
        .experts
        .get(rank * el..(rank + 1) * el)
        .ok_or_else(|| LayerError::Config(format!("rank {rank} of {world}")))?;
    let stack = |part: fn(&crate::ExpertWeights<T>) -> &Vec<T>| -> Vec<T> {
        own.iter().flat_map(|e| part(e).iter().copied()).collect()
    };
    let values = |v: &[f64]| v.iter().map(|&b| T::of(b)).collect::<Vec<T>>();
    Ok(crate::stages::Weights {
        router: params.router.clone().into(),
        bias: call.logit_bias(cfg.n_experts)?.map(|b| values(&b).into()),
        sel_bias: (call.selection_bias(cfg.n_experts)?).map(|b| values(b).into()),
        experts: Experts {
            gate: stack(|e| &e.gate).into(),
            up: stack(|e| &e.up).into(),
            down: stack(|e| &e.down).into(),
        },
    })
}
