//! The CUDA path of `lrmoe.torch.MoE` (feature `cuda`): the device
//! executor on one GPU (EP = 1) over PyTorch tensors, with no copy in or
//! out.
//!
//! * **In:** the tensors' device addresses are borrowed for the call
//!   (`kernels::gpu::Gpu::borrow`, `layer::device::borrow_weights`); the
//!   Python side (`lrmoe/torch.py`) hands only contiguous bf16 CUDA
//!   tensors of the checked shapes on this device, kept alive by autograd
//!   for the call.
//! * **Out:** every result buffer leaves as a DLPack capsule
//!   (`torch.from_dlpack`) that owns it; torch frees it through the
//!   capsule's deleter.
//! * **Streams:** the executor runs on this GPU's stream (the legacy
//!   default stream, torch's default current stream); when torch's
//!   current stream is another one, CUDA events order the call after
//!   torch's queued work and torch's later work after the call — the host
//!   never waits for that.
//! * **Memory:** the executor allocates from the device's stream-ordered
//!   pool (`cuMemAllocAsync`), the pool torch allocates from under
//!   `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`: there
//!   `torch.cuda.max_memory_allocated` counts the layer's buffers. Under
//!   torch's default caching allocator it does not. (The layer never
//!   resets the pool's high-water mark: that is torch's peak there.)

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use kernels::gpu::{CudaSlice, DeviceRepr, Gpu};
use layer::device::{DeviceComm, DeviceSaved};
use layer::{DevicePlanner, MoeConfig};
use lrmoe::train::MoeSection;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::value_error;

/// One opened GPU per device ordinal, shared by every layer of the process
/// (opening loads the kernels).
fn gpu(ordinal: usize) -> PyResult<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let mut map = GPUS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Arc::new(Gpu::open(ordinal).map_err(value_error)?);
    map.insert(ordinal, g.clone());
    Ok(g)
}

// DLPack (v0.8 `DLManagedTensor`), the exchange format `torch.from_dlpack`
// reads.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const KDL_CUDA: i32 = 2;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;

/// What a capsule's tensor owns: the buffer and its shape.
struct Held<T> {
    _buf: CudaSlice<T>,
    shape: Vec<i64>,
}

/// Frees a tensor made by [`capsule`] (called by its consumer, or by the
/// capsule when nobody consumed it).
unsafe extern "C" fn delete_tensor<T>(m: *mut DlManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were made by `capsule` with these types
    // and are freed once: DLPack calls the deleter once.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Held<T>>()));
    }
}

const DLTENSOR: &std::ffi::CStr = c"dltensor";

/// The capsule's destructor: frees the tensor unless a consumer took it
/// (a consumer renames the capsule `used_dltensor`).
unsafe extern "C" fn drop_capsule(cap: *mut pyo3::ffi::PyObject) {
    // SAFETY: a capsule made by `capsule`, named "dltensor" while unused.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) == 1 {
            let m =
                pyo3::ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()).cast::<DlManagedTensor>();
            if let Some(del) = (*m).deleter {
                del(m);
            }
        }
    }
}

/// `buf` as a DLPack capsule of a row-major tensor of `shape` (bf16 when
/// `bf16`, else f32) on device `ordinal`; the capsule owns it.
fn capsule<'py, T: DeviceRepr>(
    py: Python<'py>,
    g: &Gpu,
    buf: CudaSlice<T>,
    shape: &[usize],
    bf16: bool,
) -> PyResult<Bound<'py, PyCapsule>> {
    let n: usize = shape.iter().product();
    if buf.len() < n {
        return Err(value_error(format!(
            "internal: a result of {} values for shape {shape:?}",
            buf.len()
        )));
    }
    let data = g.address(&buf, 0).map_err(value_error)? as *mut c_void;
    let mut held = Box::new(Held {
        _buf: buf,
        shape: shape.iter().map(|&d| d as i64).collect(),
    });
    let m = Box::new(DlManagedTensor {
        dl_tensor: DlTensor {
            data,
            device: DlDevice {
                device_type: KDL_CUDA,
                device_id: g.ordinal() as i32,
            },
            ndim: shape.len() as i32,
            dtype: DlDataType {
                code: if bf16 { KDL_BFLOAT } else { KDL_FLOAT },
                bits: (std::mem::size_of::<T>() * 8) as u8,
                lanes: 1,
            },
            shape: held.shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete_tensor::<T>),
    });
    let m = Box::into_raw(m);
    // SAFETY: `m` is a fresh allocation; the held box moves into it.
    unsafe { (*m).manager_ctx = Box::into_raw(held).cast() };
    // SAFETY: a named capsule around `m`, whose destructor frees it
    // unless consumed.
    let cap = unsafe { pyo3::ffi::PyCapsule_New(m.cast(), DLTENSOR.as_ptr(), Some(drop_capsule)) };
    if cap.is_null() {
        // SAFETY: not handed out: free it here.
        unsafe { delete_tensor::<T>(m) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference just made.
    Ok(unsafe { Bound::from_owned_ptr(py, cap).cast_into_unchecked() })
}

/// The forward's device state, kept for the backward (opaque to Python).
#[pyclass(module = "lrmoe._lrmoe")]
pub struct DeviceSavedPy {
    inner: DeviceSaved,
    call: layer::CallConfig,
    tokens: usize,
}

#[pymethods]
impl DeviceSavedPy {
    /// Routed pairs per expert of this call.
    fn expert_load(&self) -> Vec<u64> {
        self.inner.expert_load()
    }

    /// The call's auxiliary load-balancing loss (0 when off).
    fn aux_loss(&self) -> f64 {
        self.inner.aux_loss
    }

    /// Tokens of the call.
    #[getter]
    fn tokens(&self) -> usize {
        self.tokens
    }
}

/// The MoE layer on one GPU (the device executor, EP = 1) over device
/// addresses of bf16 tensors.
#[pyclass(module = "lrmoe._lrmoe", frozen)]
pub struct DeviceLayer {
    cfg: MoeConfig,
    moe: MoeSection,
    seed: u64,
    gpu: Arc<Gpu>,
}

impl DeviceLayer {
    /// The weights at these addresses, borrowed for the call.
    fn weights(&self, w: (u64, u64, u64, u64)) -> PyResult<layer::device::BorrowedWeights> {
        // SAFETY: `lrmoe.torch` passes the addresses of contiguous bf16
        // CUDA tensors on this device of the layer's shapes (router
        // `H × E`, gate and up `E × H × F`, down `E × F × H`), held by
        // autograd for the call.
        unsafe {
            layer::device::borrow_weights(
                &self.gpu,
                DeviceComm::Local,
                &self.cfg,
                w.0,
                (w.1, w.2, w.3),
            )
        }
        .map_err(value_error)
    }

    /// Tokens `x`-address rows of the layer's width, borrowed.
    fn rows(&self, ptr: u64, tokens: usize) -> PyResult<kernels::gpu::Borrowed<u16>> {
        // SAFETY: as in `weights`: a contiguous bf16 CUDA tensor of
        // `tokens × hidden` values on this device, alive for the call.
        unsafe { self.gpu.borrow::<u16>(ptr, tokens * self.cfg.hidden) }.map_err(value_error)
    }

    /// Orders this call after torch's current stream `stream`.
    fn enter(&self, stream: u64) -> PyResult<()> {
        // SAFETY: `stream` is torch's current stream of this device.
        unsafe { self.gpu.wait_for_stream(stream) }.map_err(value_error)
    }

    /// Orders torch's current stream `stream` after this call.
    fn leave(&self, stream: u64) -> PyResult<()> {
        // SAFETY: as in `enter`.
        unsafe { self.gpu.stream_waits(stream) }.map_err(value_error)
    }
}

#[pymethods]
impl DeviceLayer {
    /// A layer of the given shape on CUDA device `device`; `settings` as
    /// for `Layer`.
    #[new]
    #[pyo3(signature = (hidden, ffn, n_experts, top_k, renormalize, settings = "{}", seed = 0, device = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        hidden: usize,
        ffn: usize,
        n_experts: usize,
        top_k: usize,
        renormalize: bool,
        settings: &str,
        seed: u64,
        device: usize,
    ) -> PyResult<Self> {
        let (cfg, moe) =
            crate::layer_setup((hidden, ffn, n_experts, top_k, renormalize), settings)?;
        layer::check_device_shape(&cfg).map_err(value_error)?;
        let probe = lrmoe::train::layer_call_config(
            &moe,
            (hidden, ffn),
            1.0,
            &one_rank(n_experts),
            true,
            seed,
        );
        layer::check_device_call(&probe).map_err(value_error)?;
        Ok(Self {
            cfg,
            moe,
            seed,
            gpu: gpu(device)?,
        })
    }

    /// The forward on `tokens` rows at `x`: the output (a DLPack capsule,
    /// bf16 `tokens × hidden`) and the state the backward needs.
    /// `weights` are the addresses of router, gate, up, down; `stream`
    /// torch's current stream; `expert_bias` the balancing bias.
    #[pyo3(signature = (weights, x, tokens, stream, expert_bias = None))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        weights: (u64, u64, u64, u64),
        x: u64,
        tokens: usize,
        stream: u64,
        expert_bias: Option<Vec<f64>>,
    ) -> PyResult<(Bound<'py, PyCapsule>, DeviceSavedPy)> {
        let placement = one_rank(self.cfg.n_experts);
        let pairs = (tokens * self.cfg.top_k) as f64;
        let shape = (self.cfg.hidden, self.cfg.ffn);
        let mut call =
            lrmoe::train::layer_call_config(&self.moe, shape, pairs, &placement, true, self.seed);
        if let Some(b) = expert_bias {
            call.expert_bias = b;
        }
        let mut w = self.weights(weights)?;
        if let Some(b) = call.logit_bias(self.cfg.n_experts).map_err(value_error)? {
            let b: Vec<f32> = b.iter().map(|&v| v as f32).collect();
            layer::device::set_logit_bias(&self.gpu, &self.cfg, &mut w, &b).map_err(value_error)?;
        }
        if let Some(b) = call
            .selection_bias(self.cfg.n_experts)
            .map_err(value_error)?
        {
            let b: Vec<f32> = b.iter().map(|&v| v as f32).collect();
            layer::device::set_selection_bias(&self.gpu, &self.cfg, &mut w, &b)
                .map_err(value_error)?;
        }
        let xs = self.rows(x, tokens)?;
        let planner = DevicePlanner::new(self.cfg, call.clone()).map_err(value_error)?;
        self.enter(stream)?;
        let mut sv =
            layer::device::forward(&self.gpu, DeviceComm::Local, &self.cfg, &w, &xs, &planner)
                .map_err(value_error)?;
        self.leave(stream)?;
        let y = std::mem::replace(&mut sv.y, self.gpu.zeros::<u16>(1).map_err(value_error)?);
        let y = capsule(py, &self.gpu, y, &[tokens, self.cfg.hidden], true)?;
        Ok((
            y,
            DeviceSavedPy {
                inner: sv,
                call,
                tokens,
            },
        ))
    }

    /// The LRMoE backward of `saved` for the output gradient at `dy`: the
    /// input gradient (bf16 `tokens × hidden`), the router's (f32
    /// `hidden × experts`) and the experts' (bf16, the weights' layouts)
    /// as DLPack capsules, and the call's statistics (JSON).
    fn backward<'py>(
        &self,
        py: Python<'py>,
        weights: (u64, u64, u64, u64),
        mut saved: PyRefMut<'_, DeviceSavedPy>,
        dy: u64,
        stream: u64,
    ) -> PyResult<(Vec<Bound<'py, PyCapsule>>, String)> {
        let (h, f, e) = (self.cfg.hidden, self.cfg.ffn, self.cfg.n_experts);
        let w = self.weights(weights)?;
        let dys = self.rows(dy, saved.tokens)?;
        let planner = DevicePlanner::new(self.cfg, saved.call.clone()).map_err(value_error)?;
        self.enter(stream)?;
        // The forward rows are released once the kept rows are gathered, as
        // autograd frees saved tensors (a second backward, under
        // `retain_graph`, still runs: it gathers from the input).
        let g = layer::device::backward_releasing(
            &self.gpu,
            DeviceComm::Local,
            &w,
            &mut saved.inner,
            &dys,
            &planner,
        )
        .map_err(value_error)?;
        self.leave(stream)?;
        let routed = saved.tokens * self.cfg.top_k;
        let stats = serde_json::json!({
            "routed_pairs": routed,
            "kept_pairs": g.kept_total,
            "kept_fraction": if routed == 0 { 1.0 } else { g.kept_total as f64 / routed as f64 },
            "expert_load": saved.expert_load(),
            "kept_per_rank": g.kept_pairs,
        });
        let out = vec![
            capsule(py, &self.gpu, g.dx, &[saved.tokens, h], true)?,
            capsule(py, &self.gpu, g.router, &[h, e], false)?,
            capsule(py, &self.gpu, g.experts.gate, &[e, h, f], true)?,
            capsule(py, &self.gpu, g.experts.up, &[e, h, f], true)?,
            capsule(py, &self.gpu, g.experts.down, &[e, f, h], true)?,
        ];
        Ok((out, stats.to_string()))
    }
}

/// One rank owning every expert.
fn one_rank(n_experts: usize) -> quota::Placement {
    quota::Placement {
        owner: vec![0; n_experts],
        replicas: vec![],
    }
}
