//! `lrmoe train --compare`: full backward, LRMoE and capacity-factor token
//! dropping trained to the same target validation loss; a table and an SVG
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

const MODES: [Mode; 3] = [Mode::Full, Mode::Lrmoe, Mode::Capacity];

/// Trains each mode into `out_dir/<mode>` and writes `compare.{md,json,svg}`.
pub fn run(cfg: &TrainConfig, opts: &RunOptions) -> Result<Report, TrainError> {
    let target = cfg.run.target_val_loss.ok_or_else(|| {
        TrainError::Config("--compare needs a target validation loss (--target-val-loss)".into())
    })?;
    let mut runs = Vec::new();
    for mode in MODES {
        let mut c = cfg.clone();
        c.moe.mode = mode;
        c.run.out_dir = cfg.run.out_dir.join(format!("{mode:?}").to_lowercase());
        tracing::info!(?mode, target, "compare: training");
        runs.push(train(&c, opts)?);
    }
    let table = table(target, &runs);
    let dir = &cfg.run.out_dir;
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
    let svg = dir.join("compare.svg");
    write_atomic(&svg, plot(target, &runs).as_bytes()).map_err(io(&svg))?;
    Ok(Report {
        table,
        files: [md, json, svg]
            .iter()
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
    let _ = writeln!(
        t,
        "| mode | reached | time to target (s) | MoE-layer time to target (s) | steps | final val loss | mean kept fraction | max backward buffer (KiB) |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for r in runs {
        let (reached, wall, moe, steps) = match r.reached_target {
            Some(p) => (
                "yes",
                format!("{:.1}", p.wall_s),
                format!("{:.1}", p.moe_s),
                p.step.to_string(),
            ),
            None => {
                let last = r.evals.last();
                (
                    "no",
                    format!("> {:.1}", last.map_or(0.0, |p| p.wall_s)),
                    format!("> {:.1}", last.map_or(0.0, |p| p.moe_s)),
                    r.steps.to_string(),
                )
            }
        };
        let _ = writeln!(
            t,
            "| {:?} | {reached} | {wall} | {moe} | {steps} | {:.4} | {:.3} | {:.1} |",
            r.mode,
            r.final_val_loss,
            r.mean_kept_fraction,
            r.max_buffer_bytes as f64 / 1024.0
        );
    }
    t
}

/// A line chart of validation loss against wall time, one polyline per run.
fn plot(target: f64, runs: &[TrainSummary]) -> String {
    let (w, h, m) = (720.0, 440.0, 60.0);
    let pts = runs.iter().flat_map(|r| r.evals.iter());
    let t_max = pts.clone().map(|p| p.wall_s).fold(1e-9, f64::max);
    let l_min = pts.clone().map(|p| p.val_loss).fold(target, f64::min) - 0.05;
    let l_max = pts.map(|p| p.val_loss).fold(target, f64::max) + 0.05;
    let x = |t: f64| m + (w - 2.0 * m) * t / t_max;
    let y = |l: f64| h - m - (h - 2.0 * m) * (l - l_min) / (l_max - l_min);
    let colors = ["#1f77b4", "#d62728", "#2ca02c"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - m,
        w - m,
        h - m
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>",
        h - m
    );
    for i in 0..=4 {
        let t = t_max * i as f64 / 4.0;
        let l = l_min + (l_max - l_min) * i as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{t:.0}</text>",
            x(t),
            h - m + 18.0
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{l:.2}</text>",
            m - 6.0,
            y(l) + 4.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">wall time (s)</text>",
        w / 2.0,
        h - 15.0
    );
    let _ = writeln!(s, "<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">validation loss (nats/token)</text>", h / 2.0, h / 2.0);
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"gray\" stroke-dasharray=\"4 4\"/><text x=\"{1}\" y=\"{2:.1}\" text-anchor=\"end\" fill=\"gray\">target {target:.3}</text>",
        y(target),
        w - m,
        y(target) - 4.0
    );
    for (i, r) in runs.iter().enumerate() {
        let c = colors[i % colors.len()];
        let line: Vec<String> = r
            .evals
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.wall_s), y(p.val_loss)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            line.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{:?}</text>",
            w - m - 90.0,
            m + 16.0 * (i as f64 + 1.0),
            r.mode
        );
    }
    s.push_str("</svg>\n");
    s
}
