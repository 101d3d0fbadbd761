//! Shared by the device tests: the layer's inputs, one rank's host-executor
//! call, and the device executor's suite at EP = world (run over NCCL on
//! several GPUs by `nccl.rs`, over in-process ranks sharing one GPU by
//! `gpu_layer.rs`).
#![allow(dead_code)] // each test binary uses a part

use std::time::Duration;

use kernels::gpu::Gpu;
use layer::device::DeviceComm;
use layer::transport::all_gather;
use layer::{
    backward, forward, run_local, CallConfig, LayerError, MoeConfig, MoeParams, Retention,
    Transport,
};
use quota::Placement;

pub fn data(n: usize, seed: u64) -> Vec<f64> {
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

pub type Out = (Vec<f64>, Vec<f64>, MoeParams<f64>, u64);

pub fn one_rank<X: Transport>(
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

pub fn flat(p: &MoeParams<f64>) -> Vec<f64> {
    let mut v = p.router.clone();
    for e in &p.experts {
        v.extend(&e.gate);
        v.extend(&e.up);
        v.extend(&e.down);
    }
    v
}

pub fn rel(a: &[f64], b: &[f64]) -> f64 {
    let n: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let d: f64 = b.iter().map(|y| y * y).sum();
    (n / d.max(1e-300)).sqrt()
}

/// The device executor on this rank (`comm`, EP = `t.world_size()`)
/// against the same executor at EP = 1 on every rank's tokens (outputs,
/// input gradients, this rank's experts' gradients, the summed router
/// gradient, kept pairs), with replicas, a hot router that leaves every
/// rank but 0 without pairs, retention 1 to 0, a binding memory budget,
/// priority sampling; then capacity-factor dropping against the host
/// executor on in-process ranks (f64). `t` carries the test's own
/// all-gathers.
pub fn device_executor_suite(gpu: &Gpu, comm: DeviceComm<'_>, t: &dyn Transport) {
    let (me, world) = (t.rank(), t.world_size());
    let how = match comm {
        DeviceComm::Nccl(_) => "over NCCL",
        _ => "in-process ranks on one GPU",
    };
    // The device executor (rows, all-to-alls and grouped GEMMs
    // on the GPUs) against the same executor on one GPU (EP = 1,
    // device-tested against the host executor) on all ranks' tokens
    // concatenated, on this rank's GPU: each rank's outputs, input
    // gradients and experts' gradients, the summed router gradient and the
    // kept pairs, at retention 1.0, 0.5, 0.25 and 0.
    {
        use kernels::cpu::bf16_bits_to_f32;
        use layer::device::host_call;
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
                gpu,
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
                gpu,
                comm,
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
                (
                    "gate",
                    rel(&f32s(&gg.experts.gate), &f32s(&blk(&wg.experts.gate))),
                ),
                (
                    "up",
                    rel(&f32s(&gg.experts.up), &f32s(&blk(&wg.experts.up))),
                ),
                (
                    "down",
                    rel(&f32s(&gg.experts.down), &f32s(&blk(&wg.experts.down))),
                ),
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
                assert!(wg
                    .experts
                    .gate
                    .iter()
                    .chain(&gg.experts.gate)
                    .all(|&b| b & 0x7fff == 0));
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
                    gg.experts
                        .gate
                        .iter()
                        .chain(&gg.experts.down)
                        .all(|&b| b & 0x7fff == 0),
                    "hot router: rank {me}'s experts have gradients"
                );
            }
            let kept: Vec<u64> = all_gather(t, &[gg.kept_pairs as u64]).unwrap().concat();
            assert_eq!(
                kept.iter().sum::<u64>() as usize,
                wg.kept_pairs,
                "{which} router, {slots} slots, r = {retention}: kept pairs"
            );
            // One write per line: the ranks share the launcher's stderr.
            let line = format!(
            "rank {me}: device executor {how}, {which} router, {slots} replica slots, r = {retention}: matches EP = 1 ({:?}); kept {} of {}; bytes out fwd {} bwd {}\n",
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
            let fwd = layer::device::forward_host(
                gpu,
                comm,
                &moe,
                &router,
                (&blk(&gate), &blk(&up), &blk(&down)),
                &bx,
                (None, None),
                &planner,
            )
            .unwrap();
            let got = layer::device::backward_host(gpu, comm, &fwd, &bdy, &planner).unwrap();
            let quotas = fwd.plan.quotas.clone();
            let routed: u32 = fwd.counts.iter().flatten().sum();
            assert!(
                quotas.iter().sum::<u32>() < routed,
                "the budget does not bind"
            );
            let want = host_call(
                gpu,
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
                (
                    "gate",
                    rel(&f32s(&got.experts.gate), &f32s(&blk(&wg.experts.gate))),
                ),
                (
                    "down",
                    rel(&f32s(&got.experts.down), &f32s(&blk(&wg.experts.down))),
                ),
            ];
            for (name, err) in checks {
                assert!(
                    err <= 1e-2,
                    "EP layer, binding budget: {name} relative error {err}"
                );
            }
            let line = format!(
            "rank {me}: device executor {how}, binding memory budget: kept {} of {routed}, this rank {}; matches EP = 1 at the same quotas ({:?})\n",
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
                gpu,
                comm,
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
        let g = f32s(&pri.experts.gate);
        assert!(g.iter().all(|v| v.is_finite()) && g.iter().any(|&v| v != 0.0));
        let d = rel(&f32s(&pri.experts.gate), &f32s(&top.experts.gate));
        assert!(
            d > 0.0,
            "priority sampling kept the top-q pairs with unit weights"
        );
        let line = format!(
        "rank {me}: device executor {how}, priority sampling at r = 0.5: y and router equal top-q's, kept {} of {} pairs, gate gradient differs by {d:.2} (relative)\n",
        pri.kept_total, top.kept_total
    );
        std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes()).unwrap();
    }

    // Capacity-factor dropping on the device executor against the
    // host executor on in-process ranks (f64), on inputs whose router
    // logits are exact in bf16 (ternary multiples of powers of two) so both
    // route alike: each rank's output and input gradient, its experts'
    // gradients and the summed router gradient.
    {
        use kernels::cpu::{bf16_bits_to_f32, f32_to_bf16_bits};
        use layer::device::host_call;
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
                gpu,
                comm,
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
                ("gate", rel(&f64s(&g.experts.gate), &wcat(|w| &w.gate))),
                ("up", rel(&f64s(&g.experts.up), &wcat(|w| &w.up))),
                ("down", rel(&f64s(&g.experts.down), &wcat(|w| &w.down))),
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
}
