"""lrmoe.plan against the `lrmoe plan` command on the same problems."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import lrmoe

ROOT = Path(__file__).resolve().parents[2]


def cli():
    """The `lrmoe` command: $LRMOE_BIN, a build in target/, or cargo run."""
    if os.environ.get("LRMOE_BIN"):
        return [os.environ["LRMOE_BIN"]]
    for profile in ("release", "debug"):
        exe = ROOT / "target" / profile / "lrmoe"
        if exe.exists():
            return [str(exe)]
    if shutil.which("cargo"):
        return ["cargo", "run", "-q", "--release", "-p", "lrmoe", "--"]
    pytest.skip("no lrmoe command (set LRMOE_BIN) and no cargo")


def cli_plan(problem: dict, tmp_path, *flags):
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(problem))
    run = subprocess.run(
        cli() + ["plan", "--input", str(path), *flags], capture_output=True, text=True, cwd=ROOT
    )
    return run


def comparable(report: dict) -> dict:
    """The report as plain JSON values, without the solve time."""
    out = json.loads(json.dumps(report, default=lambda a: a.tolist()))
    out.pop("solve_micros")
    return out


@pytest.mark.parametrize("example", ["plan-routed.json", "plan-kept.json"])
def test_examples_plan_as_the_command_does(example, tmp_path):
    problem = json.loads((ROOT / "examples" / example).read_text())
    run = cli_plan(problem, tmp_path)
    assert run.returncode == 0, run.stderr
    args = dict(problem)
    args.pop("n_ranks")
    ours = lrmoe.plan(**args)
    assert comparable(ours) == comparable(json.loads(run.stdout))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("solver,policy", [("exact", None), ("greedy", "uniform"), ("exact", "maxmin")])
def test_random_problems_plan_as_the_command_does(seed, solver, policy, tmp_path):
    rng = np.random.default_rng(seed)
    ranks, experts = 4, 16
    counts = rng.zipf(1.6, size=(ranks, experts)).clip(max=400) * 8
    owner = np.repeat(np.arange(ranks), experts // ranks)
    cost = {
        "act_row_bytes": 4096, "grad_row_bytes": 4096,
        "expert_weight_bytes": 1 << 20, "expert_grad_bytes": 1 << 20,
        "flops_per_pair": 1e6, "link_bytes_per_s": 4e11, "flops_per_s": 1e15,
    }
    memory = (experts // ranks + 1) * (2 << 20) + int(counts.sum() / ranks * 0.6) * 8192
    budgets = np.array([[memory, 1 << 62]] * ranks)
    controller = {"replica_slots_per_rank": 1, "replica_memory_fraction": 0.5}
    ours = lrmoe.plan(counts, owner, budgets, cost_model=cost, controller=controller,
                      solver=solver, policy=policy)
    problem = lrmoe.plan_problem(counts, owner, budgets, cost_model=cost, controller=controller)
    flags = ["--solver", solver] + (["--policy", policy] if policy else [])
    run = cli_plan(problem, tmp_path, *flags)
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout)
    assert comparable(ours) == comparable(theirs)
    q = ours["controller"]["quotas_per_source"]
    assert isinstance(q, np.ndarray) and q.shape == (ranks, experts)
    assert (q <= counts).all()


def test_errors_carry_the_commands_line(tmp_path):
    problem = json.loads((ROOT / "examples" / "plan-routed.json").read_text())
    problem["budgets"][1].pop("network_bytes")
    run = cli_plan(problem, tmp_path)
    assert run.returncode != 0
    with pytest.raises(ValueError) as err:
        lrmoe._lrmoe.plan_json(json.dumps(problem))
    message = str(err.value)
    # The same one line (its position is the JSON text's: one line here).
    assert message.startswith("budgets[1]: missing field `network_bytes` at line 1")
    assert "budgets[1]: missing field `network_bytes`" in run.stderr
    with pytest.raises(ValueError, match="solver: unknown 'fast'"):
        lrmoe.plan([[1, 2]], [0, 0], kept_counts=None, solver="fast")
    with pytest.raises(ValueError, match="exactly one of routed_counts and kept_counts"):
        lrmoe.plan(None, [0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        lrmoe.plan(kept_counts=[[1, -2]], placement=[0, 0])
    with pytest.raises(ValueError, match="n_ranks"):
        lrmoe.plan(kept_counts=np.zeros((0, 2), dtype=int), placement=[0, 0])
