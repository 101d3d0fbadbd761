//! The device-resident model on launched ranks, one GPU each (feature
//! `nccl`), against the CPU model on the whole batch in one process. Run
//! under the launcher on a machine with ≥ 2 GPUs:
//!
//! ```text
//! lrmoe launch --nproc 2 --exec <this test binary> -- --ignored --test-threads=1
//! ```
//!
//! Every rank takes its share of the batch's windows: the loss averaged
//! over ranks, every dense gradient (summed over ranks on the device) and
//! this rank's experts' gradients equal the CPU model's within bf16
//! tolerance; 30 training steps follow the CPU model's loss curve.
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used)] // test set-up panics by design

use std::sync::Arc;
use std::time::Duration;

use lrmoe::data::windows;
use lrmoe::device_model::DeviceModel;
use lrmoe::layer::device::DeviceComm;
use lrmoe::layer::transport::all_gather;
use lrmoe::layer::{run_local, CallConfig, DistEnv, NcclTransport, Transport};
use lrmoe::model::{self, Model, ModelConfig, MoeRun};
use lrmoe::optim::{self, AdamWConfig, AdamWState};
use lrmoe::quota::Placement;

fn cfg() -> ModelConfig {
    ModelConfig {
        vocab: 40,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        ffn: 16,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
        max_seq: 16,
        n_kv_heads: Some(2),
        head_dim: Some(16),
        rope_theta: Some(10_000.0),
        qk_norm: true,
        rms_eps: Some(1e-6),
    }
}

fn corpus(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7 + i / 5 + (i * i) % 3) % vocab)
        .collect()
}

fn cpu(cfg: &ModelConfig, m: &Model<f32>, data: &[u32], starts: &[usize]) -> (f64, Model<f32>) {
    let (tok, tgt) = windows(data, starts, 16);
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
    run_local(1, Duration::from_secs(60), |t| {
        let (l, c) = model::forward(t, cfg, m, &run, &tok, &tgt, 16)?;
        let g = model::backward(t, cfg, m, &run, &c, 16)?;
        Ok::<_, model::ModelError>((l, g.grads))
    })
    .remove(0)
    .unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
#[ignore = "needs ≥ 2 GPUs: run under lrmoe launch on the device"]
fn launched_ranks_train_the_device_model_like_the_cpu_model() {
    let env = DistEnv::from_env()
        .unwrap()
        .expect("run under lrmoe launch");
    let t = NcclTransport::connect(&env, Duration::from_secs(120)).unwrap();
    let gpu = Arc::new(lrmoe::kernels::gpu::Gpu::open(env.local_rank).unwrap());
    let (r, w) = (t.rank(), t.world_size());
    let cfg = cfg();
    let el = cfg.n_experts / w;
    let data = corpus(4000, 40);
    let model = Model::<f32>::init(&cfg, 7);
    let zeros = || AdamWState {
        m: Model::zeros(&cfg),
        v: Model::zeros(&cfg),
        t: 0,
    };
    let starts: Vec<usize> = (0..8).map(|i| 3 + i * 431).collect();
    let per = starts.len() / w;
    let mine = &starts[r * per..(r + 1) * per];
    let call = CallConfig::default();
    let mut dm = DeviceModel::new(
        gpu.clone(),
        DeviceComm::Nccl(t.comm()),
        &cfg,
        &model,
        &zeros(),
        &call,
        (&data, &data),
    )
    .unwrap();
    let (dl, dg) = dm.loss_and_grads(mine, 16).unwrap();
    let dl = all_gather(&t, &[dl])
        .unwrap()
        .iter()
        .map(|v| v[0])
        .sum::<f64>()
        / w as f64;
    let (cl, cg) = cpu(&cfg, &model, &data, &starts);
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
    let mut dm = DeviceModel::new(
        gpu,
        DeviceComm::Nccl(t.comm()),
        &cfg,
        &model,
        &zeros(),
        &call,
        (&data, &data),
    )
    .unwrap();
    let (mut cpu_m, mut adam) = (model.clone(), zeros());
    let mut worst = 0.0f64;
    for step in 0..30 {
        let starts: Vec<usize> = (0..8).map(|i| (step * 97 + i * 431) % 3900).collect();
        let lr = optim::lr_at(&optim_cfg, step, 30);
        let (cl, g) = cpu(&cfg, &cpu_m, &data, &starts);
        optim::step(&optim_cfg, &mut cpu_m, &g, &mut adam, lr);
        let l = dm
            .train_step(&starts[r * per..(r + 1) * per], 16, 1, &optim_cfg, lr, &[])
            .unwrap()
            .loss;
        let dl = all_gather(&t, &[l])
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
    let (back, _) = dm.download(&t).unwrap();
    assert_eq!(back.blocks[0].moe.experts.len(), cfg.n_experts);
}
