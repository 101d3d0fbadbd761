//! Helpers shared by the device model's tests (`gpu_model`, `nccl_model`):
//! the tiny configurations, a learnable corpus, the CPU model's loss and
//! gradients, a relative error.
#![allow(dead_code)] // each test binary uses its own subset
#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::time::Duration;

use lrmoe::data::windows;
use lrmoe::layer::{run_local, CallConfig};
use lrmoe::model::{self, Model, ModelConfig, MoeRun};
use lrmoe::optim::AdamWState;
use lrmoe::quota::Placement;

/// The Qwen3-MoE block (grouped-query attention, q/k norms, RoPE) and the
/// classic one (learned positions), widths that are GEMM dimensions
/// multiples of 8.
pub fn configs() -> Vec<(&'static str, ModelConfig)> {
    let classic = ModelConfig {
        vocab: 40,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        ffn: 16,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
        max_seq: 16,
        ..ModelConfig::small(40)
    };
    let qwen3 = ModelConfig {
        n_kv_heads: Some(2),
        head_dim: Some(16),
        rope_theta: Some(10_000.0),
        qk_norm: true,
        rms_eps: Some(1e-6),
        ..classic
    };
    vec![("qwen3", qwen3), ("classic", classic)]
}

/// A learnable corpus: mostly a repeating pattern, some noise.
pub fn corpus(n: usize, vocab: u32) -> Vec<u32> {
    let mut s = 12345u64;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if (s >> 60) == 0 {
                ((s >> 33) % u64::from(vocab)) as u32
            } else {
                (i as u32 * 7 + (i as u32 / 5)) % vocab
            }
        })
        .collect()
}

/// The CPU model's (f32) loss and gradients of the windows at `starts`.
pub fn cpu_loss_and_grads(
    cfg: &ModelConfig,
    m: &Model<f32>,
    data: &[u32],
    starts: &[usize],
    seq: usize,
) -> (f64, Model<f32>) {
    let (tok, tgt) = windows(data, starts, seq);
    let placement = Placement {
        owner: vec![0; cfg.n_experts],
        replicas: vec![],
    };
    let call = CallConfig::default();
    let run = MoeRun {
        placement: &placement,
        backward: &call,
        expert_bias: &[],
    };
    let mut out = run_local(1, Duration::from_secs(60), |t| {
        let (l, c) = model::forward(t, cfg, m, &run, &tok, &tgt, seq)?;
        let g = model::backward(t, cfg, m, &run, &c, seq)?;
        Ok::<_, model::ModelError>((l, g.grads))
    });
    out.remove(0).unwrap()
}

/// Zero AdamW state.
pub fn fresh_adam(cfg: &ModelConfig) -> AdamWState<f32> {
    AdamWState {
        m: Model::zeros(cfg),
        v: Model::zeros(cfg),
        t: 0,
    }
}

/// ‖a − b‖ / ‖a‖.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}
