//! What a rank carries from step to step ([`State`]) and what rank 0 has
//! logged ([`Logged`]).

use crate::data::SplitMix;
use crate::model::Model;
use crate::optim::AdamWState;

use super::metrics::StepMetrics;
use super::EvalPoint;

/// The training state a checkpoint holds.
#[derive(Clone)]
pub(super) struct State {
    pub(super) model: Model<f32>,
    pub(super) adam: AdamWState<f32>,
    pub(super) step: usize,
    pub(super) rng: SplitMix,
    pub(super) evals: Vec<EvalPoint>,
    pub(super) wall_s: f64,
    pub(super) moe_s: f64,
    /// Simulated training and MoE-layer time so far (rank 0 of timed
    /// in-process ranks; a resumed run starts from its last evaluation's).
    pub(super) sim: Option<(f64, f64)>,
    /// Each layer's balancing bias (`moe.expert_bias_rate`; empty when off).
    pub(super) expert_bias: Vec<Vec<f64>>,
    /// Each layer's routed pairs per expert in the last step (all ranks;
    /// SYMI-like replicas follow it; not in the checkpoint: a resumed run's
    /// first step has no history).
    pub(super) last_load: Vec<Vec<u64>>,
    /// The run's kept fractions and buffers so far (not in the checkpoint:
    /// a resumed run reads them back from `metrics.jsonl` as it cuts it
    /// back, [`truncate_metrics`]).
    pub(super) logged: Logged,
}

/// Sums over the layer calls a run has logged, for its summary.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Logged {
    pub(super) kept_sum: f64,
    pub(super) kept_n: usize,
    pub(super) max_buffer: u64,
    pub(super) max_experts: u64,
    pub(super) max_rank_peak: u64,
    /// The same were every step one micro-batch (`unsplit_peak_bytes`).
    pub(super) max_unsplit_peak: u64,
    /// The most device memory one timed rank held at once (measured).
    pub(super) max_held: u64,
    /// Timed in-process ranks: the host probe's seconds summed over the
    /// steps that ran it (`simulated.host_probe_s`), and how many.
    pub(super) probe_sum: f64,
    pub(super) probe_n: usize,
    /// Replicas placed, summed over the layer calls (`kept_n` of them).
    pub(super) replicas_sum: u64,
}

impl Logged {
    pub(super) fn add(&mut self, kept_fraction: f64, buffer_bytes: u64, replicas: u64) {
        self.kept_sum += kept_fraction;
        self.kept_n += 1;
        self.max_buffer = self.max_buffer.max(buffer_bytes);
        self.replicas_sum = self.replicas_sum.saturating_add(replicas);
    }

    /// Replicas the controller placed per layer call, on average (0 where
    /// no layer call was logged).
    pub(super) fn mean_replicas(&self) -> f64 {
        if self.kept_n > 0 {
            self.replicas_sum as f64 / self.kept_n as f64
        } else {
            0.0
        }
    }

    /// The host probe's mean over the steps, milliseconds (`None` where no
    /// step ran it).
    pub(super) fn mean_probe_ms(&self) -> Option<f64> {
        (self.probe_n > 0).then(|| self.probe_sum / self.probe_n as f64 * 1e3)
    }

    fn add_probe(&mut self, seconds: Option<f64>) {
        if let Some(s) = seconds.filter(|s| s.is_finite() && *s > 0.0) {
            self.probe_sum += s;
            self.probe_n += 1;
        }
    }

    /// The mean kept fraction (1 where no layer call was logged).
    pub(super) fn mean_kept(&self) -> f64 {
        if self.kept_n > 0 {
            self.kept_sum / self.kept_n as f64
        } else {
            1.0
        }
    }

    /// Adds one step as it is logged (its twin for a line read back is
    /// [`Logged::add_line`]).
    pub(super) fn add_step(&mut self, m: &StepMetrics) {
        self.max_experts = self.max_experts.max(m.expert_bytes);
        self.max_rank_peak = self.max_rank_peak.max(m.rank_peak_bytes);
        self.max_unsplit_peak = self.max_unsplit_peak.max(m.unsplit_peak_bytes);
        if let Some(sim) = &m.simulated {
            let held = sim.held_bytes.iter().copied().max().unwrap_or(0);
            self.max_held = self.max_held.max(held);
            self.add_probe(sim.host_probe_s);
        }
        for l in &m.layers {
            self.add(l.kept_fraction, l.buffer_bytes, l.replicas as u64);
        }
    }

    /// Adds the layer calls of one `metrics.jsonl` line.
    pub(super) fn add_line(&mut self, line: &serde_json::Value) {
        let experts = line["expert_bytes"].as_u64().unwrap_or(0);
        self.max_experts = self.max_experts.max(experts);
        let peak = line["rank_peak_bytes"].as_u64().unwrap_or(0);
        self.max_rank_peak = self.max_rank_peak.max(peak);
        // Lines written before it was recorded: the step as it ran.
        let unsplit = line["unsplit_peak_bytes"].as_u64().unwrap_or(peak);
        self.max_unsplit_peak = self.max_unsplit_peak.max(unsplit);
        let held = line["simulated"]["held_bytes"]
            .as_array()
            .into_iter()
            .flatten();
        let held = held
            .filter_map(serde_json::Value::as_u64)
            .max()
            .unwrap_or(0);
        self.max_held = self.max_held.max(held);
        self.add_probe(line["simulated"]["host_probe_s"].as_f64());
        for l in line["layers"].as_array().into_iter().flatten() {
            if let Some(k) = l["kept_fraction"].as_f64() {
                let buffer = l["buffer_bytes"].as_u64().unwrap_or(0);
                self.add(k, buffer, l["replicas"].as_u64().unwrap_or(0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_probe_kept_share_and_replicas_are_read_back_from_lines() {
        let mut l = Logged::default();
        assert_eq!(l.mean_probe_ms(), None);
        for line in [
            serde_json::json!({"simulated": {"host_probe_s": 0.0005, "held_bytes": [7]},
                "layers": [{"kept_fraction": 0.5, "replicas": 3}, {"kept_fraction": 0.7, "replicas": 0}]}),
            serde_json::json!({"simulated": {"host_probe_s": 0.0007}}),
            serde_json::json!({"simulated": {"held_bytes": [3]}}),
            serde_json::json!({"loss": 1.0}),
        ] {
            l.add_line(&line);
        }
        let mean = l.mean_probe_ms().expect("two probes");
        assert!((mean - 0.6).abs() < 1e-12, "{mean}");
        assert_eq!(l.max_held, 7);
        assert!((l.mean_kept() - 0.6).abs() < 1e-12);
        assert_eq!(l.mean_replicas(), 1.5);
    }
}
