//! `lrmoe-bench`: prints the planning-core tables of `docs/benchmarks.md`.
//!
//! Each throughput is shown beside a plain rayon-parallel copy of the same
//! bytes measured in the same run, so the ratio is what to compare across
//! machines.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use half::bf16;
use rayon::prelude::*;

use lrmoe_benches::redistribution_problem;

#[derive(Parser)]
#[command(about = "Benchmarks of lrmoe's planning core (CPU)")]
struct Args {
    /// Which table to print.
    #[arg(value_enum, default_value_t = Table::All)]
    table: Table,
    /// Seconds to spend per measured case (at least 3 runs each).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// ILP time limit in seconds for the solver table.
    #[arg(long, default_value_t = 2.0)]
    ilp_time_limit: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Table {
    All,
    Score,
    Pack,
    Redistribute,
    Layer,
    Replay,
    Scale,
    Planning,
    Cluster,
}

/// Runs `f` repeatedly for about `budget`; returns per-run seconds, sorted.
fn time_runs(budget: Duration, mut f: impl FnMut()) -> Vec<f64> {
    f(); // warm up
    let mut times = vec![];
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed() < budget && times.len() < 10_000) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times
}

fn median(t: &[f64]) -> f64 {
    t[t.len() / 2]
}

/// Rayon-parallel copy of `src` into `dst`, the peer of every throughput.
fn par_copy<T: Copy + Send + Sync>(src: &[T], dst: &mut [T]) {
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

fn copy_gbps(bytes: usize, budget: Duration) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = time_runs(budget, || par_copy(black_box(&src), black_box(&mut dst)));
    bytes as f64 / median(&t) / 1e9
}

fn fill<T: Copy>(n: usize, f: impl Fn(usize) -> T) -> Vec<T> {
    (0..n).map(f).collect()
}

fn score_table(budget: Duration) {
    println!("## LRM scores (n = 65536 pairs, d_in = 768, d_out = 2048)\n");
    println!("| input | accumulate | median ms | GB/s read | copy GB/s (same bytes) | ratio |");
    println!("|---|---|---|---|---|---|");
    let (n, d_in, d_out) = (65536usize, 768usize, 2048usize);
    let gate = fill(n, |i| (i % 7) as f32 / 7.0);
    let mut out = vec![0f32; n];
    let hf = fill(n * d_in, |i| ((i * 31) % 97) as f32 / 97.0 - 0.5);
    let df = fill(n * d_out, |i| ((i * 17) % 89) as f32 / 89.0 - 0.5);
    let hb: Vec<bf16> = hf.iter().map(|&x| bf16::from_f32(x)).collect();
    let db: Vec<bf16> = df.iter().map(|&x| bf16::from_f32(x)).collect();
    for (name, elem) in [("bf16", 2usize), ("f32", 4usize)] {
        let bytes = n * (d_in + d_out) * elem + n * 4;
        let copy = copy_gbps(bytes, budget);
        for acc in [lrm_score::Accumulate::F32, lrm_score::Accumulate::F64] {
            let t = time_runs(budget, || {
                let r = if elem == 2 {
                    lrm_score::pair_scores(
                        lrm_score::PairRows {
                            h: &hb,
                            delta: &db,
                            gate: &gate,
                            d_in,
                            d_out,
                        },
                        acc,
                        &mut out,
                    )
                } else {
                    lrm_score::pair_scores(
                        lrm_score::PairRows {
                            h: &hf,
                            delta: &df,
                            gate: &gate,
                            d_in,
                            d_out,
                        },
                        acc,
                        &mut out,
                    )
                };
                r.expect("finite");
                black_box(&out);
            });
            let gbps = bytes as f64 / median(&t) / 1e9;
            println!(
                "| {name} | {acc:?} | {:.3} | {gbps:.2} | {copy:.2} | {:.2} |",
                median(&t) * 1e3,
                gbps / copy
            );
        }
    }
    // Selection: 128 experts × 131072 pairs, quotas at 50%.
    let n = 131072usize;
    let expert = fill(n, |i| ((i * 2654435761) % 128) as u32);
    let id = fill(n, |i| i as u64);
    let score = fill(n, |i| ((i * 40503) % 65521) as f32);
    let quotas = vec![n / 256; 128];
    let mut kept = vec![false; n];
    let t = time_runs(budget, || {
        lrm_score::select_top(
            lrm_score::Candidates {
                expert: &expert,
                id: &id,
                score: &score,
            },
            &quotas,
            &mut kept,
        )
        .expect("valid");
        black_box(&kept);
    });
    println!(
        "\nTop-q selection, 128 experts × 131072 pairs, 50% kept: median {:.3} ms (max {:.3} ms)\n",
        median(&t) * 1e3,
        t[t.len() - 1] * 1e3
    );
}

fn pack_table(budget: Duration) {
    println!("## Pack / unpack (65536 pair rows, 8 destinations × 16 experts, 50% kept)\n");
    println!("| dtype | width | op | median ms | GB/s moved | copy GB/s (same bytes) | ratio |");
    println!("|---|---|---|---|---|---|---|");
    let n = 65536usize;
    let (n_ranks, n_experts) = (8usize, 16usize);
    let expert = fill(n, |i| ((i * 7919) % n_experts) as u32);
    let kept = fill(n, |i| (i * 40503) % 100 < 50);
    let mut routes = vec![];
    for e in 0..n_experts {
        let k = (0..n)
            .filter(|&i| kept[i] && expert[i] as usize == e)
            .count() as u64;
        for r in 0..n_ranks as u64 {
            let share = k / n_ranks as u64 + u64::from(r < k % n_ranks as u64);
            routes.push(pack::SendRoute {
                expert: e,
                rank: r as usize,
                pairs: share,
            });
        }
    }
    let plan = pack::plan(&expert, &kept, &routes, n_ranks, n_experts).expect("valid");
    let t = time_runs(budget, || {
        black_box(pack::plan(&expert, &kept, &routes, n_ranks, n_experts).expect("valid"));
    });
    for width in [768usize, 2048] {
        let rows = plan.packed_rows();
        bench_rows::<bf16>("bf16", width, n, rows, &plan, budget);
        bench_rows::<f32>("f32", width, n, rows, &plan, budget);
    }
    println!(
        "\nPlan construction (65536 pairs): median {:.3} ms\n",
        median(&t) * 1e3
    );
}

fn bench_rows<T: Copy + Send + Sync + Default + From<u8>>(
    name: &str,
    width: usize,
    n: usize,
    rows: usize,
    plan: &pack::PackPlan,
    budget: Duration,
) {
    let elem = std::mem::size_of::<T>();
    let src: Vec<T> = fill(n * width, |i| T::from((i % 251) as u8));
    let mut packed = vec![T::default(); rows * width];
    let t = time_runs(budget, || {
        pack::gather_rows(&src, width, &plan.gather, &mut packed).expect("valid");
        black_box(&packed);
    });
    let bytes = rows * width * elem;
    let copy = copy_gbps(bytes, budget);
    let g = bytes as f64 / median(&t) / 1e9;
    println!(
        "| {name} | {width} | pack (gather) | {:.3} | {g:.2} | {copy:.2} | {:.2} |",
        median(&t) * 1e3,
        g / copy
    );
    let mut out = vec![T::default(); n * width];
    let t = time_runs(budget, || {
        pack::unpack_rows(&packed, width, &plan.inverse, T::default(), &mut out).expect("valid");
        black_box(&out);
    });
    // Unpack writes every row (kept rows copied, dropped rows zeroed).
    let bytes = n * width * elem;
    let copy = copy_gbps(bytes, budget);
    let g = bytes as f64 / median(&t) / 1e9;
    println!(
        "| {name} | {width} | unpack (scatter + zero) | {:.3} | {g:.2} | {copy:.2} | {:.2} |",
        median(&t) * 1e3,
        g / copy
    );
}

fn redistribute_table(budget: Duration, ilp_limit: f64) {
    println!("## Redistribution solve latency (Zipf 1.2 counts, 4096 tokens × top-8 per rank, 60% kept)\n");
    println!("Base loads: `zero`, or `random` (uniform in [0, 8000) per rank, so the simple lower bound is not tight).\n");
    println!("| experts | ranks | extra replicas | base loads | solver | median µs | max µs | peak | lower bound | status |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let sizes = [
        (64, 8, 16),
        (128, 8, 32),
        (256, 32, 64),
        (256, 64, 128),
        (1024, 64, 512),
    ];
    for ((e, r, x), random_base) in sizes.iter().flat_map(|&s| [(s, false), (s, true)]) {
        let mut p = redistribution_problem(e, r, x, 7);
        if random_base {
            p.base_load = (0..r as u64).map(|i| (i * 2654435761) % 8000).collect();
        }
        let base = if random_base { "random" } else { "zero" };
        let lb = redistribute::peak_lower_bound(&p, &redistribute::LoadModel::default());
        for solver in [
            redistribute::Solver::Exact,
            redistribute::Solver::Greedy,
            redistribute::Solver::Ilp,
        ] {
            let cfg = redistribute::Config {
                solver,
                ilp_time_limit: Duration::from_secs_f64(ilp_limit),
                ..redistribute::Config::default()
            };
            let mut last = None;
            // The ILP gets a smaller budget of repetitions: each solve can take seconds.
            let b = if solver == redistribute::Solver::Ilp {
                budget.min(Duration::from_secs(3))
            } else {
                budget
            };
            let t = time_runs(b, || {
                last = Some(redistribute::solve(&p, &cfg).expect("feasible"))
            });
            let a = last.expect("ran");
            let status = match &a.status {
                redistribute::Status::Done => "done".to_string(),
                redistribute::Status::TimeLimit => "time limit".to_string(),
                redistribute::Status::FellBack { used, .. } => format!("fell back to {used:?}"),
            };
            println!(
                "| {e} | {r} | {x} | {base} | {solver:?} | {:.1} | {:.1} | {} | {lb} | {status} |",
                median(&t) * 1e6,
                t[t.len() - 1] * 1e6,
                a.peak
            );
        }
    }
    println!();
}

fn main() {
    let args = Args::parse();
    let budget = Duration::from_secs_f64(args.seconds);
    println!(
        "lrmoe-bench: {} rayon threads, {} logical CPUs\n",
        rayon::current_num_threads(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if matches!(args.table, Table::All | Table::Score) {
        score_table(budget);
    }
    if matches!(args.table, Table::All | Table::Pack) {
        pack_table(budget);
    }
    if matches!(args.table, Table::All | Table::Redistribute) {
        redistribute_table(budget, args.ilp_time_limit);
    }
    if matches!(args.table, Table::All | Table::Layer) {
        layer_table(budget);
    }
    if matches!(args.table, Table::All | Table::Replay) {
        replay_table();
    }
    if matches!(args.table, Table::All | Table::Scale) {
        scale_table();
    }
    if matches!(args.table, Table::All | Table::Planning) {
        planning_table(budget);
    }
    if matches!(args.table, Table::All | Table::Cluster) {
        cluster_table();
    }
}

/// The cluster model's defaults against every all-to-all measured on H200s.
fn cluster_table() {
    let c = cluster::Cluster::default();
    println!(
        "## The cluster model against the measured all-to-alls (intra-node {} GB/s per GPU and direction, {} µs)\n",
        c.intra_gb_per_s, c.intra_latency_us
    );
    match cluster::check(&c) {
        Ok(checks) => {
            print!("{}", cluster::check_table(&checks));
            let worst = checks.iter().map(|k| k.error().abs()).fold(0.0, f64::max);
            println!("\nlargest error: {:.1}%\n", 100.0 * worst);
        }
        Err(e) => println!("cluster model: {e}\n"),
    }
}

/// One layer call's planning as the executors run it: the controller
/// (`layer::plan_call`: replicas, then quotas under the ranks' budgets) and
/// the exact redistribution of the kept pairs over the instances.
fn planning_table(budget: Duration) {
    println!("## Planning one layer call (Qwen3-30B-A3B shape: hidden 2048, ffn 768, top-8; 16384 tokens per rank; Zipf 1.2)\n");
    println!("| experts | ranks | replica slots | budget (buffer share of avg pairs) | controller median µs | redistribution median µs | total median µs | kept fraction |");
    println!("|---|---|---|---|---|---|---|---|");
    for &(experts, ranks, slots, share) in &[
        (128usize, 8usize, 0usize, 1.0f64),
        (128, 8, 1, 0.6),
        (128, 8, 2, 0.8),
        (128, 16, 0, 1.0),
        (128, 16, 0, 0.6),
        (256, 32, 1, 0.6),
    ] {
        let cfg = layer::MoeConfig {
            hidden: 2048,
            ffn: 768,
            n_experts: experts,
            top_k: 8,
            renormalize: true,
        };
        let counts = lrmoe_benches::zipf_counts(ranks, experts, 16384 * 8, 1.2, 11);
        let placement = quota::Placement {
            owner: (0..experts).map(|e| e * ranks / experts).collect(),
            replicas: vec![],
        };
        let cost = quota::CostModel::swiglu_expert(
            2048,
            768,
            2,
            quota::H200_LINK_BYTES_PER_S,
            quota::H200_FLOPS_PER_S,
        );
        let owned = (experts / ranks) as u64;
        let rank_budget = quota::RankBudget {
            memory_bytes: (owned + slots as u64) * cost.instance_bytes()
                + (share * (16384 * 8) as f64) as u64 * cost.row_bytes(),
            network_bytes: u64::MAX,
        };
        let call = layer::CallConfig {
            retention: layer::Retention::Budgeted {
                budgets: vec![rank_budget; ranks],
                policy: quota::Policy::Maxmin,
            },
            replica_slots_per_rank: slots,
            replica_memory_fraction: 1.0,
            replica_rule: quota::ReplicaRule::Fill,
            ..layer::CallConfig::default()
        };
        let mut plan = None;
        let t_plan = time_runs(budget, || {
            plan = Some(
                layer::plan_call::<u16>(&cfg, &call, counts.clone(), &placement).expect("plans"),
            );
        });
        let plan = plan.expect("ran");
        let problem = redistribute::Problem {
            n_ranks: ranks,
            kept: plan.kept.clone(),
            instances: plan.placement.all_instances(),
            base_load: vec![0; ranks],
            rank_capacity: plan.caps.clone(),
        };
        let t_solve = time_runs(budget, || {
            black_box(
                redistribute::solve(&problem, &redistribute::Config::default()).expect("solves"),
            );
        });
        let kept: u64 = plan.quotas.iter().sum();
        let routed: u64 = counts.iter().flatten().sum();
        let (p, r) = (median(&t_plan) * 1e6, median(&t_solve) * 1e6);
        println!(
            "| {experts} | {ranks} | {slots} | {share} | {p:.1} | {r:.1} | {:.1} | {:.3} |",
            p + r,
            kept as f64 / routed as f64
        );
    }
    println!();
}

/// The planner's edges at many ranks: `lrmoe plan` end to end (controller,
/// exact redistribution, per-rank report) and replica planning alone.
fn scale_table() {
    println!("## Planner scale (one call each, seconds)\n");
    println!("| case | ranks | experts | replica slots | seconds |\n|---|---|---|---|---|");
    for &(ranks, experts, slots) in &[
        (100_000usize, 1usize, 0usize),
        (120_000, 1, 0),
        (100_000, 128, 0),
    ] {
        let problem = serde_json::json!({
            "n_ranks": ranks,
            "placement": {"owner": (0..experts).map(|e| e * ranks / experts).collect::<Vec<_>>()},
            "kept_counts": (0..ranks).map(|r| (0..experts).map(|e| ((r * 7 + e * 13) % 50) as u64).collect::<Vec<_>>()).collect::<Vec<_>>(),
        });
        let p = lrmoe::plan::parse_problem(&problem.to_string()).expect("valid problem");
        let t = Instant::now();
        let report = lrmoe::plan::run(&p, &lrmoe::plan::Options::default()).expect("plans");
        black_box(report);
        println!(
            "| `lrmoe plan` (kept counts, exact, report) | {ranks} | {experts} | {slots} | {:.3} |",
            t.elapsed().as_secs_f64()
        );
    }
    for &(ranks, experts, slots) in &[
        (6000usize, 1usize, 1usize),
        (8000, 1, 1),
        (8000, 1, 4),
        (8000, 128, 1),
        (8000, 1024, 2),
    ] {
        let counts: Vec<Vec<u64>> = (0..ranks)
            .map(|r| {
                (0..experts)
                    .map(|e| 1 + ((r * 7 + e * 13) % 50) as u64 * (1 + (e == 0) as u64 * 20))
                    .collect()
            })
            .collect();
        let placement = quota::Placement {
            owner: (0..experts).map(|e| e * ranks / experts).collect(),
            replicas: vec![],
        };
        let cost = quota::CostModel {
            act_row_bytes: 4096,
            grad_row_bytes: 4096,
            expert_weight_bytes: 1 << 20,
            expert_grad_bytes: 1 << 20,
            flops_per_pair: 1e7,
            forward_flops_per_pair: 0.0,
            exchange_row_bytes: 0,
            link_bytes_per_s: quota::H200_LINK_BYTES_PER_S,
            flops_per_s: quota::H200_FLOPS_PER_S,
        };
        let budgets = vec![
            quota::RankBudget {
                memory_bytes: 1 << 40,
                network_bytes: u64::MAX
            };
            ranks
        ];
        let inputs = quota::Inputs {
            counts: &counts,
            placement: &placement,
            cost: &cost,
            budgets: &budgets,
        };
        let cfg = quota::Config {
            policy: quota::Policy::Maxmin,
            replica_slots_per_rank: slots,
            replica_memory_fraction: 1.0,
            replica_rule: quota::ReplicaRule::Fill,
            forward_rows_cap: None,
        };
        let t = Instant::now();
        let placed = quota::plan_replicas(&inputs, &cfg).expect("plans");
        let secs = t.elapsed().as_secs_f64();
        let added: usize = placed.replicas.iter().map(Vec::len).sum();
        println!("| `quota::plan_replicas` ({added} replicas placed) | {ranks} | {experts} | {slots} | {secs:.3} |");
    }
    println!();
}

/// sgemm of the `gemm` crate through `kernels::cpu::matmul`, GFLOP/s.
fn sgemm_gflops(m: usize, k: usize, n: usize, budget: Duration) -> f64 {
    let a = fill(m * k, |i| (i % 7) as f32 * 0.1);
    let b = fill(k * n, |i| (i % 5) as f32 * 0.1);
    let mut c = vec![0f32; m * n];
    let op = kernels::cpu::Op::N;
    let t = time_runs(budget, || {
        kernels::cpu::matmul(&mut c, &a, op, &b, op, (m, k, n), false).expect("shapes");
        black_box(&c);
    });
    2.0 * (m * k * n) as f64 / median(&t) / 1e9
}

fn layer_table(budget: Duration) {
    use layer::{CallConfig, MoeConfig, MoeParams, Retention};
    println!("## MoE layer on CPU (f32, 1 rank, tokens 4096, top-2)\n");
    println!("FLOPs counted: forward 6·H·F per pair (+ router); backward 16·H·F per kept pair");
    println!("(recompute of gate/up 4, dW_down 2, dH 2, dW_gate + dW_up 4, dX 4) + router.");
    println!("Peer: the gemm crate's sgemm (same wrapper) at the per-expert GEMM shape and at 1024³, same run.\n");
    println!("| hidden | ffn | experts | retention | fwd ms | fwd GFLOP/s | bwd ms | bwd GFLOP/s | sgemm GFLOP/s (expert shape) | fwd / sgemm | bwd / sgemm | sgemm 1024³ |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let place = |e: usize| quota::Placement {
        owner: vec![0; e],
        replicas: vec![],
    };
    for (hidden, ffn, n_experts) in [(256usize, 512usize, 8usize), (512, 1024, 16)] {
        let cfg = MoeConfig {
            hidden,
            ffn,
            n_experts,
            top_k: 2,
            renormalize: true,
        };
        let n_tok = 4096;
        let params = MoeParams::<f32>::init(&cfg, 1);
        let x = fill(n_tok * hidden, |i| ((i * 37) % 101) as f32 / 101.0 - 0.5);
        let dy = fill(n_tok * hidden, |i| ((i * 53) % 103) as f32 / 103.0 - 0.5);
        let rows = n_tok * 2 / n_experts;
        let peer = sgemm_gflops(rows, hidden, ffn, budget);
        let big = sgemm_gflops(1024, 1024, 1024, budget);
        let placement = place(n_experts);
        for retention in [1.0, 0.5, 0.25] {
            let call = CallConfig {
                retention: if retention >= 1.0 {
                    Retention::Full
                } else {
                    Retention::Ratio(retention)
                },
                ..CallConfig::default()
            };
            let res = layer::run_local(1, Duration::from_secs(600), |t| {
                let (mut fwd, mut bwd) = (vec![], vec![]);
                let deadline = Instant::now() + budget;
                while fwd.len() < 3 || Instant::now() < deadline {
                    let c = Instant::now();
                    let (_, saved) = layer::forward(t, &cfg, &call, &params, &placement, &x)?;
                    let f_s = c.elapsed().as_secs_f64();
                    let c = Instant::now();
                    black_box(layer::backward(t, &cfg, &call, &params, &saved, &dy)?);
                    let b_s = c.elapsed().as_secs_f64();
                    fwd.push(f_s);
                    bwd.push(b_s);
                }
                Ok::<_, layer::LayerError>((fwd, bwd))
            });
            let (mut fwd, mut bwd) = res
                .into_iter()
                .next()
                .expect("one rank")
                .expect("layer runs");
            fwd.sort_by(f64::total_cmp);
            bwd.sort_by(f64::total_cmp);
            let pairs = (n_tok * 2) as f64;
            let hf = (hidden * ffn) as f64;
            let router = 2.0 * (n_tok * hidden * n_experts) as f64;
            let f_flops = 6.0 * hf * pairs + router;
            let b_flops = 16.0 * hf * pairs * retention + 2.0 * router;
            let (fm, bm) = (median(&fwd), median(&bwd));
            let (fg, bg) = (f_flops / fm / 1e9, b_flops / bm / 1e9);
            println!(
                "| {hidden} | {ffn} | {n_experts} | {retention} | {:.2} | {fg:.1} | {:.2} | {bg:.1} | {peer:.1} | {:.2} | {:.2} | {big:.1} |",
                fm * 1e3,
                bm * 1e3,
                fg / peer,
                bg / peer
            );
        }
    }
    println!();
}

fn replay_table() {
    use lrmoe::replay::{replay, synthetic, ReplayConfig, Synthetic, Workload};
    println!("## Replay latency (synthetic hot experts, Zipf 1.2; 16384 tokens × top-8 per rank; hidden 2048, ffn 768, bf16)\n");
    println!("| steps | layers | experts | ranks | cells | budget MiB | generate s | replay s (4 strategies) | LRMoE kept | LRMoE memory saving | target |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let (steps, layers, experts, ranks) = (1000usize, 48usize, 128usize, 8usize);
    let t = Instant::now();
    let trace = synthetic(&Synthetic {
        workload: Workload::HotExperts,
        steps,
        layers,
        experts,
        ranks,
        tokens: 16384,
        top_k: 8,
        zipf: 1.2,
        seed: 0,
    })
    .expect("valid synthetic config");
    let gen = t.elapsed().as_secs_f64();
    for budget_mib in [1400u64, 1000] {
        let cfg = ReplayConfig {
            hidden: 2048,
            ffn: 768,
            element_bytes: 2,
            memory_budget_bytes: budget_mib << 20,
            link_bytes_per_s: quota::H200_LINK_BYTES_PER_S,
            flops_per_s: quota::H200_FLOPS_PER_S,
            replica_slots_per_rank: 2,
            replica_memory_fraction: 0.5,
            policy: quota::Policy::Maxmin,
            replica_rule: Default::default(),
            tile_trim: 0.0,
            cluster: Default::default(),
            slots_reserved: false,
            count_forward: false,
        };
        let t = Instant::now();
        let r = replay(&trace, &cfg).expect("replay runs");
        let secs = t.elapsed().as_secs_f64();
        black_box(&r);
        println!(
            "| {steps} | {layers} | {experts} | {ranks} | {} | {budget_mib} | {gen:.2} | {secs:.2} | {:.3} | {:.1}% | < 10 s |",
            steps * layers,
            r.summary
                .iter()
                .find(|x| x.strategy == lrmoe::replay::Strategy::Lrmoe)
                .map_or(f64::NAN, |x| x.mean_kept_fraction),
            100.0 * r.lrmoe_memory_saving
        );
    }
    println!();
}
