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
    backward, forward, run_local, CallConfig, DistEnv, LayerError, MoeConfig, MoeParams,
    NcclTransport, Retention, Transport,
};
use quota::Placement;

fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20001) as f64 / 10000.0 - 1.0
        })
        .collect()
}

type Out = (Vec<f64>, Vec<f64>, MoeParams<f64>, u64);

fn one_rank<X: Transport>(
    t: &X,
    cfg: &MoeConfig,
    call: &CallConfig,
    params: &MoeParams<f64>,
    x: &[f64],
    dy: &[f64],
) -> Result<Out, LayerError> {
    let (r, n) = (t.rank(), t.world_size());
    let hd = cfg.hidden;
    let n_tok = x.len() / hd;
    let place = Placement {
        owner: (0..cfg.n_experts).map(|e| e * n / cfg.n_experts).collect(),
        replicas: vec![],
    };
    let (lo, hi) = (r * n_tok / n, (r + 1) * n_tok / n);
    let (y, saved) = forward(t, cfg, call, params, &place, &x[lo * hd..hi * hd])?;
    let (dx, grads, stats) = backward(t, cfg, call, params, &saved, &dy[lo * hd..hi * hd])?;
    Ok((y, dx, grads, stats.bytes_sent))
}

fn flat(p: &MoeParams<f64>) -> Vec<f64> {
    let mut v = p.router.clone();
    for e in &p.experts {
        v.extend(&e.gate);
        v.extend(&e.up);
        v.extend(&e.down);
    }
    v
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let n: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let d: f64 = b.iter().map(|y| y * y).sum();
    (n / d.max(1e-300)).sqrt()
}

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

    // The device executor over NCCL (rows, all-to-alls and grouped GEMMs
    // on the GPUs) against the same executor on one GPU (EP = 1,
    // device-tested against the host executor) on all ranks' tokens
    // concatenated, on this rank's GPU: each rank's outputs, input
    // gradients and experts' gradients, the summed router gradient and the
    // kept pairs, at retention 1.0, 0.5, 0.25 and 0.
    {
        use kernels::cpu::bf16_bits_to_f32;
        use kernels::gpu::Gpu;
        use layer::device::{host_call, DeviceComm};
        let gpu = Gpu::open(env.local_rank).unwrap();
        let tokens = 256;
        let moe = MoeConfig {
            hidden: 64,
            ffn: 128,
            n_experts: 8,
            top_k: 2,
            renormalize: true,
        };
        let all_tokens = tokens * world;
        let bits = |n: usize, seed: u64, scale: f64| -> Vec<u16> {
            data(n, seed)
                .into_iter()
                .map(|v| kernels::cpu::f32_to_bf16_bits((v * scale) as f32))
                .collect()
        };
        let (h, f, e) = (moe.hidden, moe.ffn, moe.n_experts);
        let el = e / world;
        let router = bits(h * e, 21, 0.5);
        let (gate, up, down) = (
            bits(e * h * f, 22, 0.125),
            bits(e * h * f, 23, 0.125),
            bits(e * f * h, 24, 0.09),
        );
        let (mut x, dy) = (bits(all_tokens * h, 25, 1.0), bits(all_tokens * h, 26, 1.0));
        // A hot router: feature 0 is 1 on every token and pulls every pair
        // to rank 0's experts, so the other ranks' experts receive nothing.
        let mut hot = router.clone();
        for (e_i, w) in hot[..e].iter_mut().enumerate() {
            *w = kernels::cpu::f32_to_bf16_bits(if e_i < el { 8.0 } else { -8.0 });
        }
        for row in x.chunks_exact_mut(h) {
            row[0] = kernels::cpu::f32_to_bf16_bits(1.0);
        }
        let f32s =
            |v: &[u16]| -> Vec<f64> { v.iter().map(|&b| f64::from(bf16_bits_to_f32(b))).collect() };
        let blk = |w: &[u16]| w[me * el * h * f..(me + 1) * el * h * f].to_vec();
        let tok = |v: &[u16]| v[me * tokens * h..(me + 1) * tokens * h].to_vec();
        for (retention, router, which, slots) in [
            (1.0, &router, "random", 0),
            (0.5, &router, "random", 0),
            (0.25, &router, "random", 0),
            (0.0, &router, "random", 0),
            (1.0, &hot, "hot", 0),
            (0.5, &hot, "hot", 0),
            (0.5, &router, "random", 1),
            (1.0, &hot, "hot", 1),
            (0.5, &hot, "hot", 2),
            (0.0, &hot, "hot", 2),
        ] {
            // The same per-expert quotas for both layers (the layer's
            // controller at this ratio); the EP layer's planner adds up to
            // `slots` replicas per rank and spreads pairs over them.
            let plan = layer::DevicePlanner::ratio(&moe, retention);
            let planner = layer::DevicePlanner::ratio_with_replicas(&moe, retention, slots);
            let want = host_call(
                &gpu,
                DeviceComm::Local,
                &moe,
                router,
                (&gate, &up, &down),
                &x,
                &dy,
                &plan,
            )
            .unwrap();
            let got = host_call(
                &gpu,
                DeviceComm::Nccl(t.comm()),
                &moe,
                router,
                (&blk(&gate), &blk(&up), &blk(&down)),
                &tok(&x),
                &tok(&dy),
                &planner,
            )
            .unwrap();
            let f64s = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| f64::from(x)).collect() };
            let (gg, wg) = (&got.grads, &want.grads);
            let checks = [
                ("y", rel(&f32s(&got.y), &f32s(&tok(&want.y)))),
                ("dx", rel(&f32s(&gg.dx), &f32s(&tok(&wg.dx)))),
                ("gate", rel(&f32s(&gg.gate), &f32s(&blk(&wg.gate)))),
                ("up", rel(&f32s(&gg.up), &f32s(&blk(&wg.up)))),
                ("down", rel(&f32s(&gg.down), &f32s(&blk(&wg.down)))),
                ("router", rel(&f64s(&gg.router), &f64s(&wg.router))),
            ];
            for (name, err) in checks {
                // Same kernels on the same rows; only the router's sum over
                // ranks (f32 of bf16 parts vs one bf16 GEMM) is rounded
                // differently.
                assert!(
                    err <= 1e-2,
                    "EP layer, {which} router, {slots} slots, r = {retention}: {name} relative error {err}"
                );
            }
            if retention == 0.0 {
                // No pair kept: no expert gradient, on either side.
                assert_eq!(wg.kept_pairs, 0);
                assert!(wg.gate.iter().chain(&gg.gate).all(|&b| b & 0x7fff == 0));
            }
            if which == "hot" && slots > 0 && retention == 1.0 && me != 0 {
                // Replicas move the hot experts' work onto this rank.
                assert!(
                    gg.kept_pairs > 0,
                    "hot router with {slots} replica slots: rank {me} processed no pairs"
                );
            }
            if which == "hot" && slots == 0 && me != 0 {
                // The case this router exists for: nothing reaches these experts.
                assert_eq!(
                    gg.kept_pairs, 0,
                    "hot router: rank {me}'s experts kept pairs"
                );
                assert!(
                    gg.gate.iter().chain(&gg.down).all(|&b| b & 0x7fff == 0),
                    "hot router: rank {me}'s experts have gradients"
                );
            }
            let kept: Vec<u64> = all_gather(&t, &[gg.kept_pairs as u64]).unwrap().concat();
            assert_eq!(
                kept.iter().sum::<u64>() as usize,
                wg.kept_pairs,
                "{which} router, {slots} slots, r = {retention}: kept pairs"
            );
            // One write per line: the ranks share the launcher's stderr.
            let line = format!(
                "rank {me}: device executor over NCCL, {which} router, {slots} replica slots, r = {retention}: matches EP = 1 ({:?}); kept {} of {}; bytes out fwd {} bwd {}\n",
                checks.map(|(n, e)| format!("{n} {e:.1e}")),
                gg.kept_pairs,
                wg.kept_pairs,
                got.forward_bytes,
                gg.bytes_sent
            );
            std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes()).unwrap();
        }
        // A binding memory budget: the controller's quotas (each rank's
        // experts may keep at most about a third of a balanced share), the
        // same quotas given to the single-GPU layer: equal results.
        {
            let cfg_b = moe;
            let cost = quota::CostModel::swiglu_expert(h, f, 2, 1e11, 1e12);
            let pairs = (tokens * moe.top_k) as u64;
            let budget = quota::RankBudget {
                memory_bytes: el as u64 * cost.instance_bytes() + pairs / 3 * cost.row_bytes(),
                network_bytes: u64::MAX,
            };
            let planner = layer::DevicePlanner::new(
                cfg_b,
                CallConfig {
                    retention: Retention::Budgeted {
                        budgets: vec![budget; world],
                        policy: quota::Policy::Maxmin,
                    },
                    ..CallConfig::default()
                },
            )
            .unwrap();
            let (bx, bdy) = (tok(&x), tok(&dy));
            let nccl = DeviceComm::Nccl(t.comm());
            let fwd = layer::device::forward_host(
                &gpu,
                nccl,
                &moe,
                &router,
                (&blk(&gate), &blk(&up), &blk(&down)),
                &bx,
                (None, None),
                &planner,
            )
            .unwrap();
            let got = layer::device::backward_host(&gpu, nccl, &fwd, &bdy, &planner).unwrap();
            let quotas = fwd.plan.quotas.clone();
            let routed: u32 = fwd.counts.iter().flatten().sum();
            assert!(
                quotas.iter().sum::<u32>() < routed,
                "the budget does not bind"
            );
            let want = host_call(
                &gpu,
                DeviceComm::Local,
                &moe,
                &router,
                (&gate, &up, &down),
                &x,
                &dy,
                &layer::DevicePlanner::fixed_quotas(&moe, quotas.clone()),
            )
            .unwrap();
            let wg = &want.grads;
            assert_eq!(got.kept_total, wg.kept_pairs);
            assert!(
                got.kept_pairs as u64 <= pairs / 3 + 1,
                "rank {me} over its cap"
            );
            let checks = [
                ("y", rel(&f32s(&fwd.y), &f32s(&tok(&want.y)))),
                ("dx", rel(&f32s(&got.dx), &f32s(&tok(&wg.dx)))),
                ("gate", rel(&f32s(&got.gate), &f32s(&blk(&wg.gate)))),
                ("down", rel(&f32s(&got.down), &f32s(&blk(&wg.down)))),
            ];
            for (name, err) in checks {
                assert!(
                    err <= 1e-2,
                    "EP layer, binding budget: {name} relative error {err}"
                );
            }
            let line = format!(
                "rank {me}: device executor over NCCL, binding memory budget: kept {} of {routed}, this rank {}; matches EP = 1 at the same quotas ({:?})\n",
                got.kept_total,
                got.kept_pairs,
                checks.map(|(n, e)| format!("{n} {e:.1e}"))
            );
            std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes()).unwrap();
        }
        // Priority sampling on the device: the same forward and router
        // gradient as top-q, as many kept pairs, different (reweighted)
        // expert gradients.
        let run = |rule| {
            let planner = layer::DevicePlanner::new(
                moe,
                CallConfig {
                    retention: Retention::Ratio(0.5),
                    rule,
                    rule_seed: 11,
                    ..CallConfig::default()
                },
            )
            .unwrap();
            let r = host_call(
                &gpu,
                DeviceComm::Nccl(t.comm()),
                &moe,
                &router,
                (&blk(&gate), &blk(&up), &blk(&down)),
                &tok(&x),
                &tok(&dy),
                &planner,
            )
            .unwrap();
            (r.y, r.grads)
        };
        let ((top_y, top), (pri_y, pri)) =
            (run(lrm_score::Rule::TopQ), run(lrm_score::Rule::Priority));
        assert_eq!(top_y, pri_y);
        assert_eq!(top.router, pri.router);
        assert_eq!(top.kept_total, pri.kept_total);
        let g = f32s(&pri.gate);
        assert!(g.iter().all(|v| v.is_finite()) && g.iter().any(|&v| v != 0.0));
        let d = rel(&f32s(&pri.gate), &f32s(&top.gate));
        assert!(
            d > 0.0,
            "priority sampling kept the top-q pairs with unit weights"
        );
        let line = format!(
            "rank {me}: device executor over NCCL, priority sampling at r = 0.5: y and router equal top-q's, kept {} of {} pairs, gate gradient differs by {d:.2} (relative)\n",
            pri.kept_total, top.kept_total
        );
        std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes()).unwrap();
    }

    // Capacity-factor dropping on the device executor over NCCL against the
    // host executor on in-process ranks (f64), on inputs whose router
    // logits are exact in bf16 (ternary multiples of powers of two) so both
    // route alike: each rank's output and input gradient, its experts'
    // gradients and the summed router gradient.
    {
        use kernels::cpu::{bf16_bits_to_f32, f32_to_bf16_bits};
        use layer::device::{host_call, DeviceComm};
        let gpu = kernels::gpu::Gpu::open(env.local_rank).unwrap();
        let moe = MoeConfig {
            hidden: 64,
            ffn: 128,
            n_experts: 8,
            top_k: 2,
            renormalize: true,
        };
        let (h, e) = (moe.hidden, moe.n_experts);
        let (tokens, el) = (256, e / world);
        let all_tokens = tokens * world;
        let bf = |v: f64| f64::from(bf16_bits_to_f32(f32_to_bf16_bits(v as f32)));
        let tern = |n: usize, seed: u64, scale: f64| -> Vec<f64> {
            data(n, seed)
                .iter()
                .map(|v| (v * 1.5).round().clamp(-1.0, 1.0) * scale)
                .collect()
        };
        let mut params = MoeParams::<f64>::init(&moe, 5);
        params.router = tern(h * e, 31, 0.125);
        for ex in &mut params.experts {
            for w in [&mut ex.gate, &mut ex.up, &mut ex.down] {
                w.iter_mut().for_each(|v| *v = bf(*v));
            }
        }
        let xa = tern(all_tokens * h, 32, 0.25);
        let dya: Vec<f64> = data(all_tokens * h, 33).into_iter().map(bf).collect();
        let bits =
            |v: &[f64]| -> Vec<u16> { v.iter().map(|&x| f32_to_bf16_bits(x as f32)).collect() };
        let f64s =
            |v: &[u16]| -> Vec<f64> { v.iter().map(|&b| f64::from(bf16_bits_to_f32(b))).collect() };
        let cat =
            |sel: fn(&layer::ExpertWeights<f64>) -> &Vec<f64>, lo: usize, hi: usize| -> Vec<f64> {
                params.experts[lo..hi]
                    .iter()
                    .flat_map(|x| sel(x).iter().copied())
                    .collect()
            };
        let tok = |v: &[f64]| v[me * tokens * h..(me + 1) * tokens * h].to_vec();
        for factor in [0.5, 1.0] {
            let call = CallConfig {
                capacity_factor: Some(factor),
                ..CallConfig::default()
            };
            let mut host = run_local(world, Duration::from_secs(120), |tr| {
                one_rank(tr, &moe, &call, &params, &xa, &dya)
            });
            let (want_y, want_dx, want_g, _) = host.swap_remove(me).unwrap();
            let got = host_call(
                &gpu,
                DeviceComm::Nccl(t.comm()),
                &moe,
                &bits(&params.router),
                (
                    &bits(&cat(|w| &w.gate, me * el, (me + 1) * el)),
                    &bits(&cat(|w| &w.up, me * el, (me + 1) * el)),
                    &bits(&cat(|w| &w.down, me * el, (me + 1) * el)),
                ),
                &bits(&tok(&xa)),
                &bits(&tok(&dya)),
                &layer::DevicePlanner::new(moe, call.clone()).unwrap(),
            )
            .unwrap();
            let wcat = |sel: fn(&layer::ExpertWeights<f64>) -> &Vec<f64>| -> Vec<f64> {
                want_g.experts[me * el..(me + 1) * el]
                    .iter()
                    .flat_map(|x| sel(x).iter().copied())
                    .collect()
            };
            let g = &got.grads;
            let checks = [
                ("y", rel(&f64s(&got.y), &want_y)),
                ("dx", rel(&f64s(&g.dx), &want_dx)),
                ("gate", rel(&f64s(&g.gate), &wcat(|w| &w.gate))),
                ("up", rel(&f64s(&g.up), &wcat(|w| &w.up))),
                ("down", rel(&f64s(&g.down), &wcat(|w| &w.down))),
                (
                    "router",
                    rel(
                        &g.router.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                        &want_g.router,
                    ),
                ),
            ];
            for (name, err) in checks {
                // bf16 GEMM outputs against f64: 3e-2 relative (rms).
                assert!(
                    err <= 3e-2,
                    "capacity {factor}: {name} relative error {err}"
                );
            }
            let line = format!(
                "rank {me}: device executor, capacity factor {factor}: matches the host executor ({:?}); {} of {} pairs reached an expert over all ranks\n",
                checks.map(|(n, e)| format!("{n} {e:.1e}")),
                g.kept_total,
                all_tokens * moe.top_k
            );
            std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes()).unwrap();
            if factor < 1.0 {
                assert!(
                    g.kept_total < all_tokens * moe.top_k,
                    "capacity 0.5 dropped nothing"
                );
            }
        }
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
