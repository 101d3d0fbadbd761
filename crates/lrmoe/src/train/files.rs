//! The run's folder: the checkpoint (write, read, check against the
//! configuration), the room it needs, orphans, and `metrics.jsonl`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::data::{Corpus, SplitMix};
use crate::model::{Model, ModelConfig};
use crate::optim::AdamWState;
use crate::tensorfile::{self, TensorFileError};

use super::config::TrainConfig;
use super::state::{Logged, State};
use super::{io_err, EvalPoint, RunOptions, TrainError};

pub(super) const CHECKPOINT: &str = "checkpoint.safetensors";

/// The checkpoint shape of the model tensor `name` holding `len` values.
pub(super) fn shape_of(cfg: &ModelConfig, name: &str, len: usize) -> Vec<usize> {
    let (d, v, f) = (cfg.d_model, cfg.vocab, cfg.ffn);
    let (qd, kd) = (
        cfg.n_heads * cfg.head_width(),
        cfg.kv_heads() * cfg.head_width(),
    );
    match name.rsplit('.').next().unwrap_or("") {
        "embed" => vec![v, d],
        "pos" => vec![cfg.max_seq, d],
        "head" => vec![d, v],
        "router" => vec![d, cfg.n_experts],
        "gate" | "up" => vec![d, f],
        "down" => vec![f, d],
        "wq" => vec![d, qd],
        "wk" | "wv" => vec![d, kd],
        "wo" => vec![qd, d],
        _ => vec![len],
    }
}

/// The checkpoint's metadata beside the tensors.
pub(super) fn checkpoint_meta(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    s: &State,
) -> HashMap<String, String> {
    let mut meta = HashMap::new();
    meta.insert("format".into(), "lrmoe-checkpoint-1".into());
    meta.insert("step".into(), s.step.to_string());
    meta.insert("adam_t".into(), s.adam.t.to_string());
    meta.insert("rng".into(), s.rng.0.to_string());
    meta.insert("wall_s".into(), s.wall_s.to_string());
    meta.insert("moe_s".into(), s.moe_s.to_string());
    if let Some((step_s, moe_s)) = s.sim {
        meta.insert("simulated_s".into(), step_s.to_string());
        meta.insert("simulated_moe_s".into(), moe_s.to_string());
    }
    meta.insert(
        "expert_bias".into(),
        serde_json::to_string(&s.expert_bias).unwrap_or_default(),
    );
    meta.insert(
        "model".into(),
        serde_json::to_string(mcfg).unwrap_or_default(),
    );
    meta.insert(
        "vocab".into(),
        corpus.vocab.iter().map(|b| format!("{b:02x}")).collect(),
    );
    meta.insert(
        "evals".into(),
        serde_json::to_string(&s.evals).unwrap_or_default(),
    );
    meta.insert("config".into(), toml::to_string(cfg).unwrap_or_default());
    meta
}

/// Bytes the checkpoint of state `s` takes on disk, at most (its final
/// evaluation curve may add a few hundred bytes; the bound's slack covers
/// them).
pub(super) fn checkpoint_bytes(
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    s: &State,
) -> u64 {
    let meta: usize = checkpoint_meta(cfg, mcfg, corpus, s)
        .iter()
        .map(|(k, v)| k.len() + v.len() + 8)
        .sum();
    let lens: Vec<usize> = s.model.tensors().iter().map(|(_, t)| t.len()).collect();
    tensorfile::saved_bytes_bound(lens.iter().chain(&lens).chain(&lens).copied(), meta) + 64 * 1024
}

/// Free bytes on the file system that holds `dir` (or its nearest existing
/// ancestor); `None` where it cannot be read.
pub(super) fn free_bytes(dir: &Path) -> Option<u64> {
    // A relative path's last ancestor is "", which never exists: the
    // working folder stands for it.
    let existing = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("."));
    let st = nix::sys::statvfs::statvfs(existing).ok()?;
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

pub(super) fn save_checkpoint(
    path: &Path,
    cfg: &TrainConfig,
    mcfg: &ModelConfig,
    corpus: &Corpus,
    s: &State,
) -> Result<(), TrainError> {
    let mut tensors = Vec::new();
    for (prefix, m) in [
        ("model.", &s.model),
        ("adam.m.", &s.adam.m),
        ("adam.v.", &s.adam.v),
    ] {
        for (name, t) in m.tensors() {
            let shape = shape_of(mcfg, &name, t.len());
            tensors.push((format!("{prefix}{name}"), shape, t.as_slice()));
        }
    }
    let clock = Instant::now();
    tensorfile::save(path, &tensors, checkpoint_meta(cfg, mcfg, corpus, s))?;
    let secs = clock.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
    tracing::debug!(
        step = s.step,
        mib = bytes >> 20,
        seconds = secs,
        mib_per_s = bytes as f64 / (1u64 << 20) as f64 / secs.max(1e-9),
        "checkpoint written"
    );
    Ok(())
}

pub(super) fn load_checkpoint(
    path: &Path,
    mcfg: &ModelConfig,
    corpus: &Corpus,
) -> Result<State, TrainError> {
    let mut f = tensorfile::load(path)?;
    let fmt = |m: String| content_error(path, m);
    check_header(&f, path, mcfg, corpus)?;
    let num = |f: &tensorfile::Loaded, k: &str| -> Result<f64, TrainError> {
        f.meta(k)?
            .parse::<f64>()
            .map_err(|e| fmt(format!("{k}: {e}")))
    };
    let step = num(&f, "step")? as usize;
    let adam_t = num(&f, "adam_t")? as u64;
    let rng = f
        .meta("rng")?
        .parse::<u64>()
        .map_err(|e| fmt(format!("rng: {e}")))?;
    let wall_s = num(&f, "wall_s")?;
    let moe_s = num(&f, "moe_s")?;
    // Simulated time (timed in-process ranks only).
    let sim = match (f.meta("simulated_s"), f.meta("simulated_moe_s")) {
        (Ok(_), Ok(_)) => Some((num(&f, "simulated_s")?, num(&f, "simulated_moe_s")?)),
        _ => None,
    };
    let evals: Vec<EvalPoint> =
        serde_json::from_str(f.meta("evals")?).map_err(|e| fmt(e.to_string()))?;
    let expert_bias = read_expert_bias(&f, path, mcfg)?;
    let mut take = |prefix: &str| -> Result<Model<f32>, TrainError> {
        let mut m = Model::<f32>::zeros(mcfg);
        for (name, t) in m.tensors_mut() {
            let shape = shape_of(mcfg, &name, t.len());
            *t = f.take(&format!("{prefix}{name}"), &shape)?;
        }
        Ok(m)
    };
    let model = take("model.")?;
    let adam = AdamWState {
        m: take("adam.m.")?,
        v: take("adam.v.")?,
        t: adam_t,
    };
    Ok(State {
        model,
        adam,
        step,
        rng: SplitMix(rng),
        evals,
        wall_s,
        moe_s,
        sim,
        expert_bias,
        last_load: Vec::new(),
        logged: Logged::default(),
    })
}

/// A checkpoint's content at fault, as an error naming the file.
pub(super) fn content_error(path: &Path, reason: String) -> TrainError {
    TrainError::Checkpoint(TensorFileError::Content {
        path: path.display().to_string(),
        reason,
    })
}

/// A checkpoint's format, model and vocabulary against this run's.
pub(super) fn check_header(
    f: &tensorfile::Loaded,
    path: &Path,
    mcfg: &ModelConfig,
    corpus: &Corpus,
) -> Result<(), TrainError> {
    let fmt = |m: String| content_error(path, m);
    if f.meta("format")? != "lrmoe-checkpoint-1" {
        return Err(fmt("not an lrmoe checkpoint".into()));
    }
    let saved: ModelConfig = crate::strict::from_json(f.meta("model")?)
        .map_err(|e| fmt(format!("metadata field model: {e}")))?;
    if saved != *mcfg {
        return Err(fmt(format!(
            "the checkpoint's model differs from the configured one ({}); resume with the configuration it was trained with",
            differences(&saved, mcfg)
        )));
    }
    let vocab: String = corpus.vocab.iter().map(|b| format!("{b:02x}")).collect();
    if f.meta("vocab")? != vocab {
        return Err(fmt("vocabulary differs from the corpus".into()));
    }
    Ok(())
}

/// The balancing bias a checkpoint carries: none in checkpoints from before
/// it, else one finite value per expert and layer.
pub(super) fn read_expert_bias(
    f: &tensorfile::Loaded,
    path: &Path,
    mcfg: &ModelConfig,
) -> Result<Vec<Vec<f64>>, TrainError> {
    let fmt = |m: String| content_error(path, m);
    let expert_bias: Vec<Vec<f64>> = match f.meta("expert_bias") {
        Ok(j) => serde_json::from_str(j).map_err(|e| fmt(format!("expert_bias: {e}")))?,
        Err(_) => Vec::new(),
    };
    if !expert_bias.is_empty()
        && (expert_bias.len() != mcfg.n_layers
            || expert_bias
                .iter()
                .any(|b| b.len() != mcfg.n_experts || b.iter().any(|v| !v.is_finite())))
    {
        return Err(fmt(format!(
            "expert_bias: {} finite values per layer for {} layers expected",
            mcfg.n_experts, mcfg.n_layers
        )));
    }
    Ok(expert_bias)
}

/// Reads `path` as a checkpoint of the model `cfg` describes on `corpus`
/// and checks it as `--resume` does (format, model shape, vocabulary, every
/// tensor's shape, finite values); returns the step it holds. Nothing is
/// trained or written.
pub fn check_checkpoint(
    path: &Path,
    cfg: &TrainConfig,
    corpus: &Corpus,
) -> Result<usize, TrainError> {
    let mcfg = cfg.model_config(corpus.vocab.len())?;
    Ok(load_checkpoint(path, &mcfg, corpus)?.step)
}

/// `field saved → configured` for each field where two configurations
/// differ, e.g. `n_experts 8 → 4, ffn 256 → 128`.
pub(super) fn differences<T: Serialize>(saved: &T, configured: &T) -> String {
    let (a, b) = (
        serde_json::to_value(saved).unwrap_or_default(),
        serde_json::to_value(configured).unwrap_or_default(),
    );
    match (a.as_object(), b.as_object()) {
        (Some(a), Some(b)) => a
            .iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k}: {v} in the checkpoint, {} configured",
                    b.get(k).cloned().unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        _ => String::from("unreadable"),
    }
}

/// Refuses an output folder the run cannot use, before anything is
/// created or written: a file in its place, an earlier run without
/// `--resume` or `--force` (the hint says which of them can work), or
/// `--resume` with no checkpoint to continue.
pub(super) fn check_out_dir(dir: &Path, opts: &RunOptions) -> Result<(), TrainError> {
    let refuse = |m: String| Err(TrainError::Config(m));
    if dir.exists() && !dir.is_dir() {
        return refuse(format!(
            "the output folder {} is a file, not a folder: choose another --out (run.out_dir)",
            dir.display()
        ));
    }
    let (ckpt, metrics) = (dir.join(CHECKPOINT), dir.join("metrics.jsonl"));
    if opts.resume && !ckpt.exists() {
        let hint = if metrics.exists() {
            "its earlier run left no checkpoint: pass --force instead of --resume to start over"
        } else {
            "drop --resume to start a new run"
        };
        return refuse(format!(
            "--resume: {} holds no checkpoint to continue ({hint})",
            dir.display()
        ));
    }
    if !opts.resume && !opts.force {
        if ckpt.exists() {
            return refuse(format!(
                "{} holds an earlier run ({}): pass --resume to continue it or --force to start over",
                dir.display(),
                ckpt.display()
            ));
        }
        if metrics.exists() {
            return refuse(format!(
                "{} holds the metrics of an earlier run that left no checkpoint ({}): pass --force to start over",
                dir.display(),
                metrics.display()
            ));
        }
    }
    Ok(())
}

/// Says how large each checkpoint write is, and refuses a run whose
/// checkpoint cannot fit on the output folder's disk (it would fail only
/// after training).
pub(super) fn check_checkpoint_room(dir: &Path, bytes: u64) -> Result<(), TrainError> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let free = free_bytes(dir);
    tracing::info!(
        checkpoint_gib = gib(bytes),
        free_gib = free.map(gib),
        "checkpoint size (each write; --no-checkpoint writes none)"
    );
    match free {
        Some(free) if free < bytes => Err(TrainError::Config(format!(
            "the checkpoint needs {:.2} GiB and {}'s disk has {:.2} GiB free: free space, choose another --out, or pass --no-checkpoint (run.checkpoint = false)",
            gib(bytes),
            dir.display(),
            gib(free)
        ))),
        _ => Ok(()),
    }
}

/// Removes temporary files a killed run left behind in `dir` (the atomic
/// writer's `.<name>.<pid>.tmp`).
pub(super) fn remove_orphans(dir: &Path) -> Result<(), TrainError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(_) => return Ok(()),
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = [CHECKPOINT, "metrics.jsonl"]
            .iter()
            .any(|f| name.starts_with(&format!(".{f}.")));
        if ours && name.ends_with(".tmp") {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_err(&path))?;
            tracing::info!(path = %path.display(), "removed a temporary file of an earlier, interrupted run");
        }
    }
    Ok(())
}

/// Cuts `metrics.jsonl` back to the lines of steps `<= step` (the resumed
/// checkpoint's), atomically, so a resumed run logs each step once. Lines
/// that do not parse end the kept part (a torn last line of a killed run).
/// Returns the kept lines' layer calls, for the run's summary.
pub(super) fn truncate_metrics(path: &Path, step: usize) -> Result<Logged, TrainError> {
    let mut logged = Logged::default();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(logged),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut kept = String::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            break;
        };
        match v.get("step").and_then(serde_json::Value::as_u64) {
            Some(s) if s as usize <= step => {
                logged.add_line(&v);
                kept.push_str(line);
                kept.push('\n');
            }
            _ => break,
        }
    }
    if kept.len() != text.len() {
        crate::fsutil::write_atomic(path, kept.as_bytes()).map_err(io_err(path))?;
    }
    Ok(logged)
}
