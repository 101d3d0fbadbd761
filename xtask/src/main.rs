//! `cargo xtask <task>`: project automation (alias in `.cargo/config.toml`).
//!
//! * `kernels` — compile `kernels/*.cu` for Hopper with nvcc into the place
//!   the `kernels` crate loads them from. The CUDA backend is issue #4: until
//!   its sources exist this task says so and fails, rather than pretending.
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

fn kernels() -> Result<()> {
    let dir = root().join("kernels");
    let sources: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    if sources.is_empty() {
        bail!(
            "no CUDA sources under {} yet: the CUDA backend is issue #4, nothing to build",
            dir.display()
        );
    }
    bail!(
        "building {} CUDA sources is not implemented yet (issue #4)",
        sources.len()
    )
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
