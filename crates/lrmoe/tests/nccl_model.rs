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

use lrmoe::layer::device::DeviceComm;
use lrmoe::layer::{DistEnv, NcclTransport};

#[test]
#[ignore = "needs ≥ 2 GPUs: run under lrmoe launch on the device"]
fn launched_ranks_train_the_device_model_like_the_cpu_model() {
    let env = DistEnv::from_env()
        .unwrap()
        .expect("run under lrmoe launch");
    let t = NcclTransport::connect(&env, Duration::from_secs(120)).unwrap();
    let gpu = Arc::new(lrmoe::kernels::gpu::Gpu::open(env.local_rank).unwrap());
    common::ranks_train_like_the_cpu_model(gpu, DeviceComm::Nccl(t.comm()), &t);
}
