//! `lrmoe train --compare`: full backward, replication only, LRMoE and
//! capacity-factor token dropping trained to the same target validation loss; a table and an SVG
//! plot of validation loss against wall time.

use std::fmt::Write as _;

use serde::Serialize;

use crate::fsutil::write_atomic;
use crate::train::{train, Mode, RunOptions, TrainConfig, TrainError, TrainSummary};

/// What the comparison wrote.
#[derive(Debug, Clone)]
pub struct Report {
    /// The Markdown table.
    pub table: String,
    /// Files written.
    pub files: Vec<String>,
}

#[derive(Serialize)]
struct CompareJson<'a> {
    target_val_loss: f64,
    runs: &'a [TrainSummary],
}

/// The modes a comparison trains unless told otherwise.
pub const MODES: [Mode; 4] = [Mode::Full, Mode::Replicate, Mode::Lrmoe, Mode::Capacity];

/// Trains each of `modes` into `out_dir/<mode>` and writes
/// `compare.{md,json,svg,png}`.
pub fn run(cfg: &TrainConfig, opts: &RunOptions, modes: &[Mode]) -> Result<Report, TrainError> {
    if modes.is_empty() {
        return Err(TrainError::Config(
            "--compare needs at least one mode".into(),
        ));
    }
    let target = cfg.run.target_val_loss.ok_or_else(|| {
        TrainError::Config("--compare needs a target validation loss (--target-val-loss)".into())
    })?;
    let mut runs = Vec::new();
    for &mode in modes {
        let mut c = cfg.clone();
        c.moe.mode = mode;
        c.run.out_dir = cfg.run.out_dir.join(format!("{mode:?}").to_lowercase());
        tracing::info!(?mode, target, "compare: training");
        runs.push(train(&c, opts)?);
        if opts.stop.is_raised() {
            tracing::warn!("compare: stopped by a signal; the later modes are not trained");
            break;
        }
    }
    let table = table(target, &runs);
    let dir = &cfg.run.out_dir;
    if !opts.writes() {
        return Ok(Report {
            table,
            files: vec![],
        });
    }
    let io = |p: &std::path::Path| {
        let p = p.to_path_buf();
        move |error| TrainError::Io {
            path: p.display().to_string(),
            error,
        }
    };
    let md = dir.join("compare.md");
    write_atomic(&md, table.as_bytes()).map_err(io(&md))?;
    let json = dir.join("compare.json");
    let body = serde_json::to_string_pretty(&CompareJson {
        target_val_loss: target,
        runs: &runs,
    })
    .unwrap_or_default();
    write_atomic(&json, body.as_bytes()).map_err(io(&json))?;
    let charts = plot(&dir.join("compare"), target, &runs)
        .map_err(|e| TrainError::Config(format!("plot: {e}")))?;
    Ok(Report {
        table,
        files: [md, json]
            .into_iter()
            .chain(charts)
            .map(|p| p.display().to_string())
            .collect(),
    })
}

fn table(target: f64, runs: &[TrainSummary]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Target validation loss: {target:.3} nats/token (unigram baseline {:.3}).\n",
        runs[0].unigram_val_loss
    );
    // Timed in-process ranks add the simulated times on their GPUs.
    let simulated = runs
        .iter()
        .any(|r| r.evals.iter().any(|p| p.simulated_s.is_some()));
    let (sim_head, sim_rule) = if simulated {
        (
            " simulated time to target (s) | simulated MoE-layer time to target (s) | measured most held on one rank (MiB) |",
            "---|---|---|",
        )
    } else {
        ("", "")
    };
    let _ = writeln!(
        t,
        "| mode | reached | time to target (s) | MoE-layer time to target (s) |{sim_head} steps | final val loss | mean kept fraction | max backward buffer (KiB) | max expert instances per rank (MiB) | max instances + buffer on one rank (MiB) |"
    );
    let _ = writeln!(t, "|---|---|---|---|{sim_rule}---|---|---|---|---|---|");
    let opt = |v: Option<f64>, above: bool| {
        v.map_or("-".to_string(), |x| {
            if above {
                format!("> {x:.2}")
            } else {
                format!("{x:.2}")
            }
        })
    };
    for r in runs {
        let (reached, point, above, steps) = match r.reached_target {
            Some(p) => ("yes", Some(p), false, p.step.to_string()),
            None => ("no", r.evals.last().copied(), true, r.steps.to_string()),
        };
        let fmt = |v: f64| {
            if above {
                format!("> {v:.1}")
            } else {
                format!("{v:.1}")
            }
        };
        let wall = fmt(point.map_or(0.0, |p| p.wall_s));
        let moe = fmt(point.map_or(0.0, |p| p.moe_s));
        let sim = if simulated {
            format!(
                " {} | {} | {:.1} |",
                opt(point.and_then(|p| p.simulated_s), above),
                opt(point.and_then(|p| p.simulated_moe_s), above),
                r.max_held_bytes as f64 / (1 << 20) as f64
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            t,
            "| {} | {reached} | {wall} | {moe} |{sim} {steps} | {:.4} | {:.3} | {:.1} | {:.2} | {:.2} |",
            r.mode,
            r.final_val_loss,
            r.mean_kept_fraction,
            r.max_buffer_bytes as f64 / 1024.0,
            r.max_expert_bytes as f64 / (1 << 20) as f64,
            r.max_rank_peak_bytes as f64 / (1 << 20) as f64
        );
    }
    t
}

/// Validation loss against wall time, one line per run, with the target
/// as a dashed line: `<stem>.svg` and `<stem>.png`.
fn plot(
    stem: &std::path::Path,
    target: f64,
    runs: &[TrainSummary],
) -> Result<Vec<std::path::PathBuf>, crate::plots::PlotError> {
    let series: Vec<crate::plots::Series> = runs
        .iter()
        .map(|r| crate::plots::Series {
            name: r.mode.to_string(),
            points: r.evals.iter().map(|p| (p.wall_s, p.val_loss)).collect(),
        })
        .collect();
    crate::plots::lines(
        stem,
        crate::plots::Labels {
            title: "validation loss against wall time",
            x: "wall time (s)",
            y: "validation loss (nats/token)",
        },
        &series,
        Some(&crate::plots::Reference {
            y: target,
            label: format!("target {target:.3}"),
        }),
    )
}
