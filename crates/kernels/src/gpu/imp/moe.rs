//! The MoE layer on one GPU (EP = 1): forward, and the LRMoE backward with
//! per-expert quotas, LRM scores, top-q selection, compaction and grouped
//! GEMMs on the kept rows only. bf16 activations and weights, f32
//! accumulation; router probabilities in f32.
//!
//! Rows are grouped by expert (stable, in pair order) with the
//! `group_by_expert` kernel; group offsets go to the grouped GEMM on the
//! device. The one host synchronisation per call is the download of the
//! routed counts per expert in the forward (the controller needs them to fix
//! the quotas); the backward's kept counts follow from those quotas on the
//! host without another sync.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{cuda, dim, random_bf16, Gpu};
use crate::cpu::GemmVariant;
use crate::KernelError;

use crate::limits::DROPPED;

use crate::gpu::{MoeHostForward, MoeHostGrads, MoeShape, QuotaPlan};

#[cfg(feature = "nccl")]
#[path = "ep.rs"]
pub mod ep;

/// Layer weights on the device, bf16: router `H × E`, gate and up
/// `E × H × F`, down `E × F × H` (row-major, `x · W`).
pub struct MoeWeights {
    router: CudaSlice<u16>,
    gate: CudaSlice<u16>,
    up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// Forward state kept for the backward.
pub struct MoeSaved {
    x: CudaSlice<u16>,
    /// Layer output `T × H`.
    pub y: CudaSlice<u16>,
    probs: CudaSlice<f32>,
    idx: CudaSlice<u32>,
    gates: CudaSlice<f32>,
    dst: CudaSlice<u32>,
    src: CudaSlice<u32>,
    offsets_u: CudaSlice<u32>,
    expert_of_row: CudaSlice<u32>,
    counts: Vec<u32>,
    xs: CudaSlice<u16>,
    /// `‖h‖²` of each grouped row (the down projection's input), for scoring.
    h_sq: CudaSlice<f32>,
    o: CudaSlice<u16>,
}

/// Gradients and figures of one backward.
pub struct MoeBackward {
    /// Input gradient `T × H`.
    pub dx: CudaSlice<u16>,
    /// Router gradient `H × E`.
    pub router: CudaSlice<u16>,
    /// Gate gradients `E × H × F`.
    pub gate: CudaSlice<u16>,
    /// Up gradients `E × H × F`.
    pub up: CudaSlice<u16>,
    /// Down gradients `E × F × H`.
    pub down: CudaSlice<u16>,
    /// Kept pairs.
    pub kept_pairs: usize,
    /// Device memory the backward held at its peak (bytes, by `cuMemGetInfo`).
    pub peak_bytes: u64,
}

fn exclusive_scan(counts: &[u32]) -> Vec<u32> {
    let mut v = Vec::with_capacity(counts.len() + 1);
    let mut s = 0u32;
    v.push(0);
    for &c in counts {
        s += c;
        v.push(s);
    }
    v
}

/// bf16 bits times `1/√fan_in` (benchmark weights of a sensible size).
fn fan_in_scaled(v: Vec<u16>, fan_in: usize) -> Vec<u16> {
    let k = 1.0 / (fan_in as f32).sqrt();
    v.into_iter()
        .map(|b| ((f32::from_bits(u32::from(b) << 16) * k).to_bits() >> 16) as u16)
        .collect()
}

fn used_bytes() -> Result<u64, KernelError> {
    let (free, total) = cudarc::driver::result::mem_get_info().map_err(cuda)?;
    Ok((total - free) as u64)
}

impl Gpu {
    /// Uploads layer weights given as bf16 bits.
    pub fn moe_weights(
        &self,
        s: &MoeShape,
        router: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
    ) -> Result<MoeWeights, KernelError> {
        s.check()?;
        let (h, f, e) = (s.hidden, s.ffn, s.experts);
        super::check("router", h * e, router.len())?;
        super::check("gate", e * h * f, gate.len())?;
        super::check("up", e * h * f, up.len())?;
        super::check("down", e * f * h, down.len())?;
        Ok(MoeWeights {
            router: self.upload(router)?,
            gate: self.upload(gate)?,
            up: self.upload(up)?,
            down: self.upload(down)?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        variant: GemmVariant,
        offsets: &CudaSlice<i32>,
        groups: usize,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        out_len: usize,
        h: usize,
        f: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        if out_len == 0 {
            // No rows (forward and data gradient): nothing to compute.
            // SAFETY: uninitialised output; the kernel or GEMM launched next
            // writes every element before anything reads it.
            return unsafe { self.uninit::<u16>(0) };
        }
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut d = unsafe { self.uninit::<u16>(out_len) }?;
        let mut ws = self.gemm_workspace(variant, groups)?;
        self.launch_gemm(variant, groups, offsets, a, b, &mut d, h, f, &mut ws)?;
        Ok(d)
    }

    /// An uninitialised device buffer of `max(n, 1)` elements, for the
    /// output of the next kernel (the device tests poison outputs to prove
    /// every kernel here writes all of its output). Skipping the zero fill
    /// saves a full write of every intermediate.
    ///
    /// # Safety
    ///
    /// 1. Nothing may read the buffer before a kernel, GEMM or copy has
    ///    written every element that is read.
    unsafe fn uninit<T: cudarc::driver::DeviceRepr>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        // SAFETY: the caller promises (1): no read before a full write.
        unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(cuda)
    }

    /// `n` copies of `value`, filled on the device.
    fn filled(&self, value: u32, n: usize) -> Result<CudaSlice<u32>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut out = unsafe { self.uninit::<u32>(n) }?;
        let n_i = dim("n", n.max(1))?;
        let mut l = self.stream.launch_builder(&self.f_fill);
        l.arg(&mut out).arg(&value).arg(&n_i);
        // SAFETY: (u32*, u32, int); out holds max(n, 1) elements.
        unsafe { l.launch(self.elementwise_config(n.max(1))) }.map_err(cuda)?;
        Ok(out)
    }

    /// `‖row‖²` of `n` bf16 rows of width `d`.
    fn row_sq(
        &self,
        x: &CudaSlice<u16>,
        n: usize,
        d: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut out = unsafe { self.uninit::<f32>(n) }?;
        if n > 0 {
            let (n_i, d_i) = (dim("rows", n)?, dim("width", d)?);
            let mut l = self.stream.launch_builder(&self.f_row_sq);
            l.arg(x).arg(&mut out).arg(&n_i).arg(&d_i);
            // SAFETY: (u16*, f32*, int, int); x holds n·d, out n.
            unsafe { l.launch(self.rows_config(n)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// Stable grouping by expert; `seg` (the input's own group offsets) lets
    /// each block scan only its expert's segment when the input is grouped.
    #[allow(clippy::too_many_arguments)]
    fn group(
        &self,
        expert: &CudaSlice<u32>,
        keep: Option<&CudaSlice<u8>>,
        seg: Option<&CudaSlice<u32>>,
        base: &[u32],
        n: usize,
        out: usize,
        groups: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>), KernelError> {
        let base_d = self.upload(base)?;
        let mut dst = self.filled(DROPPED, n)?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut src = unsafe { self.uninit::<u32>(out) }?;
        let n_i = dim("pairs", n)?;
        let null: u64 = 0;
        let mut l = self.stream.launch_builder(&self.f_group);
        l.arg(expert);
        match keep {
            Some(k) => l.arg(k),
            None => l.arg(&null),
        };
        l.arg(&base_d).arg(&mut dst).arg(&mut src).arg(&n_i);
        match seg {
            Some(sg) => l.arg(sg),
            None => l.arg(&null),
        };
        // SAFETY: 1. (u32*, u8* or null, u32*, u32*, u32*, int, u32* or
        // null) matches; seg, when given, partitions 0..n by expert;
        // 2. expert, keep and dst hold n entries, base one per block
        // (groups), src the grouped total; 3. outputs alias nothing.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (groups as u32, 1, 1),
                block_dim: (crate::limits::MAX_BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda)?;
        Ok((dst, src))
    }

    fn gather_scaled(
        &self,
        src: &CudaSlice<u16>,
        pair: &CudaSlice<u32>,
        div: usize,
        scale: Option<&CudaSlice<f32>>,
        n_out: usize,
        width: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut out = unsafe { self.uninit::<u16>(n_out * width) }?;
        if n_out == 0 {
            return Ok(out);
        }
        let (d, n, w) = (dim("div", div)?, dim("rows", n_out)?, dim("width", width)?);
        let null: u64 = 0;
        let mut l = self.stream.launch_builder(&self.f_gather_scaled);
        l.arg(src).arg(pair).arg(&d);
        match scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&mut out).arg(&n).arg(&w);
        // SAFETY: 1. (u16*, u32*, int, f32* or null, u16*, int, int)
        // matches; 2. every pair / div indexes a row of src and every pair
        // an entry of scale (built from the routing of this call); out holds
        // n_out·width; 3. out aliases nothing.
        unsafe { l.launch(self.rows_config(n_out)) }.map_err(cuda)?;
        Ok(out)
    }

    /// `out[j] = src[idx[j]]` for any 4-byte element (u32 indices, f32 gates).
    fn gather32<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        idx: &CudaSlice<u32>,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        debug_assert_eq!(
            std::mem::size_of::<T>(),
            4,
            "invariant: gather_32 moves 4-byte values"
        );
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut out = unsafe { self.uninit::<T>(n) }?;
        if n > 0 {
            let n_i = dim("n", n)?;
            let mut l = self.stream.launch_builder(&self.f_gather32);
            l.arg(src).arg(idx).arg(&mut out).arg(&n_i);
            // SAFETY: (u32*, u32*, u32*, int); idx entries index src or are
            // DROPPED; out holds n.
            unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// `out = f(a, b)` for a two-input element-wise kernel of signature
    /// `(u16*, u16*, u16*, long long)` (`add_bf16`, `swiglu_fwd_bf16`).
    fn binary(
        &self,
        f: &cudarc::driver::CudaFunction,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        n: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut out = unsafe { self.uninit::<u16>(n) }?;
        let n_i = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(a).arg(b).arg(&mut out).arg(&n_i);
        // SAFETY: 1. both kernels take (u16*, u16*, u16*, long long);
        // 2. a, b and out hold n elements; 3. out aliases nothing.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(out)
    }

    fn add(
        &self,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        n: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        self.binary(&self.f_add, a, b, n)
    }

    fn swiglu_dev(
        &self,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        n: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        self.binary(&self.swiglu_fwd, a, b, n)
    }

    fn combine_dev(
        &self,
        o: &CudaSlice<u16>,
        row: &CudaSlice<u32>,
        gates: Option<&CudaSlice<f32>>,
        s: &MoeShape,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut y = unsafe { self.uninit::<u16>(s.tokens * s.hidden) }?;
        let (t, h, k) = (
            dim("tokens", s.tokens)?,
            dim("hidden", s.hidden)?,
            dim("top_k", s.top_k)?,
        );
        let null: u64 = 0;
        let mut l = self.stream.launch_builder(&self.combine);
        l.arg(o).arg(row);
        match gates {
            Some(g) => l.arg(g),
            None => l.arg(&null),
        };
        l.arg(&mut y).arg(&t).arg(&h).arg(&k);
        // SAFETY: as in `combine_bf16`; row entries index o or are DROPPED.
        unsafe { l.launch(self.rows_config(s.tokens)) }.map_err(cuda)?;
        Ok(y)
    }

    /// Routing of `x` (`T × H`): logits `x · W_r` (a one-group GEMM),
    /// softmax, top-k; returns `(probs T × E, expert of each pair, gate of
    /// each pair, routed pairs per expert)`. The counts' download is the
    /// forward's one host synchronisation.
    #[allow(clippy::type_complexity)]
    pub(super) fn route(
        &self,
        s: &MoeShape,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        bias: Option<&CudaSlice<f32>>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u32>, CudaSlice<f32>, Vec<u32>), KernelError> {
        let (t, h, e, k) = (s.tokens, s.hidden, s.experts, s.top_k);
        let p = s.pairs();
        let one = self.upload(&[0i32, dim("tokens", t)?])?;
        // Router: logits = x · W_r (a one-group GEMM), softmax, top-k.
        let logits = self.gemm(GemmVariant::Forward, &one, 1, x, router, t * e, h, e)?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut lf = unsafe { self.uninit::<f32>(t * e) }?;
        if let Some(b) = bias {
            let (n, cols) = ((t * e) as i64, dim("experts", e)?);
            let mut l = self.stream.launch_builder(&self.f_to_f32_bias);
            l.arg(&logits).arg(b).arg(&mut lf).arg(&n).arg(&cols);
            // SAFETY: (u16*, f32*, f32*, long long, int); logits and lf hold
            // t·e, the bias e (checked where it was uploaded).
            unsafe { l.launch(self.elementwise_config(t * e)) }.map_err(cuda)?;
        } else {
            let n = (t * e) as i64;
            let mut l = self.stream.launch_builder(&self.f_to_f32);
            l.arg(&logits).arg(&mut lf).arg(&n);
            // SAFETY: (u16*, f32*, long long); both hold t·e.
            unsafe { l.launch(self.elementwise_config(t * e)) }.map_err(cuda)?;
        }
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut probs = unsafe { self.uninit::<f32>(t * e) }?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut idx = unsafe { self.uninit::<u32>(p) }?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut gates = unsafe { self.uninit::<f32>(p) }?;
        {
            let (t_i, e_i, k_i, r_i) = (
                dim("tokens", t)?,
                dim("experts", e)?,
                dim("top_k", k)?,
                i32::from(s.renormalize),
            );
            let mut l = self.stream.launch_builder(&self.router);
            l.arg(&lf)
                .arg(&mut probs)
                .arg(&mut idx)
                .arg(&mut gates)
                .arg(&t_i)
                .arg(&e_i)
                .arg(&k_i)
                .arg(&r_i);
            // SAFETY: as in `router_topk`.
            unsafe { l.launch(self.rows_config(t)) }.map_err(cuda)?;
        }
        // Counts (the call's one host sync), offsets, stable grouping.
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut counts_d = unsafe { self.uninit::<u32>(e) }?;
        {
            let n_i = dim("pairs", p)?;
            let mut l = self.stream.launch_builder(&self.f_counts);
            l.arg(&idx).arg(&mut counts_d).arg(&n_i);
            // SAFETY: (u32*, u32*, int); one block per expert writes counts[e].
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (e as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(cuda)?;
        }
        let counts = self.download(&counts_d, e)?;
        Ok((probs, idx, gates, counts))
    }

    /// Forward of the layer on `x` (`T × H` bf16 on the device): complete,
    /// every routed pair computed.
    pub fn moe_forward(
        &self,
        s: &MoeShape,
        w: &MoeWeights,
        x: &CudaSlice<u16>,
    ) -> Result<MoeSaved, KernelError> {
        s.check()?;
        let (h, f, e, k) = (s.hidden, s.ffn, s.experts, s.top_k);
        let p = s.pairs();
        let (probs, idx, gates, counts) = self.route(s, &w.router, x, None)?;
        let base = exclusive_scan(&counts);
        let offsets = self.upload(&base.iter().map(|&v| v as i32).collect::<Vec<_>>())?;
        let offsets_u = self.upload(&base)?;
        let mut eor = Vec::with_capacity(p);
        for (ex, &c) in counts.iter().enumerate() {
            eor.extend(std::iter::repeat_n(ex as u32, c as usize));
        }
        let expert_of_row = self.upload(&eor)?;
        let (dst, src) = self.group(&idx, None, None, &base[..e], p, p, e)?;
        // Experts on the grouped rows.
        let xs = self.gather_scaled(x, &src, k, None, p, h)?;
        let (_, _, hh) = self.experts_hidden(&offsets, e, p, &xs, &w.gate, &w.up, h, f)?;
        let o = self.gemm(GemmVariant::Forward, &offsets, e, &hh, &w.down, p * h, f, h)?;
        let y = self.combine_dev(&o, &dst, Some(&gates), s)?;
        let h_sq = self.row_sq(&hh, p, f)?;
        Ok(MoeSaved {
            x: x.clone(),
            y,
            probs,
            idx,
            gates,
            dst,
            src,
            offsets_u,
            expert_of_row,
            counts,
            xs,
            h_sq,
            o,
        })
    }

    /// The complete router gradient from every pair's forward output `o`
    /// (rows in grouped order, `dst`: pair → row): returns `(dW_r H × E,
    /// dX_router T × H)`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(super) fn router_backward(
        &self,
        s: &MoeShape,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        dy: &CudaSlice<u16>,
        o: &CudaSlice<u16>,
        dst: &CudaSlice<u32>,
        (probs, idx, gates): (&CudaSlice<f32>, &CudaSlice<u32>, &CudaSlice<f32>),
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let (t, h, e, k) = (s.tokens, s.hidden, s.experts, s.top_k);
        let one = self.upload(&[0i32, dim("tokens", t)?])?;
        // Router gradient from every pair's forward output.
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut dlogits = unsafe { self.uninit::<u16>(t * e) }?;
        {
            let (t_i, h_i, e_i, k_i, r_i) = (
                dim("tokens", t)?,
                dim("hidden", h)?,
                dim("experts", e)?,
                dim("top_k", k)?,
                i32::from(s.renormalize),
            );
            let mut l = self.stream.launch_builder(&self.f_router_bwd);
            l.arg(dy)
                .arg(o)
                .arg(dst)
                .arg(probs)
                .arg(idx)
                .arg(gates)
                .arg(&mut dlogits);
            l.arg(&t_i).arg(&h_i).arg(&e_i).arg(&k_i).arg(&r_i);
            // SAFETY: (u16*, u16*, u32*, f32*, u32*, f32*, u16*, int×5)
            // matches; dst maps every pair to a row of o; k ≤ 32 (checked).
            unsafe { l.launch(self.rows_config(t)) }.map_err(cuda)?;
        }
        let g_router = self.gemm(GemmVariant::WeightGrad, &one, 1, x, &dlogits, h * e, h, e)?;
        let dx_router = self.gemm(
            GemmVariant::DataGrad,
            &one,
            1,
            &dlogits,
            router,
            t * h,
            h,
            e,
        )?;
        Ok((g_router, dx_router))
    }

    /// The LRMoE backward with the controller's per-expert quotas (pairs
    /// kept per expert; more than routed keeps all). With `measure_memory`
    /// the device memory in use is read (`cuMemGetInfo`) before and after,
    /// for [`MoeBackward::peak_bytes`]; without, that field is 0 and the
    /// call skips two driver queries the GPU waits on.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_backward_quotas(
        &self,
        s: &MoeShape,
        w: &MoeWeights,
        sv: &MoeSaved,
        dy: &CudaSlice<u16>,
        quotas: &[u32],
        measure_memory: bool,
        priority_seed: Option<u64>,
    ) -> Result<MoeBackward, KernelError> {
        super::check("quotas", s.experts, quotas.len())?;
        let before = if measure_memory {
            self.trim_pool()?;
            used_bytes()?
        } else {
            0
        };
        let (t, h, f, e, k) = (s.tokens, s.hidden, s.ffn, s.experts, s.top_k);
        let p = s.pairs();
        let (g_router, dx_router) = self.router_backward(
            s,
            &w.router,
            &sv.x,
            dy,
            &sv.o,
            &sv.dst,
            (&sv.probs, &sv.idx, &sv.gates),
        )?;
        // LRM scores in grouped order: g² · ‖δ‖² · ‖h‖².
        // From norms: ‖δ‖² per token, ‖h‖² per grouped row (saved by the
        // forward), so no δ row is gathered and no h row re-read.
        let dy_sq = self.row_sq(dy, t, h)?;
        let scores = self.scores_from_norms(&sv.gates, &dy_sq, &sv.h_sq, &sv.src, p, k)?;
        // Quotas and selection.
        let kept_counts: Vec<u32> = quotas
            .iter()
            .zip(&sv.counts)
            .map(|(&q, &n)| q.min(n))
            .collect();
        let kbase = exclusive_scan(&kept_counts);
        let kept_total = kbase[e] as usize;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let (qd, mut kept) = (self.upload(quotas)?, unsafe { self.uninit::<u8>(p) }?);
        // The selection kernel only ever sets the flag: it must start at 0.
        let mut err = self.stream.clone_htod(&[0u32]).map_err(cuda)?;
        // Top-q by score, or priority sampling (top-q by the keys
        // √score / u(seed, pair), then threshold-corrected weights).
        let keys = match priority_seed {
            Some(seed) => Some(self.priority_keys_dev(&scores, &sv.src, seed, p)?),
            None => None,
        };
        let by = keys.as_ref().unwrap_or(&scores);
        self.launch_select(by, &sv.src, &sv.offsets_u, &qd, &mut kept, &mut err, e)?;
        let pair_scale = match &keys {
            Some(rho) => {
                let more: Vec<u32> = quotas.iter().map(|q| q.saturating_add(1)).collect();
                // SAFETY: the selection writes a flag for every row.
                let mut kept1 = unsafe { self.uninit::<u8>(p) }?;
                let qd1 = self.upload(&more)?;
                self.launch_select(rho, &sv.src, &sv.offsets_u, &qd1, &mut kept1, &mut err, e)?;
                let w =
                    self.priority_weights_dev(rho, &scores, (&kept, &kept1), &sv.offsets_u, p, e)?;
                let w_pair = self.gather32(&w, &sv.dst, p)?;
                Some(self.mul_f32_dev(&sv.gates, &w_pair, p)?)
            }
            None => None,
        };
        // Compaction of the kept rows (still grouped by expert).
        let (dstk, srck) = self.group(
            &sv.expert_of_row,
            Some(&kept),
            Some(&sv.offsets_u),
            &kbase[..e],
            p,
            kept_total,
            e,
        )?;
        let koff = self.upload(&kbase.iter().map(|&v| v as i32).collect::<Vec<_>>())?;
        let xk = self.gather_scaled(&sv.xs, &srck, 1, None, kept_total, h)?;
        let pair_of_kept = self.gather32(&sv.src, &srck, kept_total)?;
        let dok = self.gather_scaled(
            dy,
            &pair_of_kept,
            k,
            Some(pair_scale.as_ref().unwrap_or(&sv.gates)),
            kept_total,
            h,
        )?;
        // Grouped GEMMs on the kept rows only.
        let (dxk, g_gate, g_up, g_down) = self.experts_backward_dev(
            &koff,
            e,
            kept_total,
            &xk,
            &dok,
            (&w.gate, &w.up, &w.down),
            h,
            f,
        )?;
        // Scatter-add back to tokens (dropped pairs contribute nothing).
        let row_k = self.gather32(&dstk, &sv.dst, p)?;
        let dx_experts = self.combine_dev(&dxk, &row_k, None, s)?;
        let dx = self.add(&dx_router, &dx_experts, t * h)?;
        let peak_bytes = if measure_memory {
            self.stream.synchronize().map_err(cuda)?;
            used_bytes()?.saturating_sub(before)
        } else {
            0
        };
        if self.download(&err, 1)?[0] != 0 {
            return Err(KernelError::Cuda(
                "moe_backward: a LRM score is NaN or infinite (non-finite dy?)".into(),
            ));
        }
        Ok(MoeBackward {
            dx,
            router: g_router,
            gate: g_gate,
            up: g_up,
            down: g_down,
            kept_pairs: kept_total,
            peak_bytes,
        })
    }
}

/// Host copies of one forward + backward (for tests and `layer-grad`-style use).
#[derive(Debug, Clone)]
pub struct MoeHostResult {
    /// Output `T × H` (bf16 bits).
    pub y: Vec<u16>,
    /// Input gradient `T × H`.
    pub dx: Vec<u16>,
    /// Router gradient `H × E`.
    pub router: Vec<u16>,
    /// Gate gradients `E × H × F`.
    pub gate: Vec<u16>,
    /// Up gradients `E × H × F`.
    pub up: Vec<u16>,
    /// Down gradients `E × F × H`.
    pub down: Vec<u16>,
    /// Kept pairs.
    pub kept_pairs: usize,
}

/// One row of the layer benchmark.
#[derive(Debug, Clone, Copy)]
pub struct MoeBenchRow {
    /// Retention.
    pub retention: f64,
    /// Median backward time, ms (router, scores, selection, packing and GEMMs included).
    pub backward_ms: f64,
    /// Device memory the backward held at its peak, bytes.
    pub peak_bytes: u64,
    /// Kept pairs.
    pub kept_pairs: usize,
}

impl Gpu {
    /// Forward and LRMoE backward from host data (bf16 bits), copied back.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_host(
        &self,
        s: &MoeShape,
        router: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
        x: &[u16],
        dy: &[u16],
        plan: QuotaPlan<'_>,
    ) -> Result<MoeHostResult, KernelError> {
        super::check("dy", s.tokens * s.hidden, dy.len())?;
        let fwd = self.moe_forward_host(s, router, gate, up, down, x)?;
        let quotas = plan(std::slice::from_ref(&fwd.counts))?;
        let g = self.moe_backward_host(&fwd, dy, &quotas, None)?;
        Ok(MoeHostResult {
            y: fwd.y,
            dx: g.dx,
            router: g.router,
            gate: g.gate,
            up: g.up,
            down: g.down,
            kept_pairs: g.kept_pairs,
        })
    }

    /// Forward from host data (bf16 bits): the output and the routed counts
    /// come back; the device state stays in the result for
    /// [`moe_backward_host`](Self::moe_backward_host).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_forward_host(
        &self,
        s: &MoeShape,
        router: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
        x: &[u16],
    ) -> Result<MoeHostForward, KernelError> {
        super::check("x", s.tokens * s.hidden, x.len())?;
        let w = self.moe_weights(s, router, gate, up, down)?;
        let sv = self.moe_forward(s, &w, &self.upload(x)?)?;
        Ok(MoeHostForward {
            y: self.download(&sv.y, s.tokens * s.hidden)?,
            counts: sv.counts.clone(),
            shape: *s,
            state: Some(Box::new((w, sv))),
        })
    }

    /// The LRMoE backward of a [`moe_forward_host`](Self::moe_forward_host)
    /// with per-expert quotas (and priority sampling's seed, or top-q);
    /// the gradients come back as bf16 bits.
    pub fn moe_backward_host(
        &self,
        fwd: &MoeHostForward,
        dy: &[u16],
        quotas: &[u32],
        priority_seed: Option<u64>,
    ) -> Result<MoeHostGrads, KernelError> {
        let s = &fwd.shape;
        super::check("dy", s.tokens * s.hidden, dy.len())?;
        let (w, sv) = fwd
            .state
            .as_deref()
            .ok_or_else(|| KernelError::Cuda("the forward state is gone".into()))?;
        let b =
            self.moe_backward_quotas(s, w, sv, &self.upload(dy)?, quotas, false, priority_seed)?;
        let (t, h, f, e) = (s.tokens, s.hidden, s.ffn, s.experts);
        Ok(MoeHostGrads {
            dx: self.download(&b.dx, t * h)?,
            router: self.download(&b.router, h * e)?,
            gate: self.download(&b.gate, e * h * f)?,
            up: self.download(&b.up, e * h * f)?,
            down: self.download(&b.down, e * f * h)?,
            kept_pairs: b.kept_pairs,
            kept_row_bytes: (b.kept_pairs * 2 * s.hidden * 2) as u64,
        })
    }

    /// Times the layer on random bf16 data: the forward (median ms) and the
    /// backward at each retention.
    pub fn bench_moe(
        &self,
        s: &MoeShape,
        plans: &[(f64, QuotaPlan<'_>)],
    ) -> Result<(f64, Vec<MoeBenchRow>), KernelError> {
        let (t, h, f, e) = (s.tokens, s.hidden, s.ffn, s.experts);
        let scale = fan_in_scaled;
        let w = self.moe_weights(
            s,
            &scale(random_bf16(h * e, 31), h),
            &scale(random_bf16(e * h * f, 32), h),
            &scale(random_bf16(e * h * f, 33), h),
            &scale(random_bf16(e * f * h, 34), f),
        )?;
        let x = self.upload(&random_bf16(t * h, 35))?;
        let dy = self.upload(&random_bf16(t * h, 36))?;
        let fwd = self.time(10, || self.moe_forward(s, &w, &x).map(|_| ()))?;
        let sv = self.moe_forward(s, &w, &x)?;
        let mut rows = Vec::new();
        for &(r, plan) in plans {
            // One call reads the memory; the timed calls skip that probe.
            let quotas = plan(std::slice::from_ref(&sv.counts))?;
            let last = self.moe_backward_quotas(s, &w, &sv, &dy, &quotas, true, None)?;
            let ms = self.time(10, || {
                self.moe_backward_quotas(s, &w, &sv, &dy, &quotas, false, None)
                    .map(|_| ())
            })?;
            rows.push(MoeBenchRow {
                retention: r,
                backward_ms: ms,
                peak_bytes: last.peak_bytes,
                kept_pairs: last.kept_pairs,
            });
        }
        Ok((fwd, rows))
    }
}

/// The experts' math on rows already grouped by expert, as one
/// device-resident chain per call (the fast form of
/// [`crate::grouped::GroupedOps::experts_forward`] / `experts_backward`,
/// whose composed CPU twins are [`crate::grouped::compose_forward`] /
/// [`crate::grouped::compose_backward`]): inputs are uploaded once, the
/// intermediates (`a`, `b`, `h`, `dh`, `da`, `db`) never leave the device,
/// results are downloaded once.
impl Gpu {
    /// `a = x·W_gate`, `b = x·W_up` and `h = silu(a) ⊙ b` of `rows` grouped rows.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn experts_hidden(
        &self,
        od: &CudaSlice<i32>,
        e: usize,
        rows: usize,
        xd: &CudaSlice<u16>,
        wg: &CudaSlice<u16>,
        wu: &CudaSlice<u16>,
        h: usize,
        f: usize,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let a = self.gemm(GemmVariant::Forward, od, e, xd, wg, rows * f, h, f)?;
        let b = self.gemm(GemmVariant::Forward, od, e, xd, wu, rows * f, h, f)?;
        let hh = self.swiglu_dev(&a, &b, rows * f)?;
        Ok((a, b, hh))
    }

    /// The experts' backward on `rows` kept rows grouped by `od` (device):
    /// recomputes `a`, `b`, `h`, then `dW_down = hᵀ·d`, `dh = d·W_downᵀ`,
    /// the SwiGLU backward, `dW_gate`, `dW_up` and `dX = da·W_gateᵀ +
    /// db·W_upᵀ`; returns `(dX, dW_gate, dW_up, dW_down)`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(super) fn experts_backward_dev(
        &self,
        od: &CudaSlice<i32>,
        e: usize,
        rows: usize,
        xd: &CudaSlice<u16>,
        dd: &CudaSlice<u16>,
        (wg, wu, wd): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        h: usize,
        f: usize,
    ) -> Result<
        (
            CudaSlice<u16>,
            CudaSlice<u16>,
            CudaSlice<u16>,
            CudaSlice<u16>,
        ),
        KernelError,
    > {
        let ew = e * h * f;
        if rows == 0 {
            // No kept rows: no dX rows, zero weight gradients, no launch.
            let z = || self.stream.alloc_zeros::<u16>(ew.max(1)).map_err(cuda);
            // SAFETY: a dX of zero rows: no element of it is ever read.
            return Ok((unsafe { self.uninit::<u16>(0) }?, z()?, z()?, z()?));
        }
        let (a, b, hh) = self.experts_hidden(od, e, rows, xd, wg, wu, h, f)?;
        let g_down = self.gemm(GemmVariant::WeightGrad, od, e, &hh, dd, ew, f, h)?;
        let dh = self.gemm(GemmVariant::DataGrad, od, e, dd, wd, rows * f, f, h)?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut da = unsafe { self.uninit::<u16>(rows * f) }?;
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut db = unsafe { self.uninit::<u16>(rows * f) }?;
        if rows > 0 {
            let n = (rows * f) as i64;
            let mut l = self.stream.launch_builder(&self.swiglu_bwd);
            l.arg(&a).arg(&b).arg(&dh).arg(&mut da).arg(&mut db).arg(&n);
            // SAFETY: as in `swiglu_backward_bf16`; a, b, dh, da, db hold rows·F.
            unsafe { l.launch(self.elementwise_config(rows * f)) }.map_err(cuda)?;
        }
        let g_gate = self.gemm(GemmVariant::WeightGrad, od, e, xd, &da, ew, h, f)?;
        let g_up = self.gemm(GemmVariant::WeightGrad, od, e, xd, &db, ew, h, f)?;
        let dx1 = self.gemm(GemmVariant::DataGrad, od, e, &da, wg, rows * h, h, f)?;
        let dx2 = self.gemm(GemmVariant::DataGrad, od, e, &db, wu, rows * h, h, f)?;
        let dx = self.add(&dx1, &dx2, rows * h)?;
        Ok((dx, g_gate, g_up, g_down))
    }

    /// LRM scores from norms: `score[j] = g[p]² · dy_sq[p / k] · h_sq[j]`
    /// with `p = src[j]`, for `n` rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scores_from_norms(
        &self,
        gates: &CudaSlice<f32>,
        dy_sq: &CudaSlice<f32>,
        h_sq: &CudaSlice<f32>,
        src: &CudaSlice<u32>,
        n: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut scores = unsafe { self.uninit::<f32>(n) }?;
        if n > 0 {
            let (n_i, k_i) = (dim("pairs", n)?, dim("top_k", k)?);
            let mut l = self.stream.launch_builder(&self.f_scores_norms);
            l.arg(gates)
                .arg(dy_sq)
                .arg(h_sq)
                .arg(src)
                .arg(&mut scores)
                .arg(&n_i)
                .arg(&k_i);
            // SAFETY: (f32*, f32*, f32*, u32*, f32*, int, int); the callers'
            // src maps each of the n rows to an entry of gates, and
            // src / k to an entry of dy_sq; h_sq holds n.
            unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        }
        Ok(scores)
    }

    fn experts_check(
        offsets: &[i32],
        x: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
        h: usize,
        f: usize,
    ) -> Result<(usize, usize), KernelError> {
        let (na, nb, _) = Self::gemm_shapes(GemmVariant::Forward, offsets, h, f)?;
        super::check("x", na, x.len())?;
        super::check("gate", nb, gate.len())?;
        super::check("up", nb, up.len())?;
        super::check("down", nb, down.len())?;
        let groups = offsets.len().saturating_sub(1);
        let rows = offsets.last().copied().unwrap_or(0).max(0) as usize;
        Ok((groups, rows))
    }

    /// `o = (silu(x·W_gate) ⊙ x·W_up) · W_down` and `‖h‖²` (f32) of every
    /// row of `x` (rows grouped by `offsets`, `H` wide); weights stacked
    /// `E × H × F` (gate, up) and `E × F × H` (down), bf16 bits.
    #[allow(clippy::too_many_arguments)]
    pub fn experts_forward_bf16(
        &self,
        offsets: &[i32],
        x: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
        h: usize,
        f: usize,
    ) -> Result<(Vec<u16>, Vec<f32>), KernelError> {
        let (e, rows) = Self::experts_check(offsets, x, gate, up, down, h, f)?;
        if rows == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let (od, xd) = (self.upload(offsets)?, self.upload(x)?);
        let (wg, wu, wd) = (self.upload(gate)?, self.upload(up)?, self.upload(down)?);
        let (_, _, hh) = self.experts_hidden(&od, e, rows, &xd, &wg, &wu, h, f)?;
        let o = self.gemm(GemmVariant::Forward, &od, e, &hh, &wd, rows * h, f, h)?;
        let h_sq = self.row_sq(&hh, rows, f)?;
        Ok((self.download(&o, rows * h)?, self.download(&h_sq, rows)?))
    }

    /// Backward of [`Gpu::experts_forward_bf16`] on kept rows: `d` is each
    /// row's output gradient (`rows × H`); returns `(dX, dW_gate, dW_up,
    /// dW_down)` (zero gradients for experts with no rows).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn experts_backward_bf16(
        &self,
        offsets: &[i32],
        x: &[u16],
        d: &[u16],
        gate: &[u16],
        up: &[u16],
        down: &[u16],
        h: usize,
        f: usize,
    ) -> Result<(Vec<u16>, Vec<u16>, Vec<u16>, Vec<u16>), KernelError> {
        let (e, rows) = Self::experts_check(offsets, x, gate, up, down, h, f)?;
        super::check("d", rows * h, d.len())?;
        let ew = e * h * f;
        if rows == 0 {
            return Ok((Vec::new(), vec![0; ew], vec![0; ew], vec![0; ew]));
        }
        let (od, xd, dd) = (self.upload(offsets)?, self.upload(x)?, self.upload(d)?);
        let (wg, wu, wd) = (self.upload(gate)?, self.upload(up)?, self.upload(down)?);
        let (dx, g_gate, g_up, g_down) =
            self.experts_backward_dev(&od, e, rows, &xd, &dd, (&wg, &wu, &wd), h, f)?;
        Ok((
            self.download(&dx, rows * h)?,
            self.download(&g_gate, ew)?,
            self.download(&g_up, ew)?,
            self.download(&g_down, ew)?,
        ))
    }
}
