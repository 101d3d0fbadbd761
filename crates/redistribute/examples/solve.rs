//! Spread a hot expert's kept pairs over its owner and two replicas.

use redistribute::{solve, Config, Problem, Solver};

fn main() -> Result<(), redistribute::RedistributeError> {
    let problem = Problem {
        n_ranks: 4,
        kept: vec![vec![900, 10], vec![850, 20], vec![700, 5], vec![800, 15]],
        instances: vec![vec![0, 2, 3], vec![1]],
        base_load: vec![0; 4],
        rank_capacity: None,
    };
    for solver in [Solver::Exact, Solver::Greedy, Solver::Ilp] {
        let a = solve(
            &problem,
            &Config {
                solver,
                ..Config::default()
            },
        )?;
        println!(
            "{solver:?}: peak {} per-rank {:?} in {:.0} µs",
            a.peak, a.load, a.solve_micros
        );
    }
    Ok(())
}
