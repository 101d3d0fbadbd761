//! `lrmoe train` end to end on a tiny model: runs, resumes exactly, and
//! fails cleanly on bad input without touching a good checkpoint.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::path::{Path, PathBuf};
use std::process::Command;

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lrmoe-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_config(dir: &Path, extra: &str) -> PathBuf {
    let text = format!(
        r#"seed = 3
steps = 6
[model]
d_model = 16
n_layers = 1
n_heads = 2
ffn = 16
n_experts = 4
top_k = 2
[data]
corpus = "{}"
seq_len = 16
batch_size = 4
[moe]
ranks = 2
[run]
out_dir = "{}"
eval_every = 3
eval_batches = 1
checkpoint_every = 2
{extra}
"#,
        corpus().display(),
        dir.join("out").display()
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn lrmoe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(args)
        .env("LRMOE_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn one_line_error(stderr: &str, needle: &str) {
    let lines: Vec<&str> = stderr
        .trim_end()
        .lines()
        .filter(|l| l.starts_with("lrmoe:"))
        .collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(lines[0].contains(needle), "{stderr:?} lacks {needle:?}");
}

fn model_tensors(ckpt: &Path) -> Vec<(String, Vec<f32>)> {
    let f = lrmoe::tensorfile::load(ckpt).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = f
        .tensors
        .into_iter()
        .filter(|(k, _)| k.starts_with("model."))
        .map(|(k, (_, d))| (k, d))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn trains_writes_metrics_and_a_checkpoint() {
    let dir = tmp("basic");
    let cfg = tiny_config(&dir, "");
    let (ok, stdout, stderr) =
        lrmoe(&["train", "--config", cfg.to_str().unwrap(), "--no-progress"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("validation loss") && stdout.contains("unigram baseline 3.3"),
        "{stdout}"
    );
    let metrics = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    let layer = &lines[5]["layers"][0];
    for key in [
        "tokens_per_expert",
        "load_cv",
        "kept_fraction",
        "peak_rank_pairs",
        "buffer_bytes",
        "times",
    ] {
        assert!(!layer[key].is_null(), "metrics lack {key}");
    }
    assert!(lines[5]["val_loss"].as_f64().is_some());
    assert!(dir.join("out/checkpoint.safetensors").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resuming_reproduces_an_uninterrupted_run() {
    let a = tmp("straight");
    let cfg_a = tiny_config(&a, "");
    assert!(
        lrmoe(&[
            "train",
            "--config",
            cfg_a.to_str().unwrap(),
            "--no-progress"
        ])
        .0
    );
    let b = tmp("resumed");
    let cfg_b = tiny_config(&b, "");
    assert!(
        lrmoe(&[
            "train",
            "--config",
            cfg_b.to_str().unwrap(),
            "--steps",
            "4",
            "--no-progress"
        ])
        .0
    );
    let (ok, _, stderr) = lrmoe(&[
        "train",
        "--config",
        cfg_b.to_str().unwrap(),
        "--resume",
        "--no-progress",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(
        model_tensors(&a.join("out/checkpoint.safetensors")),
        model_tensors(&b.join("out/checkpoint.safetensors")),
        "resumed weights differ from the uninterrupted run"
    );
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn bad_inputs_are_one_line_errors_and_keep_the_good_checkpoint() {
    let dir = tmp("bad");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    let (ok, _, stderr) = lrmoe(&[
        "train",
        "--config",
        c,
        "--corpus",
        "/nonexistent/corpus.txt",
        "--no-progress",
    ]);
    assert!(!ok);
    one_line_error(&stderr, "cannot read corpus /nonexistent/corpus.txt");

    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[model]\nn_experts = 2\ntop_k = 3\n").unwrap();
    let (ok, _, stderr) = lrmoe(&["train", "--config", bad.to_str().unwrap(), "--no-progress"]);
    assert!(!ok);
    one_line_error(&stderr, "top_k = 3");

    std::fs::write(&bad, "[model]\nwidth = 2\n").unwrap();
    let (ok, _, stderr) = lrmoe(&["train", "--config", bad.to_str().unwrap(), "--no-progress"]);
    assert!(!ok);
    one_line_error(&stderr, "width");

    // A good run, then a diverging resume: the checkpoint must survive.
    assert!(lrmoe(&["train", "--config", c, "--no-progress"]).0);
    let ckpt = dir.join("out/checkpoint.safetensors");
    let before = std::fs::read(&ckpt).unwrap();
    let diverge = tiny_config(&dir, "[optim]\nlr = 1e30\nclip = 0.0\nwarmup = 1");
    let (ok, _, stderr) = lrmoe(&[
        "train",
        "--config",
        diverge.to_str().unwrap(),
        "--resume",
        "--steps",
        "9",
        "--no-progress",
    ]);
    assert!(!ok, "a diverging run must fail");
    one_line_error(&stderr, "non-finite");
    assert_eq!(
        std::fs::read(&ckpt).unwrap(),
        before,
        "the good checkpoint was overwritten"
    );

    // A corrupted checkpoint is refused on resume.
    std::fs::write(&ckpt, b"not a checkpoint").unwrap();
    let (ok, _, stderr) = lrmoe(&["train", "--config", c, "--resume", "--no-progress"]);
    assert!(!ok);
    one_line_error(&stderr, "checkpoint");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replication_only_and_a_hot_expert_workload_train() {
    let dir = tmp("replicate");
    let cfg = tiny_config(&dir, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "ranks = 2\n",
        "ranks = 2\nhot_experts = 1\nhot_bias = 2.0\n",
    );
    std::fs::write(&cfg, text).unwrap();
    let (ok, out, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--mode",
        "replicate",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("mean kept fraction 1.000"), "{out}");
    // Bad hot-expert settings are one-line errors.
    let bad = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("hot_experts = 1", "hot_experts = 9");
    std::fs::write(&cfg, bad).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    one_line_error(&err, "hot_experts");
}

#[test]
fn launched_ranks_without_nccl_fail_fast_and_name_the_rank() {
    if lrmoe::kernels::comm::COMPILED {
        return; // this build has NCCL: the GPU machine runs the real thing
    }
    let dir = tmp("launch");
    let cfg = tiny_config(&dir, "");
    let start = std::time::Instant::now();
    let (ok, _, err) = lrmoe(&[
        "launch",
        "--nproc",
        "2",
        "--grace-s",
        "5",
        "--",
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--no-progress",
    ]);
    assert!(!ok);
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    assert!(err.contains("without NCCL support"), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("lrmoe: launch: rank") && last.contains("status 2"),
        "{err}"
    );
    // Nothing to launch, or a mismatched --ranks, are one-line errors.
    let (ok, _, err) = lrmoe(&["launch", "--nproc", "2"]);
    assert!(!ok);
    one_line_error(&err, "nothing to launch");
}

#[test]
fn device_cuda_without_the_feature_is_a_one_line_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    let dir = tmp("cuda");
    let cfg = tiny_config(&dir, "");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--device",
        "cuda",
    ]);
    assert!(!ok);
    one_line_error(&err, "without CUDA support");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--device",
        "tpu",
    ]);
    assert!(!ok);
    one_line_error(&err, "expected cpu or cuda");
}
