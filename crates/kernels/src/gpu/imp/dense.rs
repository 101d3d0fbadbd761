//! The dense transformer kernels (`kernels/dense.cu`) on device buffers,
//! for the device-resident model: embedding, RMSNorm, head layout with
//! RoPE, causal softmax, residual adds, fused cross-entropy, gradient
//! norms, AdamW, and the grouped GEMM on caller-given offsets (dense
//! projections are one group; attention one group per (sequence,
//! key/value head)). Twins: [`crate::dense`]. Operations that index
//! through device buffers (tokens, targets) are `unsafe fn`; the rest
//! check lengths and are safe.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{at_least, cuda, dim, Gpu};
use crate::cpu::GemmVariant;
use crate::dense::AdamHp;
use crate::KernelError;

/// Elements a block of `sum_parts` covers (`SUM_CHUNK` in `dense.cu`).
const SUM_CHUNK: usize = 4096;

/// One sum of [`Gpu::sum_parts`]: `n` f32 at device address `dst` become
/// the sum of the `n` f32 at each of `srcs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumPart {
    /// Where the sum goes.
    pub dst: u64,
    /// What is summed, in order.
    pub srcs: Vec<u64>,
    /// Elements.
    pub n: usize,
}

/// The dense module's functions.
pub(crate) struct DenseFns {
    embed_fwd: CudaFunction,
    embed_bwd: CudaFunction,
    batch: CudaFunction,
    norm_f32: CudaFunction,
    norm_bf16: CudaFunction,
    norm_bwd_f32: CudaFunction,
    norm_bwd_bf16: CudaFunction,
    norm_bwd_wide_f32: CudaFunction,
    norm_bwd_wide_bf16: CudaFunction,
    /// Block-per-row norms for the widths of [`norm_block_takes`]
    /// (forward f32 / bf16 input, backward f32 / bf16 gradient).
    norm_block: [CudaFunction; 4],
    heads: CudaFunction,
    softmax: CudaFunction,
    softmax_bwd: CudaFunction,
    add_into: CudaFunction,
    add_f32: CudaFunction,
    sum_parts: CudaFunction,
    xent: CudaFunction,
    /// The L2-resident cross-entropy ([`XentLaunch::Resident`]): without,
    /// with cache hints.
    xent_l2: [CudaFunction; 2],
    sq_f32: CudaFunction,
    sq_bf16: CudaFunction,
    adam_f32: CudaFunction,
    adam_bf16: CudaFunction,
    adam_streams: CudaFunction,
    to_bf16: CudaFunction,
    /// Fused attention per head width (16, 32, 64, 128): forward, dK/dV,
    /// dQ recomputing, dQ from the stored dS.
    flash: Vec<(usize, [CudaFunction; 4])>,
    flash_dot: CudaFunction,
    /// Which attention path runs (`LRMOE_ATTENTION`): `materialized` —
    /// scores and probabilities as grouped GEMMs and softmax kernels;
    /// anything else — the fused kernels wherever the head width has them
    /// (16, 32, 64, 128), the faster of the two at every width measured
    /// (one H200, 2026-12-02: `docs/benchmarks.md`). The fused path keeps
    /// no `seq × seq` probabilities.
    attention: AttnPath,
    /// dQ's path when forced (`LRMOE_ATTENTION_DQ=recompute|stored|cutlass|cudnn`);
    /// `None`: cuDNN or CUTLASS where they take the shape, else by the
    /// stored dS's size ([`ATTN_DS_MAX_BYTES`]).
    attention_dq: Option<AttnDq>,
    /// The fused forward's kernel (`LRMOE_ATTENTION_FWD=mma|cooperative|
    /// pingpong`); unset: [`AttnFwd::DEFAULT`] where the CUTLASS library
    /// takes the shape, the `mma.sync` kernel elsewhere.
    attention_fwd: AttnFwd,
    /// The cross-entropy's launch (`LRMOE_XENT=streamed|resident`);
    /// unset: [`XentLaunch::DEFAULT`].
    xent_launch: XentLaunch,
}

/// How the fused cross-entropy ([`Gpu::cross_entropy_with`]) reads each
/// row twice: once for its max and sum, once for the gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XentLaunch {
    /// Blocks of 256, as many rows in flight as 32 blocks a SM: both
    /// passes read the row from HBM (the LM head's rows are ~300 KB each
    /// and a thousand of them are in flight).
    Streamed,
    /// Blocks of `threads` (a multiple of 32, at most 1024), `blocks_per_sm`
    /// a SM, one row each at a time, four 16-byte loads in flight a thread:
    /// few rows in flight, meant to keep their bytes in L2 between the two
    /// passes. `l2_hints`: the first pass asks L2 to keep the lines, the
    /// second pass and the gradient's stores to let them go first.
    /// Measured, the second read is not served from L2 to a useful degree
    /// (`docs/benchmarks.md`); with the hints the launch is still the
    /// faster one.
    Resident {
        /// Threads a block.
        threads: u32,
        /// Blocks a SM (the rows in flight: this times the SMs).
        blocks_per_sm: u32,
        /// Cache-eviction hints on the loads and stores.
        l2_hints: bool,
    },
}

impl XentLaunch {
    /// What [`Gpu::cross_entropy`] runs unless `LRMOE_XENT` says otherwise.
    /// One H200 (2026-12-04, `docs/benchmarks.md`, "The dense half by
    /// part"): 1 024 threads a block, one block a SM, with the L2 hints,
    /// took 0.96× the streamed launch's time at the LM head's shape in
    /// three runs over two calls (3.55 against 3.70 ms), 0.98× in the
    /// A3B model (3.74 against 3.81 ms).
    pub const DEFAULT: XentLaunch = XentLaunch::Resident {
        threads: 1024,
        blocks_per_sm: 1,
        l2_hints: true,
    };
}

/// What [`Gpu::rmsnorm_keeping`] returns: the input's copy (f32), the
/// normed rows (bf16) and each row's `1 / rms`.
pub type NormKeeping = (CudaSlice<f32>, CudaSlice<u16>, CudaSlice<f32>);

/// Which kernel runs the fused attention forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnFwd {
    /// `flash_fwd_*` of `kernels/dense.cu`: `mma.sync`, every head width
    /// of the fused path and any sequence length.
    Mma,
    /// CUTLASS's Hopper FMHA (`kernels/lib/attention.cu`: TMA, `wgmma`),
    /// two consumer warp groups on one query tile.
    Cooperative,
    /// The same, persistent, the two warp groups on alternate tiles.
    Pingpong,
}

impl AttnFwd {
    /// The forward the model runs unless `LRMOE_ATTENTION_FWD` says
    /// otherwise (the faster CUTLASS schedule on both model shapes; H200,
    /// 2026-12-03: `docs/benchmarks.md`, "Attention").
    pub const DEFAULT: AttnFwd = AttnFwd::Cooperative;

    fn schedule(self) -> Option<i32> {
        match self {
            AttnFwd::Mma => None,
            AttnFwd::Cooperative => Some(0),
            AttnFwd::Pingpong => Some(1),
        }
    }
}

/// The attention path of [`DenseFns::attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttnPath {
    Fused,
    Materialized,
}

/// Whether rows of `d` take the block-per-row norm kernels: `d / 8`
/// threads a block, a whole number of warps, at most 512. The backward
/// only from 1 024 ([`NORM_BLOCK_BWD_MIN`]).
fn norm_block_takes(d: usize) -> bool {
    d % 256 == 0 && d > 0 && d <= 4096
}

/// The narrowest rows the block-per-row backward takes. Narrower rows make
/// many small blocks, each adding its whole gain gradient to `dw` at the
/// end, and the adds to the same few addresses queue: at 512 (qwen3-moe-
/// mini) the dense backward took 3.53 ms against the warp kernels' 2.53
/// (H200, 2026-12-04), where at 2 048 the block kernel is 1.5× faster.
const NORM_BLOCK_BWD_MIN: usize = 1024;

/// Dynamic shared memory of the fused attention kernels for head width
/// `dh`: forward, dK/dV, dQ recomputing, dQ from stored dS (layouts in
/// `kernels/dense.cu`).
fn flash_smem(dh: usize) -> [u32; 4] {
    let dh = dh as u32;
    [
        512 * (dh + 8),
        768 * (dh + 8) + 1024,
        512 * (dh + 8),
        256 * (dh + 8),
    ]
}

/// The inputs both the dK/dV and the recomputing dQ kernel take: q, k, v,
/// dO, lse2 and D.
#[allow(clippy::type_complexity)]
fn flash_bwd_inputs<'a>(
    l: &mut cudarc::driver::LaunchArgs<'a>,
    (q, k, v, dout, lse2, d): (
        &'a CudaSlice<u16>,
        &'a CudaSlice<u16>,
        &'a CudaSlice<u16>,
        &'a CudaSlice<u16>,
        &'a CudaSlice<f32>,
        &'a CudaSlice<f32>,
    ),
) {
    l.arg(q).arg(k).arg(v).arg(dout).arg(lse2).arg(d);
}

/// How the fused attention backward gets dQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnDq {
    /// The dK/dV kernel stores dS (bf16, 2 bytes per causal score, tiled),
    /// a second kernel reads it: dQ = dS·K, one product. The default while
    /// the stored dS of one call stays within [`ATTN_DS_MAX_BYTES`].
    Stored,
    /// A second kernel recomputes S, dP and dS per query block (three
    /// products, no score memory): long sequences.
    Recompute,
    /// Not these kernels: CUTLASS's Hopper backward (`kernels/lib/
    /// attention.cu`: TMA, `wgmma`; dQ summed in f32 by atomics; grouped
    /// heads' dK and dV per query head, then summed), where it takes the
    /// shape (as its forward, [`Gpu::flash_forward_takes`]).
    Cutlass,
    /// Not these kernels: cuDNN's fused SDPA backward
    /// (`kernels/lib/cudnn_attention.cu`, on the user's `libcudnn.so.9`:
    /// `LRMOE_CUDNN`, the loader's search, or PyTorch's wheel), where it
    /// opens and takes the shape ([`Gpu::cudnn_attention`]).
    Cudnn,
}

/// The narrowest head for which the backward defaults to CUTLASS's (where
/// it takes the shape and `LRMOE_ATTENTION_DQ` is unset): measured on one
/// H200 (2026-12-03, `docs/benchmarks.md`, "Attention"), CUTLASS's
/// backward is 9% faster than the `mma.sync` kernels at head width 128
/// (Qwen3-30B-A3B) and 20% slower at 64 (qwen3-moe-mini).
const ATTN_BWD_CUTLASS_MIN_HEAD_DIM: usize = 128;

/// The narrowest head for which the backward defaults to cuDNN's where it
/// opens and takes the shape (`LRMOE_ATTENTION_DQ` unset): measured on one
/// H200 (2026-12-04, cuDNN 9.14, `docs/benchmarks.md`, "Attention"), the
/// forward with cuDNN's backward takes 0.60× the CUTLASS backward's time
/// at head width 128 (Qwen3-30B-A3B) and 0.78× the `mma.sync` kernels' at
/// 64 (qwen3-moe-mini); narrower heads are not measured.
const ATTN_BWD_CUDNN_MIN_HEAD_DIM: usize = 64;

/// The most stored dS one attention backward may allocate (bytes) before it
/// recomputes instead ([`AttnDq`]); `LRMOE_ATTENTION_DQ=recompute` or
/// `=stored` overrides the choice.
pub const ATTN_DS_MAX_BYTES: usize = 2 << 30;

/// Bytes of stored dS for `n_seq · heads` heads of `seq` rows: one 64 × 64
/// bf16 tile per causal block pair.
pub fn attn_ds_bytes(n_seq: usize, seq: usize, heads: usize) -> usize {
    let nb = seq.div_ceil(64);
    n_seq * heads * nb * (nb + 1) / 2 * 64 * 64 * 2
}

impl DenseFns {
    pub(crate) fn load(ctx: &Arc<CudaContext>, fatbin: &[u8]) -> Result<Self, KernelError> {
        let m = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(fatbin.to_vec()))
            .map_err(cuda)?;
        let f = |n: &str| m.load_function(n).map_err(cuda);
        Ok(Self {
            embed_fwd: f("embed_fwd")?,
            embed_bwd: f("embed_bwd")?,
            batch: f("batch_gather")?,
            norm_f32: f("rmsnorm_fwd_f32")?,
            norm_bf16: f("rmsnorm_fwd_bf16")?,
            norm_bwd_f32: f("rmsnorm_bwd_f32")?,
            norm_bwd_bf16: f("rmsnorm_bwd_bf16")?,
            norm_bwd_wide_f32: f("rmsnorm_bwd_wide_f32")?,
            norm_bwd_wide_bf16: f("rmsnorm_bwd_wide_bf16")?,
            norm_block: [
                f("rmsnorm_fwd_block_f32")?,
                f("rmsnorm_fwd_block_bf16")?,
                f("rmsnorm_bwd_block_f32")?,
                f("rmsnorm_bwd_block_bf16")?,
            ],
            heads: f("heads_bf16")?,
            softmax: f("softmax_causal_fwd")?,
            softmax_bwd: f("softmax_causal_bwd")?,
            add_into: f("add_into_f32")?,
            add_f32: f("add_f32")?,
            sum_parts: f("sum_parts_f32")?,
            xent: f("cross_entropy")?,
            xent_l2: [f("cross_entropy_l2")?, f("cross_entropy_l2_hint")?],
            sq_f32: f("sq_sum_f32")?,
            sq_bf16: f("sq_sum_bf16")?,
            adam_f32: f("adamw_f32")?,
            adam_bf16: f("adamw_bf16")?,
            adam_streams: f("adamw_streams_bf16")?,
            to_bf16: f("f32_to_bf16")?,
            flash: [16usize, 32, 64, 128]
                .into_iter()
                .map(|dh| {
                    let fns = [
                        f(&format!("flash_fwd_{dh}"))?,
                        f(&format!("flash_bwd_kv_{dh}"))?,
                        f(&format!("flash_bwd_q_{dh}"))?,
                        f(&format!("flash_bwd_q_ds_{dh}"))?,
                    ];
                    for (func, bytes) in fns.iter().zip(flash_smem(dh)) {
                        func.set_attribute(
                            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            bytes as i32,
                        )
                        .map_err(cuda)?;
                    }
                    Ok((dh, fns))
                })
                .collect::<Result<_, KernelError>>()?,
            flash_dot: f("flash_bwd_dot")?,
            attention: match std::env::var("LRMOE_ATTENTION") {
                Ok(v) if v.eq_ignore_ascii_case("materialized") => AttnPath::Materialized,
                _ => AttnPath::Fused,
            },
            attention_dq: match std::env::var("LRMOE_ATTENTION_DQ").as_deref() {
                Ok("recompute") => Some(AttnDq::Recompute),
                Ok("stored") => Some(AttnDq::Stored),
                Ok("cutlass") => Some(AttnDq::Cutlass),
                Ok("cudnn") => Some(AttnDq::Cudnn),
                _ => None,
            },
            attention_fwd: match std::env::var("LRMOE_ATTENTION_FWD").as_deref() {
                Ok("mma") => AttnFwd::Mma,
                Ok("pingpong") => AttnFwd::Pingpong,
                Ok("cooperative") => AttnFwd::Cooperative,
                _ => AttnFwd::DEFAULT,
            },
            xent_launch: match std::env::var("LRMOE_XENT").as_deref() {
                Ok("streamed") => XentLaunch::Streamed,
                _ => XentLaunch::DEFAULT,
            },
        })
    }

    /// Whether attention of head width `dh` runs through the fused kernels.
    fn fused_attention(&self, dh: usize) -> bool {
        self.flash_fns(dh).is_some() && self.attention == AttnPath::Fused
    }

    fn flash_fns(&self, dh: usize) -> Option<&[CudaFunction; 4]> {
        self.flash.iter().find(|(d, _)| *d == dh).map(|(_, f)| f)
    }
}

/// An element type AdamW and the norm kernel read gradients as: f32, or
/// bf16 bits (`u16`; the GEMMs' weight gradients).
pub trait GradElem: cudarc::driver::DeviceRepr {
    /// Whether the elements are bf16 bits.
    const BF16: bool;
}
impl GradElem for f32 {
    const BF16: bool = false;
}
impl GradElem for u16 {
    const BF16: bool = true;
}

impl DenseFns {
    fn sq<G: GradElem>(&self) -> &CudaFunction {
        if G::BF16 {
            &self.sq_bf16
        } else {
            &self.sq_f32
        }
    }
    fn adam<G: GradElem>(&self) -> &CudaFunction {
        if G::BF16 {
            &self.adam_bf16
        } else {
            &self.adam_f32
        }
    }
}

impl Gpu {
    /// Fills every output buffer the device operations allocate with 0xFF
    /// bytes first (device tests; off by default).
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Warp-per-row kernels: blocks of 8 warps, enough to fill the chip.
    fn warp_rows(&self, rows: usize, shared: u32) -> LaunchConfig {
        let mut c = self.rows_config(rows);
        c.shared_mem_bytes = shared;
        c
    }

    /// Grouped GEMM on device buffers (see [`GemmVariant`]): `groups`
    /// groups split by the device `offsets` (`groups + 1` entries, the last
    /// `rows`). Output bf16: `rows × f` (forward), `rows × h` (data
    /// gradient), `groups × h × f` (weight gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_dev(
        &self,
        variant: GemmVariant,
        offsets: &CudaSlice<i32>,
        groups: usize,
        rows: usize,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        h: usize,
        f: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        if h % 8 != 0 || f % 8 != 0 {
            return Err(KernelError::Shape {
                what: "h and f (multiples of 8 for 16-byte TMA rows)",
                expected: 8,
                got: h % 8 + f % 8,
            });
        }
        at_least("offsets (groups + 1)", groups + 1, offsets.len())?;
        let (na, nb, nd) = match variant {
            GemmVariant::Forward => (rows * h, groups * h * f, rows * f),
            GemmVariant::DataGrad => (rows * f, groups * h * f, rows * h),
            GemmVariant::WeightGrad => (rows * h, rows * f, groups * h * f),
        };
        at_least("a", na, a.len())?;
        at_least("b", nb, b.len())?;
        if variant == GemmVariant::WeightGrad && rows == 0 {
            // No rows: the gradient is zero (the GEMM would not write it).
            // SAFETY: uninitialised output, zeroed on the next line.
            let mut d = unsafe { self.uninit::<u16>(nd) }?;
            self.stream.memset_zeros(&mut d).map_err(cuda)?;
            return Ok(d);
        }
        if let (Some(blas), 1) = (&self.blas, groups) {
            // One group (unless LRMOE_DENSE_GEMM=cutlass): a dense GEMM,
            // cuBLAS's (the grouped kernels are tuned for many
            // expert-sized groups); a shape cuBLAS refuses falls back.
            if let Ok(d) = self.gemm_blas(blas, variant, (a, b), rows, (h, f), nd) {
                return Ok(d);
            }
        }
        self.gemm(variant, offsets, groups, a, b, nd, h, f)
    }

    /// What runs [`Gpu::gemm_dev`]'s one-group GEMMs: `"cublas"` or
    /// `"cutlass"` (the grouped kernels).
    pub fn dense_gemm(&self) -> &'static str {
        if self.blas.is_some() {
            "cublas"
        } else {
            "cutlass"
        }
    }

    /// One GEMM of [`Gpu::gemm_dev`]'s layouts (row-major; one group of
    /// `rows`) on cuBLAS: bf16 in and out, f32 accumulation. cuBLAS is
    /// column-major, so each product is computed transposed
    /// (`Dᵀ = Bᵀ·Aᵀ` and its kin), which is the row-major `D`.
    fn gemm_blas(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        variant: GemmVariant,
        (a, b): (&CudaSlice<u16>, &CudaSlice<u16>),
        rows: usize,
        (h, f): (usize, usize),
        nd: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        // SAFETY: uninitialised output; the GEMM writes all `nd` elements
        // (a weight gradient over no rows was zeroed by the caller).
        let mut d = unsafe { self.uninit::<u16>(nd) }?;
        if nd == 0 {
            return Ok(d);
        }
        let (rows, h, f) = (dim("rows", rows)?, dim("h", h)?, dim("f", f)?);
        // (op of the first operand, op of the second, m, n, k, lda, ldb,
        // ldc); the first operand is always B, the second A.
        let (ta, tb, m, n, k, lda, ldb, ldc) = match variant {
            GemmVariant::Forward => (N, N, f, rows, h, f, h, f),
            GemmVariant::DataGrad => (T, N, h, rows, f, f, f, h),
            GemmVariant::WeightGrad => (N, T, f, h, rows, f, h, f),
        };
        let (alpha, beta) = (1f32, 0f32);
        let bf16 = cudaDataType::CUDA_R_16BF;
        let (pb, _gb) = b.device_ptr(&self.stream);
        let (pa, _ga) = a.device_ptr(&self.stream);
        let (pd, gd) = d.device_ptr_mut(&self.stream);
        // SAFETY: the caller checked `a` and `b` hold the variant's
        // elements and `d` holds `nd`; the handle runs on this stream.
        let done = unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                ta,
                tb,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                pb as *const std::ffi::c_void,
                bf16,
                lda,
                pa as *const std::ffi::c_void,
                bf16,
                ldb,
                (&beta as *const f32).cast(),
                pd as *mut std::ffi::c_void,
                bf16,
                ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        drop(gd);
        done.map_err(|e| KernelError::Cuda(format!("cuBLAS GEMM: {e:?}")))?;
        Ok(d)
    }

    /// Offsets of `groups` equal groups of `rows_each` rows, on the device.
    pub fn even_offsets(
        &self,
        groups: usize,
        rows_each: usize,
    ) -> Result<CudaSlice<i32>, KernelError> {
        let o: Vec<i32> = (0..=groups)
            .map(|g| dim("rows", g * rows_each))
            .collect::<Result<_, _>>()?;
        self.upload(&o)
    }

    /// `x[i] = table[tok[i]]`, rows of `d` (f32). Twin:
    /// [`crate::dense::embed_reference`].
    ///
    /// # Safety
    ///
    /// Every token of `tok` (`n` entries) is below `table.len() / d`.
    pub unsafe fn embed(
        &self,
        table: &CudaSlice<f32>,
        tok: &CudaSlice<u32>,
        n: usize,
        d: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        // SAFETY: uninitialised output; the kernel writes all n·d entries.
        let mut x = unsafe { self.uninit::<f32>(n * d) }?;
        // SAFETY: the caller's promise.
        unsafe { self.embed_launch(table, tok, &mut x, n, d, false) }?;
        Ok(x)
    }

    /// `x[i] += table[tok[i]]` (a learned position embedding).
    ///
    /// # Safety
    ///
    /// As [`Gpu::embed`].
    pub unsafe fn embed_add(
        &self,
        table: &CudaSlice<f32>,
        tok: &CudaSlice<u32>,
        x: &mut CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), KernelError> {
        at_least("x", n * d, x.len())?;
        // SAFETY: the caller's promise.
        unsafe { self.embed_launch(table, tok, x, n, d, true) }
    }

    /// # Safety
    ///
    /// As [`Gpu::embed`]; `x` holds `n · d`.
    unsafe fn embed_launch(
        &self,
        table: &CudaSlice<f32>,
        tok: &CudaSlice<u32>,
        x: &mut CudaSlice<f32>,
        n: usize,
        d: usize,
        add: bool,
    ) -> Result<(), KernelError> {
        at_least("tokens", n, tok.len())?;
        if n * d == 0 {
            return Ok(());
        }
        let (ni, di, ai) = (dim("tokens", n)?, dim("width", d)?, i32::from(add));
        let mut l = self.stream.launch_builder(&self.dense.embed_fwd);
        l.arg(table).arg(tok).arg(x).arg(&ni).arg(&di).arg(&ai);
        // SAFETY: (f32*, u32*, f32*, int, int, int); tokens index the table
        // (caller), x holds n·d; a warp per row.
        unsafe { l.launch(self.warp_rows(n, 0)) }.map_err(cuda)?;
        Ok(())
    }

    /// A batch of `n_seq` windows of `seq` tokens from a corpus resident
    /// on the device, and their next-token targets (twin:
    /// `lrmoe::data::windows`).
    ///
    /// # Safety
    ///
    /// Every start (`n_seq` entries) satisfies `start + seq < corpus.len()`.
    pub unsafe fn batch_windows(
        &self,
        corpus: &CudaSlice<u32>,
        starts: &CudaSlice<u32>,
        n_seq: usize,
        seq: usize,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>), KernelError> {
        at_least("starts", n_seq, starts.len())?;
        let n = n_seq * seq;
        // SAFETY: uninitialised outputs; the kernel writes all n entries.
        let (mut tok, mut tgt) = unsafe { (self.uninit::<u32>(n)?, self.uninit::<u32>(n)?) };
        if n > 0 {
            let (b, s) = (dim("sequences", n_seq)?, dim("seq", seq)?);
            let mut l = self.stream.launch_builder(&self.dense.batch);
            l.arg(corpus)
                .arg(starts)
                .arg(&mut tok)
                .arg(&mut tgt)
                .arg(&b)
                .arg(&s);
            // SAFETY: (u32*, u32*, u32*, u32*, int, int); windows inside the
            // corpus (caller), outputs n entries.
            unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        }
        Ok((tok, tgt))
    }

    /// `dtable[tok[i]] += dx[i]` (atomic). Twin:
    /// [`crate::dense::embed_backward_reference`].
    ///
    /// # Safety
    ///
    /// Every token of `tok` (`n` entries) is below `dtable.len() / d`.
    pub unsafe fn embed_backward(
        &self,
        dx: &CudaSlice<f32>,
        tok: &CudaSlice<u32>,
        dtable: &mut CudaSlice<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), KernelError> {
        at_least("tokens", n, tok.len())?;
        at_least("dx", n * d, dx.len())?;
        let (ni, di) = (dim("tokens", n)?, dim("width", d)?);
        let mut l = self.stream.launch_builder(&self.dense.embed_bwd);
        l.arg(dx).arg(tok).arg(dtable).arg(&ni).arg(&di);
        // SAFETY: as in `embed`.
        unsafe { l.launch(self.elementwise_config(n * d)) }.map_err(cuda)?;
        Ok(())
    }

    /// RMSNorm of `rows` f32 rows of `w.len()`: bf16 output and `1 / rms`
    /// per row. Twin: [`crate::dense::rmsnorm_reference`].
    pub fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        self.norm_any(
            (&self.dense.norm_f32, &self.dense.norm_block[0]),
            x,
            w,
            rows,
            eps,
            None,
        )
    }

    /// [`Gpu::rmsnorm`] that also returns a copy of `x` (the residual
    /// stream the backward reads), made in the same pass where the width
    /// takes the block-per-row kernel: `(copy, y, 1 / rms)`.
    pub fn rmsnorm_keeping(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<NormKeeping, KernelError> {
        let d = w.len();
        at_least("x", rows * d, x.len())?;
        if !norm_block_takes(d) {
            let copy = self.duplicate(x)?;
            let (y, inv) = self.rmsnorm(x, w, rows, eps)?;
            return Ok((copy, y, inv));
        }
        // SAFETY: uninitialised output; the kernel copies every row.
        let mut copy = unsafe { self.uninit::<f32>(x.len()) }?;
        if x.len() > rows * d {
            // The part past the rows (none in the model) as it was.
            self.stream
                .memcpy_dtod(&x.slice(rows * d..), &mut copy.slice_mut(rows * d..))
                .map_err(cuda)?;
        }
        let (y, inv) = self.norm_any(
            (&self.dense.norm_f32, &self.dense.norm_block[0]),
            x,
            w,
            rows,
            eps,
            Some(&mut copy),
        )?;
        Ok((copy, y, inv))
    }

    /// RMSNorm of bf16 rows (the q/k head norms), as [`Gpu::rmsnorm`].
    pub fn rmsnorm_bf16(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        self.norm_any(
            (&self.dense.norm_bf16, &self.dense.norm_block[1]),
            x,
            w,
            rows,
            eps,
            None,
        )
    }

    /// `f`: the warp-per-row kernel (any width) and the block-per-row one
    /// ([`norm_block_takes`]); `keep`: where the block kernel copies `x`
    /// (only with it).
    fn norm_any<X: cudarc::driver::DeviceRepr>(
        &self,
        (f, f_block): (&CudaFunction, &CudaFunction),
        x: &CudaSlice<X>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
        keep: Option<&mut CudaSlice<f32>>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        let d = w.len();
        at_least("x", rows * d, x.len())?;
        // SAFETY: uninitialised outputs; the kernel writes every row.
        let (mut y, mut inv) =
            unsafe { (self.uninit::<u16>(rows * d)?, self.uninit::<f32>(rows)?) };
        if rows == 0 {
            return Ok((y, inv));
        }
        let (ri, di) = (dim("rows", rows)?, dim("width", d)?);
        if norm_block_takes(d) {
            let cfg = self.norm_block_config(f_block, rows, d);
            let mut l = self.stream.launch_builder(f_block);
            l.arg(x).arg(w).arg(&mut y).arg(&mut inv);
            let null = 0u64;
            match keep {
                Some(k) => l.arg(k),
                None => l.arg(&null),
            };
            l.arg(&ri).arg(&di).arg(&eps);
            // SAFETY: (X*, f32*, u16*, f32*, f32* or null, int, int,
            // float); sizes checked; d / 8 threads a block, each row's
            // eight-column chunks (whole allocations: 16-byte aligned).
            unsafe { l.launch(cfg) }.map_err(cuda)?;
        } else {
            let mut l = self.stream.launch_builder(f);
            l.arg(x)
                .arg(w)
                .arg(&mut y)
                .arg(&mut inv)
                .arg(&ri)
                .arg(&di)
                .arg(&eps);
            // SAFETY: (X*, f32*, u16*, f32*, int, int, float); sizes checked.
            unsafe { l.launch(self.warp_rows(rows, 0)) }.map_err(cuda)?;
        }
        Ok((y, inv))
    }

    /// A block of `d / 8` threads per row, as many blocks as fit on the
    /// device at once (the blocks loop over the rows).
    fn norm_block_config(&self, f: &CudaFunction, rows: usize, d: usize) -> LaunchConfig {
        let threads = (d / 8) as u32;
        // Only sizes the grid: two blocks a SM if the driver does not say.
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .unwrap_or(2)
            .max(1) as usize;
        LaunchConfig {
            grid_dim: (rows.min(self.n_sms as usize * per_sm) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Backward of [`Gpu::rmsnorm`]: adds the input gradient into `dx`
    /// (f32, the residual stream's gradient) and the gain's into `dw`.
    /// Twin: [`crate::dense::rmsnorm_backward_reference`].
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        inv: &CudaSlice<f32>,
        dy: &CudaSlice<u16>,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        at_least("dx", rows * w.len(), dx.len())?;
        self.norm_bwd_any(
            (
                &self.dense.norm_bwd_f32,
                &self.dense.norm_bwd_wide_f32,
                &self.dense.norm_block[2],
            ),
            x,
            w,
            inv,
            dy,
            dx,
            dw,
            rows,
        )
    }

    /// Backward of [`Gpu::rmsnorm_bf16`]: returns the input gradient
    /// (bf16) and adds the gain's into `dw`.
    pub fn rmsnorm_bf16_backward(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<f32>,
        inv: &CudaSlice<f32>,
        dy: &CudaSlice<u16>,
        dw: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output; the kernel writes every row.
        let mut dx = unsafe { self.uninit::<u16>(rows * w.len()) }?;
        self.norm_bwd_any(
            (
                &self.dense.norm_bwd_bf16,
                &self.dense.norm_bwd_wide_bf16,
                &self.dense.norm_block[3],
            ),
            x,
            w,
            inv,
            dy,
            &mut dx,
            dw,
            rows,
        )?;
        Ok(dx)
    }

    /// `f`: the kernels for any width (dw in registers up to 512), for
    /// wider rows that are multiples of 256 (16-byte loads), and the
    /// block-per-row one, which takes the widths of [`norm_block_takes`]
    /// from [`NORM_BLOCK_BWD_MIN`].
    #[allow(clippy::too_many_arguments)]
    fn norm_bwd_any<X: cudarc::driver::DeviceRepr, D: cudarc::driver::DeviceRepr>(
        &self,
        (f, f_wide, f_block): (&CudaFunction, &CudaFunction, &CudaFunction),
        x: &CudaSlice<X>,
        w: &CudaSlice<f32>,
        inv: &CudaSlice<f32>,
        dy: &CudaSlice<u16>,
        dx: &mut CudaSlice<D>,
        dw: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        let d = w.len();
        at_least("x", rows * d, x.len())?;
        at_least("dy", rows * d, dy.len())?;
        at_least("inv", rows, inv.len())?;
        at_least("dw", d, dw.len())?;
        if rows == 0 {
            return Ok(());
        }
        let (ri, di) = (dim("rows", rows)?, dim("width", d)?);
        let (f, cfg) = if norm_block_takes(d) && d >= NORM_BLOCK_BWD_MIN {
            (f_block, self.norm_block_config(f_block, rows, d))
        } else {
            let shared = u32::try_from(d * 4)
                .ok()
                .filter(|&b| b <= 48 * 1024)
                .ok_or(KernelError::Shape {
                    what: "norm width (at most 12288: the gain gradient sits in shared memory)",
                    expected: 12288,
                    got: d,
                })?;
            let f = if d % 256 == 0 && d > 512 { f_wide } else { f };
            (
                f,
                self.warp_rows(rows.min(self.n_sms as usize * 16), shared),
            )
        };
        let mut l = self.stream.launch_builder(f);
        l.arg(x)
            .arg(w)
            .arg(inv)
            .arg(dy)
            .arg(dx)
            .arg(dw)
            .arg(&ri)
            .arg(&di);
        // SAFETY: (X*, f32*, f32*, u16*, D*, f32*, int, int); sizes checked;
        // the warp kernels: d floats of dynamic shared memory; the block
        // kernel: d / 8 threads a block, none.
        unsafe { l.launch(cfg) }.map_err(cuda)?;
        Ok(())
    }

    /// Token-major ↔ head-major layout (see [`crate::dense::heads_reference`],
    /// its twin), rotating by RoPE with base `theta` (0: none) on the way
    /// to heads and back by the negative angle on the way to tokens.
    pub fn heads(
        &self,
        src: &CudaSlice<u16>,
        (n_seq, seq, heads, dh): (usize, usize, usize, usize),
        theta: f32,
        to_heads: bool,
    ) -> Result<CudaSlice<u16>, KernelError> {
        let n = n_seq * seq * heads * dh;
        at_least("rows", n, src.len())?;
        if dh % 2 != 0 {
            return Err(KernelError::Shape {
                what: "head_dim (even)",
                expected: dh + 1,
                got: dh,
            });
        }
        // SAFETY: uninitialised output; the kernel writes all n entries.
        let mut dst = unsafe { self.uninit::<u16>(n) }?;
        if n > 0 {
            let (b, s, h, d) = (
                dim("sequences", n_seq)?,
                dim("seq", seq)?,
                dim("heads", heads)?,
                dim("head_dim", dh)?,
            );
            let th: i32 = i32::from(to_heads);
            let mut l = self.stream.launch_builder(&self.dense.heads);
            l.arg(src)
                .arg(&mut dst)
                .arg(&b)
                .arg(&s)
                .arg(&h)
                .arg(&d)
                .arg(&theta)
                .arg(&th);
            // SAFETY: (u16*, u16*, int×4, float, int); n entries each; one
            // thread per (token, pair of dimensions), every head.
            unsafe { l.launch(self.elementwise_config(n_seq * seq * (dh / 2))) }.map_err(cuda)?;
        }
        Ok(dst)
    }

    /// Causal softmax of `rows` score rows of `seq` (bf16) scaled by
    /// `scale`. Twin: [`crate::dense::softmax_causal_reference`].
    pub fn softmax_causal(
        &self,
        s: &CudaSlice<u16>,
        rows: usize,
        seq: usize,
        scale: f32,
    ) -> Result<CudaSlice<u16>, KernelError> {
        self.softmax_any(&self.dense.softmax, &[s], rows, seq, scale)
    }

    /// Backward of [`Gpu::softmax_causal`] from the probabilities and their
    /// gradient. Twin: [`crate::dense::softmax_causal_backward_reference`].
    pub fn softmax_causal_backward(
        &self,
        p: &CudaSlice<u16>,
        dp: &CudaSlice<u16>,
        rows: usize,
        seq: usize,
        scale: f32,
    ) -> Result<CudaSlice<u16>, KernelError> {
        self.softmax_any(&self.dense.softmax_bwd, &[p, dp], rows, seq, scale)
    }

    fn softmax_any(
        &self,
        f: &CudaFunction,
        ins: &[&CudaSlice<u16>],
        rows: usize,
        seq: usize,
        scale: f32,
    ) -> Result<CudaSlice<u16>, KernelError> {
        for x in ins {
            at_least("score rows", rows * seq, x.len())?;
        }
        // SAFETY: uninitialised output; the kernel writes every entry.
        let mut out = unsafe { self.uninit::<u16>(rows * seq) }?;
        if rows > 0 && seq > 0 {
            let (ri, si) = (dim("rows", rows)?, dim("seq", seq)?);
            let mut l = self.stream.launch_builder(f);
            for x in ins {
                l.arg(*x);
            }
            l.arg(&mut out).arg(&ri).arg(&si).arg(&scale);
            // SAFETY: (u16* [, u16*], u16*, int, int, float); sizes checked.
            unsafe { l.launch(self.warp_rows(rows, 0)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// `x[..n] += y[..n]` (f32 residual, bf16 branch).
    pub fn add_into(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        self.accumulate(&self.dense.add_into, x, y, n)
    }

    /// `x[..n] += y[..n]` (f32; gradients accumulated over micro-batches).
    pub fn add_f32(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        self.accumulate(&self.dense.add_f32, x, y, n)
    }

    /// Many f32 sums through device addresses in one launch (twin:
    /// [`crate::dense::sum_parts_reference`]): each part's `n` elements at
    /// `dst` become the sum of its sources' `n` elements, in source order,
    /// from `0.0` when `from_zero`, else from the first source (one source:
    /// an exact copy). A destination may be one of its own sources. Every
    /// part has the same number of sources (at least one). In-process ranks
    /// sharing this GPU sum and gather their gradients with it.
    ///
    /// # Safety
    ///
    /// Every address holds its part's `n` f32 on this GPU's context, stays
    /// allocated until the stream reaches the kernel, and no other work
    /// writes a source or the destination meanwhile.
    pub unsafe fn sum_parts(&self, parts: &[SumPart], from_zero: bool) -> Result<(), KernelError> {
        let parts: Vec<&SumPart> = parts.iter().filter(|p| p.n > 0).collect();
        let Some(k) = parts.first().map(|p| p.srcs.len()) else {
            return Ok(());
        };
        if let Some(p) = parts.iter().find(|p| p.srcs.len() != k || k == 0) {
            return Err(KernelError::Shape {
                what: "sum_parts sources (the first part's count, at least one)",
                expected: k.max(1),
                got: p.srcs.len(),
            });
        }
        // One table: destinations, sources (k a part), lengths, inclusive
        // chunk prefix sums.
        let np = parts.len();
        let mut table: Vec<u64> = Vec::with_capacity(np * (k + 3));
        table.extend(parts.iter().map(|p| p.dst));
        table.extend(parts.iter().flat_map(|p| p.srcs.iter().copied()));
        table.extend(parts.iter().map(|p| p.n as u64));
        let mut chunks = 0u64;
        for p in &parts {
            chunks += p.n.div_ceil(SUM_CHUNK) as u64;
            table.push(chunks);
        }
        let blocks = u32::try_from(chunks).map_err(|_| KernelError::Shape {
            what: "sum_parts chunks of 4096 elements",
            expected: u32::MAX as usize,
            got: chunks as usize,
        })?;
        let dev = self.upload(&table)?;
        let at = |i: usize| self.address(&dev, i);
        let (d, s, l, c) = (at(0)?, at(np)?, at(np * (1 + k))?, at(np * (2 + k))?);
        let (np32, k32, fz) = (np as i32, k as i32, i32::from(from_zero));
        let mut b = self.stream.launch_builder(&self.dense.sum_parts);
        b.arg(&d)
            .arg(&s)
            .arg(&l)
            .arg(&c)
            .arg(&np32)
            .arg(&k32)
            .arg(&fz);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (u64*, u64*, long long*, long long*, int, int, int): the
        // table holds np, np·k, np and np entries at those addresses and
        // lives until its drop, ordered after the kernel on this stream;
        // the addresses in it are the caller's promise.
        unsafe { b.launch(cfg) }.map_err(cuda)?;
        drop(dev);
        Ok(())
    }

    /// Launches an accumulating kernel `(f32* x, const Y* y, long long n)`.
    fn accumulate<Y: cudarc::driver::DeviceRepr>(
        &self,
        f: &CudaFunction,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<Y>,
        n: usize,
    ) -> Result<(), KernelError> {
        at_least("x", n, x.len())?;
        at_least("y", n, y.len())?;
        let nl = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(x).arg(y).arg(&nl);
        // SAFETY: (f32*, Y*, long long), Y the kernel's element type (the
        // callers pair each kernel with its type); n entries each.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(())
    }

    /// `bf16(x[..n])`.
    pub fn to_bf16(&self, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output; the kernel writes all n entries.
        let mut y = unsafe { self.uninit::<u16>(n) }?;
        self.to_bf16_into(x, &mut y, n)?;
        Ok(y)
    }

    /// `y[..n] = bf16(x[..n])`.
    pub fn to_bf16_into(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        at_least("x", n, x.len())?;
        at_least("y", n, y.len())?;
        let nl = n as i64;
        let mut l = self.stream.launch_builder(&self.dense.to_bf16);
        l.arg(x).arg(y).arg(&nl);
        // SAFETY: (f32*, u16*, long long); n entries each.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(())
    }

    /// Fused cross-entropy of `n` bf16 logits rows of `v`: adds the summed
    /// loss into `loss[0]` and returns `(softmax − onehot) · inv_n` (bf16).
    /// Twin: [`crate::dense::cross_entropy_reference`].
    ///
    /// # Safety
    ///
    /// Every target of `target` (`n` entries) is below `v`.
    pub unsafe fn cross_entropy(
        &self,
        logits: &CudaSlice<u16>,
        target: &CudaSlice<u32>,
        loss: &mut CudaSlice<f32>,
        (n, v): (usize, usize),
        inv_n: f32,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: the caller's.
        unsafe {
            self.cross_entropy_with(self.dense.xent_launch, logits, target, loss, (n, v), inv_n)
        }
    }

    /// [`Gpu::cross_entropy`] with the launch `how`.
    ///
    /// # Safety
    ///
    /// Every target of `target` (`n` entries) is below `v`.
    pub unsafe fn cross_entropy_with(
        &self,
        how: XentLaunch,
        logits: &CudaSlice<u16>,
        target: &CudaSlice<u32>,
        loss: &mut CudaSlice<f32>,
        (n, v): (usize, usize),
        inv_n: f32,
    ) -> Result<CudaSlice<u16>, KernelError> {
        at_least("logits", n * v, logits.len())?;
        at_least("targets", n, target.len())?;
        let (f, cfg) = match how {
            XentLaunch::Streamed => (
                &self.dense.xent,
                LaunchConfig {
                    grid_dim: (n.min(self.n_sms as usize * 32).max(1) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
            ),
            XentLaunch::Resident {
                threads,
                blocks_per_sm,
                l2_hints,
            } => {
                if threads == 0 || threads % 32 != 0 || threads > 1024 || blocks_per_sm == 0 {
                    return Err(KernelError::Launch(format!(
                        "cross-entropy launch: {threads} threads a block (a multiple of 32 up to 1024), {blocks_per_sm} blocks a SM (at least 1)"
                    )));
                }
                let grid = n.min(self.n_sms as usize * blocks_per_sm as usize).max(1);
                (
                    &self.dense.xent_l2[usize::from(l2_hints)],
                    LaunchConfig {
                        grid_dim: (grid as u32, 1, 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            }
        };
        // SAFETY: uninitialised output; the kernel writes every row.
        let mut d = unsafe { self.uninit::<u16>(n * v) }?;
        if n > 0 {
            let (ni, vi) = (dim("rows", n)?, dim("vocabulary", v)?);
            let mut l = self.stream.launch_builder(f);
            l.arg(logits)
                .arg(target)
                .arg(loss)
                .arg(&mut d)
                .arg(&ni)
                .arg(&vi)
                .arg(&inv_n);
            // SAFETY: (u16*, u32*, f32*, u16*, int, int, float); targets
            // below v (caller); sizes checked.
            unsafe { l.launch(cfg) }.map_err(cuda)?;
        }
        Ok(d)
    }

    /// `out[0] += Σ x[..n]²` (f32 or bf16 gradients; the sum's order, so
    /// its last bits, differ between runs: blocks add their partial sums
    /// atomically). Twin: the sum in f64 on the host (the device test).
    pub fn sq_sum_into<G: GradElem>(
        &self,
        x: &CudaSlice<G>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        at_least("x", n, x.len())?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        let mut l = self.stream.launch_builder(self.dense.sq::<G>());
        l.arg(x).arg(out).arg(&nl);
        // SAFETY: (G*, f32*, long long); n entries.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(())
    }

    /// One AdamW update of the f32 master `p` and moments `m`, `v` with the
    /// gradient `g`, clipped by `hp.clip / sqrt(norm_sq[0])` (read on the
    /// device) when that norm exceeds the clip; writes the bf16 copy when
    /// given. Twin: [`crate::dense::adamw_reference`].
    #[allow(clippy::too_many_arguments)]
    pub fn adamw<G: GradElem>(
        &self,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<G>,
        p16: Option<&mut CudaSlice<u16>>,
        hp: &AdamHp,
        norm_sq: &CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let n = p.len();
        at_least("m", n, m.len())?;
        at_least("v", n, v.len())?;
        at_least("gradient", n, g.len())?;
        if let Some(c) = p16.as_deref() {
            at_least("bf16 copy", n, c.len())?;
        }
        if n == 0 {
            return Ok(());
        }
        let (nl, null) = (n as i64, 0u64);
        let mut l = self.stream.launch_builder(self.dense.adam::<G>());
        l.arg(p).arg(m).arg(v).arg(g);
        match p16 {
            Some(c) => l.arg(c),
            None => l.arg(&null),
        };
        l.arg(&nl)
            .arg(&hp.lr)
            .arg(&hp.beta1)
            .arg(&hp.beta2)
            .arg(&hp.eps)
            .arg(&hp.weight_decay)
            .arg(&hp.bc1)
            .arg(&hp.bc2)
            .arg(norm_sq)
            .arg(&hp.clip);
        // (Measured on the H200, 2026-12-03, 2²⁸ parameters: one resident
        // wave of blocks, a contiguous stretch a block, or one thread per
        // four parameters and no loop were 9%, 44% and 2% slower than this
        // grid-stride launch: `docs/benchmarks.md`, "AdamW".)
        // (Through the bulk-copy engine, tiles of 1 024–4 096 parameters
        // and 2–4 stages a block in shared memory, it was 3–150% slower:
        // 2026-12-05.)
        // SAFETY: (f32*, f32*, f32*, G*, u16* or null, long long, float×7,
        // f32*, float); n entries each (checked above), norm_sq one.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(())
    }

    /// AdamW's loads and stores without its arithmetic — `p += g`, `m +=
    /// g`, `v += g`, the bf16 copy of `p` written — in the update's launch:
    /// the bandwidth its access pattern alone reaches, the ceiling
    /// `lrmoe-gpu-bench`'s AdamW table reads the update against. Twin:
    /// [`crate::dense::adamw_streams_reference`]. (Its loop in
    /// `kernels/dense.cu` is written beside `adamw`'s, not shared through a
    /// template: with the adds in place nvcc unrolls the shared wide loop
    /// six times over — 18 four-wide loads in the PTX against the 3 of
    /// `adamw_bf16`'s loop and of this one's — a different memory pattern
    /// from the update's, 2026-12-06.)
    pub fn adamw_streams(
        &self,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<u16>,
        p16: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        let n = p.len();
        at_least("m", n, m.len())?;
        at_least("v", n, v.len())?;
        at_least("gradient", n, g.len())?;
        at_least("bf16 copy", n, p16.len())?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        let mut l = self.stream.launch_builder(&self.dense.adam_streams);
        l.arg(p).arg(m).arg(v).arg(g).arg(p16).arg(&nl);
        // SAFETY: (f32*, f32*, f32*, u16*, u16*, long long); n entries each
        // (checked above).
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(())
    }
}

/// One causal grouped-query attention call's shape: `n_seq` sequences of
/// `seq` tokens, `heads` query heads sharing `kv_heads` key/value heads of
/// width `head_dim`, rotary embeddings with base `theta` (0: none).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Sequences.
    pub n_seq: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// RoPE base (0: no rotation).
    pub theta: f32,
}

impl AttnShape {
    /// GEMM groups: one per sequence and key/value head.
    pub fn groups(&self) -> usize {
        self.n_seq * self.kv_heads
    }

    /// Query rows per group (the heads sharing one key/value head).
    pub fn rows_each(&self) -> usize {
        self.heads / self.kv_heads.max(1) * self.seq
    }
}

/// What [`Gpu::attention_forward`] keeps for the backward: head-major
/// queries and keys (rotated), values, and either the fused forward's
/// output and per-row `log2` normalisers or, on the materialised path, the
/// causal probabilities (`n_seq · heads · seq × seq`).
pub struct AttnSaved {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    rest: Kept,
}

/// The rest of what the backward reads: the probabilities (materialised
/// path) or the fused forward's output and row statistics.
enum Kept {
    Probs(CudaSlice<u16>),
    Fused {
        o: CudaSlice<u16>,
        lse2: CudaSlice<f32>,
    },
}

impl AttnSaved {
    /// Whether the fused kernels computed it (no `seq × seq` matrix kept).
    pub fn fused(&self) -> bool {
        matches!(self.rest, Kept::Fused { .. })
    }
}

impl Gpu {
    /// Causal grouped-query attention on token-major projections (`q`:
    /// tokens × heads·head_dim, `k`, `v`: tokens × kv_heads·head_dim):
    /// head layouts with RoPE, scores `QKᵀ` as grouped GEMMs (`att`: the
    /// group offsets of [`AttnShape::groups`] groups of
    /// [`AttnShape::rows_each`] rows, [`Gpu::even_offsets`]), the causal
    /// softmax (scale `1/√head_dim`), `PV`; the output token-major. Its
    /// reference is the CPU model's attention (the device model's tests).
    pub fn attention_forward(
        &self,
        s: AttnShape,
        att: &CudaSlice<i32>,
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
    ) -> Result<(CudaSlice<u16>, AttnSaved), KernelError> {
        let (n_seq, seq, h, kv, dh) = (s.n_seq, s.seq, s.heads, s.kv_heads, s.head_dim);
        let (groups, rows) = (s.groups(), n_seq * h * seq);
        let scale = 1.0 / (dh as f32).sqrt();
        let q = self.heads(q, (n_seq, seq, h, dh), s.theta, true)?;
        let k = self.heads(k, (n_seq, seq, kv, dh), s.theta, true)?;
        let v = self.heads(v, (n_seq, seq, kv, dh), 0.0, true)?;
        if self.dense.fused_attention(dh) {
            let (o, lse2) = self.flash_attention_forward((n_seq, seq, h, kv, dh), &q, &k, &v)?;
            let out = self.heads(&o, (n_seq, seq, h, dh), 0.0, false)?;
            return Ok((
                out,
                AttnSaved {
                    q,
                    k,
                    v,
                    rest: Kept::Fused { o, lse2 },
                },
            ));
        }
        let sc = self.gemm_dev(GemmVariant::DataGrad, att, groups, rows, &q, &k, seq, dh)?;
        let p = self.softmax_causal(&sc, rows, seq, scale)?;
        drop(sc);
        let c = self.gemm_dev(GemmVariant::Forward, att, groups, rows, &p, &v, seq, dh)?;
        let out = self.heads(&c, (n_seq, seq, h, dh), 0.0, false)?;
        Ok((
            out,
            AttnSaved {
                q,
                k,
                v,
                rest: Kept::Probs(p),
            },
        ))
    }

    /// The backward of [`Gpu::attention_forward`] from the output's
    /// gradient (token-major): the gradients of the token-major `q`, `k`,
    /// `v` projections (rotations undone).
    #[allow(clippy::type_complexity)]
    pub fn attention_backward(
        &self,
        s: AttnShape,
        att: &CudaSlice<i32>,
        saved: &AttnSaved,
        dout: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let (n_seq, seq, h, kv, dh) = (s.n_seq, s.seq, s.heads, s.kv_heads, s.head_dim);
        let (groups, rows) = (s.groups(), n_seq * h * seq);
        let scale = 1.0 / (dh as f32).sqrt();
        let AttnSaved { q, k, v, rest } = saved;
        let dc = self.heads(dout, (n_seq, seq, h, dh), 0.0, true)?;
        let (dq, dk, dv) = match rest {
            Kept::Fused { o, lse2 } => {
                self.flash_attention_backward((n_seq, seq, h, kv, dh), (q, k, v), (o, lse2), &dc)?
            }
            Kept::Probs(p) => {
                let dp =
                    self.gemm_dev(GemmVariant::DataGrad, att, groups, rows, &dc, v, seq, dh)?;
                let dv =
                    self.gemm_dev(GemmVariant::WeightGrad, att, groups, rows, p, &dc, seq, dh)?;
                let ds = self.softmax_causal_backward(p, &dp, rows, seq, scale)?;
                drop(dp);
                let dq = self.gemm_dev(GemmVariant::Forward, att, groups, rows, &ds, k, seq, dh)?;
                let dk =
                    self.gemm_dev(GemmVariant::WeightGrad, att, groups, rows, &ds, q, seq, dh)?;
                (dq, dk, dv)
            }
        };
        Ok((
            self.heads(&dq, (n_seq, seq, h, dh), s.theta, false)?,
            self.heads(&dk, (n_seq, seq, kv, dh), s.theta, false)?,
            self.heads(&dv, (n_seq, seq, kv, dh), 0.0, false)?,
        ))
    }
}

impl Gpu {
    fn flash_launch(
        &self,
        dims: crate::dense::AttnDims,
        which: usize,
    ) -> Result<(&CudaFunction, LaunchConfig), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        let fns = self.dense.flash_fns(dh).ok_or(KernelError::Shape {
            what: "head_dim of the fused attention (16, 32, 64 or 128)",
            expected: 64,
            got: dh,
        })?;
        if kv == 0 || heads % kv != 0 {
            return Err(KernelError::Shape {
                what: "kv_heads (a divisor of heads)",
                expected: heads,
                got: kv,
            });
        }
        let y = n_seq * if which == 1 { kv } else { heads };
        if y > 65535 {
            return Err(KernelError::Shape {
                what: "sequences × heads of one attention call (at most 65535)",
                expected: 65535,
                got: y,
            });
        }
        Ok((
            &fns[which],
            LaunchConfig {
                grid_dim: (seq.div_ceil(64) as u32, y as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: flash_smem(dh)[which],
            },
        ))
    }

    /// Fused causal grouped-query attention on head-major bf16 `q`
    /// (`[n_seq, heads, seq, dh]`), `k`, `v` (`[n_seq, kv, seq, dh]`),
    /// scale `1/√dh`: the output (head-major bf16) and each row's
    /// `log2 Σ_j exp(scale·q·k_j)` (f32), with no score matrix in memory.
    /// Twin: [`crate::dense::flash_attention_reference`].
    ///
    /// The kernel is `LRMOE_ATTENTION_FWD`'s ([`AttnFwd::DEFAULT`] unset)
    /// where it takes the shape ([`Gpu::flash_forward_takes`]), the
    /// `mma.sync` kernel elsewhere.
    pub fn flash_attention_forward(
        &self,
        dims: crate::dense::AttnDims,
        q: &CudaSlice<u16>,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        let chosen = self.dense.attention_fwd;
        let kernel = if self.flash_forward_takes(chosen, dims) {
            chosen
        } else {
            AttnFwd::Mma
        };
        self.flash_attention_forward_with(dims, q, k, v, kernel)
    }

    /// Whether forward kernel `kernel` takes `dims`: the `mma.sync` kernel
    /// every head width of the fused path; CUTLASS's head widths 64 and 128
    /// with `seq` a multiple of 128 and fewer than 2³¹ elements in q.
    pub fn flash_forward_takes(&self, kernel: AttnFwd, dims: crate::dense::AttnDims) -> bool {
        match kernel {
            AttnFwd::Mma => self.dense.flash_fns(dims.4).is_some(),
            _ => self.cutlass_attention_takes(dims).is_ok(),
        }
    }

    /// Ok where the CUTLASS attention library (forward and backward) takes
    /// `dims`; the shape error its callers return otherwise.
    fn cutlass_attention_takes(&self, dims: crate::dense::AttnDims) -> Result<(), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        let d = |x: usize| i32::try_from(x).ok();
        let takes = match (d(n_seq), d(heads), d(kv), d(seq), d(dh)) {
            // SAFETY: a pure function of five integers.
            (Some(a), Some(b), Some(c), Some(e), Some(f)) => unsafe {
                (self.attn.supports)(a, b, c, e, f) != 0
            },
            _ => false,
        };
        if takes {
            Ok(())
        } else {
            Err(KernelError::Shape {
                what: "the CUTLASS attention kernels' shape (head_dim 64 or 128, seq a multiple of 128, q under 2³¹ elements)",
                expected: 128,
                got: if dh == 64 || dh == 128 { seq } else { dh },
            })
        }
    }

    /// [`Gpu::flash_attention_forward`] on the kernel the caller names (an
    /// error where it does not take the shape).
    pub fn flash_attention_forward_with(
        &self,
        dims: crate::dense::AttnDims,
        q: &CudaSlice<u16>,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        kernel: AttnFwd,
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        at_least("q", n_seq * heads * seq * dh, q.len())?;
        at_least("k", n_seq * kv * seq * dh, k.len())?;
        at_least("v", n_seq * kv * seq * dh, v.len())?;
        let rows = n_seq * heads * seq;
        if let Some(schedule) = kernel.schedule() {
            self.cutlass_attention_takes(dims)?;
            // SAFETY: uninitialised outputs; the library writes every row
            // of every head (seq is a whole number of query tiles).
            let mut o = unsafe { self.uninit::<u16>(rows * dh) }?;
            // SAFETY: as above, one entry per row.
            let mut lse2 = unsafe { self.uninit::<f32>(rows) }?;
            self.ctx.bind_to_thread().map_err(cuda)?;
            let rc = {
                let (pq, _q) = q.device_ptr(&self.stream);
                let (pk, _k) = k.device_ptr(&self.stream);
                let (pv, _v) = v.device_ptr(&self.stream);
                let (po, _o) = o.device_ptr_mut(&self.stream);
                let (pl, _l) = lse2.device_ptr_mut(&self.stream);
                // SAFETY: 1. the library's `lrmoe_flash_fwd` with the
                // declared C signature; 2. q, k, v, o, lse2 are live device
                // allocations of the lengths checked above (the shape in
                // i32, as `flash_forward_takes` checked); 3. the stream
                // belongs to the current context.
                unsafe {
                    (self.attn.forward)(
                        schedule,
                        n_seq as i32,
                        heads as i32,
                        kv as i32,
                        seq as i32,
                        dh as i32,
                        pq as *const std::ffi::c_void,
                        pk as *const std::ffi::c_void,
                        pv as *const std::ffi::c_void,
                        po as *mut std::ffi::c_void,
                        pl as *mut f32,
                        self.n_sms as i32,
                        self.stream.cu_stream() as *mut std::ffi::c_void,
                    )
                }
            };
            if rc != 0 {
                return Err(KernelError::Cuda(format!(
                    "CUTLASS attention forward failed with code {rc}"
                )));
            }
            return Ok((o, lse2));
        }
        let (f, cfg) = self.flash_launch(dims, 0)?;
        // SAFETY: uninitialised outputs; the kernel writes every row < seq
        // of every head (each query block of each head is one block).
        let mut o = unsafe { self.uninit::<u16>(rows * dh) }?;
        // SAFETY: as above, one entry per row.
        let mut lse2 = unsafe { self.uninit::<f32>(rows) }?;
        if rows > 0 {
            let (sq, h, g) = (dim("seq", seq)?, dim("heads", heads)?, dim("kv_heads", kv)?);
            let sl = std::f32::consts::LOG2_E / (dh as f32).sqrt();
            let mut l = self.stream.launch_builder(f);
            l.arg(q)
                .arg(k)
                .arg(v)
                .arg(&mut o)
                .arg(&mut lse2)
                .arg(&sq)
                .arg(&h)
                .arg(&g)
                .arg(&sl);
            // SAFETY: (u16*×3, u16*, f32*, int×3, float); sizes checked;
            // dynamic shared memory as the kernel's layout needs (its
            // maximum set at load).
            unsafe { l.launch(cfg) }.map_err(cuda)?;
        }
        Ok((o, lse2))
    }

    /// Backward of [`Gpu::flash_attention_forward`] from the output's
    /// gradient `dout` (head-major): `dq`, `dk`, `dv` (head-major bf16),
    /// recomputing the probabilities from `lse2`; dK/dV per key block
    /// (every query head of the group in one block, no atomics), dQ per
    /// query block, from the dS the dK/dV kernel stored while it fits
    /// [`ATTN_DS_MAX_BYTES`] ([`AttnDq`]); at head widths ≥ 64 where cuDNN
    /// opens and takes the shape, cuDNN's fused backward ([`AttnDq::Cudnn`]),
    /// else at head width 128 where CUTLASS takes the shape, CUTLASS's
    /// backward ([`AttnDq::Cutlass`]). Twin:
    /// [`crate::dense::flash_attention_backward_reference`].
    #[allow(clippy::type_complexity)]
    pub fn flash_attention_backward(
        &self,
        dims: crate::dense::AttnDims,
        qkv: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        saved: (&CudaSlice<u16>, &CudaSlice<f32>),
        dout: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let (n_seq, seq, heads, _, _) = dims;
        let cutlass = self.cutlass_attention_takes(dims).is_ok();
        let cudnn = || self.cudnn_attention_workspace(dims).is_ok();
        let path = match self.dense.attention_dq {
            Some(AttnDq::Cutlass) if !cutlass => AttnDq::Stored,
            Some(AttnDq::Cudnn) if !cudnn() => AttnDq::Stored,
            Some(forced) => forced,
            None if dims.4 >= ATTN_BWD_CUDNN_MIN_HEAD_DIM && cudnn() => AttnDq::Cudnn,
            None if cutlass && dims.4 >= ATTN_BWD_CUTLASS_MIN_HEAD_DIM => AttnDq::Cutlass,
            None if attn_ds_bytes(n_seq, seq, heads) <= ATTN_DS_MAX_BYTES => AttnDq::Stored,
            None => AttnDq::Recompute,
        };
        self.flash_attention_backward_with(dims, qkv, saved, dout, path)
    }

    /// [`Gpu::flash_attention_backward`] with dQ's path chosen by the
    /// caller.
    #[allow(clippy::type_complexity)]
    pub fn flash_attention_backward_with(
        &self,
        dims: crate::dense::AttnDims,
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        (o, lse2): (&CudaSlice<u16>, &CudaSlice<f32>),
        dout: &CudaSlice<u16>,
        path: AttnDq,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        let rows = n_seq * heads * seq;
        at_least("q", rows * dh, q.len())?;
        at_least("k", n_seq * kv * seq * dh, k.len())?;
        at_least("v", n_seq * kv * seq * dh, v.len())?;
        at_least("o", rows * dh, o.len())?;
        at_least("dout", rows * dh, dout.len())?;
        at_least("lse2", rows, lse2.len())?;
        match path {
            AttnDq::Cutlass => {
                return self.cutlass_attention_backward(dims, (q, k, v), (o, lse2), dout)
            }
            AttnDq::Cudnn => {
                return self.cudnn_attention_backward(dims, (q, k, v), (o, lse2), dout)
            }
            AttnDq::Stored | AttnDq::Recompute => {}
        }
        let (fkv, ckv) = self.flash_launch(dims, 1)?;
        let (fq, cq) = self.flash_launch(dims, if path == AttnDq::Stored { 3 } else { 2 })?;
        // SAFETY: uninitialised outputs; every row < seq is written.
        let mut dq = unsafe { self.uninit::<u16>(rows * dh) }?;
        // SAFETY: every key row < seq is written (one block per 64 keys).
        let mut dk = unsafe { self.uninit::<u16>(n_seq * kv * seq * dh) }?;
        // SAFETY: as dk.
        let mut dv = unsafe { self.uninit::<u16>(n_seq * kv * seq * dh) }?;
        if rows == 0 {
            return Ok((dq, dk, dv));
        }
        // SAFETY: flash_bwd_dot writes every row's entry.
        let mut d = unsafe { self.uninit::<f32>(rows) }?;
        let (rl, dhi) = (rows as i64, dim("head_dim", dh)?);
        let mut l = self.stream.launch_builder(&self.dense.flash_dot);
        l.arg(dout).arg(o).arg(&mut d).arg(&rl).arg(&dhi);
        // SAFETY: (u16*, u16*, f32*, long long, int); rows × dh each.
        unsafe { l.launch(self.warp_rows(rows, 0)) }.map_err(cuda)?;
        let (sq, h, g) = (dim("seq", seq)?, dim("heads", heads)?, dim("kv_heads", kv)?);
        let scale = 1.0 / (dh as f32).sqrt();
        let sl = std::f32::consts::LOG2_E * scale;
        // The stored dS: every causal tile is written by the dK/dV kernel
        // (one block per key block and kv head visits every query block at
        // or after it, for every query head of the group).
        let mut ds = match path {
            AttnDq::Stored => {
                let n = attn_ds_bytes(n_seq, seq, heads) / 2;
                // SAFETY: uninitialised; written whole before flash_bwd_q_ds reads it.
                Some(unsafe { self.uninit::<u16>(n) }?)
            }
            _ => None,
        };
        let null: u64 = 0;
        let inputs = (q, k, v, dout, lse2, &d);
        let mut l = self.stream.launch_builder(fkv);
        flash_bwd_inputs(&mut l, inputs);
        l.arg(&mut dk).arg(&mut dv);
        match ds.as_mut() {
            Some(ds) => l.arg(ds),
            None => l.arg(&null),
        };
        l.arg(&sq).arg(&h).arg(&g).arg(&sl).arg(&scale);
        // SAFETY: (u16*×4, f32*×2, u16*×2, uint4* or null, int×3,
        // float×2); sizes checked; ds holds attn_ds_bytes.
        unsafe { l.launch(ckv) }.map_err(cuda)?;
        let mut l = self.stream.launch_builder(fq);
        match ds.as_ref() {
            Some(ds) => {
                l.arg(k).arg(ds).arg(&mut dq);
                l.arg(&sq).arg(&h).arg(&g);
                // SAFETY: (u16*, uint4*, u16*, int×3); ds written whole above.
                unsafe { l.launch(cq) }.map_err(cuda)?;
            }
            None => {
                flash_bwd_inputs(&mut l, inputs);
                l.arg(&mut dq);
                l.arg(&sq).arg(&h).arg(&g).arg(&sl).arg(&scale);
                // SAFETY: (u16*×4, f32*×2, u16*, int×3, float×2); sizes checked.
                unsafe { l.launch(cq) }.map_err(cuda)?;
            }
        }
        Ok((dq, dk, dv))
    }

    /// [`AttnDq::Cutlass`]: the backward through `lrmoe_flash_bwd` (the
    /// buffers' lengths checked by [`Gpu::flash_attention_backward_with`]).
    #[allow(clippy::type_complexity)]
    fn cutlass_attention_backward(
        &self,
        dims: crate::dense::AttnDims,
        qkv: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        saved: (&CudaSlice<u16>, &CudaSlice<f32>),
        dout: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        self.cutlass_attention_takes(dims)?;
        let (a, b, c, d, e) = (n_seq as i32, heads as i32, kv as i32, seq as i32, dh as i32);
        // SAFETY: a pure function of five integers (checked to fit above).
        let ws_bytes = unsafe { (self.attn.backward_workspace)(a, b, c, d, e) };
        let (rc, grads) =
            self.library_attention_backward(dims, qkv, saved, dout, ws_bytes, |p| {
                // SAFETY: 1. the library's `lrmoe_flash_bwd` with the declared
                // C signature; 2. every pointer is a live device allocation of
                // the length checked by the caller, the workspace the size the
                // library asked for; 3. the stream belongs to the current
                // context.
                unsafe {
                    (self.attn.backward)(
                        a,
                        b,
                        c,
                        d,
                        e,
                        p.q,
                        p.k,
                        p.v,
                        p.o,
                        p.lse2,
                        p.dout,
                        p.dq,
                        p.dk,
                        p.dv,
                        p.ws,
                        ws_bytes,
                        self.n_sms as i32,
                        p.stream,
                    )
                }
            })?;
        if rc != 0 {
            return Err(KernelError::Cuda(format!(
                "CUTLASS attention backward failed with code {rc}"
            )));
        }
        Ok(grads)
    }

    /// An attention backward in a library: allocates dQ, dK, dV (every
    /// element of which the library writes) and `ws_bytes` of workspace
    /// (written before read), binds the context, and calls `call` with
    /// every buffer's device pointer, held for the call.
    #[allow(clippy::type_complexity)]
    fn library_attention_backward(
        &self,
        dims: crate::dense::AttnDims,
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        (o, lse2): (&CudaSlice<u16>, &CudaSlice<f32>),
        dout: &CudaSlice<u16>,
        ws_bytes: usize,
        call: impl FnOnce(AttnBwdPtrs) -> i32,
    ) -> Result<(i32, (CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>)), KernelError> {
        let (n_seq, seq, heads, kv, dh) = dims;
        let nk = n_seq * kv * seq * dh;
        // SAFETY: scratch the library writes before it reads.
        let mut ws = unsafe { self.uninit::<u8>(ws_bytes.max(1)) }?;
        // SAFETY: the library writes every row < seq of every head.
        let mut dq = unsafe { self.uninit::<u16>(n_seq * heads * seq * dh) }?;
        // SAFETY: the library writes every key row of every key/value head.
        let mut dk = unsafe { self.uninit::<u16>(nk) }?;
        // SAFETY: as dk.
        let mut dv = unsafe { self.uninit::<u16>(nk) }?;
        self.ctx.bind_to_thread().map_err(cuda)?;
        let rc = {
            let (pq, _q) = q.device_ptr(&self.stream);
            let (pk, _k) = k.device_ptr(&self.stream);
            let (pv, _v) = v.device_ptr(&self.stream);
            let (po, _o) = o.device_ptr(&self.stream);
            let (pl, _l) = lse2.device_ptr(&self.stream);
            let (pd, _d) = dout.device_ptr(&self.stream);
            let (pdq, _dq) = dq.device_ptr_mut(&self.stream);
            let (pdk, _dk) = dk.device_ptr_mut(&self.stream);
            let (pdv, _dv) = dv.device_ptr_mut(&self.stream);
            let (pw, _w) = ws.device_ptr_mut(&self.stream);
            let cp = |p: u64| p as *const std::ffi::c_void;
            let mp = |p: u64| p as *mut std::ffi::c_void;
            call(AttnBwdPtrs {
                q: cp(pq),
                k: cp(pk),
                v: cp(pv),
                o: cp(po),
                lse2: pl as *const f32,
                dout: cp(pd),
                dq: mp(pdq),
                dk: mp(pdk),
                dv: mp(pdv),
                ws: mp(pw),
                stream: self.stream.cu_stream() as *mut std::ffi::c_void,
            })
        };
        Ok((rc, (dq, dk, dv)))
    }

    /// cuDNN's attention backward, opening it on first use (and saying
    /// once, at info level, which backward attention then runs); an error
    /// naming why where it does not open (no `libcudnn.so.9` found, or the
    /// shim failed to load).
    pub(crate) fn cudnn(&self) -> Result<&super::CudnnLib, KernelError> {
        super::CUDNN
            .get_or_init(|| {
                let lib = super::load_cudnn();
                match &lib {
                    Ok(c) => tracing::info!(
                        "attention backward: cuDNN {} ({})",
                        c.version,
                        c.path.display()
                    ),
                    Err(e) => tracing::info!("attention backward: lrmoe's kernels ({e})"),
                }
                lib
            })
            .as_ref()
            .map_err(|e| KernelError::Cuda(e.clone()))
    }

    /// Where cuDNN was opened from and its version (e.g. 92801), or why it
    /// did not open.
    pub fn cudnn_attention(&self) -> Result<(std::path::PathBuf, i32), KernelError> {
        self.cudnn().map(|c| (c.path.clone(), c.version))
    }

    /// The workspace bytes of [`AttnDq::Cudnn`] at `dims` (building and
    /// keeping cuDNN's plan for the shape), or why cuDNN does not take it.
    pub fn cudnn_attention_workspace(
        &self,
        dims: crate::dense::AttnDims,
    ) -> Result<usize, KernelError> {
        let c = self.cudnn()?;
        let (n_seq, seq, heads, kv, dh) = dims;
        let (a, b, cc, d, e) = (
            dim("n_seq", n_seq)?,
            dim("heads", heads)?,
            dim("kv_heads", kv)?,
            dim("seq", seq)?,
            dim("head_dim", dh)?,
        );
        self.ctx.bind_to_thread().map_err(cuda)?;
        let mut bytes = 0usize;
        let mut err = [0 as std::ffi::c_char; 512];
        // SAFETY: the library's `lrmoe_cudnn_bwd_workspace` with the
        // declared C signature; `bytes` and `err` are live for the call,
        // `err` of the length passed.
        let rc = unsafe {
            (c.workspace)(
                a,
                b,
                cc,
                d,
                e,
                &mut bytes,
                err.as_mut_ptr(),
                err.len() as i32,
            )
        };
        if rc != 0 {
            return Err(KernelError::Cuda(c_message(&err)));
        }
        Ok(bytes)
    }

    /// [`AttnDq::Cudnn`]: the backward through `lrmoe_cudnn_bwd` (the
    /// buffers' lengths checked by [`Gpu::flash_attention_backward_with`]).
    #[allow(clippy::type_complexity)]
    fn cudnn_attention_backward(
        &self,
        dims: crate::dense::AttnDims,
        qkv: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        saved: (&CudaSlice<u16>, &CudaSlice<f32>),
        dout: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let ws_bytes = self.cudnn_attention_workspace(dims)?;
        let c = self.cudnn()?;
        let (n_seq, seq, heads, kv, dh) = dims;
        let (a, b, cc, d, e) = (n_seq as i32, heads as i32, kv as i32, seq as i32, dh as i32);
        let mut err = [0 as std::ffi::c_char; 512];
        let (rc, grads) =
            self.library_attention_backward(dims, qkv, saved, dout, ws_bytes, |p| {
                // SAFETY: 1. the library's `lrmoe_cudnn_bwd` with the declared
                // C signature; 2. every pointer is a live device allocation of
                // the length checked by the caller, the workspace the size the
                // library asked for; 3. the stream belongs to the current
                // context; `err` is live, of the length passed.
                unsafe {
                    (c.backward)(
                        a,
                        b,
                        cc,
                        d,
                        e,
                        p.q,
                        p.k,
                        p.v,
                        p.o,
                        p.lse2,
                        p.dout,
                        p.dq,
                        p.dk,
                        p.dv,
                        p.ws,
                        ws_bytes,
                        p.stream,
                        err.as_mut_ptr(),
                        err.len() as i32,
                    )
                }
            })?;
        if rc != 0 {
            return Err(KernelError::Cuda(c_message(&err)));
        }
        Ok(grads)
    }
}

/// The device pointers an attention backward library reads and writes
/// ([`Gpu::library_attention_backward`]).
struct AttnBwdPtrs {
    q: *const std::ffi::c_void,
    k: *const std::ffi::c_void,
    v: *const std::ffi::c_void,
    o: *const std::ffi::c_void,
    lse2: *const f32,
    dout: *const std::ffi::c_void,
    dq: *mut std::ffi::c_void,
    dk: *mut std::ffi::c_void,
    dv: *mut std::ffi::c_void,
    ws: *mut std::ffi::c_void,
    stream: *mut std::ffi::c_void,
}

/// The NUL-terminated message a library wrote into `err`.
fn c_message(err: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = err
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8_lossy(&bytes).into_owned();
    if s.is_empty() {
        "cuDNN attention failed without a message".into()
    } else {
        s
    }
}
