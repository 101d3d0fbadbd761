//! Helpers shared by the device model's tests (`gpu_model`, `nccl_model`):
//! the tiny configurations, a learnable corpus, the CPU model's loss and
//! gradients, a relative error.
#![allow(dead_code)] // each test binary uses its own subset
#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::time::Duration;

use lrmoe::data::windows;
use lrmoe::layer::{run_local, CallConfig};
use lrmoe::model::{self, Model, ModelConfig};
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
    let run = model::plain_moe_run(&placement, &call);
    let mut out = run_local(1, Duration::from_secs(60), |t| {
        let (l, c) = model::forward(t, cfg, m, &run, &tok, &tgt, seq)?;
        let g = model::backward(t, cfg, m, &run, c, seq)?;
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

/// Every rank of `t` takes its share of the batch's windows on the device
/// model (`comm`): the loss averaged over ranks, every dense gradient
/// (summed over ranks on the device) and this rank's experts' gradients
/// equal the CPU model's within bf16 tolerance; 30 training steps follow
/// the CPU model's loss curve; the checkpoint's download gathers every
/// expert. Run over NCCL by `nccl_model.rs`, over in-process ranks sharing
/// one GPU by `gpu_model.rs`.
#[cfg(feature = "cuda")]
pub fn ranks_train_like_the_cpu_model<X: lrmoe::layer::Transport>(
    gpu: std::sync::Arc<lrmoe::kernels::gpu::Gpu>,
    comm: lrmoe::layer::device::DeviceComm<'_>,
    t: &X,
) {
    use lrmoe::device_model::DeviceModel;
    use lrmoe::layer::transport::all_gather;
    use lrmoe::optim::{self, AdamWConfig};
    let (r, w) = (t.rank(), t.world_size());
    let (_, cfg) = configs().remove(0);
    let el = cfg.n_experts / w;
    let data = corpus(4000, cfg.vocab as u32);
    let model = Model::<f32>::init(&cfg, 7);
    let zeros = || fresh_adam(&cfg);
    let starts: Vec<usize> = (0..8).map(|i| 3 + i * 431).collect();
    let per = starts.len() / w;
    let mine = &starts[r * per..(r + 1) * per];
    let call = CallConfig::default();
    let new_model = || {
        DeviceModel::new(
            gpu.clone(),
            comm,
            &cfg,
            &model,
            &zeros(),
            &call,
            (&data, &data),
        )
        .unwrap()
    };
    let mut dm = new_model();
    let (dl, dg) = dm.loss_and_grads(mine, 16).unwrap();
    let dl = all_gather(t, &[dl])
        .unwrap()
        .iter()
        .map(|v| v[0])
        .sum::<f64>()
        / w as f64;
    let (cl, cg) = cpu_loss_and_grads(&cfg, &model, &data, &starts, 16);
    assert!((cl - dl).abs() <= 1e-2 * cl, "rank {r}: loss {cl} vs {dl}");
    let mut experts = (Vec::new(), Vec::new());
    for ((n, a), (_, b)) in cg.tensors().into_iter().zip(dg.tensors()) {
        match n.split_once(".moe.experts.") {
            Some((_, rest)) => {
                let e: usize = rest.split('.').next().unwrap().parse().unwrap();
                if e / el == r {
                    experts.0.extend_from_slice(a);
                    experts.1.extend_from_slice(b);
                }
            }
            None => {
                let e = rel(a, b);
                assert!(e <= 5e-2, "rank {r}: {n} relative error {e}");
            }
        }
    }
    let e = rel(&experts.0, &experts.1);
    assert!(e <= 5e-2, "rank {r}: own experts relative error {e}");
    println!("rank {r}: loss cpu {cl:.5} device {dl:.5}, own experts {e:.4}");

    // 30 steps beside the CPU model on the whole batch.
    let optim_cfg = AdamWConfig {
        warmup: 5,
        ..AdamWConfig::default()
    };
    let mut dm = new_model();
    let (mut cpu_m, mut adam) = (model.clone(), zeros());
    let mut worst = 0.0f64;
    for step in 0..30 {
        let starts: Vec<usize> = (0..8).map(|i| (step * 97 + i * 431) % 3900).collect();
        let lr = optim::lr_at(&optim_cfg, step, 30);
        let (cl, g) = cpu_loss_and_grads(&cfg, &cpu_m, &data, &starts, 16);
        optim::step(&optim_cfg, &mut cpu_m, &g, &mut adam, lr);
        let l = dm
            .train_step(&starts[r * per..(r + 1) * per], 16, 1, &optim_cfg, lr, &[])
            .unwrap()
            .loss;
        let dl = all_gather(t, &[l])
            .unwrap()
            .iter()
            .map(|v| v[0])
            .sum::<f64>()
            / w as f64;
        worst = worst.max((cl - dl).abs());
    }
    println!("rank {r}: 30 steps, largest loss gap {worst:.4}");
    assert!(worst <= 0.1, "rank {r}: loss curves differ by {worst}");
    // The checkpoint's download gathers every expert on every rank.
    let (back, _) = dm.download(t).unwrap();
    assert_eq!(back.blocks[0].moe.experts.len(), cfg.n_experts);
}
