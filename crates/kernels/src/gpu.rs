//! The CUDA backend: safe wrappers that check shapes, then launch the
//! kernels of `kernels/lrmoe.cu` through cudarc (loaded dynamically, so the
//! crate builds with no CUDA installed). Without the `cuda` feature the same
//! API returns [`crate::KernelError::NotCompiledWithCuda`].
//!
//! Host-slice methods copy in, poison the output (0xFF bytes: NaN for f32
//! and bf16) so unwritten elements cannot pass a test, launch, and copy out;
//! the `bench_*` methods keep data on the device and time with CUDA events.

#[cfg(not(feature = "cuda"))]
use crate::KernelError;

/// Medians of a device benchmark, milliseconds, with the bytes each moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median kernel time, ms.
    pub ms: f64,
    /// Bytes the kernel must move (reads + writes, or reads only where stated).
    pub bytes: f64,
}

impl Timing {
    /// `bytes / ms`, in GB/s.
    pub fn gbps(&self) -> f64 {
        self.bytes / (self.ms * 1e-3) / 1e9
    }
}

/// Device buffers and views (cudarc's), as the device operations take them.
#[cfg(feature = "cuda")]
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
#[cfg(feature = "cuda")]
pub use imp::{
    dense::{
        attn_ds_bytes, AttnDq, AttnFwd, AttnSaved, AttnShape, GradElem, NormKeeping, SumPart,
        XentLaunch, ATTN_DS_MAX_BYTES,
    },
    ops::{Borrowed, ExpertsBackward, Routed},
    Download, Gpu, Mark,
};

/// Where the attention backward looks for cuDNN (`libcudnn.so.9`, for
/// `AttnDq::Cudnn`), in order. `explicit` (`LRMOE_CUDNN`: the library, or
/// the folder holding it) is the only candidate when given; otherwise the
/// loader's own search by soname, then `nvidia/cudnn/lib/libcudnn.so.9`
/// under each Python package folder in `python_paths` (where PyTorch's
/// wheels install it), those that exist.
pub fn cudnn_candidates(
    explicit: Option<&std::path::Path>,
    python_paths: &[std::path::PathBuf],
) -> Vec<std::path::PathBuf> {
    const SONAME: &str = "libcudnn.so.9";
    if let Some(p) = explicit {
        return vec![if p.is_dir() {
            p.join(SONAME)
        } else {
            p.to_path_buf()
        }];
    }
    let mut v = vec![std::path::PathBuf::from(SONAME)];
    for dir in python_paths {
        let lib = dir.join("nvidia").join("cudnn").join("lib").join(SONAME);
        if lib.is_file() && !v.contains(&lib) {
            v.push(lib);
        }
    }
    v
}

/// Writes `bytes` to `dir/lrmoe-{stem}-{hash}.so`, named by a hash of the
/// bytes, unless that file exists, and returns its path: the embedded
/// kernel libraries are opened from there. Atomic and safe to race: each
/// call writes its own temporary file (this process, a per-process call
/// number) and renames it over the content-named one, so threads or
/// processes opening devices at once never see a partial file, and a
/// rename that loses to another writer of the same bytes is no error.
pub fn write_content_named(
    dir: &std::path::Path,
    stem: &str,
    bytes: &[u8],
) -> std::io::Result<std::path::PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let path = dir.join(format!("lrmoe-{stem}-{h:016x}.so"));
    if path.exists() {
        return Ok(path);
    }
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("{}-{call}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &path));
    match written {
        Ok(()) => Ok(path),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            if path.exists() {
                Ok(path)
            } else {
                Err(e)
            }
        }
    }
}

/// Stand-in when built without CUDA: every call is an error.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct Gpu(());

#[cfg(not(feature = "cuda"))]
impl Gpu {
    /// Opens device `ordinal`.
    pub fn open(_ordinal: usize) -> Result<Self, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn set_gemm_sm_reserve(&self, _sms: u32) {}
    /// See the CUDA build.
    pub fn set_poison(&self, _on: bool) {}
    /// See the CUDA build.
    pub fn device_name(&self) -> Result<String, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn sync(&self) -> Result<(), KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn lrm_scores_bf16(
        &self,
        _h: &[u16],
        _d: &[u16],
        _g: &[f32],
        _di: usize,
        _do: usize,
    ) -> Result<Vec<f32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn gather_u8(&self, _src: &[u8], _idx: &[u32]) -> Result<Vec<u8>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn expand_runs(
        &self,
        _runs: &[u32],
        _step: u32,
        _len: usize,
    ) -> Result<Vec<u32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn kept_counts(
        &self,
        _key: &[u32],
        _keep: &[u8],
        _groups: usize,
    ) -> Result<Vec<u32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn gather_rows_u16(
        &self,
        _src: &[u16],
        _width: usize,
        _idx: &[u32],
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn unpack_rows_u16(
        &self,
        _packed: &[u16],
        _width: usize,
        _inverse: &[u32],
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn select_top(
        &self,
        _scores: &[f32],
        _ids: &[u32],
        _offsets: &[u32],
        _quotas: &[u32],
    ) -> Result<Vec<bool>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn swiglu_bf16(&self, _a: &[u16], _b: &[u16]) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn logits_bias_f32(&self, _l: &[u16], _b: &[f32]) -> Result<Vec<f32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn priority_keys(
        &self,
        _s: &[f32],
        _i: &[u32],
        _seed: u64,
    ) -> Result<Vec<f32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn priority_weights(
        &self,
        _rho: &[f32],
        _s: &[f32],
        _k: (&[u8], &[u8]),
        _o: &[u32],
    ) -> Result<Vec<f32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn mul_f32(&self, _a: &[f32], _b: &[f32]) -> Result<Vec<f32>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn measure_allocations(&self, _sizes: &[u64]) -> Result<u64, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    #[allow(clippy::type_complexity)]
    pub fn swiglu_backward_bf16(
        &self,
        _a: &[u16],
        _b: &[u16],
        _dh: &[u16],
    ) -> Result<(Vec<u16>, Vec<u16>), KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    #[allow(clippy::type_complexity)]
    pub fn router_topk(
        &self,
        _logits: &[f32],
        _sel_bias: Option<&[f32]>,
        _e: usize,
        _k: usize,
        _renormalize: bool,
    ) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>), KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn grouped_gemm_bf16(
        &self,
        _variant: crate::cpu::GemmVariant,
        _offsets: &[i32],
        _a: &[u16],
        _b: &[u16],
        _h: usize,
        _f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_gemm_onto_bf16(
        &self,
        _variant: crate::cpu::GemmVariant,
        _offsets: &[i32],
        _a: &[u16],
        _b: &[u16],
        _base: &[u16],
        _h: usize,
        _f: usize,
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn combine_bf16(
        &self,
        _o: &[u16],
        _h: usize,
        _row: &[u32],
        _gates: &[f32],
        _k: usize,
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
    /// See the CUDA build.
    pub fn combine_onto_bf16(
        &self,
        _base: Option<&[u16]>,
        _o: &[u16],
        _h: usize,
        _row: &[u32],
        _gates: &[f32],
        _k: usize,
    ) -> Result<Vec<u16>, KernelError> {
        Err(KernelError::NotCompiledWithCuda)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    pub mod dense;
    pub mod ops;

    use std::sync::Arc;

    use cudarc::driver::{
        CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
    };

    use super::Timing;
    use crate::cpu::GemmVariant;
    use crate::KernelError;
    use dense::XentLaunch;

    static FATBIN: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/out/lrmoe.fatbin"
    ));
    static DENSE_FATBIN: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/out/dense.fatbin"
    ));
    static GEMM_SO: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/out/liblrmoe_grouped_gemm.so"
    ));

    type WorkspaceFn = unsafe extern "C" fn(i32, i32, i32) -> usize;
    type RunFn = unsafe extern "C" fn(
        i32,
        i32,
        *const i32,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        f32,
        i32,
        i32,
        i32,
        *mut std::ffi::c_void,
        usize,
        *mut std::ffi::c_void,
    ) -> i32;

    static ATTN_SO: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/out/liblrmoe_attention.so"
    ));

    /// `lrmoe_flash_fwd_supports(n_seq, heads, kv, seq, dh)`.
    pub(crate) type AttnSupportsFn = unsafe extern "C" fn(i32, i32, i32, i32, i32) -> i32;
    /// `lrmoe_flash_fwd(schedule, n_seq, heads, kv, seq, dh, q, k, v, o,
    /// lse2, sm_count, stream)`.
    pub(crate) type AttnFwdFn = unsafe extern "C" fn(
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut f32,
        i32,
        *mut std::ffi::c_void,
    ) -> i32;

    /// `lrmoe_flash_bwd_workspace(n_seq, heads, kv, seq, dh)`.
    pub(crate) type AttnBwdWsFn = unsafe extern "C" fn(i32, i32, i32, i32, i32) -> usize;
    /// `lrmoe_flash_bwd(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, dout,
    /// dq, dk, dv, workspace, ws_bytes, sm_count, stream)`.
    pub(crate) type AttnBwdFn = unsafe extern "C" fn(
        i32,
        i32,
        i32,
        i32,
        i32,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const f32,
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        usize,
        i32,
        *mut std::ffi::c_void,
    ) -> i32;

    static CUDNN_SO: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../kernels/out/liblrmoe_cudnn_attention.so"
    ));

    /// `lrmoe_cudnn_version()`.
    type CudnnVersionFn = unsafe extern "C" fn() -> i32;
    /// `lrmoe_cudnn_bwd_workspace(n_seq, heads, kv, seq, dh, &bytes, err,
    /// err_len)`.
    pub(crate) type CudnnWsFn = unsafe extern "C" fn(
        i32,
        i32,
        i32,
        i32,
        i32,
        *mut usize,
        *mut std::ffi::c_char,
        i32,
    ) -> i32;
    /// `lrmoe_cudnn_bwd(n_seq, heads, kv, seq, dh, q, k, v, o, lse2, dout,
    /// dq, dk, dv, workspace, ws_bytes, stream, err, err_len)`.
    pub(crate) type CudnnBwdFn = unsafe extern "C" fn(
        i32,
        i32,
        i32,
        i32,
        i32,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const std::ffi::c_void,
        *const f32,
        *const std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        *mut std::ffi::c_void,
        usize,
        *mut std::ffi::c_void,
        *mut std::ffi::c_char,
        i32,
    ) -> i32;

    /// cuDNN's fused attention backward (`kernels/lib/cudnn_attention.cu`)
    /// and the `libcudnn.so.9` it runs on.
    pub(crate) struct CudnnLib {
        _shim: libloading::Library,
        _cudnn: libloading::Library,
        /// Where `libcudnn.so.9` was opened from.
        pub(crate) path: std::path::PathBuf,
        /// cuDNN's version number (e.g. 92801).
        pub(crate) version: i32,
        pub(crate) workspace: CudnnWsFn,
        pub(crate) backward: CudnnBwdFn,
    }

    /// Python's package folders (`sys.path` of `python3`), for
    /// [`super::cudnn_candidates`]; none when there is no Python.
    fn python_paths() -> Vec<std::path::PathBuf> {
        std::process::Command::new("python3")
            .args(["-c", "import sys; print(chr(10).join(sys.path))"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| !l.is_empty())
                    .map(std::path::PathBuf::from)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// cuDNN's attention backward for the process, opened on first use
    /// ([`Gpu::cudnn`]; the shim keeps a plan per device): the reason it
    /// did not open otherwise.
    pub(crate) static CUDNN: std::sync::OnceLock<Result<CudnnLib, String>> =
        std::sync::OnceLock::new();

    /// Opens `libcudnn.so.9` (the first of [`super::cudnn_candidates`] that
    /// opens), then the embedded shim, whose dependency on that soname then
    /// resolves to the copy already open.
    fn load_cudnn() -> Result<CudnnLib, String> {
        let explicit = std::env::var_os("LRMOE_CUDNN").map(std::path::PathBuf::from);
        let mut tried = Vec::new();
        let mut open = |candidates: Vec<std::path::PathBuf>| {
            for c in candidates {
                if tried.iter().any(|(t, _)| *t == c) {
                    continue;
                }
                // SAFETY: cuDNN's initialisers only set up its own state.
                match unsafe { libloading::Library::new(&c) } {
                    Ok(lib) => return Some((lib, c)),
                    Err(e) => tried.push((c, e.to_string())),
                }
            }
            None
        };
        // Python is asked for its package folders only when the loader's
        // own search (or `LRMOE_CUDNN`) finds nothing.
        let mut opened = open(super::cudnn_candidates(explicit.as_deref(), &[]));
        if opened.is_none() && explicit.is_none() {
            opened = open(super::cudnn_candidates(None, &python_paths()));
        }
        let tried: Vec<String> = tried
            .iter()
            .map(|(c, e)| format!("{}: {e}", c.display()))
            .collect();
        let (cudnn, path) = opened.ok_or_else(|| {
            format!(
                "cuDNN (libcudnn.so.9) did not open; set LRMOE_CUDNN to the library or its folder (tried {})",
                tried.join("; ")
            )
        })?;
        // SAFETY: 1. the library is the one `cargo xtask kernels` built from
        // kernels/lib/cudnn_attention.cu, embedded in this binary; 2. its
        // initialisers register its CUDA kernel and the frontend's statics;
        // 3. the symbols' types are the `extern "C"` signatures declared in
        // that file.
        unsafe {
            let shim = open_embedded(CUDNN_SO, "cudnn_attention").map_err(|e| e.to_string())?;
            let version: CudnnVersionFn =
                symbol(&shim, b"lrmoe_cudnn_version\0").map_err(|e| e.to_string())?;
            let workspace: CudnnWsFn =
                symbol(&shim, b"lrmoe_cudnn_bwd_workspace\0").map_err(|e| e.to_string())?;
            let backward: CudnnBwdFn =
                symbol(&shim, b"lrmoe_cudnn_bwd\0").map_err(|e| e.to_string())?;
            Ok(CudnnLib {
                version: version(),
                _shim: shim,
                _cudnn: cudnn,
                path,
                workspace,
                backward,
            })
        }
    }

    /// The CUTLASS grouped GEMM library, written from the embedded bytes to a
    /// content-named file in the temporary folder and opened with dlopen.
    struct GemmLib {
        _lib: libloading::Library,
        workspace: WorkspaceFn,
        run: RunFn,
    }

    /// The CUTLASS attention library (`kernels/lib/attention.cu`: forward
    /// and backward), opened as [`GemmLib`] is.
    pub(crate) struct AttnLib {
        _lib: libloading::Library,
        pub(crate) supports: AttnSupportsFn,
        pub(crate) forward: AttnFwdFn,
        pub(crate) backward_workspace: AttnBwdWsFn,
        pub(crate) backward: AttnBwdFn,
    }

    /// Writes an embedded library to a content-named file in the temporary
    /// folder (once; atomically) and opens it.
    ///
    /// # Safety
    /// `bytes` must be a library `cargo xtask kernels` built from
    /// `kernels/lib/`, whose initialisers only register CUDA kernels.
    unsafe fn open_embedded(bytes: &[u8], stem: &str) -> Result<libloading::Library, KernelError> {
        // (One temporary name per process let one thread rename the file
        // another was still writing: "No such file or directory" from
        // parallel device tests, 2026-12-05; each call has its own now.)
        let dir = std::env::temp_dir();
        let path = super::write_content_named(&dir, stem, bytes).map_err(|e| {
            KernelError::Cuda(format!(
                "cannot write the {stem} library to {}: {e}",
                dir.display()
            ))
        })?;
        // SAFETY: the caller's contract.
        unsafe { libloading::Library::new(&path) }
            .map_err(|e| KernelError::Cuda(format!("dlopen {}: {e}", path.display())))
    }

    /// The function `name` (NUL-terminated) of `lib`.
    ///
    /// # Safety
    /// `T` must be the symbol's type as the library declares it.
    unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T, KernelError> {
        // SAFETY: the caller's contract.
        unsafe { lib.get::<T>(name) }
            .map(|f| *f)
            .map_err(|e| KernelError::Cuda(e.to_string()))
    }

    fn load_attention() -> Result<AttnLib, KernelError> {
        // SAFETY: 1. the library is the one `cargo xtask kernels` built from
        // kernels/lib/attention.cu, embedded in this binary; 2. its
        // initialisers only register CUDA kernels; 3. the symbols' types are
        // the `extern "C"` signatures declared in that file.
        unsafe {
            let lib = open_embedded(ATTN_SO, "attention")?;
            let supports: AttnSupportsFn = symbol(&lib, b"lrmoe_flash_fwd_supports\0")?;
            let forward: AttnFwdFn = symbol(&lib, b"lrmoe_flash_fwd\0")?;
            let backward_workspace: AttnBwdWsFn = symbol(&lib, b"lrmoe_flash_bwd_workspace\0")?;
            let backward: AttnBwdFn = symbol(&lib, b"lrmoe_flash_bwd\0")?;
            Ok(AttnLib {
                _lib: lib,
                supports,
                forward,
                backward_workspace,
                backward,
            })
        }
    }

    fn load_gemm() -> Result<GemmLib, KernelError> {
        // SAFETY: 1. the library is the one `cargo xtask kernels` built from
        // kernels/lib/grouped_gemm.cu, embedded in this binary; 2. its
        // initialisers only register CUDA kernels; 3. the symbols' types are
        // the `extern "C"` signatures declared in that file.
        unsafe {
            let lib = open_embedded(GEMM_SO, "gemm")?;
            let workspace: WorkspaceFn = symbol(&lib, b"lrmoe_grouped_gemm_workspace\0")?;
            let run: RunFn = symbol(&lib, b"lrmoe_grouped_gemm\0")?;
            Ok(GemmLib {
                _lib: lib,
                workspace,
                run,
            })
        }
    }

    /// The embedded libraries open and name their symbols without a GPU
    /// (they link the CUDA runtime statically and reach the driver only
    /// when called), and the attention library's pure functions answer as
    /// its header says.
    #[cfg(test)]
    #[test]
    fn the_embedded_libraries_open_and_answer_shape_questions() {
        load_gemm().unwrap();
        let a = load_attention().unwrap();
        let (takes, ws) = (a.supports, a.backward_workspace);
        // SAFETY: a pure function of five integers.
        let t = |d: [i32; 5]| unsafe { takes(d[0], d[1], d[2], d[3], d[4]) != 0 };
        assert!(t([8, 32, 4, 2048, 128]) && t([32, 8, 2, 512, 64]) && t([1, 2, 2, 128, 64]));
        for bad in [
            [1, 2, 1, 100, 64],
            [1, 2, 1, 128, 32],
            [1, 3, 2, 128, 64],
            [0, 2, 2, 128, 64],
            [1, 2, 0, 128, 64],
            // 2³¹ elements of q: past the library's 32-bit offsets.
            [64, 32, 4, 8192, 128],
        ] {
            assert!(!t(bad), "{bad:?}");
        }
        // SAFETY: as above.
        let bytes = |d: [i32; 5]| unsafe { ws(d[0], d[1], d[2], d[3], d[4]) };
        assert_eq!(bytes([1, 2, 1, 100, 64]), 0);
        // Rows of 128 × 2 heads: the statistic twice and dQ in f32, plus dK
        // and dV per query head in bf16 for grouped heads.
        let rows = 256usize;
        assert_eq!(bytes([1, 2, 2, 128, 64]), rows * 4 * 2 + rows * 64 * 4);
        assert_eq!(
            bytes([1, 2, 1, 128, 64]),
            rows * 4 * 2 + rows * 64 * 4 + 2 * rows * 64 * 2
        );
    }

    /// cuDNN's backward opens where the machine has `libcudnn.so.9` (then
    /// the shim's symbols resolve and it reports a cuDNN 9 version) and is
    /// otherwise an error that says how to point at the library — no GPU
    /// needed either way.
    #[cfg(test)]
    #[test]
    fn cudnn_opens_or_says_how_to_find_it() {
        match load_cudnn() {
            Ok(c) => assert!((90000..100000).contains(&c.version), "{}", c.version),
            Err(e) => assert!(
                e.contains("libcudnn.so.9") && e.contains("LRMOE_CUDNN"),
                "{e}"
            ),
        }
    }

    fn variant_code(v: GemmVariant) -> i32 {
        match v {
            GemmVariant::Forward => 0,
            GemmVariant::DataGrad => 1,
            GemmVariant::WeightGrad => 2,
        }
    }

    fn cuda(e: impl std::fmt::Debug) -> KernelError {
        KernelError::Cuda(format!("{e:?}"))
    }

    use crate::cpu::check;

    /// `got` holds at least `expected` elements (device buffers may be
    /// longer than the rows a call uses).
    fn at_least(what: &'static str, expected: usize, got: usize) -> Result<(), KernelError> {
        if got >= expected {
            Ok(())
        } else {
            Err(KernelError::Shape {
                what,
                expected,
                got,
            })
        }
    }

    fn dim(what: &'static str, x: usize) -> Result<i32, KernelError> {
        i32::try_from(x).map_err(|_| KernelError::Shape {
            what,
            expected: i32::MAX as usize,
            got: x,
        })
    }

    /// A device-to-host copy in flight ([`Gpu::download_later`]).
    pub struct Download<'a, T> {
        gpu: &'a Gpu,
        host: Option<cudarc::driver::PinnedHostSlice<u64>>,
        done: cudarc::driver::CudaEvent,
        n: usize,
        _t: std::marker::PhantomData<T>,
    }

    impl<T: cudarc::driver::DeviceRepr + Copy> Download<'_, T> {
        /// Blocks until the copy is done; the `n` elements.
        pub fn wait(mut self) -> Result<Vec<T>, KernelError> {
            self.done.synchronize().map_err(cuda)?;
            let host = self
                .host
                .take()
                .ok_or_else(|| KernelError::Cuda("a download waited twice".into()))?;
            // SAFETY: the event above follows the copy of n elements of T
            // into this pinned buffer (8-byte aligned, at least n · size_of
            // T bytes): they are initialised values of T.
            let v = unsafe {
                std::slice::from_raw_parts(host.as_ptr().map_err(cuda)? as *const T, self.n)
            }
            .to_vec();
            self.gpu.give_pinned(host);
            Ok(v)
        }
    }

    impl<T> Drop for Download<'_, T> {
        fn drop(&mut self) {
            if let Some(h) = self.host.take() {
                // Not waited for (an error path): the copy may still write.
                let _ = self.done.synchronize();
                self.gpu.give_pinned(h);
            }
        }
    }

    /// A point in a stream's work, timed by the device (a CUDA event with
    /// timing): [`Gpu::mark`] on the compute stream, `NcclComm::mark` on a
    /// communicator's stream.
    pub struct Mark(cudarc::driver::CudaEvent);

    impl Mark {
        /// Records a timed event on `stream`.
        pub(crate) fn on(ctx: &Arc<CudaContext>, stream: &CudaStream) -> Result<Self, KernelError> {
            let ev = ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda)?;
            ev.record(stream).map_err(cuda)?;
            Ok(Self(ev))
        }

        /// Device milliseconds from `earlier` to this mark (waits for both).
        pub fn ms_since(&self, earlier: &Mark) -> Result<f64, KernelError> {
            self.0.synchronize().map_err(cuda)?;
            earlier.0.synchronize().map_err(cuda)?;
            Ok(f64::from(earlier.0.elapsed_ms(&self.0).map_err(cuda)?))
        }
    }

    /// One device with the lrmoe module loaded.
    pub struct Gpu {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        _module: Arc<CudaModule>,
        scores: CudaFunction,
        gather: CudaFunction,
        unpack: CudaFunction,
        select: CudaFunction,
        swiglu_fwd: CudaFunction,
        swiglu_bwd: CudaFunction,
        router: CudaFunction,
        combine: CudaFunction,
        gemm: GemmLib,
        /// The CUTLASS attention kernels ([`Gpu::flash_attention_forward`],
        /// [`Gpu::flash_attention_backward`]).
        pub(crate) attn: AttnLib,
        f_group: CudaFunction,
        f_gather_scaled: CudaFunction,
        f_gather32: CudaFunction,
        f_add: CudaFunction,
        f_to_f32: CudaFunction,
        f_to_f32_bias: CudaFunction,
        f_priority_keys: CudaFunction,
        f_priority_weights: CudaFunction,
        f_mul_f32: CudaFunction,
        f_router_bwd: CudaFunction,
        f_col_mean: CudaFunction,
        f_col_sum: CudaFunction,
        f_row_sq: CudaFunction,
        f_scores_norms: CudaFunction,
        f_fill: CudaFunction,
        f_key_counts: CudaFunction,
        f_gather_u8: CudaFunction,
        f_expand_runs: CudaFunction,
        dense: dense::DenseFns,
        /// cuBLAS on the compute stream, for the dense model's one-group
        /// GEMMs ([`Gpu::gemm_dev`]; the default: measured 5% faster on the
        /// A3B shape and 15% on qwen3-moe-mini, H200, 2026-12-02); `None`
        /// (`LRMOE_DENSE_GEMM=cutlass`, or libcublas missing): the grouped
        /// kernels.
        blas: Option<cudarc::cublas::CudaBlas>,
        /// The workspace cuBLAS runs in ([`open_blas`]); declared after
        /// `blas`, so the handle is destroyed before its workspace is freed.
        _blas_workspace: Option<CudaSlice<u8>>,
        /// Fill every output buffer with 0xFF bytes before its kernel runs
        /// (device tests: a kernel that skips an element is caught).
        poison: std::sync::atomic::AtomicBool,
        n_sms: u32,
        /// SMs the grouped GEMMs leave free (for a collective running
        /// beside them): see [`Gpu::set_gemm_sm_reserve`].
        gemm_reserve: std::sync::atomic::AtomicU32,
        /// Pinned host buffers for [`Gpu::download_later`] (each waited
        /// for before it returns to the pool).
        pinned: std::sync::Mutex<Vec<cudarc::driver::PinnedHostSlice<u64>>>,
    }

    impl std::fmt::Debug for Gpu {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Gpu").field("n_sms", &self.n_sms).finish()
        }
    }

    /// The workspace [`open_blas`] gives cuBLAS, MiB, unless
    /// `LRMOE_CUBLAS_WORKSPACE_MIB` sets one: 0, cuBLAS's own default.
    /// cuBLAS recommends 32 MiB on Hopper (its `cublasSetWorkspace`
    /// reference) and PyTorch gives its handles that on sm_90, where its
    /// o projection's GEMMs ran 1.17–1.30× faster than ours at the A3B
    /// shape (2026-12-05); whether the workspace is the difference is
    /// unmeasured, so the default stays cuBLAS's until a device run
    /// (`LRMOE_CUBLAS_WORKSPACE_MIB=32` against 0, `docs/benchmarks.md`)
    /// says otherwise.
    const BLAS_WORKSPACE_MIB: usize = 0;

    /// cuBLAS on `stream`, with a workspace of its own where one is asked
    /// for ([`BLAS_WORKSPACE_MIB`]),
    /// unless `LRMOE_DENSE_GEMM=cutlass` asks for the grouped kernels or
    /// libcublas does not load (then the grouped kernels run every GEMM).
    fn open_blas(
        stream: &Arc<CudaStream>,
    ) -> (Option<cudarc::cublas::CudaBlas>, Option<CudaSlice<u8>>) {
        if std::env::var("LRMOE_DENSE_GEMM").as_deref() == Ok("cutlass") {
            return (None, None);
        }
        // cudarc panics when it cannot load the library; probe first.
        // SAFETY: a presence probe of the library (dlopen only).
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return (None, None);
        }
        let Ok(blas) = cudarc::cublas::CudaBlas::new(stream.clone()) else {
            return (None, None);
        };
        let mib = match std::env::var("LRMOE_CUBLAS_WORKSPACE_MIB") {
            Ok(v) => v.trim().parse::<usize>().unwrap_or_else(|_| {
                tracing::warn!(
                    "LRMOE_CUBLAS_WORKSPACE_MIB={v:?} is not a whole number of MiB; \
                     using {BLAS_WORKSPACE_MIB}"
                );
                BLAS_WORKSPACE_MIB
            }),
            Err(_) => BLAS_WORKSPACE_MIB,
        };
        if mib == 0 {
            return (Some(blas), None);
        }
        // Without a workspace of its own cuBLAS runs on its default one;
        // a failed allocation keeps that (slower, still correct).
        let Ok(ws) = stream.alloc_zeros::<u8>(mib << 20) else {
            return (Some(blas), None);
        };
        let set = {
            use cudarc::driver::DevicePtr;
            let (ptr, _guard) = ws.device_ptr(stream);
            // SAFETY: the handle runs on `stream`; `ws` outlives it (the
            // field order of `Gpu`) and nothing else uses it.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    mib << 20,
                )
            }
        };
        match set {
            cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => (Some(blas), Some(ws)),
            _ => (Some(blas), None),
        }
    }

    /// What [`pool_set`] does to the device's stream-ordered memory pool.
    enum PoolOp {
        /// Keep freed memory across synchronisations (the default release
        /// threshold, 0, hands it back to the driver at every
        /// synchronisation and the next allocation maps it again: measured
        /// 2–4× slower layer calls on the H200).
        KeepFreed,
        /// Hand every freed byte back now (before reading memory in use).
        Trim,
    }

    fn pool_set(ctx: &Arc<CudaContext>, op: PoolOp) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        let pool = default_pool(ctx)?;
        let mut keep: u64 = u64::MAX;
        // SAFETY: driver calls on the device's own pool; the release
        // threshold attribute takes a u64.
        pool_call(unsafe {
            match op {
                PoolOp::KeepFreed => sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut keep as *mut u64).cast(),
                ),
                PoolOp::Trim => sys::cuMemPoolTrimTo(pool, 0),
            }
        })
    }

    /// Reads (`reset` false) or resets to the bytes in use (`reset` true) the
    /// high-water mark of the device's stream-ordered pool, and returns the
    /// pool's bytes in use now and its high-water mark.
    fn pool_usage(ctx: &Arc<CudaContext>, reset: bool) -> Result<(u64, u64), KernelError> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let pool = default_pool(ctx)?;
        if reset {
            let mut zero: u64 = 0;
            // SAFETY: the device's own pool; the high-water mark is a u64
            // that may only be set to zero (which resets it to the bytes
            // in use).
            pool_call(unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            })?;
        }
        let get = |attr: A| -> Result<u64, KernelError> {
            let mut v: u64 = 0;
            // SAFETY: the device's own pool; both usage attributes are u64.
            pool_call(unsafe {
                sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast())
            })?;
            Ok(v)
        };
        let current = get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        let high = get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
        Ok((current, high))
    }

    /// The default stream-ordered memory pool of `ctx`'s device.
    fn default_pool(
        ctx: &Arc<CudaContext>,
    ) -> Result<cudarc::driver::sys::CUmemoryPool, KernelError> {
        use cudarc::driver::sys;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        ctx.bind_to_thread().map_err(cuda)?;
        // SAFETY: a driver query on the context's own device with a valid
        // out-pointer.
        pool_call(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) })?;
        Ok(pool)
    }

    /// A memory-pool driver call's result as a `KernelError`.
    fn pool_call(r: cudarc::driver::sys::CUresult) -> Result<(), KernelError> {
        if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(KernelError::Cuda(format!("memory pool call failed: {r:?}")))
        }
    }

    /// A grouped GEMM's workspace and the SM count it was sized for.
    struct GemmWorkspace {
        buf: CudaSlice<u8>,
        sms: i32,
    }

    /// Warps per block of the row kernels.
    const THREADS: u32 = 256;

    impl Gpu {
        /// Opens device `ordinal` and loads the kernels.
        pub fn open(ordinal: usize) -> Result<Self, KernelError> {
            // cudarc panics when it cannot load libcuda; say so as an error.
            // SAFETY: a presence probe of the driver library (dlopen only).
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(KernelError::Cuda(
                    "the CUDA driver library (libcuda.so) was not found: is this a GPU machine with a driver?".into(),
                ));
            }
            let ctx = CudaContext::new(ordinal).map_err(cuda)?;
            let stream = ctx.default_stream();
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(FATBIN.to_vec()))
                .map_err(cuda)?;
            pool_set(&ctx, PoolOp::KeepFreed)?;
            let n_sms = ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(cuda)? as u32;
            let (blas, blas_workspace) = open_blas(&stream);
            Ok(Self {
                scores: module.load_function("lrm_scores_bf16").map_err(cuda)?,
                gather: module.load_function("gather_rows_u16").map_err(cuda)?,
                unpack: module.load_function("unpack_rows_u16").map_err(cuda)?,
                select: module.load_function("select_top_q").map_err(cuda)?,
                swiglu_fwd: module.load_function("swiglu_fwd_bf16").map_err(cuda)?,
                swiglu_bwd: module.load_function("swiglu_bwd_bf16").map_err(cuda)?,
                router: module.load_function("router_topk").map_err(cuda)?,
                combine: module.load_function("combine_bf16").map_err(cuda)?,
                gemm: load_gemm()?,
                attn: load_attention()?,
                f_group: module.load_function("group_by_expert").map_err(cuda)?,
                f_gather_scaled: module.load_function("gather_scaled_u16").map_err(cuda)?,
                f_gather32: module.load_function("gather_32").map_err(cuda)?,
                f_add: module.load_function("add_bf16").map_err(cuda)?,
                f_to_f32: module.load_function("bf16_to_f32").map_err(cuda)?,
                f_to_f32_bias: module.load_function("bf16_to_f32_bias").map_err(cuda)?,
                f_priority_keys: module.load_function("priority_keys").map_err(cuda)?,
                f_priority_weights: module.load_function("priority_weights").map_err(cuda)?,
                f_mul_f32: module.load_function("mul_f32").map_err(cuda)?,
                f_router_bwd: module.load_function("router_backward").map_err(cuda)?,
                f_col_mean: module.load_function("col_mean_f32").map_err(cuda)?,
                f_col_sum: module.load_function("col_sum_bf16").map_err(cuda)?,
                f_row_sq: module.load_function("row_sq_norms_bf16").map_err(cuda)?,
                f_scores_norms: module.load_function("scores_from_norms").map_err(cuda)?,
                f_fill: module.load_function("fill_u32").map_err(cuda)?,
                f_key_counts: module.load_function("key_counts").map_err(cuda)?,
                f_gather_u8: module.load_function("gather_u8").map_err(cuda)?,
                f_expand_runs: module.load_function("expand_runs").map_err(cuda)?,
                dense: dense::DenseFns::load(&ctx, DENSE_FATBIN)?,
                blas,
                _blas_workspace: blas_workspace,
                poison: std::sync::atomic::AtomicBool::new(false),
                _module: module,
                ctx,
                stream,
                n_sms,
                gemm_reserve: std::sync::atomic::AtomicU32::new(0),
                pinned: std::sync::Mutex::new(Vec::new()),
            })
        }

        /// The grid of the warp-per-row kernels: one warp per row (up to
        /// 2³¹ threads). The block scheduler then hands out rows as warps
        /// finish, where a capped grid (16 blocks per SM, grid-stride) fixed
        /// each warp's rows up front and waited for the unluckiest when rows
        /// differ in cost (an unpack's kept and dropped rows, a combine's
        /// tokens with more or fewer kept pairs). Unpack of 131 072 rows on
        /// one H200, alternating in one call: half dropped 0.89 → 0.91×
        /// copy, none dropped 0.92 → 0.94×.
        fn rows_config(&self, rows: usize) -> LaunchConfig {
            let warps_per_block = (THREADS / 32) as usize;
            // The kernels index threads in `int` (block × threads): past
            // 2³¹ threads the grid stops growing and the warps loop over
            // the rows instead.
            let max_blocks = i32::MAX as usize / THREADS as usize;
            let blocks = rows.div_ceil(warps_per_block).clamp(1, max_blocks) as u32;
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        }

        /// Copies host data to a new device buffer (an empty slice gives a
        /// one-element buffer no kernel reads).
        pub fn upload<T: cudarc::driver::DeviceRepr>(
            &self,
            host: &[T],
        ) -> Result<CudaSlice<T>, KernelError> {
            if host.is_empty() {
                // Zero-size buffers are ordinary: allocate one element so the
                // pointer is valid; kernels never read it.
                // SAFETY: the one uninitialised element is never read.
                return unsafe { self.stream.alloc::<T>(1) }.map_err(cuda);
            }
            // From pageable memory. Staging through a pinned pool was tried
            // and showed no gain: a pool buffer stays busy until the device
            // reaches its copy, the host runs milliseconds ahead, so the
            // pool kept allocating pinned memory, which is slow.
            self.stream.clone_htod(host).map_err(cuda)
        }

        /// A buffer of `max(n, 1)` elements, every byte 0xFF (NaN for
        /// floats), filled on the device: the host-slice entry points' and
        /// the benches' outputs, so a kernel that skips an element shows.
        fn poisoned<T: cudarc::driver::DeviceRepr>(
            &self,
            n: usize,
        ) -> Result<CudaSlice<T>, KernelError> {
            // SAFETY: every byte is written by the fill below before any use.
            let mut out = unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(cuda)?;
            self.fill_ff(&mut out)?;
            Ok(out)
        }

        /// The first `n` elements of a device buffer, on the host (waits
        /// for the stream).
        pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
            &self,
            dev: &CudaSlice<T>,
            n: usize,
        ) -> Result<Vec<T>, KernelError> {
            let mut v = self.stream.clone_dtoh(dev).map_err(cuda)?;
            v.truncate(n);
            Ok(v)
        }

        /// A timed mark of the work enqueued on the compute stream so far
        /// (no wait).
        pub fn mark(&self) -> Result<Mark, KernelError> {
            Mark::on(&self.ctx, &self.stream)
        }

        /// Enqueues a copy of the first `n` elements of `dev` to pinned host
        /// memory and returns at once; [`Download::wait`] blocks until the
        /// copy (and the work before it on the compute stream, not the work
        /// enqueued after) is done. Lets the host read a few counts while
        /// the device runs on.
        pub fn download_later<T: cudarc::driver::DeviceRepr + Copy>(
            &self,
            dev: &CudaSlice<T>,
            n: usize,
        ) -> Result<Download<'_, T>, KernelError> {
            use cudarc::driver::DevicePtr;
            if n > dev.len() {
                return Err(KernelError::Shape {
                    what: "download length",
                    expected: n,
                    got: dev.len(),
                });
            }
            let bytes = n * std::mem::size_of::<T>();
            let mut host = self.take_pinned(bytes.div_ceil(8))?;
            if n > 0 {
                let (src, _g) = dev.device_ptr(&self.stream);
                let dst = host.as_mut_slice().map_err(cuda)?;
                // SAFETY: a copy of n elements (bytes) from a live device
                // buffer of at least n into this pinned buffer of at least as
                // many bytes (as u64 words), on the compute stream; the
                // buffer stays out of the pool until the copy is waited for.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, bytes);
                    cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
                }
                .map_err(cuda)?;
            }
            let done = self.ctx.new_event(None).map_err(cuda)?;
            done.record(&self.stream).map_err(cuda)?;
            Ok(Download {
                gpu: self,
                host: Some(host),
                done,
                n,
                _t: std::marker::PhantomData,
            })
        }

        /// A pinned buffer of at least `words` u64 from the pool (pinned
        /// allocations are slow, so they are kept).
        fn take_pinned(
            &self,
            words: usize,
        ) -> Result<cudarc::driver::PinnedHostSlice<u64>, KernelError> {
            let mut pool = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = pool.iter().position(|b| b.len() >= words) {
                return Ok(pool.swap_remove(i));
            }
            drop(pool);
            // SAFETY: the contents are written by a copy before any read.
            unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<u64>(words.max(512).next_power_of_two(), 0)
                    .map_err(cuda)
            }
        }

        /// Returns a pinned buffer whose copy is done to the pool.
        fn give_pinned(&self, b: cudarc::driver::PinnedHostSlice<u64>) {
            let mut pool = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < 8 {
                pool.push(b);
            }
        }

        /// LRM scores `g² · ‖δ‖² · ‖h‖²` of `gate.len()` rows of bf16 bits.
        pub fn lrm_scores_bf16(
            &self,
            h: &[u16],
            delta: &[u16],
            gate: &[f32],
            d_in: usize,
            d_out: usize,
        ) -> Result<Vec<f32>, KernelError> {
            let n = gate.len();
            check("h", n * d_in, h.len())?;
            check("delta", n * d_out, delta.len())?;
            let (hd, dd, gd) = (self.upload(h)?, self.upload(delta)?, self.upload(gate)?);
            let mut out = self.poisoned::<f32>(n)?;
            if n > 0 {
                self.launch_scores(&hd, &dd, &gd, &mut out, n, d_in, d_out)?;
            }
            self.download(&out, n)
        }

        #[allow(clippy::too_many_arguments)]
        fn launch_scores(
            &self,
            h: &CudaSlice<u16>,
            delta: &CudaSlice<u16>,
            gate: &CudaSlice<f32>,
            out: &mut CudaSlice<f32>,
            n: usize,
            d_in: usize,
            d_out: usize,
        ) -> Result<(), KernelError> {
            let (n_i, di, dout) = (dim("n", n)?, dim("d_in", d_in)?, dim("d_out", d_out)?);
            let mut b = self.stream.launch_builder(&self.scores);
            b.arg(h)
                .arg(delta)
                .arg(gate)
                .arg(out)
                .arg(&n_i)
                .arg(&di)
                .arg(&dout);
            // SAFETY: 1. the kernel's signature is (u16*, u16*, f32*, f32*,
            // int, int, int), matching the arguments in order; 2. h holds
            // n·d_in, delta n·d_out, gate and out n elements (checked by the
            // callers); 3. out does not alias the inputs.
            unsafe { b.launch(self.rows_config(n)) }.map_err(cuda)?;
            Ok(())
        }

        /// `out[j] = src[idx[j]]` for rows of `width` u16 (bf16 bits).
        pub fn gather_rows_u16(
            &self,
            src: &[u16],
            width: usize,
            idx: &[u32],
        ) -> Result<Vec<u16>, KernelError> {
            let rows = src.len().checked_div(width).unwrap_or(0);
            check("src", rows * width, src.len())?;
            if let Some(&bad) = idx.iter().find(|&&i| width > 0 && i as usize >= rows) {
                return Err(KernelError::Shape {
                    what: "idx (row out of range)",
                    expected: rows,
                    got: bad as usize,
                });
            }
            let (sd, id) = (self.upload(src)?, self.upload(idx)?);
            let mut out = self.poisoned::<u16>(idx.len() * width)?;
            if !idx.is_empty() && width > 0 {
                self.launch_rows(&self.gather, &sd, &id, &mut out, idx.len(), width)?;
            }
            self.download(&out, idx.len() * width)
        }

        /// A map given as runs, expanded on the device: entry `dst + i` of
        /// each run `[dst, src, n]` (flattened triples, host) is
        /// `src + i·step`, `len` entries (twin:
        /// [`crate::cpu::expand_runs_reference`]). Only the triples cross
        /// to the device, so a plan of `O(runs)` on the host becomes a map
        /// of any length without the host touching each entry.
        pub fn expand_runs_dev(
            &self,
            runs: &[u32],
            step: u32,
            len: usize,
        ) -> Result<CudaSlice<u32>, KernelError> {
            crate::cpu::check_runs(runs, step, len)?;
            // SAFETY: the kernel writes each of the len entries (the runs
            // tile 0..len, checked above).
            let mut out = unsafe { self.uninit::<u32>(len) }?;
            if len > 0 {
                let rd = self.upload(runs)?;
                let (nr, ln) = (dim("runs", runs.len() / 3)?, dim("len", len)?);
                let mut l = self.stream.launch_builder(&self.f_expand_runs);
                l.arg(&rd).arg(&nr).arg(&step).arg(&mut out).arg(&ln);
                // SAFETY: (u32*, int, u32, u32*, int); the triples tile
                // 0..len ascending (checked), out holds len.
                unsafe { l.launch(self.elementwise_config(len)) }.map_err(cuda)?;
            }
            Ok(out)
        }

        /// [`Gpu::expand_runs_dev`] with the result on the host.
        pub fn expand_runs(
            &self,
            runs: &[u32],
            step: u32,
            len: usize,
        ) -> Result<Vec<u32>, KernelError> {
            let d = self.expand_runs_dev(runs, step, len)?;
            self.download(&d, len)
        }

        /// `out[j] = src[idx[j]]` on bytes (host slices; see `gather_u8_dev`).
        pub fn gather_u8(&self, src: &[u8], idx: &[u32]) -> Result<Vec<u8>, KernelError> {
            if let Some(&bad) = idx.iter().find(|&&i| i as usize >= src.len()) {
                return Err(KernelError::Shape {
                    what: "idx (byte out of range)",
                    expected: src.len(),
                    got: bad as usize,
                });
            }
            let (sd, id) = (self.upload(src)?, self.upload(idx)?);
            // SAFETY: every index was checked against src above.
            let out = unsafe { self.gather_u8_dev(&sd, &id, idx.len()) }?;
            self.download(&out, idx.len())
        }

        /// Byte gather on the device: `out[j] = src[idx[j]]`, `n` entries
        /// (every index must lie inside `src`).
        ///
        /// # Safety
        ///
        /// 1. `idx` holds `n` entries, each an index of `src`.
        pub unsafe fn gather_u8_dev(
            &self,
            src: &CudaSlice<u8>,
            idx: &CudaSlice<u32>,
            n: usize,
        ) -> Result<CudaSlice<u8>, KernelError> {
            // SAFETY: the kernel writes all n entries.
            let mut out = unsafe { self.uninit::<u8>(n) }?;
            if n > 0 {
                let n_i = dim("n", n)?;
                let mut l = self.stream.launch_builder(&self.f_gather_u8);
                l.arg(src).arg(idx).arg(&mut out).arg(&n_i);
                // SAFETY: (u8*, u32*, u8*, int); idx holds n in-bounds indices
                // of src (checked by the host wrapper, built so by the EP plan).
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            Ok(out)
        }

        /// Kept rows per key: `counts[b] = #{p : key[p] == b && keep[p] != 0}`
        /// for `b < groups` (host slices; see `kept_counts_dev`).
        pub fn kept_counts(
            &self,
            key: &[u32],
            keep: &[u8],
            groups: usize,
        ) -> Result<Vec<u32>, KernelError> {
            check("keep", key.len(), keep.len())?;
            let (kd, md) = (self.upload(key)?, self.upload(keep)?);
            let c = self.kept_counts_dev(&kd, &md, key.len(), groups)?;
            self.download(&c, groups)
        }

        /// [`Gpu::kept_counts`] on device buffers of `n` entries.
        pub fn kept_counts_dev(
            &self,
            key: &CudaSlice<u32>,
            keep: &CudaSlice<u8>,
            n: usize,
            groups: usize,
        ) -> Result<CudaSlice<u32>, KernelError> {
            at_least("keys and flags", n, key.len().min(keep.len()))?;
            // SAFETY: key and keep hold n entries (checked above).
            unsafe { self.key_counts(key, Some(keep), n, groups) }
        }

        /// Rows per key on the device, `groups` counts: `#{p < n : key[p]
        /// == b}` and, with `keep`, `keep[p] != 0` (keys at or above
        /// `groups` are not counted). One grid-stride pass with shared
        /// bins and one atomic per warp and key.
        ///
        /// # Safety
        ///
        /// 1. `key` (and `keep`) hold at least `n` entries.
        pub(crate) unsafe fn key_counts(
            &self,
            key: &CudaSlice<u32>,
            keep: Option<&CudaSlice<u8>>,
            n: usize,
            groups: usize,
        ) -> Result<CudaSlice<u32>, KernelError> {
            let mut out = self
                .stream
                .alloc_zeros::<u32>(groups.max(1))
                .map_err(cuda)?;
            if groups == 0 || n == 0 {
                return Ok(out);
            }
            let (n_i, g_i) = (dim("n", n)?, dim("groups", groups)?);
            // Shared bins up to the default 48 KiB of shared memory.
            let shared = groups <= 12 * 1024;
            let shared_i = i32::from(shared);
            let blocks = n.div_ceil(256).clamp(1, (self.n_sms * 4) as usize) as u32;
            let null: u64 = 0;
            let mut l = self.stream.launch_builder(&self.f_key_counts);
            l.arg(key);
            match keep {
                Some(k) => l.arg(k),
                None => l.arg(&null),
            };
            l.arg(&mut out).arg(&n_i).arg(&g_i).arg(&shared_i);
            // SAFETY: (u32*, u8* or null, u32*, int, int, int); key (and
            // keep) hold n (the caller's promise), out holds groups zeroed
            // counts; the shared bins hold groups u32 when used.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: if shared { (groups * 4) as u32 } else { 0 },
                })
            }
            .map_err(cuda)?;
            Ok(out)
        }

        /// `out[i] = packed[inverse[i]]`, zeros where `inverse[i]` is `u32::MAX`.
        pub fn unpack_rows_u16(
            &self,
            packed: &[u16],
            width: usize,
            inverse: &[u32],
        ) -> Result<Vec<u16>, KernelError> {
            let rows = packed.len().checked_div(width).unwrap_or(0);
            check("packed", rows * width, packed.len())?;
            if let Some(&bad) = inverse
                .iter()
                .find(|&&i| width > 0 && i != crate::limits::DROPPED && i as usize >= rows)
            {
                return Err(KernelError::Shape {
                    what: "inverse (row out of range)",
                    expected: rows,
                    got: bad as usize,
                });
            }
            let (pd, id) = (self.upload(packed)?, self.upload(inverse)?);
            let mut out = self.poisoned::<u16>(inverse.len() * width)?;
            if !inverse.is_empty() && width > 0 {
                self.launch_rows(&self.unpack, &pd, &id, &mut out, inverse.len(), width)?;
            }
            self.download(&out, inverse.len() * width)
        }

        fn launch_rows(
            &self,
            f: &CudaFunction,
            src: &CudaSlice<u16>,
            idx: &CudaSlice<u32>,
            out: &mut CudaSlice<u16>,
            n_out: usize,
            width: usize,
        ) -> Result<(), KernelError> {
            let (n_i, w) = (dim("rows", n_out)?, dim("width", width)?);
            let mut b = self.stream.launch_builder(f);
            b.arg(src).arg(idx).arg(out).arg(&n_i).arg(&w);
            // SAFETY: 1. both row kernels take (u16*, u32*, u16*, int, int);
            // 2. idx holds n_out indices, each < rows of src (checked by the
            // callers, DROPPED allowed for unpack); 3. out holds n_out·width
            // elements and does not alias src.
            unsafe { b.launch(self.rows_config(n_out)) }.map_err(cuda)?;
            Ok(())
        }

        /// Per-expert top-q: pairs grouped by expert (`offsets`, `n_experts + 1`
        /// entries), ties to the smaller id. Scores must be finite and ≥ 0.
        pub fn select_top(
            &self,
            scores: &[f32],
            ids: &[u32],
            offsets: &[u32],
            quotas: &[u32],
        ) -> Result<Vec<bool>, KernelError> {
            crate::cpu::check_selection(scores, ids, offsets, quotas)?;
            let (sd, idd, od, qd) = (
                self.upload(scores)?,
                self.upload(ids)?,
                self.upload(offsets)?,
                self.upload(quotas)?,
            );
            let mut kept = self.poisoned::<u8>(scores.len())?;
            let mut err = self.stream.clone_htod(&[0u32]).map_err(cuda)?;
            if !quotas.is_empty() {
                // SAFETY: `check_selection` checked the offsets and quotas
                // against the scores, ids and the kept flags' length.
                unsafe {
                    self.launch_select(&sd, &idd, &od, &qd, &mut kept, &mut err, quotas.len())
                }?;
            }
            if self.stream.clone_dtoh(&err).map_err(cuda)?[0] != 0 {
                return Err(KernelError::Cuda(
                    "select_top: a score is NaN, infinite or negative".into(),
                ));
            }
            Ok(self
                .download(&kept, scores.len())?
                .into_iter()
                .map(|k| k == 1)
                .collect())
        }

        /// Top-q selection on the device: for each segment `b` of `offsets`
        /// (`n_experts + 1` entries), flags in `kept` the `quotas[b]` rows
        /// with the largest `scores` (ties to the smaller `ids`); a
        /// non-finite score sets `err[0]` (twin:
        /// [`crate::cpu::select_top_reference`]).
        ///
        /// # Safety
        ///
        /// 1. `offsets` holds `n_experts + 1` ascending entries ending at
        ///    most at the length of `scores`, `ids` and `kept`; `quotas`
        ///    holds `n_experts`.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn launch_select(
            &self,
            scores: &CudaSlice<f32>,
            ids: &CudaSlice<u32>,
            offsets: &CudaSlice<u32>,
            quotas: &CudaSlice<u32>,
            kept: &mut CudaSlice<u8>,
            err: &mut CudaSlice<u32>,
            n_experts: usize,
        ) -> Result<(), KernelError> {
            let grid = u32::try_from(n_experts).map_err(|_| KernelError::Shape {
                what: "experts",
                expected: u32::MAX as usize,
                got: n_experts,
            })?;
            let mut b = self.stream.launch_builder(&self.select);
            b.arg(scores)
                .arg(ids)
                .arg(offsets)
                .arg(quotas)
                .arg(kept)
                .arg(err);
            // SAFETY: 1. the kernel takes (f32*, u32*, u32*, u32*, u8*, u32*);
            // 2. offsets has n_experts + 1 non-decreasing entries ending at
            // the pair count (checked by the caller), so every block reads
            // and writes inside scores, ids and kept; 3. kept and err alias
            // nothing else.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (512, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(cuda)?;
            Ok(())
        }

        /// Top-q selection of `n_pairs` pairs over `n_experts` experts with
        /// Zipf(0.8) counts, half of each expert kept; bytes = scores and ids read.
        pub fn bench_select(
            &self,
            n_experts: usize,
            n_pairs: usize,
        ) -> Result<Timing, KernelError> {
            let w: Vec<f64> = (1..=n_experts).map(|i| (i as f64).powf(-0.8)).collect();
            let total: f64 = w.iter().sum();
            let mut counts: Vec<u32> = w
                .iter()
                .map(|x| (x / total * n_pairs as f64) as u32)
                .collect();
            counts[0] += n_pairs as u32 - counts.iter().sum::<u32>();
            let mut offsets = vec![0u32];
            for c in &counts {
                offsets.push(offsets.last().copied().unwrap_or(0) + c);
            }
            let quotas: Vec<u32> = counts.iter().map(|c| c / 2).collect();
            let scores: Vec<f32> = random_bf16(n_pairs, 9)
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16).abs())
                .collect();
            let ids: Vec<u32> = (0..n_pairs as u32).collect();
            let (sd, idd, od, qd) = (
                self.upload(&scores)?,
                self.upload(&ids)?,
                self.upload(&offsets)?,
                self.upload(&quotas)?,
            );
            let mut kept = self.poisoned::<u8>(n_pairs)?;
            let mut err = self.stream.clone_htod(&[0u32]).map_err(cuda)?;
            let ms = self.time(50, || {
                // SAFETY: the offsets are the prefix sums of counts summing
                // to n_pairs, the length of every row buffer.
                unsafe { self.launch_select(&sd, &idd, &od, &qd, &mut kept, &mut err, n_experts) }
            })?;
            Ok(Timing {
                ms,
                bytes: (n_pairs * 9) as f64,
            })
        }

        fn elementwise_config(&self, n: usize) -> LaunchConfig {
            let blocks = n
                .div_ceil(THREADS as usize)
                .clamp(1, (self.n_sms * 32) as usize) as u32;
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        }

        /// Router logits (bf16 bits, rows of `bias.len()` columns) plus a
        /// per-column bias, f32: the hot-expert workload's logits (twin:
        /// [`crate::cpu::logits_bias_reference`]).
        pub fn logits_bias_f32(
            &self,
            logits: &[u16],
            bias: &[f32],
        ) -> Result<Vec<f32>, KernelError> {
            let cols = bias.len();
            if cols == 0 || logits.len() % cols != 0 {
                return Err(KernelError::Shape {
                    what: "logits (whole rows of the bias's width)",
                    expected: cols,
                    got: logits.len(),
                });
            }
            let n = logits.len();
            let (ld, bd) = (self.upload(logits)?, self.upload(bias)?);
            let mut out = self.poisoned::<f32>(n)?;
            if n > 0 {
                let (n_i, c_i) = (n as i64, dim("columns", cols)?);
                let mut l = self.stream.launch_builder(&self.f_to_f32_bias);
                l.arg(&ld).arg(&bd).arg(&mut out).arg(&n_i).arg(&c_i);
                // SAFETY: (u16*, f32*, f32*, long long, int) matches; logits
                // and out hold n, bias cols (n a multiple of cols).
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            self.download(&out, n)
        }

        /// Priority sampling keys `√score / u(seed, id)` (twin:
        /// [`crate::cpu::priority_keys_reference`]).
        pub fn priority_keys(
            &self,
            score: &[f32],
            id: &[u32],
            seed: u64,
        ) -> Result<Vec<f32>, KernelError> {
            check("id", score.len(), id.len())?;
            let (sd, idd) = (self.upload(score)?, self.upload(id)?);
            let out = self.priority_keys_dev(&sd, &idd, seed, score.len())?;
            self.download(&out, score.len())
        }

        /// [`Gpu::priority_keys`] on device buffers of `n` entries.
        pub fn priority_keys_dev(
            &self,
            score: &CudaSlice<f32>,
            id: &CudaSlice<u32>,
            seed: u64,
            n: usize,
        ) -> Result<CudaSlice<f32>, KernelError> {
            at_least("scores and ids", n, score.len().min(id.len()))?;
            // SAFETY: the kernel below writes all n keys (nothing reads a
            // zero-size output). A poisoned upload here cost a host
            // round trip a layer call (session 51).
            let mut out = unsafe { self.uninit::<f32>(n) }?;
            if n > 0 {
                let n_i = dim("n", n)?;
                let mut l = self.stream.launch_builder(&self.f_priority_keys);
                l.arg(score).arg(id).arg(&seed).arg(&mut out).arg(&n_i);
                // SAFETY: (f32*, u32*, u64, f32*, int) matches; all hold n.
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            Ok(out)
        }

        /// Priority sampling weights per expert segment of `offsets` (from
        /// 0 to the rows) from the keys, the scores and the masks kept at
        /// `q` and `q + 1` (twin: [`crate::cpu::priority_weights_reference`]).
        pub fn priority_weights(
            &self,
            rho: &[f32],
            score: &[f32],
            (kept_q, kept_q1): (&[u8], &[u8]),
            offsets: &[u32],
        ) -> Result<Vec<f32>, KernelError> {
            let n = rho.len();
            check("score", n, score.len())?;
            check("kept at q", n, kept_q.len())?;
            check("kept at q + 1", n, kept_q1.len())?;
            if offsets.first() != Some(&0)
                || offsets.windows(2).any(|w| w[0] > w[1])
                || offsets[offsets.len() - 1] as usize != n
            {
                return Err(KernelError::Shape {
                    what: "offsets (ascending from 0 to the rows)",
                    expected: n,
                    got: offsets.last().copied().unwrap_or(0) as usize,
                });
            }
            let (rd, sd) = (self.upload(rho)?, self.upload(score)?);
            let (kd, k1d, od) = (
                self.upload(kept_q)?,
                self.upload(kept_q1)?,
                self.upload(offsets)?,
            );
            // SAFETY: the offsets were checked above against n, the length
            // of every row buffer.
            let out = unsafe {
                self.priority_weights_dev(&rd, &sd, (&kd, &k1d), &od, n, offsets.len() - 1)
            }?;
            self.download(&out, n)
        }

        /// [`Gpu::priority_weights`] on device buffers (`groups` segments).
        ///
        /// # Safety
        ///
        /// 1. `rho`, `score` and both masks hold `n` entries.
        /// 2. `offsets` holds `groups + 1` ascending entries from 0 to `n`
        ///    (every row in one segment: the output is written nowhere
        ///    else).
        pub unsafe fn priority_weights_dev(
            &self,
            rho: &CudaSlice<f32>,
            score: &CudaSlice<f32>,
            (kept_q, kept_q1): (&CudaSlice<u8>, &CudaSlice<u8>),
            offsets: &CudaSlice<u32>,
            n: usize,
            groups: usize,
        ) -> Result<CudaSlice<f32>, KernelError> {
            // SAFETY: the caller's offsets partition 0..n (2.), so the
            // blocks write every row's weight.
            let mut out = unsafe { self.uninit::<f32>(n) }?;
            if groups > 0 && n > 0 {
                let grid = u32::try_from(groups).map_err(|_| KernelError::Shape {
                    what: "groups",
                    expected: u32::MAX as usize,
                    got: groups,
                })?;
                let mut l = self.stream.launch_builder(&self.f_priority_weights);
                l.arg(rho)
                    .arg(score)
                    .arg(kept_q)
                    .arg(kept_q1)
                    .arg(offsets)
                    .arg(&mut out);
                // SAFETY: (f32*, f32*, u8*, u8*, u32*, f32*) matches; the
                // offsets' groups + 1 entries partition 0..n, which every
                // row buffer holds.
                unsafe {
                    l.launch(LaunchConfig {
                        grid_dim: (grid, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(cuda)?;
            }
            Ok(out)
        }

        /// `a ⊙ b` (f32).
        pub fn mul_f32(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>, KernelError> {
            check("b", a.len(), b.len())?;
            let (ad, bd) = (self.upload(a)?, self.upload(b)?);
            let out = self.mul_f32_dev(&ad, &bd, a.len())?;
            self.download(&out, a.len())
        }

        /// [`Gpu::mul_f32`] on device buffers of `n` entries.
        pub fn mul_f32_dev(
            &self,
            a: &CudaSlice<f32>,
            b: &CudaSlice<f32>,
            n: usize,
        ) -> Result<CudaSlice<f32>, KernelError> {
            at_least("factors", n, a.len().min(b.len()))?;
            // SAFETY: the kernel below writes all n products.
            let mut out = unsafe { self.uninit::<f32>(n) }?;
            if n > 0 {
                let n_i = dim("n", n)?;
                let mut l = self.stream.launch_builder(&self.f_mul_f32);
                l.arg(a).arg(b).arg(&mut out).arg(&n_i);
                // SAFETY: (f32*, f32*, f32*, int) matches; all hold n.
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            Ok(out)
        }

        /// `h = silu(a) ⊙ b` on bf16 bits (f32 math, round to nearest even).
        pub fn swiglu_bf16(&self, a: &[u16], b: &[u16]) -> Result<Vec<u16>, KernelError> {
            check("b", a.len(), b.len())?;
            let n = a.len();
            let (ad, bd) = (self.upload(a)?, self.upload(b)?);
            let mut h = self.poisoned::<u16>(n)?;
            if n > 0 {
                let n_i = n as i64;
                let mut l = self.stream.launch_builder(&self.swiglu_fwd);
                l.arg(&ad).arg(&bd).arg(&mut h).arg(&n_i);
                // SAFETY: 1. (u16*, u16*, u16*, long long) matches; 2. all
                // three buffers hold n elements; 3. h aliases nothing.
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            self.download(&h, n)
        }

        /// SwiGLU backward on bf16 bits: `(da, db)`.
        #[allow(clippy::type_complexity)]
        pub fn swiglu_backward_bf16(
            &self,
            a: &[u16],
            b: &[u16],
            dh: &[u16],
        ) -> Result<(Vec<u16>, Vec<u16>), KernelError> {
            check("b", a.len(), b.len())?;
            check("dh", a.len(), dh.len())?;
            let n = a.len();
            let (ad, bd, gd) = (self.upload(a)?, self.upload(b)?, self.upload(dh)?);
            let mut da = self.poisoned::<u16>(n)?;
            let mut db = self.poisoned::<u16>(n)?;
            if n > 0 {
                let n_i = n as i64;
                let mut l = self.stream.launch_builder(&self.swiglu_bwd);
                l.arg(&ad)
                    .arg(&bd)
                    .arg(&gd)
                    .arg(&mut da)
                    .arg(&mut db)
                    .arg(&n_i);
                // SAFETY: 1. (u16*, u16*, u16*, u16*, u16*, long long)
                // matches; 2. all buffers hold n elements; 3. da and db
                // alias nothing.
                unsafe { l.launch(self.elementwise_config(n)) }.map_err(cuda)?;
            }
            Ok((self.download(&da, n)?, self.download(&db, n)?))
        }

        /// Softmax and top-k of `t × e` f32 logits into `probs` (`t × e`),
        /// `idx` and `gates` (`t × k`), which must hold that many elements.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn launch_router_topk(
            &self,
            logits: &CudaSlice<f32>,
            sel_bias: Option<&CudaSlice<f32>>,
            (probs, idx, gates): (
                &mut CudaSlice<f32>,
                &mut CudaSlice<u32>,
                &mut CudaSlice<f32>,
            ),
            t: usize,
            e: usize,
            k: usize,
            renormalize: bool,
        ) -> Result<(), KernelError> {
            if logits.len() < t * e
                || probs.len() < t * e
                || idx.len() < t * k
                || gates.len() < t * k
            {
                return Err(KernelError::Shape {
                    what: "router buffers",
                    expected: t * e,
                    got: logits.len().min(probs.len()),
                });
            }
            let (t_i, e_i, k_i, r_i) = (
                dim("tokens", t)?,
                dim("experts", e)?,
                dim("top_k", k)?,
                i32::from(renormalize),
            );
            if let Some(b) = sel_bias {
                at_least("selection bias (one per expert)", e, b.len())?;
            }
            let null = 0u64;
            let mut l = self.stream.launch_builder(&self.router);
            l.arg(logits);
            match sel_bias {
                Some(b) => l.arg(b),
                None => l.arg(&null),
            };
            l.arg(probs)
                .arg(idx)
                .arg(gates)
                .arg(&t_i)
                .arg(&e_i)
                .arg(&k_i)
                .arg(&r_i);
            // SAFETY: 1. (f32*, const f32* or null, f32*, u32*, f32*, int,
            // int, int, int) matches; 2. logits and probs hold t·e, the bias
            // e, idx and gates t·k elements (checked above); 3. outputs
            // alias nothing.
            unsafe { l.launch(self.rows_config(t)) }.map_err(cuda)?;
            Ok(())
        }

        /// Router softmax and top-k over `t × e` logits: `(probs, idx, gates)`.
        #[allow(clippy::type_complexity)]
        pub fn router_topk(
            &self,
            logits: &[f32],
            sel_bias: Option<&[f32]>,
            e: usize,
            k: usize,
            renormalize: bool,
        ) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>), KernelError> {
            let t = crate::cpu::check_router(logits.len(), e, k)?;
            if let Some(b) = sel_bias {
                check("selection bias (one per expert)", e, b.len())?;
            }
            let bd = sel_bias.map(|b| self.upload(b)).transpose()?;
            let ld = self.upload(logits)?;
            let mut probs = self.poisoned::<f32>(t * e)?;
            let mut idx = self.poisoned::<u32>(t * k)?;
            let mut gates = self.poisoned::<f32>(t * k)?;
            if t > 0 {
                self.launch_router_topk(
                    &ld,
                    bd.as_ref(),
                    (&mut probs, &mut idx, &mut gates),
                    t,
                    e,
                    k,
                    renormalize,
                )?;
            }
            Ok((
                self.download(&probs, t * e)?,
                self.download(&idx, t * k)?,
                self.download(&gates, t * k)?,
            ))
        }

        /// Combine: `y[t] = Σ_j gates[t, j] · o[row[t, j]]` on bf16 bits.
        pub fn combine_bf16(
            &self,
            o: &[u16],
            h: usize,
            row: &[u32],
            gates: &[f32],
            k: usize,
        ) -> Result<Vec<u16>, KernelError> {
            self.combine_onto_bf16(None, o, h, row, gates, k)
        }

        /// [`Gpu::combine_bf16`] added onto `base` (`t × h`, bf16 bits) in
        /// f32 before the one rounding (twin:
        /// [`crate::cpu::combine_onto_bf16_reference`]).
        pub fn combine_onto_bf16(
            &self,
            base: Option<&[u16]>,
            o: &[u16],
            h: usize,
            row: &[u32],
            gates: &[f32],
            k: usize,
        ) -> Result<Vec<u16>, KernelError> {
            let t = crate::cpu::check_combine(base, o, h, row, gates, k)?;
            let (od, rd, gd) = (self.upload(o)?, self.upload(row)?, self.upload(gates)?);
            let bd = base.map(|b| self.upload(b)).transpose()?;
            let null: u64 = 0;
            let mut y = self.poisoned::<u16>(t * h)?;
            if t > 0 && h > 0 {
                let (t_i, h_i, k_i) = (dim("tokens", t)?, dim("hidden", h)?, dim("top_k", k)?);
                let mut l = self.stream.launch_builder(&self.combine);
                l.arg(&od).arg(&rd).arg(&gd);
                match &bd {
                    Some(b) => l.arg(b),
                    None => l.arg(&null),
                };
                l.arg(&mut y).arg(&t_i).arg(&h_i).arg(&k_i);
                // SAFETY: 1. (u16*, u32*, f32*, u16* or null, u16*, int,
                // int, int) matches; 2. every row index is DROPPED or < rows
                // of o (checked above), base and y hold t·h elements; 3. y
                // aliases nothing.
                unsafe { l.launch(self.rows_config(t)) }.map_err(cuda)?;
            }
            self.download(&y, t * h)
        }

        /// SwiGLU forward over `n` elements; bytes = a, b read + h written.
        pub fn bench_swiglu(&self, n: usize) -> Result<Timing, KernelError> {
            let (a, b) = (
                self.upload(&random_bf16(n, 10))?,
                self.upload(&random_bf16(n, 11))?,
            );
            let mut h = self.poisoned::<u16>(n)?;
            let n_i = n as i64;
            let ms = self.time(20, || {
                let mut l = self.stream.launch_builder(&self.swiglu_fwd);
                l.arg(&a).arg(&b).arg(&mut h).arg(&n_i);
                // SAFETY: as in `swiglu_bf16`: matching signature, n elements each.
                unsafe { l.launch(self.elementwise_config(n)) }
                    .map(|_| ())
                    .map_err(cuda)
            })?;
            Ok(Timing {
                ms,
                bytes: (3 * n * 2) as f64,
            })
        }

        /// The router backward's parts at `t` tokens × top-`k` of `e`
        /// experts, width `h` (median ms each): the dlogits kernel, the
        /// router weight gradient `xᵀ·dlogits` as one GEMM group and
        /// split over 8 token groups (partial outputs, not summed), and the
        /// input gradient `dlogits·Wᵀ`. Bytes: the pair rows and dy read.
        pub fn bench_router_backward(
            &self,
            t: usize,
            h: usize,
            e: usize,
            k: usize,
        ) -> Result<Vec<(&'static str, f64)>, KernelError> {
            let rows = t * k;
            let o = self.upload(&random_bf16(rows * h, 21))?;
            let dy = self.upload(&random_bf16(t * h, 22))?;
            let x = self.upload(&random_bf16(t * h, 23))?;
            let router = self.upload(&random_bf16(h * e, 24))?;
            let row = self.upload(&permutation(rows, 25))?;
            let probs = self.upload(&vec![1.0f32 / e as f32; t * e])?;
            let idx: Vec<u32> = (0..rows)
                .map(|i| ((i % k) * (e / k.max(1))) as u32)
                .collect();
            let idx = self.upload(&idx)?;
            let gates = self.upload(&vec![1.0f32 / k as f32; rows])?;
            let mut dl = self.poisoned::<u16>(t * e)?;
            let (t_i, h_i, e_i, k_i) = (
                dim("tokens", t)?,
                dim("hidden", h)?,
                dim("experts", e)?,
                dim("top_k", k)?,
            );
            let null = 0u64;
            let mut out = Vec::new();
            let ms = self.time(20, || {
                let mut l = self.stream.launch_builder(&self.f_router_bwd);
                l.arg(&dy)
                    .arg(&o)
                    .arg(&row)
                    .arg(&probs)
                    .arg(&idx)
                    .arg(&gates);
                l.arg(&null).arg(&mut dl);
                l.arg(&t_i).arg(&h_i).arg(&e_i).arg(&k_i).arg(&1i32);
                // SAFETY: as in `router_backward`: matching signature,
                // row a permutation of the t·k rows of o, idx < e, no
                // auxiliary term.
                unsafe { l.launch(self.rows_config(t)) }
                    .map(|_| ())
                    .map_err(cuda)
            })?;
            out.push(("dlogits kernel", ms));
            let one = self.upload(&[0i32, t_i])?;
            let split: Vec<i32> = (0..=8).map(|g| (g * t / 8) as i32).collect();
            let split = self.upload(&split)?;
            let ms = self.time(20, || {
                self.gemm(GemmVariant::WeightGrad, &one, 1, &x, &dl, h * e, h, e)
                    .map(|_| ())
            })?;
            out.push(("router weight gradient (1 group)", ms));
            let ms = self.time(20, || {
                self.gemm(GemmVariant::WeightGrad, &split, 8, &x, &dl, 8 * h * e, h, e)
                    .map(|_| ())
            })?;
            out.push(("router weight gradient (8 token groups)", ms));
            let ms = self.time(20, || {
                self.gemm(GemmVariant::DataGrad, &one, 1, &dl, &router, t * h, h, e)
                    .map(|_| ())
            })?;
            out.push(("router input gradient", ms));
            Ok(out)
        }

        /// Combine of `t` tokens × `k` pairs of width `h`; bytes = expert rows
        /// read + outputs written.
        pub fn bench_combine(&self, t: usize, h: usize, k: usize) -> Result<Timing, KernelError> {
            let rows = t * k;
            let o = self.upload(&random_bf16(rows * h, 12))?;
            let row = self.upload(&permutation(rows, 13))?;
            let gates = self.upload(&vec![0.25f32; rows])?;
            let mut y = self.poisoned::<u16>(t * h)?;
            let (t_i, h_i, k_i) = (dim("tokens", t)?, dim("hidden", h)?, dim("top_k", k)?);
            let null: u64 = 0;
            let ms = self.time(20, || {
                let mut l = self.stream.launch_builder(&self.combine);
                l.arg(&o)
                    .arg(&row)
                    .arg(&gates)
                    .arg(&null)
                    .arg(&mut y)
                    .arg(&t_i)
                    .arg(&h_i)
                    .arg(&k_i);
                // SAFETY: as in `combine_bf16`: matching signature, rows a
                // permutation of 0..t·k, y holds t·h elements.
                unsafe { l.launch(self.rows_config(t)) }
                    .map(|_| ())
                    .map_err(cuda)
            })?;
            Ok(Timing {
                ms,
                bytes: ((rows + t) * h * 2 + rows * 8) as f64,
            })
        }

        /// Shapes of a grouped GEMM: `(a, b, d)` element counts.
        fn gemm_shapes(
            variant: GemmVariant,
            offsets: &[i32],
            h: usize,
            f: usize,
        ) -> Result<(usize, usize, usize), KernelError> {
            if offsets.first().copied().unwrap_or(0) != 0 || offsets.windows(2).any(|w| w[0] > w[1])
            {
                return Err(KernelError::Shape {
                    what: "offsets (must start at 0 and not decrease)",
                    expected: 0,
                    got: 1,
                });
            }
            if h % 8 != 0 || f % 8 != 0 {
                return Err(KernelError::Shape {
                    what: "h and f (multiples of 8 for 16-byte TMA rows)",
                    expected: 8,
                    got: h % 8 + f % 8,
                });
            }
            let e = offsets.len().saturating_sub(1);
            let rows = offsets.last().copied().unwrap_or(0) as usize;
            Ok(match variant {
                GemmVariant::Forward => (rows * h, e * h * f, rows * f),
                GemmVariant::DataGrad => (rows * f, e * h * f, rows * h),
                GemmVariant::WeightGrad => (rows * h, rows * f, e * h * f),
            })
        }

        #[allow(clippy::too_many_arguments)]
        fn launch_gemm<A: cudarc::driver::DevicePtr<u16>, B: cudarc::driver::DevicePtr<u16>>(
            &self,
            variant: GemmVariant,
            groups: usize,
            offsets: &CudaSlice<i32>,
            a: &A,
            b: &B,
            d: &mut CudaSlice<u16>,
            onto: bool,
            h: usize,
            f: usize,
            ws: &mut GemmWorkspace,
        ) -> Result<(), KernelError> {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let ws_len = ws.buf.len();
            // The SM count the workspace was sized for (the reserve may
            // change meanwhile on another thread sharing this `Gpu`).
            let sms = ws.sms;
            let (g, hh, ff) = (dim("groups", groups)?, dim("h", h)?, dim("f", f)?);
            self.ctx.bind_to_thread().map_err(cuda)?;
            let (po, _o) = offsets.device_ptr(&self.stream);
            let (pa, _a) = a.device_ptr(&self.stream);
            let (pb, _b) = b.device_ptr(&self.stream);
            let (pd, _d) = d.device_ptr_mut(&self.stream);
            let (pw, _w) = ws.buf.device_ptr_mut(&self.stream);
            // SAFETY: 1. the function is the library's `lrmoe_grouped_gemm`
            // with the declared C signature; 2. every pointer is a live
            // device allocation of the sizes `gemm_shapes` checked (offsets
            // has groups + 1 entries, the workspace the size the library
            // asked for; with `onto`, d holds the base it is added onto);
            // 3. the stream belongs to the current context.
            let rc = unsafe {
                (self.gemm.run)(
                    variant_code(variant),
                    g,
                    po as *const i32,
                    pa as *const std::ffi::c_void,
                    pb as *const std::ffi::c_void,
                    pd as *mut std::ffi::c_void,
                    if onto { 1.0 } else { 0.0 },
                    hh,
                    ff,
                    sms,
                    pw as *mut std::ffi::c_void,
                    ws_len,
                    self.stream.cu_stream() as *mut std::ffi::c_void,
                )
            };
            if rc != 0 {
                return Err(KernelError::Cuda(format!(
                    "grouped GEMM failed with code {rc}"
                )));
            }
            Ok(())
        }

        /// SMs a grouped GEMM is launched on: all but the reserve.
        fn gemm_sms(&self) -> i32 {
            let r = self.gemm_reserve.load(std::sync::atomic::Ordering::Relaxed);
            self.n_sms.saturating_sub(r).max(1) as i32
        }

        /// Leaves `sms` SMs out of the grouped GEMMs launched from now on
        /// (0: all SMs), so that a collective running beside them on
        /// another stream is not waited for by the GEMMs' persistent
        /// blocks. Results do not depend on it (the tiles and their
        /// reduction order are the same); only the speed does.
        pub fn set_gemm_sm_reserve(&self, sms: u32) {
            self.gemm_reserve
                .store(sms, std::sync::atomic::Ordering::Relaxed);
        }

        /// A grouped GEMM's workspace for the SM count of now, which the
        /// launch then uses.
        fn gemm_workspace(
            &self,
            variant: GemmVariant,
            groups: usize,
        ) -> Result<GemmWorkspace, KernelError> {
            let sms = self.gemm_sms();
            // SAFETY: a pure query of the library (declared C signature).
            let bytes = unsafe {
                (self.gemm.workspace)(variant_code(variant), dim("groups", groups)?, sms)
            };
            // Not zeroed (one memset launch less per GEMM): the library's
            // setup kernel writes every per-group array and CUTLASS's
            // `initialize` prepares its own part on the stream. The device
            // tests run with poisoned buffers, this one included.
            // SAFETY: nothing reads the workspace before those writes.
            let buf = unsafe { self.uninit::<u8>(bytes) }?;
            Ok(GemmWorkspace { buf, sms })
        }

        /// Grouped GEMM on bf16 bits (f32 accumulation, bf16 out); see
        /// [`GemmVariant`] for the three products. Group sizes are read on
        /// the device from `offsets`.
        pub fn grouped_gemm_bf16(
            &self,
            variant: GemmVariant,
            offsets: &[i32],
            a: &[u16],
            b: &[u16],
            h: usize,
            f: usize,
        ) -> Result<Vec<u16>, KernelError> {
            self.grouped_gemm_host(variant, offsets, a, b, None, h, f)
        }

        /// [`Gpu::grouped_gemm_bf16`] added onto `base` (the output's shape):
        /// `base + A·B` summed in f32 in the GEMM's epilogue and rounded
        /// once (twin: [`crate::grouped::CpuTwins`]'
        /// `grouped_gemm_onto`).
        #[allow(clippy::too_many_arguments)]
        pub fn grouped_gemm_onto_bf16(
            &self,
            variant: GemmVariant,
            offsets: &[i32],
            a: &[u16],
            b: &[u16],
            base: &[u16],
            h: usize,
            f: usize,
        ) -> Result<Vec<u16>, KernelError> {
            self.grouped_gemm_host(variant, offsets, a, b, Some(base), h, f)
        }

        /// The host-slice grouped GEMM: into a poisoned output, or onto
        /// `base` when given.
        #[allow(clippy::too_many_arguments)]
        fn grouped_gemm_host(
            &self,
            variant: GemmVariant,
            offsets: &[i32],
            a: &[u16],
            b: &[u16],
            base: Option<&[u16]>,
            h: usize,
            f: usize,
        ) -> Result<Vec<u16>, KernelError> {
            let (na, nb, nd) = Self::gemm_shapes(variant, offsets, h, f)?;
            check("a", na, a.len())?;
            check("b", nb, b.len())?;
            if let Some(base) = base {
                check("base", nd, base.len())?;
            }
            let groups = offsets.len().saturating_sub(1);
            let (od, ad, bd) = (self.upload(offsets)?, self.upload(a)?, self.upload(b)?);
            let mut d = match base {
                Some(base) => self.upload(base)?,
                None => self.poisoned::<u16>(nd)?,
            };
            if groups > 0 && nd > 0 {
                let mut ws = self.gemm_workspace(variant, groups)?;
                let onto = base.is_some();
                self.launch_gemm(variant, groups, &od, &ad, &bd, &mut d, onto, h, f, &mut ws)?;
            }
            self.download(&d, nd)
        }

        /// Grouped GEMM over `counts` rows per group, random bf16 data;
        /// returns the timing and the TFLOP/s (`2·rows·h·f` FLOPs).
        pub fn bench_grouped_gemm(
            &self,
            variant: GemmVariant,
            counts: &[u32],
            h: usize,
            f: usize,
        ) -> Result<(Timing, f64), KernelError> {
            let mut offsets = vec![0i32];
            for &c in counts {
                offsets.push(offsets.last().copied().unwrap_or(0) + c as i32);
            }
            let (na, nb, nd) = Self::gemm_shapes(variant, &offsets, h, f)?;
            let groups = counts.len();
            let od = self.upload(&offsets)?;
            let ad = self.upload(&random_bf16(na, 21))?;
            let bd = self.upload(&random_bf16(nb, 22))?;
            let mut d = self.poisoned::<u16>(nd)?;
            let mut ws = self.gemm_workspace(variant, groups)?;
            let ms = self.time(20, || {
                self.launch_gemm(variant, groups, &od, &ad, &bd, &mut d, false, h, f, &mut ws)
            })?;
            let rows = offsets.last().copied().unwrap_or(0) as f64;
            let flops = 2.0 * rows * h as f64 * f as f64;
            Ok((
                Timing {
                    ms,
                    bytes: ((na + nb + nd) * 2) as f64,
                },
                flops / (ms * 1e-3) / 1e12,
            ))
        }

        /// Allocates one device buffer per size (plain `cuMemAlloc`), touches
        /// every byte, and returns the device memory in use while all are
        /// held, minus what was in use before (`cuMemGetInfo`). Frees them.
        pub fn measure_allocations(&self, sizes: &[u64]) -> Result<u64, KernelError> {
            self.trim_pool()?;
            let (free0, _) = cudarc::driver::result::mem_get_info().map_err(cuda)?;
            let mut held = Vec::with_capacity(sizes.len());
            for &b in sizes {
                if b > 0 {
                    held.push(self.stream.alloc_zeros::<u8>(b as usize).map_err(cuda)?);
                }
            }
            self.stream.synchronize().map_err(cuda)?;
            let (free1, _) = cudarc::driver::result::mem_get_info().map_err(cuda)?;
            drop(held);
            Ok(free0.saturating_sub(free1) as u64)
        }

        /// Starts a peak measurement of the device's stream-ordered pool:
        /// resets its high-water mark to the bytes in use and returns them.
        /// [`Gpu::pool_peak_bytes`] then says the most held at once since.
        /// Buffers count from their allocation to their free, both in the
        /// host's call order; the pool is the device's, so the figure covers
        /// every thread that allocates on it meanwhile.
        pub fn pool_reset_peak(&self) -> Result<u64, KernelError> {
            Ok(pool_usage(&self.ctx, true)?.0)
        }

        /// The pool's high-water mark since [`Gpu::pool_reset_peak`], bytes.
        pub fn pool_peak_bytes(&self) -> Result<u64, KernelError> {
            Ok(pool_usage(&self.ctx, false)?.1)
        }

        /// The pool's bytes in use now and its high-water mark since
        /// [`Gpu::pool_reset_peak`].
        pub fn pool_usage(&self) -> Result<(u64, u64), KernelError> {
            pool_usage(&self.ctx, false)
        }

        /// Waits for the stream, then hands the pool's freed memory back to
        /// the driver, so `cuMemGetInfo` counts live buffers only.
        pub fn trim_pool(&self) -> Result<(), KernelError> {
            self.stream.synchronize().map_err(cuda)?;
            pool_set(&self.ctx, PoolOp::Trim)
        }

        /// Median time of `f` over `reps` runs after 3 warm-ups, by CUDA events.
        fn time(
            &self,
            reps: usize,
            mut f: impl FnMut() -> Result<(), KernelError>,
        ) -> Result<f64, KernelError> {
            for _ in 0..3 {
                f()?;
            }
            let mut ts = Vec::with_capacity(reps);
            for _ in 0..reps {
                let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                let a = self.ctx.new_event(timing).map_err(cuda)?;
                let b = self.ctx.new_event(timing).map_err(cuda)?;
                a.record(&self.stream).map_err(cuda)?;
                f()?;
                b.record(&self.stream).map_err(cuda)?;
                b.synchronize().map_err(cuda)?;
                ts.push(f64::from(a.elapsed_ms(&b).map_err(cuda)?));
            }
            ts.sort_by(f64::total_cmp);
            Ok(ts[ts.len() / 2])
        }

        /// AdamW over `n` parameters (f32 masters and moments, the bf16
        /// copy written) with a bf16 (`bf16_grad`) or an f32 gradient, 10
        /// timed runs: bytes = what it must move, 28 or 30 a parameter.
        pub fn bench_adamw(&self, n: usize, bf16_grad: bool) -> Result<Timing, KernelError> {
            let hp = crate::dense::AdamHp {
                lr: 1e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                bc1: 0.1,
                bc2: 0.05,
                clip: 1.0,
            };
            let (mut p, mut m, mut v) = (self.zeros(n)?, self.zeros(n)?, self.zeros(n)?);
            let mut p16 = self.zeros::<u16>(n)?;
            let norm = self.upload(&[4.0f32])?;
            let ms = if bf16_grad {
                let g = self.zeros::<u16>(n)?;
                self.time(10, || {
                    self.adamw(&mut p, &mut m, &mut v, &g, Some(&mut p16), &hp, &norm)
                })?
            } else {
                let g = self.zeros::<f32>(n)?;
                self.time(10, || {
                    self.adamw(&mut p, &mut m, &mut v, &g, Some(&mut p16), &hp, &norm)
                })?
            };
            let per = if bf16_grad { 28.0 } else { 30.0 };
            Ok(Timing {
                ms,
                bytes: per * n as f64,
            })
        }

        /// AdamW's access pattern alone over `n` parameters
        /// ([`Gpu::adamw_streams`]: the same loads and stores as
        /// [`Gpu::bench_adamw`] with a bf16 gradient, adds for the
        /// arithmetic), 10 timed runs: bytes = 28 a parameter.
        pub fn bench_adamw_streams(&self, n: usize) -> Result<Timing, KernelError> {
            let (mut p, mut m, mut v) = (self.zeros(n)?, self.zeros(n)?, self.zeros(n)?);
            let mut p16 = self.zeros::<u16>(n)?;
            let g = self.zeros::<u16>(n)?;
            let ms = self.time(10, || {
                self.adamw_streams(&mut p, &mut m, &mut v, &g, &mut p16)
            })?;
            Ok(Timing {
                ms,
                bytes: 28.0 * n as f64,
            })
        }

        /// The squared norm of `n` bf16 (`bf16`) or f32 zeros, 10 timed
        /// runs: bytes = the input read once.
        pub fn bench_sq_sum(&self, n: usize, bf16: bool) -> Result<Timing, KernelError> {
            let mut out = self.zeros::<f32>(1)?;
            let ms = if bf16 {
                let x = self.zeros::<u16>(n)?;
                self.time(10, || self.sq_sum_into(&x, n, &mut out))?
            } else {
                let x = self.zeros::<f32>(n)?;
                self.time(10, || self.sq_sum_into(&x, n, &mut out))?
            };
            Ok(Timing {
                ms,
                bytes: (if bf16 { 2 } else { 4 } * n) as f64,
            })
        }

        /// The dense rows' memory-bound kernels at a model's shape (issue
        /// 31's embedding and norm parts): `n` tokens of width `d`, a
        /// vocabulary of `vocab`, 10 timed runs each. Rows: the embedding's
        /// forward (f32 table rows gathered: 8 bytes an element), the
        /// RMSNorm forward keeping its f32 input (`rmsnorm_keeping`: read
        /// 4, copy 4, bf16 output 2), and its backward adding into the f32
        /// residual gradient (`rmsnorm_backward`: x 4, dy 2, dx read and
        /// written 8).
        pub fn bench_rows(
            &self,
            n: usize,
            d: usize,
            vocab: usize,
        ) -> Result<Vec<(&'static str, Timing)>, KernelError> {
            let table = self.zeros::<f32>(vocab * d)?;
            let tok: Vec<u32> = (0..n).map(|i| ((i * 7919) % vocab) as u32).collect();
            let tok = self.upload(&tok)?;
            // SAFETY: every token is below `vocab`, the table's rows.
            let embed = self.time(10, || unsafe { self.embed(&table, &tok, n, d) }.map(drop))?;
            drop(table);
            let x = self.upload(&vec![0.5f32; n * d])?;
            let w = self.upload(&vec![1.0f32; d])?;
            let fwd = self.time(10, || self.rmsnorm_keeping(&x, &w, n, 1e-6).map(drop))?;
            let (_, _, inv) = self.rmsnorm_keeping(&x, &w, n, 1e-6)?;
            let dy = self.zeros::<u16>(n * d)?;
            let (mut dx, mut dw) = (self.zeros::<f32>(n * d)?, self.zeros::<f32>(d)?);
            let bwd = self.time(10, || {
                self.rmsnorm_backward(&x, &w, &inv, &dy, &mut dx, &mut dw, n)
            })?;
            let e = (n * d) as f64;
            Ok(vec![
                (
                    "embedding forward (f32 rows gathered)",
                    Timing {
                        ms: embed,
                        bytes: 8.0 * e,
                    },
                ),
                (
                    "RMSNorm forward, f32 input kept",
                    Timing {
                        ms: fwd,
                        bytes: 10.0 * e,
                    },
                ),
                (
                    "RMSNorm backward into the f32 residual gradient",
                    Timing {
                        ms: bwd,
                        bytes: 14.0 * e,
                    },
                ),
            ])
        }

        /// Device-to-device copy of `bytes`: the bandwidth peer (bytes read + written).
        pub fn bench_copy(&self, bytes: usize) -> Result<Timing, KernelError> {
            let src = self.upload(&random_bf16(bytes / 2, 7))?;
            let mut dst = self.poisoned::<u16>(bytes / 2)?;
            let ms = self.time(20, || self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda))?;
            Ok(Timing {
                ms,
                bytes: 2.0 * bytes as f64,
            })
        }

        /// The fused cross-entropy over `n` random bf16 rows of `v` with the
        /// launch `how`, 10 timed runs: bytes = the least HBM must move,
        /// the logits read once and the gradient written once (4 bytes an
        /// element). Also the loss summed by the last run and the
        /// gradient's first `keep_rows` rows, to hold launches against
        /// each other.
        pub fn bench_cross_entropy(
            &self,
            (n, v): (usize, usize),
            how: XentLaunch,
            keep_rows: usize,
        ) -> Result<(Timing, f32, Vec<u16>), KernelError> {
            // 64 random rows, repeated on the device (host generation and
            // upload of the whole 5 GB would take longer than the runs).
            let block_rows = n.clamp(1, 64);
            let block = self.upload(&random_bf16(block_rows * v, 11))?;
            let mut logits = self.poisoned::<u16>(n * v)?;
            for r0 in (0..n).step_by(block_rows) {
                let rows = block_rows.min(n - r0);
                self.stream
                    .memcpy_dtod(
                        &block.slice(..rows * v),
                        &mut logits.slice_mut(r0 * v..(r0 + rows) * v),
                    )
                    .map_err(cuda)?;
            }
            let target: Vec<u32> = (0..n).map(|i| ((i * 7919) % v) as u32).collect();
            let target = self.upload(&target)?;
            let mut loss = self.upload(&[0f32])?;
            let mut last = None;
            let ms = self.time(10, || {
                self.stream.memset_zeros(&mut loss).map_err(cuda)?;
                // SAFETY: every target is below v (taken modulo v).
                let d = unsafe {
                    self.cross_entropy_with(
                        how,
                        &logits,
                        &target,
                        &mut loss,
                        (n, v),
                        1.0 / n as f32,
                    )
                }?;
                last = Some(d);
                Ok(())
            })?;
            let d = last.expect("invariant: `time` runs its closure");
            let kept = self.download(&d, keep_rows.min(n) * v)?;
            let loss = self.download(&loss, 1)?[0];
            Ok((
                Timing {
                    ms,
                    bytes: 4.0 * (n * v) as f64,
                },
                loss,
                kept,
            ))
        }

        /// Zero fill of `bytes` (`cuMemsetD8Async`, write only): the
        /// bandwidth of rows that are only written (bytes = written).
        pub fn bench_memset(&self, bytes: usize) -> Result<Timing, KernelError> {
            let mut dst = self.poisoned::<u16>(bytes / 2)?;
            let ms = self.time(20, || self.stream.memset_zeros(&mut dst).map_err(cuda))?;
            Ok(Timing {
                ms,
                bytes: bytes as f64,
            })
        }

        /// LRM scores over `n` random rows; bytes = rows read.
        pub fn bench_scores(
            &self,
            n: usize,
            d_in: usize,
            d_out: usize,
        ) -> Result<Timing, KernelError> {
            let h = self.upload(&random_bf16(n * d_in, 1))?;
            let d = self.upload(&random_bf16(n * d_out, 2))?;
            let g = self.upload(&vec![0.5f32; n])?;
            let mut out = self.poisoned::<f32>(n)?;
            let ms = self.time(20, || {
                self.launch_scores(&h, &d, &g, &mut out, n, d_in, d_out)
            })?;
            Ok(Timing {
                ms,
                bytes: (n * (d_in + d_out) * 2 + n * 8) as f64,
            })
        }

        /// Gather of `n` rows of `width` bf16 through a random permutation;
        /// bytes = read + written.
        pub fn bench_gather(&self, n: usize, width: usize) -> Result<Timing, KernelError> {
            let src = self.upload(&random_bf16(n * width, 3))?;
            let idx = self.upload(&permutation(n, 4))?;
            let mut out = self.poisoned::<u16>(n * width)?;
            let ms = self.time(20, || {
                self.launch_rows(&self.gather, &src, &idx, &mut out, n, width)
            })?;
            Ok(Timing {
                ms,
                bytes: 2.0 * (n * width * 2) as f64 + (n * 4) as f64,
            })
        }

        /// Unpack of `n` rows of `width` bf16 with `dropped` of every 100
        /// rows dropped; bytes = rows read + all rows written.
        pub fn bench_unpack(
            &self,
            n: usize,
            width: usize,
            dropped_per_100: usize,
        ) -> Result<Timing, KernelError> {
            let kept: Vec<usize> = (0..n)
                .filter(|i| (i * 37) % 100 >= dropped_per_100)
                .collect();
            let mut inverse = vec![crate::limits::DROPPED; n];
            let perm = permutation(kept.len(), 5);
            for (j, &i) in kept.iter().enumerate() {
                inverse[i] = perm[j];
            }
            let packed = self.upload(&random_bf16(kept.len().max(1) * width, 6))?;
            let inv = self.upload(&inverse)?;
            let mut out = self.poisoned::<u16>(n * width)?;
            let ms = self.time(20, || {
                self.launch_rows(&self.unpack, &packed, &inv, &mut out, n, width)
            })?;
            Ok(Timing {
                ms,
                bytes: ((kept.len() + n) * width * 2 + n * 4) as f64,
            })
        }
    }

    use crate::cpu::random_bf16;

    fn permutation(n: usize, seed: u64) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        let mut s = seed | 1;
        for i in (1..n).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            p.swap(i, (s % (i as u64 + 1)) as usize);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::{cudnn_candidates, write_content_named};
    use std::path::PathBuf;

    /// Sixteen threads writing the same library at once, each reading it
    /// back as soon as its call returns (as dlopen would), all get the one
    /// content-named path with whole bytes and leave no temporary file;
    /// other bytes get another name; an unwritable folder is an error, not
    /// a panic.
    #[test]
    fn content_named_writes_race_safely() {
        let dir = std::env::temp_dir().join(format!("lrmoe-embed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes: Vec<u8> = (0..1 << 22).map(|i: u32| (i * 7 + 3) as u8).collect();
        for round in 0..4 {
            let stem = format!("t{round}");
            let paths: Vec<PathBuf> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..16)
                    .map(|_| {
                        s.spawn(|| {
                            let p = write_content_named(&dir, &stem, &bytes).unwrap();
                            let back = std::fs::read(&p).unwrap();
                            assert!(back == bytes, "a partial file: {} bytes", back.len());
                            p
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(paths.iter().all(|p| *p == paths[0]));
        }
        let other = write_content_named(&dir, "t0", &bytes[1..]).unwrap();
        assert!(other.exists());
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left.len(), 5, "{left:?}");
        assert!(left.iter().all(|n| n.ends_with(".so")), "{left:?}");
        assert!(write_content_named(&dir.join("missing/deeper"), "t", &bytes).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `LRMOE_CUDNN` is the only candidate when set (a folder names the
    /// library inside it); otherwise the soname, then the Python package
    /// folders that hold cuDNN, each once.
    #[test]
    fn cudnn_candidates_follow_the_documented_order() {
        let dir = std::env::temp_dir().join(format!("lrmoe-cudnn-{}", std::process::id()));
        let lib = dir.join("site/nvidia/cudnn/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcudnn.so.9"), b"").unwrap();
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let site = dir.join("site");

        let only = cudnn_candidates(Some(&lib), std::slice::from_ref(&site));
        assert_eq!(only, vec![lib.join("libcudnn.so.9")]);
        let file = PathBuf::from("/opt/x/libcudnn.so.9.1");
        assert_eq!(cudnn_candidates(Some(&file), &[]), vec![file]);

        let found = cudnn_candidates(None, &[empty, site.clone(), site]);
        assert_eq!(
            found,
            vec![PathBuf::from("libcudnn.so.9"), lib.join("libcudnn.so.9")]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
