//! The device executor on one GPU (EP = 1, `layer::device::host_call`,
//! bf16) against this crate's host executor (f32) on the same bf16-rounded
//! weights and inputs.
//! Device tests, `#[ignore]`d here: run on the GPU machine with feature
//! `cuda` and `-- --ignored`.
//!
//! Inputs and router weights are small multiples of powers of two so the
//! router logits are exact in bf16 and f32 alike: both sides then route every
//! token to the same experts, and the comparison measures the expert math.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // test helpers panic on set-up failure by design

use std::time::Duration;

use kernels::cpu::{bf16_bits_to_f32, f32_to_bf16_bits};
use kernels::gpu::Gpu;
use layer::device::{self, DeviceComm};
use layer::{run_local, CallConfig, DevicePlanner, ExpertWeights, MoeConfig, MoeParams};
use quota::Placement;

mod common;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn ternary(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() % 3) as f32 - 1.0) * scale)
            .collect()
    }
}

fn round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| bf16_bits_to_f32(f32_to_bf16_bits(x)))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| f32_to_bf16_bits(x)).collect()
}

fn rel(got: &[u16], want: &[f32]) -> f64 {
    let (mut n, mut d) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let g = f64::from(bf16_bits_to_f32(g));
        assert!(g.is_finite(), "non-finite GPU output");
        n += (g - f64::from(w)).powi(2);
        d += f64::from(w).powi(2);
    }
    (n / d.max(1e-300)).sqrt()
}

fn cat(p: &MoeParams<f32>, sel: fn(&ExpertWeights<f32>) -> &Vec<f32>) -> Vec<f32> {
    p.experts
        .iter()
        .flat_map(|ex| sel(ex).iter().copied())
        .collect()
}

#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn gpu_layer_matches_the_cpu_layer() {
    let gpu = Gpu::open(0).unwrap();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    for &(t, h, f, e, k, renormalize) in &[
        (256usize, 64usize, 128usize, 8usize, 2usize, true),
        (512, 128, 64, 16, 4, false),
    ] {
        let cfg = MoeConfig {
            hidden: h,
            ffn: f,
            n_experts: e,
            top_k: k,
            renormalize,
        };
        let mut p = MoeParams::<f32>::init(&cfg, rng.next());
        p.router = rng.ternary(h * e, 0.125);
        for ex in &mut p.experts {
            ex.gate = round(&ex.gate);
            ex.up = round(&ex.up);
            ex.down = round(&ex.down);
        }
        let x = rng.ternary(t * h, 0.25);
        let dy = round(
            &(0..t * h)
                .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
                .collect::<Vec<_>>(),
        );
        let place = Placement {
            owner: vec![0; e],
            replicas: vec![],
        };
        let call = CallConfig::default();
        let mut cpu = run_local(1, Duration::from_secs(120), |tr| {
            let (y, saved) = layer::forward(tr, &cfg, &call, &p, &place, &x)?;
            let (dx, g, _) = layer::backward(tr, &cfg, &call, &p, &saved, &dy)?;
            Ok::<_, layer::LayerError>((y, dx, g))
        });
        let (y, dx, g) = cpu.remove(0).unwrap();
        let (wr, wg, wu, wd) = (
            bits(&p.router),
            bits(&cat(&p, |w| &w.gate)),
            bits(&cat(&p, |w| &w.up)),
            bits(&cat(&p, |w| &w.down)),
        );
        let run = |planner: &DevicePlanner| {
            device::host_call(
                &gpu,
                DeviceComm::Local,
                &cfg,
                &wr,
                (&wg, &wu, &wd),
                &bits(&x),
                &bits(&dy),
                planner,
            )
            .unwrap()
        };
        let r = run(&DevicePlanner::ratio(&cfg, 1.0));
        assert_eq!(r.grads.kept_pairs, t * k);
        let checks = [
            ("y", rel(&r.y, &y)),
            ("dx", rel(&r.grads.dx, &dx)),
            ("router", rel32(&r.grads.router, &g.router)),
            ("gate", rel(&r.grads.experts.gate, &cat(&g, |w| &w.gate))),
            ("up", rel(&r.grads.experts.up, &cat(&g, |w| &w.up))),
            ("down", rel(&r.grads.experts.down, &cat(&g, |w| &w.down))),
        ];
        for (name, err) in checks {
            assert!(
                err <= 3e-2,
                "{name} ({t}, {h}, {f}, {e}, {k}): relative error {err}"
            );
        }
        // The capacity-factor baseline on the device against the host
        // executor: the first ⌈0.5 · P / E⌉ pairs of each expert only.
        let capped = CallConfig {
            capacity_factor: Some(0.5),
            ..CallConfig::default()
        };
        let mut cpu = run_local(1, Duration::from_secs(120), |tr| {
            let (y, saved) = layer::forward(tr, &cfg, &capped, &p, &place, &x)?;
            let (dx, g, s) = layer::backward(tr, &cfg, &capped, &p, &saved, &dy)?;
            Ok::<_, layer::LayerError>((y, dx, g, s.kept_pairs))
        });
        let (cy, cdx, cg, ck) = cpu.remove(0).unwrap();
        let c = run(&DevicePlanner::new(cfg, capped.clone()).unwrap());
        assert_eq!(
            c.grads.kept_pairs, ck,
            "capacity: pairs that reached an expert"
        );
        assert!(ck < t * k, "capacity 0.5 dropped nothing");
        for (name, err) in [
            ("y", rel(&c.y, &cy)),
            ("dx", rel(&c.grads.dx, &cdx)),
            ("router", rel32(&c.grads.router, &cg.router)),
            ("gate", rel(&c.grads.experts.gate, &cat(&cg, |w| &w.gate))),
            ("down", rel(&c.grads.experts.down, &cat(&cg, |w| &w.down))),
        ] {
            assert!(
                err <= 3e-2,
                "capacity 0.5, {name} ({t}, {h}, {f}, {e}, {k}): relative error {err}"
            );
        }
        // The balancing bias (selection only) on the device against the
        // host executor: the same choices, unbiased gates.
        let bias: Vec<f64> = (0..e)
            .map(|_| ((rng.next() % 2001) as f64 / 1000.0 - 1.0) * 0.05)
            .collect();
        let biased = CallConfig {
            expert_bias: bias.clone(),
            ..CallConfig::default()
        };
        let mut cpu = run_local(1, Duration::from_secs(120), |tr| {
            let (_, plain) = layer::forward(tr, &cfg, &CallConfig::default(), &p, &place, &x)?;
            let (y, saved) = layer::forward(tr, &cfg, &biased, &p, &place, &x)?;
            let routed = saved.plan.routed[0].clone();
            let (dx, g, _) = layer::backward(tr, &cfg, &biased, &p, &saved, &dy)?;
            Ok::<_, layer::LayerError>((y, dx, g, routed, plain.plan.routed[0].clone()))
        });
        let (by, bdx, bg, brouted, plain_routed) = cpu.remove(0).unwrap();
        assert_ne!(brouted, plain_routed, "the bias changed no choice");
        let planner = DevicePlanner::new(cfg, biased.clone()).unwrap();
        let b32: Vec<f32> = bias.iter().map(|&b| b as f32).collect();
        let fwd = device::forward_host(
            &gpu,
            DeviceComm::Local,
            &cfg,
            &wr,
            (&wg, &wu, &wd),
            &bits(&x),
            (None, Some(&b32)),
            &planner,
        )
        .unwrap();
        let dev_routed: Vec<u64> = fwd.counts[0].iter().map(|&c| u64::from(c)).collect();
        assert_eq!(dev_routed, brouted, "biased choices: device vs host");
        let bgr =
            device::backward_host(&gpu, DeviceComm::Local, &fwd, &bits(&dy), &planner).unwrap();
        for (name, err) in [
            ("y", rel(&fwd.y, &by)),
            ("dx", rel(&bgr.dx, &bdx)),
            ("router", rel32(&bgr.router, &bg.router)),
            ("gate", rel(&bgr.experts.gate, &cat(&bg, |w| &w.gate))),
        ] {
            assert!(
                err <= 3e-2,
                "balancing bias, {name} ({t}, {h}, {f}, {e}, {k}): relative error {err}"
            );
        }
        // The auxiliary balancing loss on the device against the host
        // executor: its value and its share of the router's gradient.
        let aux = CallConfig {
            aux_loss_coeff: 0.05,
            ..CallConfig::default()
        };
        let mut cpu = run_local(1, Duration::from_secs(120), |tr| {
            let (_, saved) = layer::forward(tr, &cfg, &aux, &p, &place, &x)?;
            let a = saved.aux_loss();
            let (dx, g, _) = layer::backward(tr, &cfg, &aux, &p, &saved, &dy)?;
            Ok::<_, layer::LayerError>((a, dx, g))
        });
        let (aloss, adx, ag) = cpu.remove(0).unwrap();
        let planner = DevicePlanner::new(cfg, aux.clone()).unwrap();
        let fwd = device::forward_host(
            &gpu,
            DeviceComm::Local,
            &cfg,
            &wr,
            (&wg, &wu, &wd),
            &bits(&x),
            (None, None),
            &planner,
        )
        .unwrap();
        assert!(
            (fwd.aux_loss - aloss).abs() <= 1e-4 * aloss.abs().max(1e-6),
            "aux loss: device {} vs host {aloss}",
            fwd.aux_loss
        );
        let agr =
            device::backward_host(&gpu, DeviceComm::Local, &fwd, &bits(&dy), &planner).unwrap();
        let plain_router = &g.router;
        let router_err = rel32(&agr.router, &ag.router);
        assert!(
            router_err <= 3e-2 && rel32(&agr.router, plain_router) > 1e-3,
            "aux router gradient: {router_err} vs host, {} vs plain",
            rel32(&agr.router, plain_router)
        );
        assert!(rel(&agr.dx, &adx) <= 3e-2, "aux dx: {}", rel(&agr.dx, &adx));
        // Pruned: kept pairs follow the quotas round(r · n_e).
        let half = run(&DevicePlanner::ratio(&cfg, 0.5));
        assert!(
            half.grads.kept_pairs <= t * k / 2 + e && half.grads.kept_pairs + e >= t * k / 2,
            "kept {}",
            half.grads.kept_pairs
        );
        // Priority sampling at the same quotas: the same forward, router
        // gradient and kept count; reweighted, different expert gradients.
        let pri = run(&DevicePlanner::new(
            cfg,
            CallConfig {
                retention: layer::Retention::Ratio(0.5),
                rule: lrm_score::Rule::Priority,
                ..CallConfig::default()
            },
        )
        .unwrap());
        assert_eq!(pri.y, half.y);
        assert_eq!(pri.grads.router, half.grads.router);
        assert_eq!(pri.grads.kept_pairs, half.grads.kept_pairs);
        assert!(
            pri.grads.experts.gate.iter().all(|&b| b & 0x7f80 != 0x7f80),
            "non-finite gradient"
        );
        if half.grads.kept_pairs > e && half.grads.kept_pairs < t * k {
            assert_ne!(
                pri.grads.experts.gate, half.grads.experts.gate,
                "priority sampling equals top-q"
            );
        }
        // The forward's projections kept for the backward. Every row kept:
        // borrowed in place, the same grouped GEMMs on the same groups, so
        // every output equals the recomputing backward's bit for bit. Half
        // kept: gathered from the forward's, computed there in the
        // forward's groups, so within bf16 rounding of the recomputed
        // (0.5% in norm), the same kept pairs and forward.
        for (ratio, plain) in [(1.0, &r), (0.5, &half)] {
            let retention = if ratio < 1.0 {
                layer::Retention::Ratio(ratio)
            } else {
                layer::Retention::Full
            };
            let kept = run(&DevicePlanner::new(
                cfg,
                CallConfig {
                    retention,
                    keep_projections: true,
                    ..CallConfig::default()
                },
            )
            .unwrap());
            assert_eq!(kept.y, plain.y, "keep_projections y (r = {ratio})");
            assert_eq!(kept.grads.kept_pairs, plain.grads.kept_pairs);
            for (name, a, b) in [
                ("dx", &kept.grads.dx, &plain.grads.dx),
                ("gate", &kept.grads.experts.gate, &plain.grads.experts.gate),
                ("up", &kept.grads.experts.up, &plain.grads.experts.up),
                ("down", &kept.grads.experts.down, &plain.grads.experts.down),
            ] {
                if ratio == 1.0 {
                    assert_eq!(a, b, "keep_projections {name} (r = {ratio})");
                } else {
                    let wide: Vec<f32> = b.iter().map(|&v| bf16_bits_to_f32(v)).collect();
                    let err = rel(a, &wide);
                    assert!(err <= 5e-3, "keep_projections {name} (r = {ratio}): {err}");
                }
            }
            assert_eq!(kept.grads.router, plain.grads.router);
        }
    }
}

fn rel32(got: &[f32], want: &[f32]) -> f64 {
    let (mut n, mut d) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(g.is_finite(), "non-finite output");
        n += (f64::from(g) - f64::from(w)).powi(2);
        d += f64::from(w).powi(2);
    }
    (n / d.max(1e-300)).sqrt()
}

/// The layer's bf16 expert backend on this GPU (`ExpertBackend::Bf16(Gpu)`,
/// what `lrmoe train --device cuda` uses with several ranks) against the same
/// backend on the kernels' CPU twins: expert parallelism over in-process
/// ranks with replicas, complete forward, full and halved backward.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn gpu_expert_backend_matches_the_cpu_twins() {
    use layer::{ExpertBackend, Retention, Transport};
    use std::sync::Arc;
    let gpu = ExpertBackend::Bf16(Arc::new(Gpu::open(0).unwrap()));
    let twins = ExpertBackend::Bf16(Arc::new(kernels::grouped::CpuTwins));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    let cfg = MoeConfig {
        hidden: 64,
        ffn: 96,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let t = 384;
    let mut p = MoeParams::<f32>::init(&cfg, rng.next());
    p.router = rng.ternary(cfg.hidden * cfg.n_experts, 0.125);
    let x = rng.ternary(t * cfg.hidden, 0.25);
    let dy: Vec<f32> = (0..t * cfg.hidden)
        .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    for (retention, ranks) in [
        (Retention::Full, 1usize),
        (Retention::Full, 2),
        (Retention::Ratio(0.5), 2),
    ] {
        let go = |experts: &ExpertBackend| {
            let call = CallConfig {
                retention: retention.clone(),
                replica_slots_per_rank: 1,
                replica_rule: quota::ReplicaRule::Fill,
                experts: experts.clone(),
                ..CallConfig::default()
            };
            let place = Placement {
                owner: (0..cfg.n_experts)
                    .map(|e| e * ranks / cfg.n_experts)
                    .collect(),
                replicas: vec![],
            };
            let res = run_local(ranks, Duration::from_secs(120), |tr| {
                let r = tr.rank();
                let (lo, hi) = (r * t / ranks, (r + 1) * t / ranks);
                let hd = cfg.hidden;
                let (y, saved) = layer::forward(tr, &cfg, &call, &p, &place, &x[lo * hd..hi * hd])?;
                let (dx, g, s) =
                    layer::backward(tr, &cfg, &call, &p, &saved, &dy[lo * hd..hi * hd])?;
                Ok::<_, layer::LayerError>((y, dx, g, s.kept_pairs))
            });
            let (mut y, mut dx, mut kept) = (vec![], vec![], 0);
            let mut grads = None;
            for r in res {
                let (yr, dxr, g, k) = r.unwrap();
                y.extend(yr);
                dx.extend(dxr);
                kept += k;
                grads = Some(g);
            }
            (y, dx, grads.unwrap(), kept)
        };
        let (gy, gdx, gg, gk) = go(&gpu);
        let (cy, cdx, cg, ck) = go(&twins);
        let what = format!("{retention:?} on {ranks} ranks");
        // Both sides round every GEMM output to bf16; only the summation
        // order differs, so 1e-2 relative (rms) is loose by about 10×.
        assert!(rel32(&gy, &cy) <= 1e-2, "{what}: y {}", rel32(&gy, &cy));
        if retention == Retention::Full {
            assert_eq!(gk, t * cfg.top_k, "{what}: full retention dropped pairs");
            assert!(
                rel32(&gdx, &cdx) <= 1e-2,
                "{what}: dx {}",
                rel32(&gdx, &cdx)
            );
            for ((name, a), (_, b)) in gg.tensors().into_iter().zip(cg.tensors()) {
                let e = rel32(a, b);
                assert!(e <= 1e-2, "{what}: {name} {e}");
            }
        } else {
            // Scores come from each backend's own ‖h‖²: the kept sets may
            // differ at ties, their sizes (the quotas) may not.
            assert_eq!(gk, ck, "{what}: kept pairs differ");
            assert!(gk < t * cfg.top_k, "{what}: nothing was dropped");
        }
        eprintln!("{what}: GPU expert backend matches the twins (kept {gk})");
    }
}

/// The multi-rank device executor — every exchange, replica, sum and plan
/// of the NCCL path — on 2 and 4 in-process ranks sharing this one GPU
/// (`DeviceComm::Staged`: rows and sums device to device), against EP = 1
/// and the host executor: the suite `nccl.rs` runs over NCCL.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn device_executor_on_in_process_ranks_matches_ep1_and_the_host() {
    let gpu = Gpu::open(0).unwrap();
    for world in [2, 4] {
        let results = run_local(world, Duration::from_secs(600), |t| {
            common::device_executor_suite(&gpu, DeviceComm::Staged(t), t);
            Ok::<_, layer::LayerError>(())
        });
        for (rank, r) in results.into_iter().enumerate() {
            if let Err(e) = r {
                panic!("EP = {world}, rank {rank}: {e}");
            }
        }
    }
}

/// Every collective of an in-process rank, without the shared memory: the
/// device executor stages its exchanges through the host.
struct HostStaged<'a>(&'a layer::LocalTransport);

impl layer::Transport for HostStaged<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), layer::TransportError> {
        self.0.all_to_all_bytes(send, send_counts)
    }
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, layer::TransportError> {
        self.0.all_gather_bytes(local)
    }
    fn bytes_sent(&self) -> u64 {
        self.0.bytes_sent()
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), layer::TransportError> {
        self.0.all_reduce_sum_f32(buf)
    }
}

/// 16 experts, top-4, of the given widths (the in-process rank tests).
fn sixteen_experts(hidden: usize, ffn: usize) -> MoeConfig {
    MoeConfig {
        hidden,
        ffn,
        n_experts: 16,
        top_k: 4,
        renormalize: true,
    }
}

/// `n` random bf16 values scaled for a fan-in of `h`.
fn fan_in_bits(n: usize, seed: u64, h: usize) -> Vec<u16> {
    kernels::cpu::fan_in_scaled(kernels::cpu::random_bf16(n, seed), h)
}

/// In-process ranks exchange rows device to device (`Transport::swap_offers`):
/// the same bits as the host-staged exchange, on 2 and 4 ranks, with and
/// without replicas, at r = 1 and 0.5 — and the same again with the ranks
/// taking turns (`run_local_timed`), whose timelines record every exchange.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn in_process_exchange_equals_host_staging_bit_for_bit() {
    use layer::device::host_call;
    use layer::Transport;
    let gpu = Gpu::open(0).unwrap();
    let moe = sixteen_experts(128, 256);
    let (h, f, e, tokens) = (moe.hidden, moe.ffn, moe.n_experts, 512);
    let bits = |n: usize, seed: u64| fan_in_bits(n, seed, h);
    for timed in [false, true] {
        for world in [2, 4] {
            let el = e / world;
            let body = |t: &layer::LocalTransport| {
                let r = t.rank() as u64;
                let router = bits(h * e, 1);
                let (gate, up, down) = (
                    bits(el * h * f, 10 + r),
                    bits(el * h * f, 20 + r),
                    bits(el * f * h, 30 + r),
                );
                let (x, dy) = (bits(tokens * h, 40 + r), bits(tokens * h, 50 + r));
                for (ratio, slots) in [(1.0, 0), (0.5, 0), (0.5, 1), (1.0, 2)] {
                    let p = DevicePlanner::ratio_with_replicas(&moe, ratio, slots);
                    let run = |comm| {
                        host_call(&gpu, comm, &moe, &router, (&gate, &up, &down), &x, &dy, &p)
                    };
                    let a = run(DeviceComm::Staged(t))?;
                    let b = run(DeviceComm::Staged(&HostStaged(t)))?;
                    let what = format!("EP = {world}, r = {ratio}, {slots} slots, rank {r}");
                    assert_eq!(a.y, b.y, "{what}: y");
                    assert_eq!(a.grads.dx, b.grads.dx, "{what}: dx");
                    assert_eq!(a.grads.router, b.grads.router, "{what}: router");
                    assert_eq!(a.grads.experts, b.grads.experts, "{what}: experts");
                    assert_eq!(a.grads.kept_total, b.grads.kept_total, "{what}");
                    assert_eq!(a.grads.bytes_sent, b.grads.bytes_sent, "{what}");
                }
                // The sums over ranks (the model's data-parallel gradients):
                // values of mixed magnitudes, so any other summation order
                // would show.
                let parts = || -> Result<Vec<_>, layer::LayerError> {
                    [1usize, 1000, 65_537]
                        .iter()
                        .map(|&n| {
                            let v: Vec<f32> = (0..n)
                                .map(|j| {
                                    let u = ((j * 7919 + r as usize * 104_729) % 1000) as f32;
                                    (u * 1e-3 - 0.5) * 10f32.powi((j % 7) as i32 - 3)
                                })
                                .collect();
                            Ok(gpu.upload(&v)?)
                        })
                        .collect()
                };
                let a = device::sum_over_ranks(&gpu, DeviceComm::Staged(t), parts()?)?;
                let b = device::sum_over_ranks(&gpu, DeviceComm::Staged(&HostStaged(t)), parts()?)?;
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(
                        gpu.download(x, x.len())?,
                        gpu.download(y, y.len())?,
                        "EP = {world}: sums over ranks differ"
                    );
                }
                t.close_step(0)?;
                t.fence()?;
                Ok::<_, layer::LayerError>(t.take_step(0))
            };
            let results = if timed {
                layer::run_local_timed(world, Duration::from_secs(600), body)
            } else {
                run_local(world, Duration::from_secs(600), body)
            };
            let mut steps = None;
            for (rank, r) in results.into_iter().enumerate() {
                match r {
                    Ok(s) => steps = steps.or(s),
                    Err(e) => panic!("EP = {world}, timed {timed}, rank {rank}: {e}"),
                }
            }
            if timed {
                let all = steps.expect("rank 0 took the step");
                assert_eq!(all.len(), world);
                // Every rank recorded the same collectives, the exchanges
                // with rows in them among them.
                let kinds = |v: &Vec<layer::timeline::Entry>| {
                    v.iter()
                        .filter(|e| !matches!(e, layer::timeline::Entry::Work { .. }))
                        .count()
                };
                assert!(all
                    .iter()
                    .all(|v| kinds(v) == kinds(&all[0]) && kinds(v) > 0));
                let moved: u64 = all[0]
                    .iter()
                    .filter_map(|e| match e {
                        layer::timeline::Entry::Exchange { bytes_to, .. } => {
                            Some(bytes_to.iter().sum::<u64>())
                        }
                        _ => None,
                    })
                    .sum();
                assert!(
                    moved > (tokens * h * 2) as u64,
                    "rank 0 recorded {moved} bytes"
                );
                eprintln!(
                    "EP = {world}, timed: {} entries on rank 0, {moved} bytes out",
                    all[0].len()
                );
            }
            eprintln!("EP = {world}, timed {timed}: device-to-device exchanges and sums = host staging, bit for bit");
        }
    }
}

/// Timed ranks with a GPU clock (`LocalTransport::set_clock`): each piece
/// of work is device time between two marks, the layer's parts are
/// recorded under their phase, and each rank's `Held` is its own memory:
/// on one rank the pool's high-water mark over the same call run untimed
/// (within 1%); on two ranks, 64 MiB that rank 1 alone holds across the
/// exchanges (while rank 0 runs) show in rank 1's figure and not in rank
/// 0's.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn timed_ranks_read_device_time_and_their_own_memory() {
    use layer::device::{host_call, GpuClock};
    use layer::timeline::Entry;
    use layer::Transport;
    let gpu = std::sync::Arc::new(Gpu::open(0).unwrap());
    let moe = sixteen_experts(256, 512);
    let (h, f, e, tokens) = (moe.hidden, moe.ffn, moe.n_experts, 2048);
    let bits = |n: usize, seed: u64| fan_in_bits(n, seed, h);
    const EXTRA: usize = 64 << 20;
    for world in [1usize, 2] {
        let el = e / world;
        let body = |t: &layer::LocalTransport| {
            if t.timed() {
                t.set_clock(std::sync::Arc::new(GpuClock(gpu.clone())))?;
            }
            let start = gpu.pool_reset_peak()?;
            let r = t.rank() as u64;
            let extra = (r == 1).then(|| gpu.zeros::<u8>(EXTRA)).transpose()?;
            let p = DevicePlanner::ratio(&moe, 0.5);
            t.phase("moe")?;
            let out = host_call(
                &gpu,
                DeviceComm::Staged(t),
                &moe,
                &bits(h * e, 1),
                (
                    &bits(el * h * f, 10 + r),
                    &bits(el * h * f, 20 + r),
                    &bits(el * f * h, 30 + r),
                ),
                &bits(tokens * h, 40 + r),
                &bits(tokens * h, 50 + r),
                &p,
            )?;
            // The whole call's high-water mark (untimed: timed turns reset
            // it).
            let (_, high) = gpu.pool_usage()?;
            drop((out, extra));
            t.close_step(0)?;
            t.fence()?;
            Ok::<_, layer::LayerError>((high - start, t.take_step(0)))
        };
        let mut all = None;
        for (rank, res) in layer::run_local_timed(world, Duration::from_secs(600), body)
            .into_iter()
            .enumerate()
        {
            let (_, steps) = res.unwrap_or_else(|e| panic!("{world} ranks, rank {rank}: {e}"));
            all = all.or(steps);
        }
        let all = all.expect("rank 0 took the step");
        let held: Vec<u64> = all
            .iter()
            .map(|v| match v.last() {
                Some(Entry::Held { bytes }) => *bytes,
                other => panic!("{world} ranks: the step ends with {other:?}"),
            })
            .collect();
        for v in &all {
            let parts: Vec<&str> = v
                .iter()
                .filter_map(|e| match e {
                    Entry::Work { phase, seconds, .. } => {
                        assert!(*seconds >= 0.0 && seconds.is_finite(), "{e:?}");
                        phase.strip_prefix("moe: ")
                    }
                    _ => None,
                })
                .collect();
            for want in ["route", "experts dX", "scatter"] {
                assert!(
                    parts.contains(&want),
                    "{world} ranks: no part {want} in {parts:?}"
                );
            }
            let busy: f64 = v
                .iter()
                .filter_map(|e| match e {
                    Entry::Work { phase, seconds, .. } if phase.starts_with("moe") => {
                        Some(*seconds)
                    }
                    _ => None,
                })
                .sum();
            assert!(busy > 1e-5, "{world} ranks: {busy} s of work");
        }
        eprintln!("{world} ranks: held {held:?} bytes");
        if world == 1 {
            let untimed = run_local(1, Duration::from_secs(600), body)
                .pop()
                .expect("one rank")
                .unwrap_or_else(|e| panic!("untimed: {e}"))
                .0;
            eprintln!("1 rank untimed: the pool's high-water mark {untimed} bytes");
            assert!(
                held[0].abs_diff(untimed) <= untimed / 100,
                "one rank holds {} bytes, the pool's high-water mark is {untimed}",
                held[0]
            );
        } else {
            let more = held[1] as i64 - held[0] as i64;
            let extra = EXTRA as i64;
            assert!(
                (more - extra).abs() < extra / 8,
                "rank 1 holds {more} bytes more than rank 0, not about {extra}"
            );
        }
    }
}

/// `backward_releasing` (the owner's forward rows released once the kept
/// rows are gathered) gives the bits of `backward` (the saved state kept
/// whole), and a second backward of the released state — its `x` rows
/// then gathered from the input, as a call with replicas does — gives
/// them again: on one rank and on 2 in-process ranks, at r = 1 (projections
/// kept and recomputed) and with a binding budget under top-q and
/// priority sampling.
#[test]
#[ignore = "needs a GPU: run with --ignored on the device"]
fn releasing_backward_equals_the_kept_state_bit_for_bit() {
    use kernels::cpu::random_bf16;
    use layer::Retention;
    use lrm_score::Rule::{Priority, TopQ};
    let gpu = Gpu::open(0).unwrap();
    gpu.set_poison(true);
    let cfg = MoeConfig {
        hidden: 64,
        ffn: 128,
        n_experts: 8,
        top_k: 2,
        renormalize: true,
    };
    let t = 384;
    let calls = [
        ("r = 1, projections kept", Retention::Full, true, TopQ),
        ("r = 1, recomputed", Retention::Full, false, TopQ),
        ("r = 0.5, top-q", Retention::Ratio(0.5), false, TopQ),
        ("r = 0.5, priority", Retention::Ratio(0.5), false, Priority),
        ("r = 0.5, kept", Retention::Ratio(0.5), true, TopQ),
    ];
    let one = |comm: DeviceComm<'_>| -> Result<(), String> {
        let r = comm.rank() as u64;
        let w = device::random_weights(&gpu, comm, &cfg).map_err(|e| e.to_string())?;
        let x = gpu.upload(&random_bf16(t * cfg.hidden, 71 + r)).unwrap();
        let dy = gpu.upload(&random_bf16(t * cfg.hidden, 72 + r)).unwrap();
        for (what, retention, keep, rule) in calls.clone() {
            let binding = matches!(retention, Retention::Ratio(_));
            let call = CallConfig {
                retention,
                keep_projections: keep,
                rule,
                ..CallConfig::default()
            };
            let planner = DevicePlanner::new(cfg, call).unwrap();
            let err = |e: layer::LayerError| format!("{what}: {e}");
            let mut sv = device::forward(&gpu, comm, &cfg, &w, &x, &planner).map_err(err)?;
            let runs = [
                device::backward(&gpu, comm, &w, &sv, &dy, &planner).map_err(err)?,
                device::backward_releasing(&gpu, comm, &w, &mut sv, &dy, &planner).map_err(err)?,
                device::backward(&gpu, comm, &w, &sv, &dy, &planner).map_err(err)?,
            ];
            let host = |g: &layer::device::DeviceGrads| {
                let n = |s: &kernels::gpu::CudaSlice<u16>| gpu.download(s, s.len()).unwrap();
                (
                    n(&g.dx),
                    gpu.download(&g.router, g.router.len()).unwrap(),
                    [n(&g.experts.gate), n(&g.experts.up), n(&g.experts.down)],
                    (g.kept_pairs, g.kept_total),
                )
            };
            let want = host(&runs[0]);
            // kept_total counts every rank's kept pairs.
            if binding && want.3 .1 >= t * cfg.top_k * comm.world_size() {
                return Err(format!("{what}: the budget does not bind"));
            }
            for (i, g) in runs[1..].iter().enumerate() {
                if host(g) != want {
                    return Err(format!("{what}: backward {} differs from the first", i + 2));
                }
            }
        }
        Ok(())
    };
    one(DeviceComm::Local).unwrap();
    let results = run_local(2, Duration::from_secs(300), |tr| {
        one(DeviceComm::Staged(tr)).map_err(layer::LayerError::Config)
    });
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            panic!("EP = 2, rank {rank}: {e}");
        }
    }
}
