//! The NCCL transport on real GPUs, one process per GPU. Run under the
//! launcher on a machine with ≥ 2 GPUs (feature `nccl`):
//!
//! ```text
//! lrmoe launch --nproc 2 --exec <this test binary> -- --ignored --test-threads=1
//! ```
//!
//! Every rank: (1) the transport conformance suite the in-process transport
//! passes in CI; (2) the layer's forward + backward at EP = world over NCCL
//! with replicas, against the same EP run in-process (bit-identical) and,
//! at full retention, against EP = 1 (f64, relative error ≤ 1e-10);
//! (3) the experts' GEMMs on each rank's GPU against the CPU twins;
//! (4) the device-resident EP layer against the single-GPU layer;
//! (5) a peer that leaves: rank 1 exits, rank 0's next collective must fail
//! within the timeout instead of hanging.

#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used)] // test set-up panics by design

use std::time::{Duration, Instant};

use layer::transport::{all_gather, conformance};
use layer::{
    run_local, CallConfig, DistEnv, MoeConfig, MoeParams, NcclTransport, Retention, Transport,
};

mod common;

use common::{data, flat, one_rank, rel};
use layer::device::DeviceComm;

#[test]
#[ignore = "needs 2+ GPUs under `lrmoe launch`: run with --ignored on the device"]
fn nccl_transport_suite_gradients_and_a_dead_peer() {
    let env = DistEnv::from_env()
        .unwrap()
        .expect("run under `lrmoe launch` (WORLD_SIZE is not set)");
    let t = NcclTransport::connect(&env, Duration::from_secs(60)).unwrap();
    let (me, world) = (t.rank(), t.world_size());

    conformance(&t).unwrap();
    eprintln!("rank {me}: conformance suite passed over NCCL");

    let cfg = MoeConfig {
        hidden: 16,
        ffn: 12,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let params = MoeParams::<f64>::init(&cfg, 11);
    let n_tok = 96 * world;
    let x = data(n_tok * cfg.hidden, 5);
    let dy = data(n_tok * cfg.hidden, 6);
    for (retention, slots) in [
        (Retention::Full, 1),
        (Retention::Ratio(0.5), 1),
        (Retention::Ratio(0.25), 0),
    ] {
        let call = CallConfig {
            retention: retention.clone(),
            replica_slots_per_rank: slots,
            replica_rule: quota::ReplicaRule::Fill,
            ..CallConfig::default()
        };
        let (y, dx, g, sent) = one_rank(&t, &cfg, &call, &params, &x, &dy).unwrap();
        // The same EP run in-process: identical bits, identical bytes.
        let local = run_local(world, Duration::from_secs(60), |lt| {
            one_rank(lt, &cfg, &call, &params, &x, &dy)
        });
        let (ly, ldx, lg, lsent) = local.into_iter().nth(me).unwrap().unwrap();
        assert_eq!(
            y, ly,
            "{retention:?}: forward differs from the in-process run"
        );
        assert_eq!(dx, ldx, "{retention:?}: dx differs from the in-process run");
        assert_eq!(
            g, lg,
            "{retention:?}: gradients differ from the in-process run"
        );
        assert_eq!(sent, lsent, "{retention:?}: bytes sent differ");
        // Full retention: every rank's slice and the summed gradients equal
        // EP = 1 on all tokens.
        if retention == Retention::Full {
            let ys = all_gather(&t, &y).unwrap().concat();
            let dxs = all_gather(&t, &dx).unwrap().concat();
            let one = run_local(1, Duration::from_secs(60), |lt| {
                one_rank(lt, &cfg, &call, &params, &x, &dy)
            });
            let (y1, dx1, g1, _) = one.into_iter().next().unwrap().unwrap();
            assert!(rel(&ys, &y1) <= 1e-10, "y: {}", rel(&ys, &y1));
            assert!(rel(&dxs, &dx1) <= 1e-10, "dx: {}", rel(&dxs, &dx1));
            assert!(rel(&flat(&g), &flat(&g1)) <= 1e-10, "grads");
        }
        eprintln!("rank {me}: {retention:?}: NCCL EP={world} equals in-process (sent {sent} B)");
    }

    // The experts' GEMMs on this rank's GPU (the bf16 grouped kernels, as
    // `lrmoe train --device cuda` runs launched ranks) against the same EP
    // in-process on the kernels' CPU twins: equal within bf16 summation-order
    // noise (1e-2 relative; both round every GEMM output to bf16).
    let gpu = kernels::gpu::Gpu::open(env.local_rank).unwrap();
    let on = |experts: layer::ExpertBackend| CallConfig {
        replica_slots_per_rank: 1,
        replica_rule: quota::ReplicaRule::Fill,
        experts,
        ..CallConfig::default()
    };
    let gcall = on(layer::ExpertBackend::Bf16(std::sync::Arc::new(gpu)));
    let tcall = on(layer::ExpertBackend::Bf16(std::sync::Arc::new(
        kernels::grouped::CpuTwins,
    )));
    // The TMA-fed kernels need h and f in multiples of 8.
    let gcfg = MoeConfig { ffn: 16, ..cfg };
    let gparams = MoeParams::<f64>::init(&gcfg, 12);
    let (y, dx, g, _) = one_rank(&t, &gcfg, &gcall, &gparams, &x, &dy).unwrap();
    let local = run_local(world, Duration::from_secs(60), |lt| {
        one_rank(lt, &gcfg, &tcall, &gparams, &x, &dy)
    });
    let (ly, ldx, lg, _) = local.into_iter().nth(me).unwrap().unwrap();
    assert!(rel(&y, &ly) <= 1e-2, "GPU experts y: {}", rel(&y, &ly));
    assert!(rel(&dx, &ldx) <= 1e-2, "GPU experts dx: {}", rel(&dx, &ldx));
    assert!(
        rel(&flat(&g), &flat(&lg)) <= 1e-2,
        "GPU experts grads: {}",
        rel(&flat(&g), &flat(&lg))
    );
    eprintln!(
        "rank {me}: GPU experts over NCCL match the twins (y {:.1e}, dx {:.1e}, grads {:.1e})",
        rel(&y, &ly),
        rel(&dx, &ldx),
        rel(&flat(&g), &flat(&lg))
    );

    // The device executor over NCCL against EP = 1 and the host executor.
    {
        let gpu = kernels::gpu::Gpu::open(env.local_rank).unwrap();
        common::device_executor_suite(&gpu, DeviceComm::Nccl(t.comm()), &t);
    }

    // A peer that leaves: rank 1 returns (its process exits), rank 0 must
    // get an error within the timeout.
    let short = NcclTransport::connect(&env, Duration::from_secs(5)).unwrap();
    all_gather(&short, &[1u8]).unwrap();
    if me != 0 {
        return;
    }
    let start = Instant::now();
    let r = all_gather(&short, &vec![0u8; 1 << 20]);
    let waited = start.elapsed();
    assert!(r.is_err(), "a collective with a departed peer succeeded");
    assert!(waited < Duration::from_secs(20), "took {waited:?}");
    eprintln!(
        "rank 0: departed peer detected in {waited:?}: {}",
        r.unwrap_err()
    );
}
