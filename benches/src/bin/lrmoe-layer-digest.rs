//! `lrmoe-layer-digest`: a digest of the device executor's results (every
//! output, input gradient, router and expert gradient, bit for bit) on
//! fixed inputs, EP = 1 and in-process EP = 2 and 4, at r = 1 and 0.5,
//! with and without replica slots and with priority sampling — so two
//! builds can be held to the same bits. Each case runs twice (the digest
//! of a nondeterministic case differs between its runs).

use std::time::Duration;

use kernels::gpu::Gpu;
use layer::device::{host_call, DeviceComm};
use layer::{run_local, CallConfig, DevicePlanner, MoeConfig, Retention, Transport};

fn fnv(h: &mut u64, v: impl IntoIterator<Item = u8>) {
    for b in v {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

fn bits(n: usize, seed: u64, scale: f32) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = ((s >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0;
            kernels::cpu::f32_to_bf16_bits(v * scale)
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let gpu = Gpu::open(0)?;
    let cfg = MoeConfig {
        hidden: 256,
        ffn: 512,
        n_experts: 16,
        top_k: 4,
        renormalize: true,
    };
    let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.n_experts);
    let tokens = 2048;
    let router = bits(h * e, 1, 0.5);
    let (gate, up, down) = (
        bits(e * h * f, 2, 0.1),
        bits(e * h * f, 3, 0.1),
        bits(e * f * h, 4, 0.07),
    );
    let (x, dy) = (bits(tokens * h, 5, 1.0), bits(tokens * h, 6, 1.0));
    let planners: Vec<(&str, DevicePlanner)> = vec![
        ("r=1", DevicePlanner::ratio(&cfg, 1.0)),
        ("r=0.5", DevicePlanner::ratio(&cfg, 0.5)),
        (
            "r=0.5 replicas",
            DevicePlanner::ratio_with_replicas(&cfg, 0.5, 1),
        ),
        (
            "r=0.5 priority",
            DevicePlanner::new(
                cfg,
                CallConfig {
                    retention: Retention::Ratio(0.5),
                    rule: lrm_score::Rule::Priority,
                    rule_seed: 7,
                    ..CallConfig::default()
                },
            )?,
        ),
    ];
    for world in [1usize, 2, 4] {
        for (name, planner) in &planners {
            let mut digests = Vec::new();
            for _ in 0..2 {
                let el = e / world;
                let per = tokens / world;
                let res = run_local(world, Duration::from_secs(120), |t| {
                    let r = t.rank();
                    let comm = if world == 1 {
                        DeviceComm::Local
                    } else {
                        DeviceComm::Staged(t)
                    };
                    let blk = |w: &[u16], n: usize| w[r * el * n..(r + 1) * el * n].to_vec();
                    host_call(
                        &gpu,
                        comm,
                        &cfg,
                        &router,
                        (&blk(&gate, h * f), &blk(&up, h * f), &blk(&down, f * h)),
                        &x[r * per * h..(r + 1) * per * h],
                        &dy[r * per * h..(r + 1) * per * h],
                        planner,
                    )
                });
                let mut d = 0xcbf2_9ce4_8422_2325u64;
                let mut kept = 0;
                for out in res {
                    let out = out?;
                    let g = &out.grads;
                    for v in [
                        &out.y,
                        &g.dx,
                        &g.experts.gate,
                        &g.experts.up,
                        &g.experts.down,
                    ] {
                        fnv(&mut d, v.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    fnv(&mut d, g.router.iter().flat_map(|x| x.to_le_bytes()));
                    kept += g.kept_pairs;
                }
                digests.push((d, kept));
            }
            println!(
                "world {world} {name}: digest {:016x} kept {} | again {:016x}",
                digests[0].0, digests[0].1, digests[1].0
            );
        }
    }
    Ok(())
}
