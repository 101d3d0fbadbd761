//! The integer program through good_lp (see the crate doc for the model).

use good_lp::{
    constraint, variable, Constraint, Expression, ProblemVariables, Solution, SolutionStatus,
    SolverModel, Variable, WithTimeLimit,
};

use crate::{greedy, Config, Problem, RedistributeError, Route, Solver, Status};

/// One integer variable per (source, expert, instance) — or per (expert,
/// instance) when the network weight is zero and sources do not matter.
struct Model {
    vars: ProblemVariables,
    peak: Variable,
    constraints: Vec<Constraint>,
    /// (source or `None` for expert-level, expert, rank, variable).
    cells: Vec<(Option<usize>, usize, usize, Variable)>,
}

fn build(problem: &Problem, cfg: &Config) -> Result<Model, String> {
    let c = cfg.load.compute_per_pair as f64;
    let m = cfg.load.network_per_pair as f64;
    let by_source = cfg.load.network_per_pair > 0;
    let kept = problem.kept_per_expert();
    let n = problem.n_ranks;
    let mut vars = ProblemVariables::new();
    let lb = crate::peak_lower_bound(problem, &cfg.load);
    let as_i32 = |x: u64| -> Result<f64, String> {
        i32::try_from(x)
            .map(f64::from)
            .map_err(|_| format!("value {x} exceeds the ILP's 32-bit integer range"))
    };
    let peak = vars.add(variable().integer().min(as_i32(lb)?));
    let mut constraints = Vec::new();
    let mut cells = Vec::new();
    let mut processed: Vec<Expression> = vec![Expression::from(0.0); n];
    let mut moved: Vec<Expression> = vec![Expression::from(0.0); n];
    for (e, inst) in problem.instances.iter().enumerate() {
        let sources: Vec<Option<usize>> = if by_source {
            (0..n)
                .filter(|&s| problem.kept[s][e] > 0)
                .map(Some)
                .collect()
        } else {
            vec![None]
        };
        for s in sources {
            let want = match s {
                Some(s) => problem.kept[s][e],
                None => kept[e],
            };
            if want == 0 {
                continue;
            }
            let mut sum = Expression::from(0.0);
            for &r in inst {
                let x = vars.add(variable().integer().min(0).max(as_i32(want)?));
                sum += x;
                processed[r] += x;
                if let Some(s) = s {
                    if s != r {
                        moved[r] += x;
                        moved[s] += x;
                    }
                }
                cells.push((s, e, r, x));
            }
            constraints.push(constraint!(sum == as_i32(want)?));
        }
    }
    for r in 0..n {
        let base = as_i32(problem.base_load[r])?;
        let p = processed[r].clone();
        constraints.push(constraint!(
            base + c * p.clone() + m * moved[r].clone() <= peak
        ));
        if let Some(cap) = problem.rank_capacity.as_ref().map(|caps| caps[r]) {
            if cap < kept.iter().sum::<u64>() {
                constraints.push(constraint!(p <= as_i32(cap)?));
            }
        }
    }
    Ok(Model {
        vars,
        peak,
        constraints,
        cells,
    })
}

fn run<S>(solver: S, model: Model, limit_s: f64) -> Result<(Vec<f64>, bool), String>
where
    S: good_lp::solvers::Solver,
    S::Model: WithTimeLimit,
{
    let Model {
        vars,
        peak,
        constraints,
        cells,
    } = model;
    let mut m = vars.minimise(peak).using(solver).with_time_limit(limit_s);
    for c in constraints {
        m = m.with(c);
    }
    let sol = m.solve().map_err(|e| e.to_string())?;
    let optimal = matches!(sol.status(), SolutionStatus::Optimal);
    Ok((
        cells.iter().map(|cell| sol.value(cell.3)).collect(),
        optimal,
    ))
}

#[allow(unreachable_code)]
fn run_backend(model: Model, limit_s: f64) -> Result<(Vec<f64>, bool), String> {
    #[cfg(feature = "highs")]
    return run(good_lp::highs, model, limit_s);
    #[cfg(all(feature = "coin_cbc", not(feature = "highs")))]
    return run(good_lp::coin_cbc, model, limit_s);
    #[cfg(all(feature = "microlp", not(feature = "highs"), not(feature = "coin_cbc")))]
    return run(good_lp::microlp, model, limit_s);
    let _ = (model, limit_s);
    Err("no ILP backend compiled (enable microlp, highs or coin_cbc)".into())
}

/// Solves the ILP, or falls back to greedy (and from there to exact).
pub(crate) fn solve(
    problem: &Problem,
    cfg: &Config,
) -> Result<(Vec<Route>, Status), RedistributeError> {
    let attempt = build(problem, cfg).and_then(|model| {
        let cells: Vec<_> = model.cells.iter().map(|c| (c.0, c.1, c.2)).collect();
        run_backend(model, cfg.ilp_time_limit.as_secs_f64()).map(|(v, opt)| (cells, v, opt))
    });
    match attempt {
        Ok((cells, values, optimal)) => {
            let mut routes = Vec::new();
            let mut expert_flows: crate::ExpertFlows =
                problem.instances.iter().map(|i| vec![0; i.len()]).collect();
            for ((s, e, r), v) in cells.into_iter().zip(values) {
                let pairs = v.round().max(0.0) as u64;
                match s {
                    Some(source) => routes.push(Route {
                        source,
                        expert: e,
                        rank: r,
                        pairs,
                    }),
                    None => {
                        let i = problem.instances[e]
                            .iter()
                            .position(|&x| x == r)
                            .expect("invariant: cell rank is an instance of its expert");
                        expert_flows[e][i] = pairs;
                    }
                }
            }
            if cfg.load.network_per_pair == 0 {
                routes = crate::split_to_sources(problem, &expert_flows);
            }
            if crate::conservation_error(problem, &routes).is_none() {
                let status = if optimal {
                    Status::Done
                } else {
                    Status::TimeLimit
                };
                return Ok((routes, status));
            }
            fallback(
                problem,
                cfg,
                "ILP solution does not conserve pairs after rounding".into(),
            )
        }
        Err(reason) => fallback(problem, cfg, reason),
    }
}

fn fallback(
    problem: &Problem,
    cfg: &Config,
    reason: String,
) -> Result<(Vec<Route>, Status), RedistributeError> {
    {
        {
            let (flows, used) = match greedy::solve(problem, &cfg.load) {
                Some(f) => (f, Solver::Greedy),
                None => (
                    crate::exact::solve(problem, &cfg.load, &problem.kept_per_expert())?,
                    Solver::Exact,
                ),
            };
            Ok((
                crate::split_to_sources(problem, &flows),
                Status::FellBack { reason, used },
            ))
        }
    }
}
