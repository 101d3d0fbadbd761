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

mod common;

use common::{configs, corpus, cpu_loss_and_grads, fresh_adam, rel};
use lrmoe::device_model::DeviceModel;
use lrmoe::layer::device::DeviceComm;
use lrmoe::layer::transport::all_gather;
use lrmoe::layer::{CallConfig, DistEnv, NcclTransport, Transport};
use lrmoe::model::Model;
use lrmoe::optim::{self, AdamWConfig};

#[test]
#[ignore = "needs ≥ 2 GPUs: run under lrmoe launch on the device"]
fn launched_ranks_train_the_device_model_like_the_cpu_model() {
    let env = DistEnv::from_env()
        .unwrap()
        .expect("run under lrmoe launch");
    let t = NcclTransport::connect(&env, Duration::from_secs(120)).unwrap();
    let gpu = Arc::new(lrmoe::kernels::gpu::Gpu::open(env.local_rank).unwrap());
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
            DeviceComm::Nccl(t.comm()),
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
    let dl = all_gather(&t, &[dl])
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
