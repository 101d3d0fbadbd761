//! `lrmoe train` end to end on a tiny model: runs, resumes exactly, and
//! fails cleanly on bad input without touching a good checkpoint.

#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::path::{Path, PathBuf};
use std::process::Command;

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare.txt")
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

/// Rewrites the configuration at `cfg`, each `(from, to)` in turn (each
/// `from` must be in it).
fn edit_config(cfg: &Path, swaps: &[(&str, &str)]) {
    let mut text = std::fs::read_to_string(cfg).unwrap();
    for (from, to) in swaps {
        assert!(text.contains(from), "{from:?} is not in {}", cfg.display());
        text = text.replace(from, to);
    }
    std::fs::write(cfg, text).unwrap();
}

/// `lrmoe train --config CFG --compare --modes MODES STOP… --no-progress
/// --out OUT`.
fn compare(cfg: &Path, out: &Path, modes: &str, stop: &[&str]) -> (bool, String, String) {
    let (cfg, out) = (cfg.to_str().unwrap(), out.to_str().unwrap());
    let mut args = vec!["train", "--config", cfg, "--compare", "--modes", modes];
    args.extend_from_slice(stop);
    args.extend(["--no-progress", "--out", out]);
    lrmoe(&args)
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
    edit_config(
        &cfg,
        &[(
            "ranks = 2\n",
            "ranks = 2\nhot_experts = 1\nhot_bias = 2.0\n",
        )],
    );
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
    // SYMI-like replication on the same hot workload: dropless, and after
    // the first step its replicas follow the previous step's load.
    let (ok, out, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--mode",
        "symi",
        "--force",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("mean kept fraction 1.000"), "{out}");
    let metrics = std::fs::read_to_string(dir.join("out").join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(
        last["layers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["replicas"].as_u64() > Some(0)),
        "no SYMI-like replica: {last}"
    );
    // One rank's placement, replicas and buffer together: at least its
    // instances and at least rank 0's largest buffer.
    let peak = last["rank_peak_bytes"].as_u64().unwrap();
    let buffer = last["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["buffer_bytes"].as_u64())
        .max()
        .unwrap();
    assert!(
        peak >= last["expert_bytes"].as_u64().unwrap() && peak >= buffer && buffer > 0,
        "{last}"
    );
    // Bad hot-expert settings are one-line errors.
    edit_config(&cfg, &[("hot_experts = 1", "hot_experts = 9")]);
    let (ok, _, err) = lrmoe(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    one_line_error(&err, "hot_experts");
}

/// Fixed ownership fit to the budget splits its steps; each line states
/// what the step would hold unsplit (the micro-batches' buffers summed),
/// which is more than it held split and equal where it ran whole, and the
/// comparison's summary carries the run's largest.
#[test]
fn a_split_step_states_what_it_needs_unsplit() {
    let dir = tmp("unsplit");
    // A target out of reach: all 4 steps run.
    let cfg = tiny_config(&dir, "target_val_loss = 0.5");
    edit_config(&cfg, &[("ranks = 2\n", "ranks = 2\nfit_budget = true\n")]);
    let out = dir.join("cmp");
    let (ok, _, err) = compare(&cfg, &out, "full,lrmoe", &["--steps", "4"]);
    assert!(ok, "{err}");
    let metrics = std::fs::read_to_string(out.join("full").join("metrics.jsonl")).unwrap();
    let mut split = 0;
    for line in metrics.lines() {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        let (peak, unsplit) = (
            m["rank_peak_bytes"].as_u64().unwrap(),
            m["unsplit_peak_bytes"].as_u64().unwrap(),
        );
        if m["micro_batches"].as_u64().unwrap() > 1 {
            // Every buffer holds rows, and each micro-batch routes some.
            assert!(unsplit > peak, "{m}");
            split += 1;
        } else {
            assert_eq!(unsplit, peak, "{m}");
        }
    }
    assert!(split > 0, "no step was split: {metrics}");
    // The same first step run whole (same seed, same batch, same model):
    // the host executor's buffers are not all rows, so the micro-batches'
    // peaks summed bound the whole step's peak from above, and closely.
    let first = |text: &str| -> serde_json::Value {
        serde_json::from_str(text.lines().next().unwrap()).unwrap()
    };
    let modelled = first(&metrics)["unsplit_peak_bytes"].as_u64().unwrap();
    let whole_dir = tmp("unsplit-whole");
    let whole_cfg = tiny_config(&whole_dir, "");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        whole_cfg.to_str().unwrap(),
        "--mode",
        "full",
        "--steps",
        "1",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    let whole = first(&std::fs::read_to_string(whole_dir.join("out/metrics.jsonl")).unwrap());
    assert_eq!(whole["micro_batches"], 1, "{whole}");
    let held = whole["rank_peak_bytes"].as_u64().unwrap();
    assert!(
        modelled >= held && (modelled as f64) <= 1.25 * held as f64,
        "modelled {modelled}, held whole {held}"
    );
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("compare.json")).unwrap()).unwrap();
    let runs = c["runs"].as_array().unwrap();
    let figure = |i: usize, k: &str| runs[i][k].as_u64().unwrap();
    assert_eq!(runs[0]["mode"], "full", "{c}");
    assert!(figure(0, "max_unsplit_peak_bytes") > figure(0, "max_rank_peak_bytes"));
    // LRMoE's forward computes every pair: with the budget holding the
    // forward's rows (the default) its steps split as well. Each run
    // records what its budget held.
    assert!(figure(1, "max_unsplit_peak_bytes") > figure(1, "max_rank_peak_bytes"));
    for r in runs {
        assert_eq!(r["budget_held"], "forward_and_backward", "{c}");
    }
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

fn metric_steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

fn checkpoint_step(dir: &Path) -> u64 {
    let f = lrmoe::tensorfile::load(&dir.join("out/checkpoint.safetensors")).unwrap();
    f.meta("step").unwrap().parse().unwrap()
}

#[test]
fn ranks_stop_together_at_the_time_cap_and_checkpoint() {
    // The issue's reproduction: a checkpoint every step (rank 0 slower than
    // rank 1) and a short time cap used to split the ranks.
    let dir = tmp("timecap");
    let cfg = tiny_config(&dir, "");
    edit_config(
        &cfg,
        &[
            ("checkpoint_every = 2", "checkpoint_every = 1"),
            ("steps = 6", "steps = 100000"),
        ],
    );
    let (ok, out, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--max-minutes",
        "0.02",
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("time cap reached"), "{out}");
    let steps = metric_steps(&dir);
    assert!(!steps.is_empty() && steps.len() < 100000);
    assert_eq!(checkpoint_step(&dir), *steps.last().unwrap());
}

#[test]
fn bad_time_caps_are_one_line_errors() {
    let dir = tmp("badcap");
    let cfg = tiny_config(&dir, "");
    for v in ["-1", "0", "NaN", "inf", "1e300"] {
        let (ok, _, err) = lrmoe(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            &format!("--max-minutes={v}"),
            "--no-progress",
        ]);
        assert!(!ok, "{v}");
        one_line_error(&err, "--max-minutes");
    }
}

#[cfg(unix)]
#[test]
fn a_signal_stops_at_a_step_boundary_with_checkpoint_and_summary() {
    let dir = tmp("sigint");
    let cfg = tiny_config(&dir, "");
    edit_config(
        &cfg,
        &[
            ("steps = 6", "steps = 100000"),
            ("checkpoint_every = 2", "checkpoint_every = 0"),
        ],
    );
    let child = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(["train", "--config", cfg.to_str().unwrap(), "--no-progress"])
        .env("LRMOE_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("out/metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |t| t.lines().count() < 3) {
        assert!(start.elapsed() < std::time::Duration::from_secs(60));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("stopped by signal"), "{stdout}");
    let steps = metric_steps(&dir);
    assert!(steps.len() < 100000);
    assert_eq!(checkpoint_step(&dir), *steps.last().unwrap());
}

#[test]
fn resume_cuts_the_log_back_and_removes_orphaned_temporaries() {
    let dir = tmp("records");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    assert!(lrmoe(&["train", "--config", c, "--steps", "4", "--no-progress"]).0);
    // A killed run: steps logged after the checkpoint, a torn last line and
    // a half-written checkpoint.
    let metrics = dir.join("out/metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"step\":5,\"loss\":1.0}\n{\"step\":6,\"lo");
    std::fs::write(&metrics, text).unwrap();
    let orphan = dir.join("out/.checkpoint.safetensors.12345.tmp");
    std::fs::write(&orphan, b"half").unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--resume", "--no-progress"]);
    assert!(ok, "{err}");
    assert_eq!(metric_steps(&dir), vec![1, 2, 3, 4, 5, 6]);
    assert!(!orphan.exists());
}

#[test]
fn an_earlier_run_is_not_overwritten_without_resume_or_force() {
    let dir = tmp("force");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    assert!(lrmoe(&["train", "--config", c, "--steps", "2", "--no-progress"]).0);
    let ckpt = dir.join("out/checkpoint.safetensors");
    let before = std::fs::read(&ckpt).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--no-progress"]);
    assert!(!ok);
    one_line_error(&err, "--resume");
    assert_eq!(std::fs::read(&ckpt).unwrap(), before);
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--force", "--no-progress"]);
    assert!(ok, "{err}");
    assert_eq!(metric_steps(&dir), vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn sequence_lengths_that_cannot_fit_are_one_line_errors() {
    let dir = tmp("seqlen");
    // A small corpus: its validation split is 500 tokens.
    let small = dir.join("small.txt");
    let text: String = (0..5000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    std::fs::write(&small, text).unwrap();
    let cfg = tiny_config(&dir, "");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--corpus",
        small.to_str().unwrap(),
        "--no-progress",
    ]);
    assert!(ok, "{err}");
    let long = tiny_config(&dir, "").to_str().unwrap().to_string();
    let t = std::fs::read_to_string(&long)
        .unwrap()
        .replace("seq_len = 16", "seq_len = 600");
    std::fs::write(&long, t).unwrap();
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        &long,
        "--corpus",
        small.to_str().unwrap(),
        "--force",
        "--no-progress",
    ]);
    assert!(!ok);
    one_line_error(&err, "data.seq_len = 600 does not fit the corpus");
    // Fits the shipped corpus, but not in any memory.
    let t = std::fs::read_to_string(&long)
        .unwrap()
        .replace("seq_len = 600", "seq_len = 400000");
    std::fs::write(&long, t).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", &long, "--force", "--no-progress"]);
    assert!(!ok);
    one_line_error(&err, "GiB");
    assert!(err.contains("lower data.seq_len"), "{err}");
}

#[test]
fn config_and_checkpoint_errors_say_what_failed_once() {
    let dir = tmp("msgs");
    let cfg = tiny_config(&dir, "");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let bad = dir.join("bad.toml");
    for (from, to, needle) in [
        (
            "seq_len = 16",
            "seq_len = 16\nval_fraction = 1.5",
            "data.val_fraction = 1.5",
        ),
        ("[run]", "[optim]\nbeta2 = nan\n[run]", "optim.beta2"),
        ("[run]", "[optim]\neps = inf\n[run]", "optim.eps"),
        ("[model]\n", "model = [16, 1]\n[xmodel]\n", "xmodel"),
    ] {
        std::fs::write(&bad, text.replace(from, to)).unwrap();
        let (ok, _, err) = lrmoe(&["train", "--config", bad.to_str().unwrap()]);
        assert!(!ok);
        one_line_error(&err, needle);
        assert!(!err.contains("corrupted"), "{err}");
    }
    // A section written as an array.
    std::fs::write(
        &bad,
        text.replace("[moe]\nranks = 2\n", "")
            .replace("steps = 6\n", "steps = 6\nmoe = [\"full\", \"host\", 2]\n"),
    )
    .unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", bad.to_str().unwrap()]);
    assert!(!ok);
    one_line_error(&err, "moe: expected an object");

    // A checkpoint of another model: the differing fields, no Debug dump.
    let c = cfg.to_str().unwrap();
    assert!(lrmoe(&["train", "--config", c, "--steps", "2", "--no-progress"]).0);
    std::fs::write(&bad, text.replace("n_experts = 4", "n_experts = 2")).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", bad.to_str().unwrap(), "--resume"]);
    assert!(!ok);
    one_line_error(&err, "n_experts: 4 in the checkpoint, 2 configured");
    assert!(!err.contains("ModelConfig"), "{err}");
    let ckpt_path = dir.join("out/checkpoint.safetensors");
    assert_eq!(err.matches("checkpoint.safetensors").count(), 1, "{err}");

    // A NaN weight names the file and the tensor.
    let mut f = lrmoe::tensorfile::load(&ckpt_path).unwrap();
    let meta = f.metadata.clone();
    let mut tensors: Vec<_> = f.tensors.drain().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let victim = tensors
        .iter_mut()
        .find(|(n, _)| n.starts_with("model.") && n.ends_with("router"))
        .unwrap();
    victim.1 .1[3] = f32::NAN;
    let victim_name = victim.0.clone();
    let named: Vec<lrmoe::tensorfile::NamedTensor<'_>> = tensors
        .iter()
        .map(|(n, (s, d))| (n.clone(), s.clone(), d.as_slice()))
        .collect();
    lrmoe::tensorfile::save(&ckpt_path, &named, meta).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--resume"]);
    assert!(!ok);
    one_line_error(&err, &victim_name);
    assert!(
        err.contains(ckpt_path.to_str().unwrap()) && err.contains("non-finite"),
        "{err}"
    );
}

#[test]
fn the_device_executor_without_a_gpu_is_a_one_line_error() {
    let dir = tmp("executor");
    let cfg = tiny_config(&dir, "");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--executor",
        "device",
        "--no-progress",
    ]);
    assert!(!ok);
    one_line_error(&err, "--device cuda");
}

#[test]
fn the_balancing_bias_evens_out_a_hot_expert_and_is_checkpointed() {
    // A hot expert takes most pairs; DeepSeek-V3's auxiliary-loss-free
    // bias (moe.expert_bias_rate) moves the choice away from it step by
    // step, so the later steps' max/mean load falls well below the run
    // without it. The bias is part of the checkpoint.
    let imbalance = |rate: &str| -> (f64, PathBuf) {
        let dir = tmp(&format!("bias-{rate}"));
        let cfg = tiny_config(&dir, "");
        let moe =
            format!("ranks = 2\nhot_experts = 1\nhot_bias = 2.0\nexpert_bias_rate = {rate}\n");
        edit_config(&cfg, &[("steps = 6", "steps = 40"), ("ranks = 2\n", &moe)]);
        let (ok, _, err) = lrmoe(&["train", "--config", cfg.to_str().unwrap(), "--no-progress"]);
        assert!(ok, "{err}");
        let log = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
        let rows: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let last: Vec<f64> = rows[rows.len() - 15..]
            .iter()
            .map(|r| r["layers"][0]["load_max_over_mean"].as_f64().unwrap())
            .collect();
        (last.iter().sum::<f64>() / last.len() as f64, dir)
    };
    let (plain, _) = imbalance("0.0");
    let (biased, dir) = imbalance("0.05");
    eprintln!("max/mean load, last 15 of 40 steps: bias off {plain:.3}, on {biased:.3}");
    assert!(
        biased < 0.8 * plain,
        "max/mean load with the bias {biased:.3}, without {plain:.3}"
    );
    let f = lrmoe::tensorfile::load(&dir.join("out/checkpoint.safetensors")).unwrap();
    let bias: Vec<Vec<f64>> = serde_json::from_str(f.meta("expert_bias").unwrap()).unwrap();
    assert_eq!((bias.len(), bias[0].len()), (1, 4));
    assert!(bias[0][0] < 0.0, "the hot expert's bias falls: {bias:?}");
    // A negative rate is a one-line error.
    let cfg = tiny_config(&tmp("bias-bad"), "");
    edit_config(
        &cfg,
        &[("ranks = 2\n", "ranks = 2\nexpert_bias_rate = -1.0\n")],
    );
    let (ok, _, err) = lrmoe(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    one_line_error(&err, "expert_bias_rate");
}

/// A Qwen3-MoE `config.json` (grouped-query attention, q/k norms, RoPE) of
/// a tiny shape.
fn tiny_qwen3_json(dir: &Path, extra: &str) -> PathBuf {
    let text = format!(
        r#"{{"model_type": "qwen3_moe", "hidden_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": 96, "max_position_embeddings": 64, "torch_dtype": "bfloat16"{extra}}}"#
    );
    let path = dir.join("config.json");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_qwen3_config_json_trains_and_resumes_exactly() {
    let run = |name: &str, steps: Option<&str>, resume: bool| -> (PathBuf, String) {
        let dir = tmp(name);
        let cfg = tiny_config(&dir, "");
        let json = tiny_qwen3_json(&dir, "");
        let mut args = vec![
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--model-config",
            json.to_str().unwrap(),
            "--layers",
            "1",
            "--no-progress",
        ];
        if let Some(s) = steps {
            args.extend(["--steps", s]);
        }
        let (ok, _, stderr) = lrmoe(&args);
        assert!(ok, "{stderr}");
        if resume {
            args.retain(|a| *a != "--steps" && Some(*a) != steps);
            args.push("--resume");
            let (ok, _, stderr) = lrmoe(&args);
            assert!(ok, "{stderr}");
        }
        (dir, stderr)
    };
    let (a, warn) = run("qwen3-straight", None, false);
    assert!(
        warn.contains("not used by the model: torch_dtype"),
        "{warn}"
    );
    assert!(
        warn.contains("replaces the configuration's [model] section"),
        "the flag's override of the file is said: {warn}"
    );
    let (b, _) = run("qwen3-resumed", Some("4"), true);
    let ta = model_tensors(&a.join("out/checkpoint.safetensors"));
    assert_eq!(ta, model_tensors(&b.join("out/checkpoint.safetensors")));
    let names: Vec<&str> = ta.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"model.blocks.0.q_norm") && !names.contains(&"model.pos"));
    let wk = ta.iter().find(|(n, _)| n == "model.blocks.0.wk").unwrap();
    assert_eq!(wk.1.len(), 16 * 2 * 4, "grouped-query key projection");
    let head = ta.iter().find(|(n, _)| n == "model.head").unwrap();
    assert_eq!(
        head.1.len(),
        16 * 96,
        "the config's vocabulary, not the corpus's"
    );
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn config_json_errors_are_one_line_and_name_the_field() {
    let dir = tmp("qwen3-bad");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    for (extra, needle) in [
        (r#", "use_sliding_window": true"#, "use_sliding_window"),
        (r#", "mlp_only_layers": [0]"#, "mlp_only_layers"),
        (r#", "num_key_value_heads": 3"#, "n_kv_heads"),
        (r#", "vocab_size": 8"#, "model.vocab"),
        (
            r#", "max_position_embeddings": 8"#,
            "max_position_embeddings",
        ),
    ] {
        let json = tiny_qwen3_json(&dir, extra);
        let (ok, _, err) = lrmoe(&[
            "train",
            "--config",
            c,
            "--model-config",
            json.to_str().unwrap(),
        ]);
        assert!(!ok, "{extra}");
        one_line_error(&err, needle);
    }
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        c,
        "--model-config",
        "/nonexistent.json",
    ]);
    assert!(!ok);
    one_line_error(&err, "nonexistent.json");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The summary line's mean kept fraction.
fn summary_kept(stdout: &str) -> f64 {
    let at = stdout.find("mean kept fraction ").unwrap() + "mean kept fraction ".len();
    stdout[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The mean of every logged layer call's kept fraction in `metrics.jsonl`.
fn logged_kept(dir: &Path) -> f64 {
    let text = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    let kept: Vec<f64> = text
        .lines()
        .flat_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["layers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["kept_fraction"].as_f64().unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    kept.iter().sum::<f64>() / kept.len() as f64
}

#[test]
fn the_summary_kept_fraction_is_the_whole_runs_after_a_resume() {
    let dir = tmp("kept");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    let (ok, first, err) = lrmoe(&["train", "--config", c, "--steps", "3", "--no-progress"]);
    assert!(ok, "{err}");
    assert!(
        summary_kept(&first) < 0.95,
        "the tiny run drops pairs: {first}"
    );
    // Three more steps: the summary covers all six.
    let (ok, second, err) = lrmoe(&["train", "--config", c, "--resume", "--no-progress"]);
    assert!(ok, "{err}");
    assert!(
        (summary_kept(&second) - logged_kept(&dir)).abs() < 6e-4,
        "{second}"
    );
    // A resume that trains no step reports the run's, not 1.000.
    let (ok, third, err) = lrmoe(&["train", "--config", c, "--resume", "--no-progress"]);
    assert!(ok, "{err}");
    assert!(third.starts_with("steps 6"), "{third}");
    assert!(
        (summary_kept(&third) - logged_kept(&dir)).abs() < 6e-4,
        "{third}"
    );
    assert_eq!(summary_kept(&third), summary_kept(&second));
}

#[test]
fn negative_numbers_after_a_space_name_the_flag_and_its_range() {
    let dir = tmp("negative");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    for (flag, value, range) in [
        ("--buffer-fraction", "-0.5", "> 0"),
        ("--steps", "-5", "≥ 1"),
        ("--max-minutes", "-1", "(0, 525600]"),
        ("--target-val-loss", "-1", "> 0"),
        ("--seed", "-3", "whole number"),
    ] {
        let (ok, _, err) = lrmoe(&["train", "--config", c, flag, value]);
        assert!(!ok, "{flag} {value}");
        one_line_error(&err, flag);
        assert!(
            err.contains(range) && !err.contains("unexpected argument"),
            "{err}"
        );
    }
    let (ok, _, err) = lrmoe(&[
        "layer-grad",
        "--weights",
        "w",
        "--inputs",
        "x",
        "--out",
        "o",
        "--retention",
        "-1",
    ]);
    assert!(!ok);
    one_line_error(&err, "--retention");
    assert!(err.contains("[0, 1]"), "{err}");
    assert!(!dir.join("out").exists(), "nothing created");
}

#[test]
fn nonsense_settings_are_refused_before_anything_is_written() {
    let dir = tmp("nonsense");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--steps", "0"]);
    assert!(!ok);
    one_line_error(&err, "--steps");
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--buffer-fraction", "3"]);
    assert!(!ok);
    one_line_error(
        &err,
        "moe.buffer_fraction = 3 must be in (0, moe.ranks = 2]",
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    let bad = dir.join("bad.toml");
    for (from, to, needle) in [
        ("steps = 6", "steps = 0", "steps = 0"),
        (
            "checkpoint_every = 2",
            "checkpoint_every = 2\ntarget_val_loss = -1.0",
            "run.target_val_loss = -1",
        ),
    ] {
        std::fs::write(&bad, text.replace(from, to)).unwrap();
        let (ok, _, err) = lrmoe(&["train", "--config", bad.to_str().unwrap()]);
        assert!(!ok, "{to}");
        one_line_error(&err, needle);
    }
    assert!(!dir.join("out").exists(), "no folder, no checkpoint");
}

#[test]
fn refusal_hints_point_the_way_that_works() {
    let dir = tmp("hints");
    let cfg = tiny_config(&dir, "");
    let c = cfg.to_str().unwrap();
    // A folder with only the metrics of a run that left no checkpoint.
    std::fs::create_dir_all(dir.join("out")).unwrap();
    std::fs::write(dir.join("out/metrics.jsonl"), "{\"step\":1}\n").unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c]);
    assert!(!ok);
    one_line_error(&err, "left no checkpoint");
    assert!(
        err.contains("--force") && !err.contains("--resume"),
        "{err}"
    );
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--resume"]);
    assert!(!ok);
    one_line_error(&err, "no checkpoint to continue");
    assert!(err.contains("--force"), "{err}");
    // --resume into a new folder creates nothing.
    let fresh = dir.join("fresh");
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        c,
        "--out",
        fresh.to_str().unwrap(),
        "--resume",
    ]);
    assert!(!ok);
    one_line_error(&err, "drop --resume");
    assert!(!fresh.exists(), "no empty folder left behind");
    // An output "folder" that is a file.
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", c, "--out", file.to_str().unwrap()]);
    assert!(!ok);
    one_line_error(&err, "is a file, not a folder");
    assert!(!err.contains("os error"), "{err}");
}

#[test]
fn train_help_shows_the_defaults_it_runs_with() {
    let (ok, help, err) = lrmoe(&["train", "--help"]);
    assert!(ok, "{err}");
    let d = lrmoe::train::TrainConfig::default();
    for needle in [
        format!("[default: steps, {}]", d.steps),
        format!("[default: seed, {}]", d.seed),
        format!("[default: run.out_dir, {}]", d.run.out_dir.display()),
        format!("[default: moe.buffer_fraction, {}]", d.moe.buffer_fraction),
        format!("[default: model.n_layers, {}]", d.model.n_layers),
        format!("[default: moe.ranks, {} on the CPU", d.moe.ranks),
        format!("[default: moe.selection_rule, {}]", d.moe.selection_rule),
        "built-in Shakespeare corpus".to_string(),
        "Where it runs:".to_string(),
    ] {
        assert!(help.contains(&needle), "help lacks {needle:?}:\n{help}");
    }
    let modes: Vec<String> = lrmoe::compare::MODES
        .iter()
        .map(|m| format!("{m:?}").to_lowercase())
        .collect();
    assert!(
        help.contains(&format!("[default: {}]", modes.join(", "))),
        "--modes names its {} default modes:\n{help}",
        modes.len()
    );
    assert!(!help.contains("three"), "{help}");
}

#[test]
fn a_final_evaluation_at_the_target_counts_as_reaching_it() {
    // Stopped by its time cap after the first step, before any evaluation
    // in the loop: the final evaluation, far below an easy target, is
    // where the run reached it.
    let dir = tmp("final-reach");
    let cfg = tiny_config(&dir, "target_val_loss = 50.0");
    edit_config(&cfg, &[("eval_every = 3", "eval_every = 100")]);
    let out = dir.join("cmp");
    let (ok, _, err) = compare(&cfg, &out, "full", &["--max-minutes", "0.000001"]);
    assert!(ok, "{err}");
    let md = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(md.contains("| Full | yes | "), "{md}");
    assert!(md.contains("| 1 |"), "reached at step 1: {md}");
}

#[test]
fn the_main_job_runs_from_any_folder_without_a_checkpoint_if_asked() {
    // A folder with no data/ in it: the built-in corpus.
    let dir = tmp("anywhere");
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(["train", "--steps", "2", "--no-progress", "--no-checkpoint"])
        .current_dir(&dir)
        .env("LRMOE_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("unigram baseline 3.3"), "{stdout}");
    assert!(dir.join("runs/default/metrics.jsonl").exists());
    assert!(!dir.join("runs/default/checkpoint.safetensors").exists());
    // Without a checkpoint the folder can only be started over.
    let (ok, _, err) = lrmoe(&[
        "train",
        "--out",
        dir.join("runs/default").to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(!ok);
    one_line_error(&err, "--force");
}

#[test]
fn the_checkpoint_size_is_said_before_training() {
    let dir = tmp("ckptsize");
    let cfg = tiny_config(&dir, "");
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--steps",
            "1",
            "--no-progress",
        ])
        .env("LRMOE_LOG", "info")
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("checkpoint size"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("checkpoint_gib") && line.contains("free_gib"),
        "{line}"
    );
    let said: f64 = line
        .split("checkpoint_gib=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let real = std::fs::metadata(dir.join("out/checkpoint.safetensors"))
        .unwrap()
        .len() as f64
        / (1u64 << 30) as f64;
    assert!(
        said >= real && said < real + 0.001,
        "said {said} GiB, wrote {real}"
    );
}

#[test]
fn configured_settings_are_honoured_or_refused_never_replaced() {
    let dir = tmp("configured");
    let cfg = tiny_config(&dir, "");
    // Launched ranks: a configured moe.ranks that is not WORLD_SIZE.
    let out = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(["train", "--config", cfg.to_str().unwrap(), "--no-progress"])
        .env("LRMOE_LOG", "warn")
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "29999")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    one_line_error(
        &err,
        "the configuration's moe.ranks = 2 disagrees with WORLD_SIZE = 3",
    );
}

#[test]
fn toml_errors_say_line_and_column_on_one_line() {
    let dir = tmp("tomlerr");
    let cfg = tiny_config(&dir, "");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, text.replace("seq_len = 16", "seq_len = \"x\"")).unwrap();
    let (ok, _, err) = lrmoe(&["train", "--config", bad.to_str().unwrap()]);
    assert!(!ok);
    let line = text.lines().position(|l| l == "seq_len = 16").unwrap() + 1;
    one_line_error(&err, &format!("line {line}, column 11: invalid type"));
    assert!(
        err.contains("(in `seq_len = \"x\"`)") && !err.contains('^'),
        "{err}"
    );
}

/// A path as a command-line argument (the tests' paths are UTF-8).
fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `lrmoe redraw [flags] --input I… [--out O]`.
fn redraw(flags: &[&str], inputs: &[&Path], out: Option<&Path>) -> (bool, String, String) {
    let mut args: Vec<String> = std::iter::once("redraw")
        .chain(flags.iter().copied())
        .map(String::from)
        .collect();
    for i in inputs {
        args.extend(["--input".to_string(), i.display().to_string()]);
    }
    if let Some(o) = out {
        args.extend(["--out".to_string(), o.display().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    lrmoe(&args)
}

#[test]
fn redraw_writes_a_comparison_again_and_labels_simulated_times() {
    let dir = tmp("redraw");
    let cfg = tiny_config(&dir, "target_val_loss = 50.0");
    let out = dir.join("cmp");
    let (ok, _, err) = compare(&cfg, &out, "full,lrmoe", &["--steps", "3"]);
    assert!(ok, "{err}");
    let json = out.join("compare.json");
    let table = std::fs::read_to_string(out.join("compare.md")).unwrap();

    // Redrawn elsewhere: the same table, both plots, no simulated plot (CPU ranks).
    let again = dir.join("again");
    let (ok, stdout, err) = redraw(&[], &[&json], Some(&again));
    assert!(ok, "{err}");
    assert!(stdout.contains("| LRMoE | yes |"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(again.join("compare.md")).unwrap(),
        table
    );
    for f in ["compare.svg", "compare.png"] {
        assert!(
            std::fs::metadata(again.join(f)).unwrap().len() > 1000,
            "{f}"
        );
    }
    assert!(!again.join("compare-simulated.svg").exists());

    // With simulated times and the GPUs they are for: a second plot, and the
    // table names the cluster model.
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for run in c["runs"].as_array_mut().unwrap() {
        for (i, e) in run["evals"].as_array_mut().unwrap().iter_mut().enumerate() {
            e["simulated_s"] = serde_json::json!(0.5 * (i + 1) as f64);
            e["simulated_moe_s"] = serde_json::json!(0.2 * (i + 1) as f64);
        }
    }
    c["simulated_on"] = serde_json::json!({
        "gpus": 16,
        "cluster": {"gpus_per_node": 8, "intra_gb_per_s": 336.0, "intra_latency_us": 56.0,
                    "inter_gb_per_s": 45.0, "inter_latency_us": 30.0, "call_overhead_us": 0.0}
    });
    let sim = dir.join("sim.json");
    std::fs::write(&sim, c.to_string()).unwrap();
    let (ok, stdout, err) = redraw(&[], &[&sim], None);
    assert!(ok, "{err}");
    assert!(
        stdout.contains("16 GPUs, 8 a node; intra-node 336 GB/s and 56 µs"),
        "{stdout}"
    );
    assert!(
        stdout.contains("simulated MoE-layer time to target"),
        "{stdout}"
    );
    // Written beside the input.
    assert!(dir.join("compare-simulated.svg").exists());
    assert!(dir.join("compare-simulated.png").exists());

    // Bad input: one line, nothing written.
    c["simulated_on"]["gpus"] = serde_json::json!(0);
    let bad_cases = [
        (
            "{\"target_val_loss\": 2.0, \"runs\": [".to_string(),
            "not a compare.json",
        ),
        (
            "{\"target_val_loss\": 2.0, \"runs\": []}".to_string(),
            "has no runs",
        ),
        (c.to_string(), "simulated_on.gpus must be at least 1"),
    ];
    let empty = dir.join("empty");
    for (i, (text, needle)) in bad_cases.iter().enumerate() {
        let f = dir.join(format!("bad{i}.json"));
        std::fs::write(&f, text).unwrap();
        let (ok, _, err) = redraw(&[], &[&f], Some(&empty));
        assert!(!ok);
        one_line_error(&err, needle);
    }
    let (ok, _, err) = redraw(&[], &[&dir.join("absent.json")], None);
    assert!(!ok);
    one_line_error(&err, "absent.json");
    assert!(!empty.exists(), "nothing written on bad input");
}

/// Comparisons trained in parts (one device call each) join into one:
/// every mode's row and both plots, the joined compare.json beside them;
/// `--rerun` lets a later input's run of a mode replace an earlier one's;
/// without it a mode twice, another target, an --out that holds an input or no --out
/// at all is one line and writes nothing.
#[test]
fn redraw_joins_comparisons_trained_in_parts() {
    let dir = tmp("redraw-join");
    let cfg = tiny_config(&dir, "target_val_loss = 50.0");
    let (a, b) = (dir.join("a"), dir.join("b"));
    for (out, modes) in [(&a, "full"), (&b, "lrmoe,capacity")] {
        let (ok, _, err) = compare(&cfg, out, modes, &["--steps", "2"]);
        assert!(ok, "{err}");
    }
    let (ja, jb) = (a.join("compare.json"), b.join("compare.json"));
    let joined = dir.join("joined");
    let (ok, stdout, err) = redraw(&[], &[&ja, &jb], Some(&joined));
    assert!(ok, "{err}");
    for row in ["| Full | yes |", "| LRMoE | yes |", "| Capacity | yes |"] {
        assert!(stdout.contains(row), "{row}: {stdout}");
    }
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(joined.join("compare.json")).unwrap())
            .unwrap();
    let modes: Vec<&str> = c["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["full", "lrmoe", "capacity"]);
    assert!(joined.join("compare.svg").exists() && joined.join("compare.md").exists());

    // --rerun: a later input's LRMoE run replaces the earlier one, in place.
    let mut again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&jb).unwrap()).unwrap();
    let lrmoe_run = again["runs"][0].clone();
    assert_eq!(lrmoe_run["mode"], "lrmoe");
    again["runs"] = serde_json::json!([lrmoe_run]);
    again["runs"][0]["steps"] = serde_json::json!(7);
    let jr = dir.join("rerun.json");
    std::fs::write(&jr, again.to_string()).unwrap();
    let rejoined = dir.join("rejoined");
    let (ok, _, err) = redraw(&["--rerun"], &[&ja, &jb, &jr], Some(&rejoined));
    assert!(ok, "{err}");
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(rejoined.join("compare.json")).unwrap())
            .unwrap();
    let runs: Vec<(&str, u64)> = c["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["mode"].as_str().unwrap(), r["steps"].as_u64().unwrap()))
        .collect();
    assert_eq!(runs, [("full", 2), ("lrmoe", 7), ("capacity", 2)]);

    // One summary row per comparison, also written to --out.
    let (jj, md) = (joined.join("compare.json"), dir.join("summary.md"));
    let args = [
        "summary",
        "--input",
        path(&ja),
        "--input",
        path(&jj),
        "--out",
        path(&md),
    ];
    let (ok, stdout, err) = lrmoe(&args);
    assert!(ok, "{err}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(rows[1].starts_with("| a | — | 50.000 | Full "), "{stdout}");
    assert!(
        rows[2].starts_with("| joined |") && rows[2].contains("| Full | LRMoE "),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(&md).unwrap(),
        stdout.replace(&format!("wrote {}\n", md.display()), "")
    );
    // Into a pipe already closed (`… | head`): no panic, the file still written.
    std::fs::remove_file(&md).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lrmoe"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success() && !err.contains("panicked"), "{err}");
    assert!(md.exists());
    // A folder stands for the compare.json in it; one without is one line.
    let (ok, by_folder, err) = lrmoe(&["summary", "--input", path(&joined)]);
    assert!(ok, "{err}");
    assert_eq!(
        by_folder.lines().nth(2),
        rows.get(2).copied(),
        "{by_folder}"
    );
    let (ok, _, err) = lrmoe(&["summary", "--input", path(&ja), "--input", path(&dir)]);
    assert!(!ok);
    one_line_error(&err, &dir.display().to_string());
    // With bounds: a closing count; a bound that is not a positive number,
    // or one bound without the other, is one line.
    let (ok, stdout, err) = lrmoe(&[
        "summary",
        "--input",
        path(&ja),
        "--time-bound",
        "0.8",
        "--steps-bound",
        "1.15",
    ]);
    assert!(ok, "{err}");
    assert!(
        stdout.contains(
            "at most 0.80× its MoE-layer time and 1.15× its steps to the target: both in"
        ),
        "{stdout}"
    );
    for bad in [
        &["--time-bound", "-1", "--steps-bound", "1"][..],
        &["--time-bound", "0.8"][..],
    ] {
        let mut args = vec!["summary", "--input", path(&ja)];
        args.extend_from_slice(bad);
        let (ok, _, err) = lrmoe(&args);
        assert!(!ok);
        one_line_error(
            &err,
            if bad.len() == 4 {
                "positive"
            } else {
                "--steps-bound"
            },
        );
    }

    // Bad joins.
    let mut other: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ja).unwrap()).unwrap();
    other["target_val_loss"] = serde_json::json!(49.0);
    other["runs"][0]["mode"] = serde_json::json!("symi");
    let other_target = dir.join("other-target.json");
    std::fs::write(&other_target, other.to_string()).unwrap();
    let empty = dir.join("empty");
    let a_before = std::fs::read(&ja).unwrap();
    let cases: [(Vec<&Path>, Option<&Path>, &str); 4] = [
        (
            vec![&ja, &ja],
            Some(&empty),
            "mode Full is in an earlier input too",
        ),
        (vec![&ja, &other_target], Some(&empty), "target 49 differs"),
        (vec![&ja, &jb], Some(&a), "holds the input"),
        (vec![&ja, &jb], None, "say where with --out"),
    ];
    for (inputs, out, needle) in cases {
        let (ok, _, err) = redraw(&[], &inputs, out);
        assert!(!ok, "{needle}");
        one_line_error(&err, needle);
    }
    // --rerun with one input has nothing to replace.
    let (ok, _, err) = redraw(&["--rerun"], &[&ja], Some(&empty));
    assert!(!ok);
    one_line_error(&err, "give two or more --input");
    // A mode named twice in one comparison would train into one folder twice.
    let twice = dir.join("twice");
    let (ok, _, err) = compare(&cfg, &twice, "lrmoe,full,lrmoe", &["--steps", "2"]);
    assert!(!ok);
    one_line_error(&err, "--modes names LRMoE twice");
    assert!(!twice.exists());
    assert!(!empty.exists(), "nothing written on a bad join");
    assert_eq!(std::fs::read(&ja).unwrap(), a_before, "the input is kept");
}

#[test]
fn evaluations_come_more_often_near_the_target() {
    let dir = tmp("eval-near");
    // Every step within 1000 nats of a target never reached: the grid's
    // first evaluation (step 3), then every step.
    let cfg = tiny_config(&dir, "eval_near_every = 1\neval_near_margin = 1000.0");
    let cfg = path(&cfg);
    let (ok, _, err) = lrmoe(&[
        "train",
        "--config",
        cfg,
        "--steps",
        "8",
        "--target-val-loss",
        "0.01",
        "--no-progress",
        "--no-checkpoint",
    ]);
    assert!(ok, "{err}");
    let evaluated: Vec<u64> = std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|m| !m["val_loss"].is_null())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [3, 4, 5, 6, 7, 8]);
    // Without a target there is nothing to be near: one line, no run.
    let (ok, _, err) = lrmoe(&["train", "--config", cfg, "--no-progress", "--force"]);
    assert!(!ok);
    one_line_error(
        &err,
        "run.eval_near_every evaluates more often near the target",
    );
}

/// The budget holds the forward's rows too (`moe.budget_forward`, on by
/// default): LRMoE's forward computes every pair, more than the 0.6
/// budget, so its steps split as fixed ownership's do; with
/// `budget_forward = false` (the backward alone) LRMoE never splits.
/// Without `fit_budget` nothing splits either way.
#[test]
fn a_budget_that_holds_the_forward_splits_lrmoe_s_steps() {
    let micro_batches = |name: &str, moe: &str, flags: &[&str]| -> Vec<u64> {
        let dir = tmp(name);
        let cfg = tiny_config(&dir, "");
        edit_config(&cfg, &[("ranks = 2\n", &format!("ranks = 2\n{moe}"))]);
        let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
        args.extend(["--mode", "lrmoe", "--steps", "3", "--no-progress"]);
        args.extend(flags);
        let (ok, _, err) = lrmoe(&args);
        assert!(ok, "{err}");
        let text = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| {
                let m: serde_json::Value = serde_json::from_str(l).unwrap();
                m["micro_batches"].as_u64().unwrap()
            })
            .collect()
    };
    assert_eq!(
        micro_batches("budget-fwd", "fit_budget = true\n", &[]),
        [2, 2, 2]
    );
    assert_eq!(
        micro_batches(
            "budget-bwd",
            "fit_budget = true\nbudget_forward = false\n",
            &[]
        ),
        [1, 1, 1]
    );
    // The flags say the same.
    assert_eq!(
        micro_batches("budget-flags", "", &["--fit-budget"]),
        [2, 2, 2]
    );
    let flags = ["--fit-budget", "--budget-forward", "false"];
    assert_eq!(micro_batches("budget-flags-bwd", "", &flags), [1, 1, 1]);
    assert_eq!(
        micro_batches("budget-none", "budget_forward = true\n", &[]),
        [1, 1, 1]
    );
}
