//! Device-buffer operations of the MoE layer's executors (the `layer`
//! crate's device executor composes them): routing, grouping by expert,
//! row gathers, the experts' grouped GEMM chains, combine, the router's
//! backward, LRM scores from norms, selection. bf16 activations and
//! weights, f32 accumulation; router probabilities in f32. Each has a CPU
//! twin in [`crate::cpu`] or [`crate::grouped`] and a device test.
//!
//! Operations that read through device index buffers are `unsafe fn`: the
//! kernels cannot check that an index lies inside its source, so the
//! caller promises it (the layer builds every index from `pack`'s layouts
//! or from this module's own outputs, whose ranges are stated here).
//! Operations on lengths alone check them and are safe.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};

use super::{at_least, cuda, dim, Gpu};
use crate::cpu::GemmVariant;
use crate::KernelError;

use crate::limits::DROPPED;

/// One call's routing on the device ([`Gpu::route`]).
pub struct Routed {
    /// Router probabilities, `tokens × experts` (f32).
    pub probs: CudaSlice<f32>,
    /// Expert of each pair, `tokens · top_k` (each below `experts`).
    pub idx: CudaSlice<u32>,
    /// Routing weight of each pair (f32).
    pub gates: CudaSlice<f32>,
    /// Routed pairs per expert (host).
    pub counts: Vec<u32>,
    /// Tokens routed.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Whether the top-k weights were renormalised.
    pub renormalize: bool,
}

/// What [`Gpu::experts_backward_data`] keeps for
/// [`Gpu::experts_backward_weights`]: the group offsets on the device and,
/// when rows were kept, `h`, `da`, `db` (`rows × F` each).
pub struct ExpertsBackward {
    od: CudaSlice<i32>,
    e: usize,
    rows: usize,
    dims: (usize, usize),
    hidden: Option<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>)>,
}

/// Where the experts' backward takes the projections `a = x·W_gate`,
/// `b = x·W_up` of its rows from.
#[derive(Clone, Copy)]
enum Projections<'a> {
    /// Recomputed from the rows' inputs `x`.
    From(&'a CudaSlice<u16>),
    /// Kept from the forward.
    Kept(&'a CudaSlice<u16>, &'a CudaSlice<u16>),
}

/// A device buffer another library owns (a PyTorch tensor), seen as a
/// `CudaSlice` for the length of one call ([`Gpu::borrow`]). Dropping it
/// leaves the memory to its owner: nothing is freed.
pub struct Borrowed<T>(std::mem::ManuallyDrop<CudaSlice<T>>);

impl<T> std::ops::Deref for Borrowed<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}

impl<T> Borrowed<T> {
    /// The buffer as a plain `CudaSlice`, for a container whose fields are
    /// `CudaSlice`s (`layer::device::BorrowedWeights`): the caller must
    /// hand it back with `CudaSlice::leak`, never drop it (that would free
    /// its owner's memory).
    pub fn into_inner(self) -> CudaSlice<T> {
        let mut me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the slice is taken once.
        unsafe { std::mem::ManuallyDrop::take(&mut me.0) }
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the slice is gone with `self`.
        let s = unsafe { std::mem::ManuallyDrop::take(&mut self.0) };
        // Hands the address back without freeing it (its owner frees it).
        let _ = s.leak();
    }
}

impl Gpu {
    /// `len` elements at device address `ptr`, owned by another library
    /// (a PyTorch tensor's storage), as a buffer the operations here take;
    /// dropping it frees nothing. Work on it is queued on this GPU's
    /// stream: order the owner's stream with [`Gpu::wait_for_stream`] and
    /// [`Gpu::stream_waits`].
    ///
    /// # Safety
    ///
    /// `ptr` is a live allocation of this device's context holding at least
    /// `len` elements of `T`, and it stays alive, and is not written by
    /// anyone else, while the returned buffer or work queued on it is in
    /// use. (A null `ptr` is refused here.)
    pub unsafe fn borrow<T: cudarc::driver::DeviceRepr>(
        &self,
        ptr: u64,
        len: usize,
    ) -> Result<Borrowed<T>, KernelError> {
        if ptr == 0 {
            return Err(KernelError::Cuda(format!(
                "a borrowed buffer of {len} elements at the null device address"
            )));
        }
        // SAFETY: the caller's contract; `Borrowed` never frees it.
        let s = unsafe { self.stream.upgrade_device_ptr(ptr, len) };
        Ok(Borrowed(std::mem::ManuallyDrop::new(s)))
    }

    /// `stream` (a raw `CUstream` of this device's context) as a stream
    /// wrapper, or `None` when it is this GPU's own stream.
    ///
    /// # Safety
    ///
    /// `stream` is a live CUDA stream of this device's primary context,
    /// alive while the wrapper is.
    unsafe fn other_stream(
        &self,
        stream: u64,
    ) -> Option<std::sync::Arc<cudarc::driver::CudaStream>> {
        if stream as usize == self.stream.cu_stream() as usize {
            return None;
        }
        // SAFETY: the caller's contract; the wrapper does not own it.
        Some(unsafe {
            self.ctx
                .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
        })
    }

    /// Orders this GPU's stream after the work queued so far on `stream`
    /// (a raw `CUstream` of this device's context; 0 is the legacy default
    /// stream), without the host waiting. A no-op when it is this GPU's own
    /// stream.
    ///
    /// # Safety
    ///
    /// `stream` is a live CUDA stream of this device's primary context.
    pub unsafe fn wait_for_stream(&self, stream: u64) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        match unsafe { self.other_stream(stream) } {
            Some(other) => self.stream.join(&other).map_err(cuda),
            None => Ok(()),
        }
    }

    /// Orders `stream` (as in [`Gpu::wait_for_stream`]) after the work
    /// queued so far on this GPU's stream, without the host waiting.
    ///
    /// # Safety
    ///
    /// As [`Gpu::wait_for_stream`].
    pub unsafe fn stream_waits(&self, stream: u64) -> Result<(), KernelError> {
        // SAFETY: the caller's contract.
        match unsafe { self.other_stream(stream) } {
            Some(other) => other.join(&self.stream).map_err(cuda),
            None => Ok(()),
        }
    }
}

impl Gpu {
    /// The compute stream every operation here runs on (the collectives
    /// order their own stream against it).
    #[cfg(feature = "nccl")]
    pub(crate) fn compute_stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        &self.stream
    }

    /// Waits until the compute stream has finished its work.
    pub fn sync(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(cuda)
    }

    /// Device memory in use on this device (bytes, `cuMemGetInfo`; call
    /// [`Gpu::trim_pool`] first to count live buffers only).
    pub fn used_bytes(&self) -> Result<u64, KernelError> {
        self.ctx.bind_to_thread().map_err(cuda)?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(cuda)?;
        Ok((total - free) as u64)
    }

    /// A zero-filled device buffer of `max(n, 1)` elements.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(cuda)
    }

    /// A copy of a whole device buffer, on the compute stream.
    pub fn duplicate<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.clone_dtod(src).map_err(cuda)
    }

    /// Copies `src` into `dst` (equal lengths) on the compute stream.
    pub fn copy<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut cudarc::driver::CudaViewMut<'_, T>,
    ) -> Result<(), KernelError> {
        if src.len() != dst.len() {
            return Err(KernelError::Shape {
                what: "copy destination",
                expected: src.len(),
                got: dst.len(),
            });
        }
        self.stream.memcpy_dtod(src, dst).map_err(cuda)
    }

    /// The device ordinal this GPU's context belongs to.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name as the driver gives it ("NVIDIA H200", …).
    pub fn device_name(&self) -> Result<String, KernelError> {
        self.ctx.name().map_err(cuda)
    }

    /// The device address of element `off` of `buf`, for an exchange
    /// between ranks of one process that share this device's context
    /// (`layer`'s in-process ranks): the peer copies from it with
    /// [`Gpu::copy_from_address`] while the owner keeps `buf` alive and
    /// unwritten.
    pub fn address<T: cudarc::driver::DeviceRepr>(
        &self,
        buf: &CudaSlice<T>,
        off: usize,
    ) -> Result<u64, KernelError> {
        at_least("address offset", off, buf.len())?;
        let (p, _g) = buf.device_ptr(&self.stream);
        Ok(p + (off * std::mem::size_of::<T>()) as u64)
    }

    /// Copies `n` elements from device address `src` into `dst` from
    /// element `off`, on the compute stream.
    ///
    /// # Safety
    ///
    /// `src` must address at least `n` elements of `T` in a live allocation
    /// of this device's context that nobody writes until the copy is done
    /// (the caller waits for the compute stream before the owner may).
    pub unsafe fn copy_from_address<T: cudarc::driver::DeviceRepr>(
        &self,
        src: u64,
        dst: &mut CudaSlice<T>,
        off: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        use cudarc::driver::DevicePtrMut;
        at_least("copy destination", off + n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let bytes = n * std::mem::size_of::<T>();
        let (d, _g) = dst.device_ptr_mut(&self.stream);
        let d = d + (off * std::mem::size_of::<T>()) as u64;
        // SAFETY: `dst` holds `off + n` elements (checked); the caller
        // promises `src` holds `n` and stays unwritten until the stream
        // reaches the copy.
        unsafe { cudarc::driver::result::memcpy_dtod_async(d, src, bytes, self.stream.cu_stream()) }
            .map_err(cuda)
    }

    /// `n` elements of `src` from element `off`, on the host (waits for the
    /// compute stream).
    pub fn download_range<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        off: usize,
        n: usize,
    ) -> Result<Vec<T>, KernelError> {
        at_least("download range", off + n, src.len())?;
        let mut host = vec![T::default(); n];
        if n > 0 {
            self.stream
                .memcpy_dtoh(&src.slice(off..off + n), &mut host)
                .map_err(cuda)?;
            self.sync()?;
        }
        Ok(host)
    }

    /// Writes `host` into `dst` from element `off`, on the compute stream.
    pub fn upload_range<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaSlice<T>,
        off: usize,
    ) -> Result<(), KernelError> {
        at_least("upload range", off + host.len(), dst.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(off..off + host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(cuda)
    }

    /// bf16 bits to f32, `n` values (twin: [`crate::cpu::bf16_bits_to_f32`]).
    pub fn to_f32_dev(&self, x: &CudaSlice<u16>, n: usize) -> Result<CudaSlice<f32>, KernelError> {
        at_least("values", n, x.len())?;
        // SAFETY: uninitialised output; the conversion below writes it all.
        let mut out = unsafe { self.uninit::<f32>(n) }?;
        if n > 0 {
            let n_i = n as i64;
            let mut l = self.stream.launch_builder(&self.f_to_f32);
            l.arg(x).arg(&mut out).arg(&n_i);
            // SAFETY: (u16*, f32*, long long); both hold n.
            unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// `a + b` of two bf16 views of equal length, into a new buffer.
    pub fn add_views(
        &self,
        a: &CudaView<'_, u16>,
        b: &CudaView<'_, u16>,
    ) -> Result<CudaSlice<u16>, KernelError> {
        let n = a.len();
        at_least("b", n, b.len())?;
        // SAFETY: the kernel writes all n elements.
        let mut out = unsafe { self.uninit::<u16>(n) }?;
        let n_i = n as i64;
        let mut l = self.stream.launch_builder(&self.f_add);
        l.arg(a).arg(b).arg(&mut out).arg(&n_i);
        // SAFETY: (u16*, u16*, u16*, long long); a, b and out hold n; out
        // aliases neither input.
        unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm<A: DevicePtr<u16>, B: DevicePtr<u16>>(
        &self,
        variant: GemmVariant,
        offsets: &CudaSlice<i32>,
        groups: usize,
        a: &A,
        b: &B,
        out_len: usize,
        h: usize,
        f: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        // SAFETY: uninitialised output (one element when there are no
        // rows: nothing to compute); the GEMM writes every element.
        let d = unsafe { self.uninit::<u16>(out_len) }?;
        self.gemm_into(variant, offsets, groups, (a, b), d, false, out_len, (h, f))
    }

    /// [`Gpu::gemm`] added onto `d` (which holds the base, `out_len`
    /// elements): `d + A·B`, summed in f32 in the epilogue and rounded once.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_onto<A: DevicePtr<u16>, B: DevicePtr<u16>>(
        &self,
        variant: GemmVariant,
        offsets: &CudaSlice<i32>,
        groups: usize,
        a: &A,
        b: &B,
        d: CudaSlice<u16>,
        out_len: usize,
        h: usize,
        f: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        self.gemm_into(variant, offsets, groups, (a, b), d, true, out_len, (h, f))
    }

    /// The grouped GEMM into `d` (`out_len` elements; its base when
    /// `onto`); no launch when there is no output.
    #[allow(clippy::too_many_arguments)]
    fn gemm_into<A: DevicePtr<u16>, B: DevicePtr<u16>>(
        &self,
        variant: GemmVariant,
        offsets: &CudaSlice<i32>,
        groups: usize,
        (a, b): (&A, &B),
        mut d: CudaSlice<u16>,
        onto: bool,
        out_len: usize,
        (h, f): (usize, usize),
    ) -> Result<CudaSlice<u16>, KernelError> {
        if out_len == 0 {
            // No rows (forward and data gradient): nothing to compute.
            return Ok(d);
        }
        at_least("output", out_len, d.len())?;
        let mut ws = self.gemm_workspace(variant, groups)?;
        self.launch_gemm(variant, groups, offsets, a, b, &mut d, onto, h, f, &mut ws)?;
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
    pub unsafe fn uninit<T: cudarc::driver::DeviceRepr>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        // SAFETY: the caller promises (1): no read before a full write.
        let mut out = unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(cuda)?;
        if self.poison.load(std::sync::atomic::Ordering::Relaxed) {
            self.fill_ff(&mut out)?;
        }
        Ok(out)
    }

    /// Every byte of `out` set to 0xFF (NaN for floats), on the stream.
    pub(super) fn fill_ff<T: cudarc::driver::DeviceRepr>(
        &self,
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        use cudarc::driver::DevicePtrMut;
        let bytes = out.num_bytes();
        let (ptr, _sync) = out.device_ptr_mut(&self.stream);
        // SAFETY: a byte fill of the whole buffer, on its stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, self.stream.cu_stream())
        }
        .map_err(cuda)
    }

    /// `n` copies of `value`, filled on the device.
    pub fn filled(&self, value: u32, n: usize) -> Result<CudaSlice<u32>, KernelError> {
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

    /// `‖row‖²` of `n` bf16 rows of width `d` (twin: a sum of squares
    /// per row).
    pub fn row_sq(
        &self,
        x: &CudaSlice<u16>,
        n: usize,
        d: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        at_least("rows", n * d, x.len())?;
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

    /// Stable grouping of `n` rows by key (expert): block `b` writes the
    /// rows whose key is `b` (and whose `keep` flag is set, when given), in
    /// row order, at `base[b]..`; returns `(dst, src)`: `dst[row]` its
    /// grouped position or `DROPPED`, `src[pos]` the row at `pos` (`out`
    /// entries). `seg` (the input's own group offsets, `groups + 1`) lets
    /// each block scan only its key's segment when the input is grouped.
    ///
    /// # Safety
    ///
    /// 1. `expert` (and `keep`) hold `n` entries, `base` one per group;
    /// 2. the selected rows with key `b` number exactly
    ///    `base[b + 1] - base[b]` (`out - base[b]` for the last), so writes
    ///    stay inside `src`;
    /// 3. `seg`, when given, partitions `0..n` by key.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn group(
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

    /// `out[j] = src[pair[j] / div] · scale[pair[j]]` for `n_out` rows of
    /// `width` bf16 (no scale: a plain row gather).
    ///
    /// # Safety
    ///
    /// 1. `pair` holds `n_out` entries; every `pair[j] / div` is a row of
    ///    `src` (rows of `width`) and every `pair[j]` an entry of `scale`.
    pub unsafe fn gather_scaled(
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

    /// `out[j] = src[idx[j]]` for any 4-byte element (u32 indices, f32
    /// gates), `n` entries; a `DROPPED` index yields `DROPPED`.
    ///
    /// # Safety
    ///
    /// 1. `idx` holds `n` entries, each an index of `src` or `DROPPED`.
    pub unsafe fn gather32<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
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

    /// `a + b` of `n` bf16 values (f32 sum, rounded once).
    pub fn add(
        &self,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        n: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        at_least("a", n, a.len())?;
        at_least("b", n, b.len())?;
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

    /// `y[t] = base[t] + Σ_k gate[t·K + k] · o[row[t·K + k]]` over
    /// `tokens` tokens (rows of `hidden` bf16; no gates: a plain sum; no
    /// base: zero; `DROPPED` rows add nothing), summed in f32 and rounded
    /// once. Twin: [`crate::cpu::combine_onto_bf16_reference`].
    ///
    /// # Safety
    ///
    /// 1. `row` (and `gates`) hold `tokens · top_k` entries; every row is a
    ///    row of `o` or `DROPPED`.
    pub unsafe fn combine_rows(
        &self,
        o: &CudaSlice<u16>,
        row: &CudaSlice<u32>,
        gates: Option<&CudaSlice<f32>>,
        base: Option<&CudaSlice<u16>>,
        (tokens, hidden, top_k): (usize, usize, usize),
    ) -> Result<CudaSlice<u16>, KernelError> {
        if let Some(b) = base {
            at_least("base", tokens * hidden, b.len())?;
        }
        // SAFETY: uninitialised output; the kernel or GEMM launched next
        // writes every element before anything reads it.
        let mut y = unsafe { self.uninit::<u16>(tokens * hidden) }?;
        let (t, h, k) = (
            dim("tokens", tokens)?,
            dim("hidden", hidden)?,
            dim("top_k", top_k)?,
        );
        let null: u64 = 0;
        let mut l = self.stream.launch_builder(&self.combine);
        l.arg(o).arg(row);
        match gates {
            Some(g) => l.arg(g),
            None => l.arg(&null),
        };
        match base {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(&mut y).arg(&t).arg(&h).arg(&k);
        // SAFETY: as in `combine_bf16`; row entries index o or are DROPPED.
        unsafe { l.launch(self.rows_config(tokens)) }.map_err(cuda)?;
        Ok(y)
    }

    /// Column means of a `t × e` f32 matrix on the device, `e` values
    /// (twin: a mean per column in row order; the router's mean
    /// probability per expert for the auxiliary balancing loss).
    pub fn col_mean(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        e: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        at_least("matrix", t * e, x.len())?;
        // SAFETY: uninitialised output; the kernel writes all e entries.
        let mut out = unsafe { self.uninit::<f32>(e) }?;
        if e > 0 {
            let (t_i, e_i) = (dim("rows", t)?, dim("columns", e)?);
            let mut l = self.stream.launch_builder(&self.f_col_mean);
            l.arg(x).arg(&mut out).arg(&t_i).arg(&e_i);
            // SAFETY: (f32*, f32*, int, int); x holds t·e, out e.
            unsafe { l.launch(self.elementwise_config(e)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// Column sums of a `g × n` bf16 matrix in f32, rows added in order
    /// (twin: [`crate::cpu::col_sum_bf16_reference`]).
    pub fn col_sum_bf16(
        &self,
        x: &CudaSlice<u16>,
        g: usize,
        n: usize,
    ) -> Result<CudaSlice<f32>, KernelError> {
        at_least("matrix", g * n, x.len())?;
        // SAFETY: uninitialised output; the kernel writes all n entries.
        let mut out = unsafe { self.uninit::<f32>(n) }?;
        if n > 0 {
            let (g_i, n_i) = (dim("rows", g)?, dim("columns", n)?);
            let mut l = self.stream.launch_builder(&self.f_col_sum);
            l.arg(x).arg(&mut out).arg(&g_i).arg(&n_i);
            // SAFETY: (u16*, f32*, int, int); x holds g·n, out n.
            unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
        }
        Ok(out)
    }

    /// Routing of `x` (`tokens × hidden`) with the router `W_r` (`hidden ×
    /// experts`): logits `x · W_r` (a one-group GEMM) plus `bias[e]` when
    /// given, softmax, top-k by probability plus `sel_bias[e]` when given
    /// (the choice only: gates are the unbiased probabilities), gates
    /// renormalised if asked. The counts' download
    /// is the forward's one host synchronisation. Twins:
    /// [`crate::cpu::router_topk_reference`], `logits_bias_reference`.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        bias: Option<&CudaSlice<f32>>,
        sel_bias: Option<&CudaSlice<f32>>,
        (t, h, e, k): (usize, usize, usize, usize),
        renormalize: bool,
    ) -> Result<Routed, KernelError> {
        let p = t * k;
        at_least("x", t * h, x.len())?;
        at_least("router", h * e, router.len())?;
        if let Some(b) = bias {
            at_least("bias", e, b.len())?;
        }
        if k == 0 || k > crate::limits::MAX_TOP_K || k > e || e == 0 {
            return Err(KernelError::Shape {
                what: "top_k (1..=MAX_TOP_K and at most experts)",
                expected: crate::limits::MAX_TOP_K.min(e),
                got: k,
            });
        }
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
        if t > 0 {
            self.launch_router_topk(
                &lf,
                sel_bias,
                (&mut probs, &mut idx, &mut gates),
                t,
                e,
                k,
                renormalize,
            )?;
        }
        // Counts (the call's one host sync), offsets, stable grouping.
        // SAFETY: idx holds p = t · k expert ids.
        let counts_d = unsafe { self.key_counts(&idx, None, p, e) }?;
        let counts = self.download(&counts_d, e)?;
        Ok(Routed {
            probs,
            idx,
            gates,
            counts,
            tokens: t,
            experts: e,
            top_k: k,
            renormalize,
        })
    }

    /// The complete router gradient of a [`Routed`] call from every pair's
    /// forward output `o` (`row`: pair → row of `o`) and the output
    /// gradient `dy`: returns `(dW_r hidden × E in f32, dX_router tokens ×
    /// hidden)`. Twin: the host layer's router backward.
    ///
    /// # Safety
    ///
    /// 1. `row` holds one entry per pair of `r`, each a row of `o`
    ///    (`hidden` wide).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn router_backward(
        &self,
        r: &Routed,
        aux_dp: Option<&CudaSlice<f32>>,
        router: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        dy: &CudaSlice<u16>,
        o: &CudaSlice<u16>,
        row: &CudaSlice<u32>,
        h: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<u16>), KernelError> {
        let (t, e, k) = (r.tokens, r.experts, r.top_k);
        at_least("x", t * h, x.len())?;
        at_least("dy", t * h, dy.len())?;
        at_least("router", h * e, router.len())?;
        at_least("row", t * k, row.len())?;
        if let Some(a) = aux_dp {
            at_least("aux_dp (one per expert)", e, a.len())?;
        }
        let (probs, idx, gates, dst) = (&r.probs, &r.idx, &r.gates, row);
        let null = 0u64;
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
                i32::from(r.renormalize),
            );
            let mut l = self.stream.launch_builder(&self.f_router_bwd);
            l.arg(dy).arg(o).arg(dst).arg(probs).arg(idx).arg(gates);
            match aux_dp {
                Some(a) => l.arg(a),
                None => l.arg(&null),
            };
            l.arg(&mut dlogits);
            l.arg(&t_i).arg(&h_i).arg(&e_i).arg(&k_i).arg(&r_i);
            // SAFETY: (u16*, u16*, u32*, f32*, u32*, f32*, const f32* or
            // null, u16*, int×5) matches; dst maps every pair to a row of o;
            // aux_dp holds e (checked); k ≤ 32 (checked).
            unsafe { l.launch(self.rows_config(t)) }.map_err(cuda)?;
        }
        // The weight gradient `xᵀ·dlogits` reduces over all t tokens into
        // only h·e outputs (16 tiles at the Qwen3 shape): split the tokens
        // into groups so the GEMM fills the chip, then sum the groups'
        // bf16 partials in f32 (0.18 → 0.07 ms at 16384 × 2048 × 128).
        let groups = TOKEN_GROUPS.min(t.max(1));
        let split: Vec<i32> = (0..=groups)
            .map(|g| dim("tokens", g * t / groups))
            .collect::<Result<_, _>>()?;
        let split = self.upload(&split)?;
        let parts = self.gemm(
            GemmVariant::WeightGrad,
            &split,
            groups,
            x,
            &dlogits,
            groups * h * e,
            h,
            e,
        )?;
        let g_router = self.col_sum_bf16(&parts, groups, h * e)?;
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
}

/// Token groups the router weight gradient's GEMM is split into.
const TOKEN_GROUPS: usize = 8;

/// Each of the stacked gate, up and down weights holds `n` elements.
fn check_expert_weights(
    (wg, wu, wd): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
    n: usize,
) -> Result<(), KernelError> {
    for w in [wg, wu, wd] {
        at_least("expert weights", n, w.len())?;
    }
    Ok(())
}

/// Checks group offsets for `groups` groups of `rows` rows and uploads
/// them as the grouped GEMM takes them (i32).
fn checked_offsets(gpu: &Gpu, offsets: &[u32], rows: usize) -> Result<CudaSlice<i32>, KernelError> {
    let ok = offsets.first() == Some(&0)
        && offsets.windows(2).all(|w| w[0] <= w[1])
        && offsets.last().map(|&v| v as usize) == Some(rows)
        && rows <= i32::MAX as usize;
    if !ok {
        return Err(KernelError::Shape {
            what: "group offsets (from 0, ascending, ending at the row count)",
            expected: rows,
            got: offsets.last().copied().unwrap_or(0) as usize,
        });
    }
    gpu.upload(&offsets.iter().map(|&v| v as i32).collect::<Vec<_>>())
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
    fn experts_hidden<X: DevicePtr<u16>>(
        &self,
        od: &CudaSlice<i32>,
        e: usize,
        rows: usize,
        xd: &X,
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

    /// `dh = d·W_downᵀ`, then the SwiGLU backward: `(da, db)` of the rows
    /// whose projections are `a`, `b` (`rows × F` each).
    #[allow(clippy::too_many_arguments)]
    fn swiglu_grads(
        &self,
        od: &CudaSlice<i32>,
        e: usize,
        rows: usize,
        (a, b): (&CudaSlice<u16>, &CudaSlice<u16>),
        dd: &CudaSlice<u16>,
        wd: &CudaSlice<u16>,
        (h, f): (usize, usize),
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let dh = self.gemm(GemmVariant::DataGrad, od, e, dd, wd, rows * f, f, h)?;
        // SAFETY: uninitialised output; the kernel launched next writes
        // every element before anything reads it.
        let mut da = unsafe { self.uninit::<u16>(rows * f) }?;
        // SAFETY: as for `da`.
        let mut db = unsafe { self.uninit::<u16>(rows * f) }?;
        let n = (rows * f) as i64;
        let mut l = self.stream.launch_builder(&self.swiglu_bwd);
        l.arg(a).arg(b).arg(&dh).arg(&mut da).arg(&mut db).arg(&n);
        // SAFETY: as in `swiglu_backward_bf16`; a, b, dh, da, db hold rows·F.
        unsafe { l.launch(self.elementwise_config(rows * f)) }.map_err(cuda)?;
        Ok((da, db))
    }

    /// The experts' forward on rows grouped by `offsets` (`E + 1` entries,
    /// host): `o = (silu(x·W_gate) ⊙ x·W_up) · W_down` and `‖h‖²` of every
    /// row (device; twin: [`Gpu::experts_forward_bf16`]'s
    /// [`crate::grouped::compose_forward`]).
    #[allow(clippy::type_complexity)]
    pub fn experts_forward_dev<X: DevicePtr<u16>>(
        &self,
        offsets: &[u32],
        x: &X,
        w: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        dims: (usize, usize),
    ) -> Result<(CudaSlice<u16>, CudaSlice<f32>), KernelError> {
        let (o, h_sq, _) = self.experts_forward_any(offsets, x, w, dims, false)?;
        Ok((o, h_sq))
    }

    /// [`Gpu::experts_forward_dev`] that also returns the projections
    /// `a = x·W_gate` and `b = x·W_up` (`rows × F` each), for a backward
    /// that reads them instead of recomputing them
    /// ([`Gpu::experts_backward_data_from`]).
    #[allow(clippy::type_complexity)]
    pub fn experts_forward_keep<X: DevicePtr<u16>>(
        &self,
        offsets: &[u32],
        x: &X,
        w: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        dims: (usize, usize),
    ) -> Result<
        (
            CudaSlice<u16>,
            CudaSlice<f32>,
            (CudaSlice<u16>, CudaSlice<u16>),
        ),
        KernelError,
    > {
        let (o, h_sq, ab) = self.experts_forward_any(offsets, x, w, dims, true)?;
        let ab = match ab {
            Some(ab) => ab,
            // SAFETY: zero rows: nothing is read.
            None => unsafe { (self.uninit::<u16>(0)?, self.uninit::<u16>(0)?) },
        };
        Ok((o, h_sq, ab))
    }

    #[allow(clippy::type_complexity)]
    fn experts_forward_any<X: DevicePtr<u16>>(
        &self,
        offsets: &[u32],
        x: &X,
        (wg, wu, wd): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        (h, f): (usize, usize),
        keep: bool,
    ) -> Result<
        (
            CudaSlice<u16>,
            CudaSlice<f32>,
            Option<(CudaSlice<u16>, CudaSlice<u16>)>,
        ),
        KernelError,
    > {
        let rows = offsets.last().copied().unwrap_or(0) as usize;
        let e = offsets.len().saturating_sub(1);
        let od = checked_offsets(self, offsets, rows)?;
        at_least("x", rows * h, x.len())?;
        check_expert_weights((wg, wu, wd), e * h * f)?;
        if rows == 0 {
            // SAFETY: zero rows: nothing is read.
            return unsafe { Ok((self.uninit::<u16>(0)?, self.uninit::<f32>(0)?, None)) };
        }
        let (a, b, hh) = self.experts_hidden(&od, e, rows, x, wg, wu, h, f)?;
        // Unless kept, a and b are freed here (in stream order, after the
        // kernel that read them), before the down GEMM allocates `o`.
        let ab = keep.then_some((a, b));
        let o = self.gemm(GemmVariant::Forward, &od, e, &hh, wd, rows * h, f, h)?;
        let h_sq = self.row_sq(&hh, rows, f)?;
        Ok((o, h_sq, ab))
    }

    /// The experts' backward on kept rows grouped by `offsets` (`E + 1`
    /// entries, host; `x` the rows' inputs, `d` their output gradients):
    /// recomputes `a`, `b`, `h`, then `dW_down = hᵀ·d`, `dh = d·W_downᵀ`,
    /// the SwiGLU backward, `dW_gate`, `dW_up` and `dX = da·W_gateᵀ +
    /// db·W_upᵀ`; returns `(dX, dW_gate, dW_up, dW_down)` (twin:
    /// [`crate::grouped::compose_backward`]). The composition of
    /// [`Gpu::experts_backward_data`] and [`Gpu::experts_backward_weights`].
    #[allow(clippy::type_complexity)]
    pub fn experts_backward_dev(
        &self,
        offsets: &[u32],
        xd: &CudaSlice<u16>,
        dd: &CudaSlice<u16>,
        w: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        (h, f): (usize, usize),
    ) -> Result<
        (
            CudaSlice<u16>,
            CudaSlice<u16>,
            CudaSlice<u16>,
            CudaSlice<u16>,
        ),
        KernelError,
    > {
        let (dx, st) = self.experts_backward_data(offsets, xd, dd, w, (h, f))?;
        let (gg, gu, gd) = self.experts_backward_weights(st, xd, dd)?;
        Ok((dx, gg, gu, gd))
    }

    /// The data half of [`Gpu::experts_backward_dev`]: `dX` of the rows,
    /// enqueued before any weight gradient so that its exchange can run
    /// beside [`Gpu::experts_backward_weights`]; the state that needs is
    /// returned. Same arguments, same results bit for bit.
    pub fn experts_backward_data(
        &self,
        offsets: &[u32],
        xd: &CudaSlice<u16>,
        dd: &CudaSlice<u16>,
        w: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        dims: (usize, usize),
    ) -> Result<(CudaSlice<u16>, ExpertsBackward), KernelError> {
        self.experts_backward_data_any(offsets, Projections::From(xd), dd, w, dims)
    }

    /// [`Gpu::experts_backward_data`] on the projections `a = x·W_gate`,
    /// `b = x·W_up` of the same rows (`rows × F` each, as
    /// [`Gpu::experts_forward_keep`] returns them) instead of recomputing
    /// them from `x`: two grouped GEMMs fewer, the same result.
    pub fn experts_backward_data_from(
        &self,
        offsets: &[u32],
        ab: (&CudaSlice<u16>, &CudaSlice<u16>),
        dd: &CudaSlice<u16>,
        w: (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        dims: (usize, usize),
    ) -> Result<(CudaSlice<u16>, ExpertsBackward), KernelError> {
        self.experts_backward_data_any(offsets, Projections::Kept(ab.0, ab.1), dd, w, dims)
    }

    fn experts_backward_data_any(
        &self,
        offsets: &[u32],
        proj: Projections<'_>,
        dd: &CudaSlice<u16>,
        (wg, wu, wd): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        (h, f): (usize, usize),
    ) -> Result<(CudaSlice<u16>, ExpertsBackward), KernelError> {
        let rows = offsets.last().copied().unwrap_or(0) as usize;
        let e = offsets.len().saturating_sub(1);
        let od = checked_offsets(self, offsets, rows)?;
        match proj {
            Projections::Kept(a, b) => {
                at_least("a", rows * f, a.len())?;
                at_least("b", rows * f, b.len())?;
            }
            Projections::From(xd) => at_least("x", rows * h, xd.len())?,
        }
        at_least("d", rows * h, dd.len())?;
        check_expert_weights((wg, wu, wd), e * h * f)?;
        let (dx, hidden) = if rows == 0 {
            // No kept rows: no dX rows, zero weight gradients, no launch.
            // SAFETY: a dX of zero rows: nothing is read.
            (unsafe { self.uninit::<u16>(0) }?, None)
        } else {
            let (hh, da, db) = match proj {
                Projections::Kept(a, b) => {
                    let hh = self.swiglu_dev(a, b, rows * f)?;
                    let (da, db) = self.swiglu_grads(&od, e, rows, (a, b), dd, wd, (h, f))?;
                    (hh, da, db)
                }
                Projections::From(xd) => {
                    let (a, b, hh) = self.experts_hidden(&od, e, rows, xd, wg, wu, h, f)?;
                    let (da, db) = self.swiglu_grads(&od, e, rows, (&a, &b), dd, wd, (h, f))?;
                    // a and b are read for the last time above: freed now
                    // (in stream order, after that kernel), they never
                    // share the pool with dX. The peak per row is then x,
                    // d and the six `f`-wide rows of that kernel, not those
                    // and dX as well.
                    drop((a, b));
                    (hh, da, db)
                }
            };
            // dX = da·W_gateᵀ, then db·W_upᵀ added onto it in the second
            // GEMM's epilogue (no separate pass over the rows).
            let dx1 = self.gemm(GemmVariant::DataGrad, &od, e, &da, wg, rows * h, h, f)?;
            let dx = self.gemm_onto(GemmVariant::DataGrad, &od, e, &db, wu, dx1, rows * h, h, f)?;
            (dx, Some((hh, da, db)))
        };
        Ok((
            dx,
            ExpertsBackward {
                od,
                e,
                rows,
                dims: (h, f),
                hidden,
            },
        ))
    }

    /// The weight half of [`Gpu::experts_backward_dev`]: `(dW_gate,
    /// dW_up, dW_down)` from the data half's state and the same `x` and `d`
    /// rows (zeros when no row was kept).
    #[allow(clippy::type_complexity)]
    pub fn experts_backward_weights(
        &self,
        st: ExpertsBackward,
        xd: &CudaSlice<u16>,
        dd: &CudaSlice<u16>,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>), KernelError> {
        let ExpertsBackward {
            od,
            e,
            rows,
            dims: (h, f),
            hidden,
        } = st;
        let ew = e * h * f;
        at_least("x", rows * h, xd.len())?;
        at_least("d", rows * h, dd.len())?;
        let Some((hh, da, db)) = hidden else {
            let z = || self.stream.alloc_zeros::<u16>(ew.max(1)).map_err(cuda);
            return Ok((z()?, z()?, z()?));
        };
        // Each input freed (in stream order) once its last GEMM is queued,
        // so each gradient's output replaces an input of `f`-wide rows.
        let g_down = self.gemm(GemmVariant::WeightGrad, &od, e, &hh, dd, ew, f, h)?;
        drop(hh);
        let g_gate = self.gemm(GemmVariant::WeightGrad, &od, e, xd, &da, ew, h, f)?;
        drop(da);
        let g_up = self.gemm(GemmVariant::WeightGrad, &od, e, xd, &db, ew, h, f)?;
        Ok((g_gate, g_up, g_down))
    }

    /// LRM scores from norms: `score[j] = g[p]² · dy_sq[p / k] · h_sq[j]`
    /// with `p = src[j]`, for `n` rows (twin: [`lrm_score`]'s
    /// `g²·‖δ‖²·‖h‖²` on the rows themselves).
    ///
    /// # Safety
    ///
    /// 1. `src` and `h_sq` hold `n` entries; every `src[j]` is an entry of
    ///    `gates` and `src[j] / k` an entry of `dy_sq`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scores_from_norms(
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
        let (_, rows) = Self::experts_check(offsets, x, gate, up, down, h, f)?;
        if rows == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let xd = self.upload(x)?;
        let (wg, wu, wd) = (self.upload(gate)?, self.upload(up)?, self.upload(down)?);
        let (o, h_sq) =
            self.experts_forward_dev(&host_offsets(offsets), &xd, (&wg, &wu, &wd), (h, f))?;
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
        let (xd, dd) = (self.upload(x)?, self.upload(d)?);
        let (wg, wu, wd) = (self.upload(gate)?, self.upload(up)?, self.upload(down)?);
        let (dx, g_gate, g_up, g_down) =
            self.experts_backward_dev(&host_offsets(offsets), &xd, &dd, (&wg, &wu, &wd), (h, f))?;
        Ok((
            self.download(&dx, rows * h)?,
            self.download(&g_gate, ew)?,
            self.download(&g_up, ew)?,
            self.download(&g_down, ew)?,
        ))
    }
}

/// Offsets already checked by `gemm_shapes` (non-negative) as u32.
fn host_offsets(offsets: &[i32]) -> Vec<u32> {
    offsets.iter().map(|&v| v.max(0) as u32).collect()
}
