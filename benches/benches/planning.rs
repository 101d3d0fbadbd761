//! Criterion benches of the planning core (`cargo bench -p lrmoe-benches`).
//! The table-printing `lrmoe-bench` binary gives the ratios for the docs;
//! these give criterion's statistics and regression tracking.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lrmoe_benches::{redistribution_problem, zipf_counts};

fn solvers(c: &mut Criterion) {
    let mut g = c.benchmark_group("redistribute");
    for (e, r, x) in [(128usize, 8usize, 32usize), (1024, 64, 512)] {
        let p = redistribution_problem(e, r, x, 7);
        for solver in [redistribute::Solver::Exact, redistribute::Solver::Greedy] {
            let cfg = redistribute::Config {
                solver,
                ..redistribute::Config::default()
            };
            g.bench_with_input(
                BenchmarkId::new(format!("{solver:?}"), format!("{e}x{r}+{x}")),
                &p,
                |b, p| b.iter(|| redistribute::solve(p, &cfg).expect("feasible")),
            );
        }
    }
    g.finish();
}

/// One layer call's host planning as the device executor runs it, on the
/// qwen3-moe-mini shape (128 experts, top-8, 16 384 tokens a step) with
/// the trainer's LRMoE settings at 8 and 16 ranks: the controller's plan of
/// the forward (quotas, replicas, the forward's split) and the backward's
/// redistribution of the kept pairs, with every slot's replica placed
/// (`fill`) and, at 16 ranks, with the default rule (`-paying`: at this
/// even routing no replica pays, so none is placed), and fixed ownership
/// (`-owners`: the owners' split alone). `backward+layout` is the whole
/// `redistribute` piece of the simulator's phases: the split, its checks,
/// the ranks' loads and this rank's layout. On the in-process ranks of
/// issue 30 this host time is time the GPU waits for; the host probe
/// printed first (`simulated.host_probe_s`'s workload) scales it to the
/// device machine's host.
fn layer_call_plan(c: &mut Criterion) {
    use lrmoe::train::{layer_call_config, Executor, Mode, MoeSection};
    eprintln!("host probe: {:.3} ms", lrmoe::simulate::host_probe() * 1e3);
    let cfg = layer::MoeConfig {
        hidden: 512,
        ffn: 256,
        n_experts: 128,
        top_k: 8,
        renormalize: true,
    };
    let mut g = c.benchmark_group("layer_call_plan");
    // (rule, ranks, Zipf exponent of the experts' popularity: 0 is even
    // routing, 1.0 gives the hottest expert ~25× the mean at 128 experts;
    // the buffer, `moe.buffer_fraction`: the default 0.6, or 1.5 as in the
    // simulated comparisons of issue 30, where every pair is kept).
    for (mode, rule, ranks, skew, buffer) in [
        (Mode::Lrmoe, quota::ReplicaRule::Fill, 8usize, 0.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::Fill, 16, 0.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::Paying, 16, 0.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::PayingCompute, 16, 0.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::Paying, 16, 1.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::PayingCompute, 16, 1.0, 0.6),
        (Mode::Full, quota::ReplicaRule::Paying, 16, 1.0, 0.6),
        (Mode::Lrmoe, quota::ReplicaRule::Paying, 8, 1.0, 1.5),
        (Mode::Lrmoe, quota::ReplicaRule::Paying, 16, 1.0, 1.5),
    ] {
        let tag = match (mode, rule) {
            (Mode::Full, _) => "-owners",
            (_, quota::ReplicaRule::Fill) => "",
            (_, quota::ReplicaRule::Paying) => "-paying",
            (_, quota::ReplicaRule::PayingCompute) => "-paying-compute",
        };
        let tag = if skew > 0.0 {
            format!("{tag}-zipf{skew}")
        } else {
            tag.to_string()
        };
        let tag = if buffer != 0.6 {
            format!("{tag}-buffer{buffer}")
        } else {
            tag
        };
        let pairs = 16_384 / ranks * cfg.top_k;
        let moe = MoeSection {
            ranks,
            mode,
            executor: Executor::Device,
            replica_rule: rule,
            buffer_fraction: buffer,
            ..MoeSection::default()
        };
        let placement = quota::Placement {
            owner: (0..cfg.n_experts)
                .map(|e| e * ranks / cfg.n_experts)
                .collect(),
            replicas: vec![],
        };
        let call = layer_call_config(
            &moe,
            (cfg.hidden, cfg.ffn),
            pairs as f64,
            &placement,
            true,
            0,
        );
        let planner = layer::DevicePlanner::new(cfg, call).expect("a device call");
        // Every source's pairs drawn over the experts by the same popularity.
        let routed: Vec<Vec<u32>> = zipf_counts(ranks, cfg.n_experts, pairs as u64, skew, 7)
            .into_iter()
            .map(|row| row.into_iter().map(|c| c as u32).collect())
            .collect();
        g.bench_function(BenchmarkId::new(format!("forward{tag}"), ranks), |b| {
            b.iter(|| planner.forward(&routed).expect("a plan"))
        });
        // The rest of the forward's host side on one rank: the plan's
        // checks and this rank's layout of its rows over the instances.
        g.bench_function(
            BenchmarkId::new(format!("forward+layout{tag}"), ranks),
            |b| {
                b.iter(|| {
                    let plan = planner.forward(&routed).expect("a plan");
                    layer::check_plan(&plan, &routed, cfg.n_experts / ranks).expect("a valid plan");
                    let local = pack::ep::local_experts(&plan.instances, ranks);
                    pack::ep::instance_layout(&plan.forward, &local, 1).expect("a layout")
                })
            },
        );
        // What the forward's dispatch waits for: the replicas, the split
        // over the instances, its checks and this rank's layout (the
        // quotas follow while the experts compute).
        g.bench_function(
            BenchmarkId::new(format!("routes+layout{tag}"), ranks),
            |b| {
                b.iter(|| {
                    let routes = planner.routes(&routed).expect("routes");
                    let el = cfg.n_experts / ranks;
                    layer::check_routes(&routes.instances, &routes.forward, &routed, el)
                        .expect("valid routes");
                    let local = pack::ep::local_experts(&routes.instances, ranks);
                    pack::ep::instance_layout(&routes.forward, &local, 1).expect("a layout")
                })
            },
        );
        let plan = planner.forward(&routed).expect("a plan");
        let total: Vec<u64> = (0..cfg.n_experts)
            .map(|e| routed.iter().map(|r| u64::from(r[e])).sum())
            .collect();
        let kept: Vec<Vec<u32>> = routed
            .iter()
            .map(|r| {
                (0..cfg.n_experts)
                    .map(|e| {
                        let q = u64::from(plan.quotas[e]).min(total[e]);
                        (u64::from(r[e]) * q).checked_div(total[e]).unwrap_or(0) as u32
                    })
                    .collect()
            })
            .collect();
        g.bench_function(BenchmarkId::new(format!("backward{tag}"), ranks), |b| {
            b.iter(|| planner.backward(&plan, &kept).expect("a split"))
        });
        let local = pack::ep::local_experts(&plan.instances, ranks);
        g.bench_function(
            BenchmarkId::new(format!("backward+layout{tag}"), ranks),
            |b| {
                b.iter(|| {
                    let split = planner.backward(&plan, &kept).expect("a split");
                    layer::check_split(&split, &kept, &plan.instances).expect("a valid split");
                    let loads = split.loads();
                    (
                        pack::ep::instance_layout(&split, &local, 1).expect("a layout"),
                        loads,
                    )
                })
            },
        );
    }
    g.finish();
}

fn scores(c: &mut Criterion) {
    let (n, d_in, d_out) = (8192usize, 768usize, 2048usize);
    let h: Vec<half::bf16> = (0..n * d_in)
        .map(|i| half::bf16::from_f32((i % 13) as f32 * 0.1))
        .collect();
    let d: Vec<half::bf16> = (0..n * d_out)
        .map(|i| half::bf16::from_f32((i % 11) as f32 * 0.1))
        .collect();
    let gate = vec![0.5f32; n];
    let mut out = vec![0f32; n];
    let mut g = c.benchmark_group("lrm_score");
    g.throughput(Throughput::Bytes((n * (d_in + d_out) * 2) as u64));
    g.bench_function("bf16_f32acc", |b| {
        b.iter(|| {
            lrm_score::pair_scores(
                lrm_score::PairRows {
                    h: &h,
                    delta: &d,
                    gate: &gate,
                    d_in,
                    d_out,
                },
                lrm_score::Accumulate::F32,
                &mut out,
            )
            .expect("finite")
        })
    });
    g.finish();
}

criterion_group!(benches, solvers, layer_call_plan, scores);
criterion_main!(benches);
