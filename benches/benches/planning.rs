//! Criterion benches of the planning core (`cargo bench -p lrmoe-benches`).
//! The table-printing `lrmoe-bench` binary gives the ratios for the docs;
//! these give criterion's statistics and regression tracking.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lrmoe_benches::redistribution_problem;

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

criterion_group!(benches, solvers, scores);
criterion_main!(benches);
