//! Where the CUDA build's inputs and outputs live, and the one place that
//! fixes the compiler's version and flags. `cargo xtask kernels` builds with
//! these; the `cuda` feature embeds the outputs; a CPU test fails with
//! "run `cargo xtask kernels`" when the outputs are stale.

use std::path::{Path, PathBuf};

/// nvcc and its parts from PyPI, pinned to the device machine's CUDA 13.0
/// (its 580 driver cannot JIT newer PTX).
pub const NVCC_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
];

/// CUTLASS headers (C++ templates, CuTe), installed without dependencies.
pub const CUTLASS_PACKAGE: &str = "nvidia-cutlass==4.2.0.0";

/// For the libraries of [`CUDNN_LIBS`]: cudnn-frontend's headers, cuDNN's
/// headers and `libcudnn.so.9` to link against (by soname; at run time the
/// user's copy), NVRTC's header (the frontend includes it), installed
/// without dependencies.
pub const CUDNN_PACKAGES: &[&str] = &[
    "nvidia-cudnn-frontend==1.32.0",
    "nvidia-cudnn-cu13==9.28.1.4",
    "nvidia-cuda-nvrtc==13.0.88",
];

/// The stems of `kernels/lib/*.cu` built against cuDNN ([`CUDNN_PACKAGES`]).
pub const CUDNN_LIBS: &[&str] = &["cudnn_attention"];

/// nvcc flags for `kernels/lib/*.cu`: shared libraries with `extern "C"`
/// launchers, sm_90a (wgmma needs it), static CUDA runtime. The include and
/// library folders of the virtual environment are added by the builder.
pub const LIB_FLAGS: &[&str] = &[
    "-O3",
    "-std=c++17",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler",
    "-fPIC",
    "-shared",
    "-gencode=arch=compute_90a,code=sm_90a",
];

/// nvcc flags: Hopper machine code (no JIT at load) plus compute_90 PTX.
pub const NVCC_FLAGS: &[&str] = &[
    "-O3",
    "-std=c++17",
    "--fatbin",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
];

/// The CUDA sources, `<workspace>/kernels/*.cu`, sorted.
pub fn sources(workspace: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(workspace.join("kernels"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    v.sort();
    Ok(v)
}

/// Host-side libraries, `<workspace>/kernels/lib/*.cu`, sorted; each becomes
/// `kernels/out/lib<stem>.so`.
pub fn lib_sources(workspace: &Path) -> std::io::Result<Vec<PathBuf>> {
    let dir = workspace.join("kernels").join("lib");
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    v.sort();
    Ok(v)
}

/// The folder of compiled outputs, `<workspace>/kernels/out`.
pub fn out_dir(workspace: &Path) -> PathBuf {
    workspace.join("kernels").join("out")
}

/// FNV-1a over the flags, the pins and every source's name and bytes (the
/// shared `limits.cuh` included): what the outputs were built from.
pub fn stamp(workspace: &Path) -> std::io::Result<String> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in NVCC_FLAGS
        .iter()
        .chain(NVCC_PACKAGES)
        .chain(LIB_FLAGS)
        .chain([&CUTLASS_PACKAGE])
        .chain(CUDNN_PACKAGES)
    {
        eat(f.as_bytes());
        eat(&[0]);
    }
    for src in sources(workspace)?
        .into_iter()
        .chain(lib_sources(workspace)?)
        .chain([workspace.join("kernels").join("limits.cuh")])
    {
        eat(src
            .file_name()
            .map(|n| n.as_encoded_bytes())
            .unwrap_or_default());
        eat(&[0]);
        eat(&std::fs::read(&src)?);
    }
    Ok(format!("{h:016x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_kernels_match_their_sources() {
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let want = stamp(&ws).expect("sources readable");
        let got = std::fs::read_to_string(out_dir(&ws).join("STAMP")).unwrap_or_default();
        assert_eq!(
            got.trim(),
            want,
            "kernels/out is stale against kernels/*.cu: run `cargo xtask kernels`"
        );
        for src in sources(&ws).expect("sources") {
            let stem = src
                .file_stem()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            assert!(
                out_dir(&ws).join(format!("{stem}.fatbin")).exists(),
                "kernels/out/{stem}.fatbin is missing: run `cargo xtask kernels`"
            );
        }
    }
}
