//! AdamW with global-norm gradient clipping, over [`Model`] tensors.

use crate::model::Model;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup: usize,
    /// Decoupled weight decay (matrices only; gains and embeddings are exempt).
    pub weight_decay: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Numerical floor.
    pub eps: f64,
    /// Global gradient-norm clip (0 disables).
    pub clip: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup: 100,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            clip: 1.0,
        }
    }
}

/// Learning rate at `step` (0-based) of `total`: warm-up, then cosine.
pub fn lr_at(cfg: &AdamWConfig, step: usize, total: usize) -> f64 {
    if step < cfg.warmup {
        return cfg.lr * (step + 1) as f64 / cfg.warmup as f64;
    }
    let span = total.saturating_sub(cfg.warmup).max(1);
    let t = ((step - cfg.warmup) as f64 / span as f64).min(1.0);
    cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
}

/// Optimizer state: first and second moments, shaped like the model.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWState<T> {
    /// First moments.
    pub m: Model<T>,
    /// Second moments.
    pub v: Model<T>,
    /// Updates applied so far.
    pub t: u64,
}

fn decays(name: &str) -> bool {
    !(name.contains("norm") || name == "embed" || name == "pos")
}

/// Clips `grads` to global norm `cfg.clip` and applies one AdamW update at
/// learning rate `lr`. Returns the gradient norm before clipping.
pub fn step<T: layer::Value>(
    cfg: &AdamWConfig,
    model: &mut Model<T>,
    grads: &Model<T>,
    state: &mut AdamWState<T>,
    lr: f64,
) -> f64 {
    // One running sum in tensor order (the order of the flattened sum it
    // replaces, so the norm keeps its bits), without a flattening iterator.
    let norm = grads
        .tensors()
        .iter()
        .fold(0.0f64, |acc, (_, t)| {
            t.iter().fold(acc, |a, g| a + g.wide() * g.wide())
        })
        .sqrt();
    let scale = if cfg.clip > 0.0 && norm > cfg.clip {
        cfg.clip / norm
    } else {
        1.0
    };
    state.t += 1;
    let bc1 = 1.0 - cfg.beta1.powi(state.t as i32);
    let bc2 = 1.0 - cfg.beta2.powi(state.t as i32);
    let g_all = grads.tensors();
    let m_all = state.m.tensors_mut();
    let v_all = state.v.tensors_mut();
    for ((((name, p), (_, g)), (_, m)), (_, v)) in model
        .tensors_mut()
        .into_iter()
        .zip(g_all)
        .zip(m_all)
        .zip(v_all)
    {
        let wd = if decays(&name) { cfg.weight_decay } else { 0.0 };
        // Zipped slices (no bounds checks), so the loop vectorises; the
        // arithmetic is unchanged, bit for bit.
        for (((p, &g), m), v) in p
            .iter_mut()
            .zip(g.iter())
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            let gi = g.wide() * scale;
            let mi = cfg.beta1 * m.wide() + (1.0 - cfg.beta1) * gi;
            let vi = cfg.beta2 * v.wide() + (1.0 - cfg.beta2) * gi * gi;
            *m = T::of(mi);
            *v = T::of(vi);
            let update = (mi / bc1) / ((vi / bc2).sqrt() + cfg.eps) + wd * p.wide();
            *p = T::of(p.wide() - lr * update);
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let c = AdamWConfig {
            warmup: 10,
            ..AdamWConfig::default()
        };
        assert!((lr_at(&c, 9, 100) - c.lr).abs() < 1e-12);
        assert!(lr_at(&c, 50, 100) < c.lr);
        assert!((lr_at(&c, 100, 100) - c.min_lr).abs() < 1e-12);
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_its_gradient_sign() {
        let cfg = ModelConfig {
            vocab: 3,
            d_model: 4,
            n_layers: 1,
            n_heads: 1,
            ffn: 2,
            n_experts: 2,
            top_k: 1,
            renormalize: false,
            max_seq: 4,
            ..ModelConfig::small(3)
        };
        let mut model = Model::<f64>::zeros(&cfg);
        let mut grads = Model::<f64>::zeros(&cfg);
        grads.head[0] = 0.5;
        grads.head[1] = -0.25;
        let mut state = AdamWState {
            m: Model::zeros(&cfg),
            v: Model::zeros(&cfg),
            t: 0,
        };
        let c = AdamWConfig {
            clip: 0.0,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        step(&c, &mut model, &grads, &mut state, 0.01);
        assert!((model.head[0] + 0.01).abs() < 1e-6);
        assert!((model.head[1] - 0.01).abs() < 1e-6);
        assert_eq!(model.head[2], 0.0);
    }
}
