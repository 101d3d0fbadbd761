//! The `lrmoe` command line. Every failure is one line on stderr and a
//! non-zero exit status.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use lrmoe::{quota, redistribute};

#[derive(Parser)]
#[command(
    name = "lrmoe",
    version,
    about = "LRMoE: plannable, compacted MoE backward"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan one layer call: quotas, replicas and the redistribution, as JSON.
    Plan {
        /// Planning problem (JSON; schema in docs/formats.md).
        #[arg(long)]
        input: PathBuf,
        /// Redistribution solver.
        #[arg(long, value_enum, default_value_t = SolverArg::Exact)]
        solver: SolverArg,
        /// Quota policy (overrides the problem file's).
        #[arg(long, value_enum)]
        policy: Option<PolicyArg>,
        /// Time limit of the ILP solver, milliseconds.
        #[arg(long, default_value_t = 2000)]
        ilp_time_limit_ms: u64,
        /// Write the plan here (atomically) instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum SolverArg {
    Exact,
    Ilp,
    Greedy,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyArg {
    Uniform,
    Maxmin,
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Plan {
            input,
            solver,
            policy,
            ilp_time_limit_ms,
            out,
        } => {
            let text = std::fs::read_to_string(&input)
                .with_context(|| format!("cannot read {}", input.display()))?;
            let problem = lrmoe::plan::parse_problem(&text)
                .with_context(|| format!("{}", input.display()))?;
            let opts = lrmoe::plan::Options {
                solver: match solver {
                    SolverArg::Exact => redistribute::Solver::Exact,
                    SolverArg::Ilp => redistribute::Solver::Ilp,
                    SolverArg::Greedy => redistribute::Solver::Greedy,
                },
                policy: policy.map(|p| match p {
                    PolicyArg::Uniform => quota::Policy::Uniform,
                    PolicyArg::Maxmin => quota::Policy::Maxmin,
                }),
                ilp_time_limit: Duration::from_millis(ilp_time_limit_ms),
            };
            let report = lrmoe::plan::run(&problem, &opts)
                .with_context(|| format!("{}", input.display()))?;
            let json = serde_json::to_string_pretty(&report)? + "\n";
            match out {
                Some(path) => lrmoe::fsutil::write_atomic(&path, json.as_bytes())
                    .with_context(|| format!("cannot write {}", path.display()))?,
                None => print!("{json}"),
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lrmoe: {e:#}");
            ExitCode::from(2)
        }
    }
}
