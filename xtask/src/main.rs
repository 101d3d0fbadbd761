//! `cargo xtask <task>`: project automation (alias in `.cargo/config.toml`).
//!
//! * `kernels` — compile `kernels/*.cu` for Hopper (sm_90) with nvcc into
//!   `kernels/out/` (fatbins and a STAMP of what they were built from), where
//!   the `kernels` crate embeds them. nvcc comes from PyPI, pinned in
//!   `kernels::artifacts`, installed into `.venv-cuda/` on first use.
//! * `ci` — run what `.ci/run` runs (format check, clippy, tests).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("invariant: xtask lives one level below the workspace root")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

/// nvcc from the project-local virtual environment, installing the pinned
/// PyPI packages on first use.
fn nvcc(root: &Path) -> Result<PathBuf> {
    let venv = root.join(".venv-cuda");
    let find = || -> Option<PathBuf> {
        let lib = venv.join("lib");
        std::fs::read_dir(&lib)
            .ok()?
            .filter_map(|e| e.ok())
            .find_map(|e| {
                let p = e.path().join("site-packages/nvidia/cu13/bin/nvcc");
                p.exists().then_some(p)
            })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(kernels::artifacts::NVCC_PACKAGES))?;
    run(Command::new(venv.join("bin/pip"))
        .args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
        ])
        .arg(kernels::artifacts::CUTLASS_PACKAGE)
        .args(kernels::artifacts::CUDNN_PACKAGES))?;
    find().context("nvcc not found in .venv-cuda after installing the pinned packages")
}

fn kernels() -> Result<()> {
    let root = root();
    let sources = kernels::artifacts::sources(&root).context("cannot list kernels/*.cu")?;
    if sources.is_empty() {
        bail!("no CUDA sources under kernels/");
    }
    // The constants the Rust wrappers and the kernels share.
    let header = root.join("kernels").join("limits.cuh");
    if std::fs::read_to_string(&header).ok().as_deref() != Some(&kernels::limits::header()) {
        std::fs::write(&header, kernels::limits::header())?;
        eprintln!("xtask: wrote {}", header.display());
    }
    let nvcc = nvcc(&root)?;
    let out = kernels::artifacts::out_dir(&root);
    std::fs::create_dir_all(&out)?;
    for src in &sources {
        let stem = src
            .file_stem()
            .context("source without a name")?
            .to_string_lossy()
            .into_owned();
        let target = out.join(format!("{stem}.fatbin"));
        let tmp = out.join(format!(".{stem}.fatbin.tmp"));
        run(Command::new(&nvcc)
            .args(kernels::artifacts::NVCC_FLAGS)
            .arg("-o")
            .arg(&tmp)
            .arg(src))?;
        std::fs::rename(&tmp, &target)?;
        eprintln!("xtask: wrote {}", target.display());
    }
    // Host-side libraries (CUTLASS): headers and the static runtime come
    // from the same virtual environment as nvcc.
    let cu13 = nvcc
        .parent()
        .and_then(Path::parent)
        .context("nvcc outside its package")?;
    let site = cu13
        .parent()
        .and_then(Path::parent)
        .context("nvidia package outside site-packages")?;
    let cutlass = site.join("cutlass_library/source");
    let fmha = patched_fmha(&cutlass, &root)?;
    for src in kernels::artifacts::lib_sources(&root)? {
        if !cutlass.join("include/cutlass/cutlass.h").exists() {
            bail!(
                "CUTLASS headers missing under {}: delete .venv-cuda and rerun",
                cutlass.display()
            );
        }
        let stem = src
            .file_stem()
            .context("source without a name")?
            .to_string_lossy()
            .into_owned();
        let target = out.join(format!("liblrmoe_{stem}.so"));
        let tmp = out.join(format!(".liblrmoe_{stem}.so.tmp"));
        let mut cmd = Command::new(&nvcc);
        if kernels::artifacts::CUDNN_LIBS.contains(&stem.as_str()) {
            let cudnn = site.join("nvidia/cudnn");
            if !site.join("include/cudnn_frontend.h").exists()
                || !cudnn.join("lib/libcudnn.so.9").exists()
            {
                bail!(
                    "cuDNN packages missing under {}: delete .venv-cuda and rerun",
                    site.display()
                );
            }
            // The frontend's headers land in site-packages/include; the
            // library is linked by its soname (-l:), found at run time.
            cmd.arg(format!("-I{}", site.join("include").display()))
                .arg(format!("-I{}", cudnn.join("include").display()))
                .arg(format!("-L{}", cudnn.join("lib").display()))
                .args(["-l:libcudnn.so.9", "-diag-suppress", "2810"]);
        }
        run(cmd
            .args(kernels::artifacts::LIB_FLAGS)
            .arg(format!("-I{}", cutlass.join("include").display()))
            .arg(format!(
                "-I{}",
                cutlass.join("tools/util/include").display()
            ))
            // The Hopper FMHA's collectives and kernels (attention.cu).
            .arg(format!("-I{}", fmha.display()))
            .arg(format!("-L{}", cu13.join("lib").display()))
            .arg("-o")
            .arg(&tmp)
            .arg(&src))?;
        std::fs::rename(&tmp, &target)?;
        eprintln!("xtask: wrote {}", target.display());
    }
    let stamp = kernels::artifacts::stamp(&root)?;
    std::fs::write(out.join("STAMP"), format!("{stamp}\n"))?;
    eprintln!("xtask: kernels/out is fresh ({stamp})");
    Ok(())
}

/// Edits to CUTLASS 4.2's Hopper FMHA example (`examples/88_hopper_fmha`
/// of the pinned wheel) for a bf16 backward: upstream builds the backward
/// for fp16 only, where `half_t` converts from `float` on assignment and
/// `bfloat16_t` does not. (file, text, replacement); each text must occur
/// exactly once.
const FMHA_PATCHES: &[(&str, &str, &str)] = &[
    (
        "kernel/fmha_kernel_bwd_convert.hpp",
        "value_dest[v] = value_src[v];",
        "value_dest[v] = static_cast<Element>(value_src[v]);",
    ),
    (
        "collective/fmha_collective_bwd_tma_warpspecialized.hpp",
        "acc_DS(i) = acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i));",
        "acc_DS(i) = static_cast<Element>(acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i)));",
    ),
];

/// The FMHA example's headers copied from the wheel to
/// `target/cutlass-fmha/` with [`FMHA_PATCHES`] applied; the folder to
/// include.
fn patched_fmha(cutlass: &Path, root: &Path) -> Result<PathBuf> {
    fn copy(from: &Path, to: &Path) -> Result<()> {
        std::fs::create_dir_all(to)?;
        for e in std::fs::read_dir(from)? {
            let e = e?;
            let (src, dst) = (e.path(), to.join(e.file_name()));
            if e.file_type()?.is_dir() {
                copy(&src, &dst)?;
            } else {
                std::fs::copy(&src, &dst)?;
            }
        }
        Ok(())
    }
    let from = cutlass.join("examples/88_hopper_fmha");
    let to = root.join("target/cutlass-fmha/88_hopper_fmha");
    if to.exists() {
        std::fs::remove_dir_all(&to)?;
    }
    copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
    for (file, text, with) in FMHA_PATCHES {
        let path = to.join(file);
        let src = std::fs::read_to_string(&path)?;
        if src.matches(text).count() != 1 {
            bail!(
                "{} no longer holds `{text}` exactly once: the CUTLASS wheel changed",
                path.display()
            );
        }
        std::fs::write(&path, src.replace(text, with))?;
    }
    Ok(to)
}

fn ci() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let r = root();
    run(Command::new(&cargo)
        .current_dir(&r)
        .args(["fmt", "--all", "--check"]))?;
    run(Command::new(&cargo).current_dir(&r).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    run(Command::new(&cargo).current_dir(&r).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        "kernels/cuda,lrmoe-benches/cuda,layer/cuda,lrmoe/cuda",
        "--",
        "-D",
        "warnings",
    ]))?;
    run(Command::new(&cargo)
        .current_dir(&r)
        .args(["test", "--workspace", "--all-targets"]))
}

fn main() -> std::process::ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    let result = match task.as_str() {
        "kernels" => kernels(),
        "ci" => ci(),
        _ => Err(anyhow::anyhow!("usage: cargo xtask <kernels|ci>")),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
