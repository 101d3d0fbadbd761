"""lrmoe for Python: the LRMoE planner on NumPy arrays and the MoE layer.

* :func:`plan` — one layer call's plan (quotas, replicas, redistribution),
  the same plan ``lrmoe plan`` gives for the same problem.
* :class:`Layer` — the MoE layer on one rank (the Rust host executor) on
  NumPy ``float32`` arrays: forward, and the LRMoE backward (LRM scores,
  selection within the controller's quotas, compacted expert GEMMs).
* :mod:`lrmoe.torch` — ``lrmoe.torch.MoE``, an ``nn.Module`` over
  :class:`Layer`, and ``replace_moe_blocks`` for Hugging Face Qwen3-MoE
  models (needs PyTorch).

Errors from the library are ``ValueError`` carrying its one-line message.
Layouts follow the Rust layer: router ``hidden × n_experts``; per expert
``gate``/``up`` ``hidden × ffn`` and ``down`` ``ffn × hidden``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import _lrmoe

__version__ = _lrmoe.__version__

__all__ = ["plan", "plan_problem", "Layer", "LayerSaved", "__version__"]


def _int_matrix(name: str, a: Any) -> list:
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (ranks × experts), got {arr.ndim}-D")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name}: counts must be whole numbers")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name}: counts must be non-negative")
    return [[int(v) for v in row] for row in arr]


def plan_problem(
    routed_counts: Any = None,
    placement: Any = None,
    budgets: Any = None,
    *,
    cost_model: Optional[Mapping[str, float]] = None,
    kept_counts: Any = None,
    controller: Optional[Mapping[str, Any]] = None,
    base_load: Any = None,
    load_model: Optional[Mapping[str, float]] = None,
    n_ranks: Optional[int] = None,
) -> dict:
    """The ``lrmoe plan`` problem (a JSON-ready dict) from arrays.

    ``placement`` is the owner rank of each expert (array-like) or a dict
    ``{"owner": [...], "replicas": [[...], ...]}``. ``budgets`` is one
    ``{"memory_bytes", "network_bytes"}`` per rank, or an ``(n_ranks, 2)``
    array of them. ``n_ranks`` defaults to the counts' rows.
    """
    if placement is None:
        raise ValueError("placement: required (the owner rank of each expert)")
    if isinstance(placement, Mapping):
        pl = {"owner": [int(o) for o in placement["owner"]]}
        if placement.get("replicas") is not None:
            pl["replicas"] = [[int(r) for r in rs] for rs in placement["replicas"]]
        extra = set(placement) - {"owner", "replicas"}
        if extra:
            raise ValueError(f"placement: unknown field {sorted(extra)[0]}")
    else:
        pl = {"owner": [int(o) for o in np.asarray(placement).reshape(-1)]}
    problem: dict = {"placement": pl}
    if (routed_counts is None) == (kept_counts is None):
        raise ValueError("give exactly one of routed_counts and kept_counts")
    counts_name = "routed_counts" if routed_counts is not None else "kept_counts"
    counts = _int_matrix(counts_name, routed_counts if routed_counts is not None else kept_counts)
    problem[counts_name] = counts
    problem["n_ranks"] = int(n_ranks) if n_ranks is not None else len(counts)
    if budgets is not None:
        if isinstance(budgets, np.ndarray) or (
            len(budgets) and not isinstance(budgets[0], Mapping)
        ):
            b = np.asarray(budgets)
            if b.ndim != 2 or b.shape[1] != 2:
                raise ValueError("budgets: expected (n_ranks, 2) [memory_bytes, network_bytes]")
            problem["budgets"] = [
                {"memory_bytes": int(m), "network_bytes": int(n)} for m, n in b
            ]
        else:
            problem["budgets"] = [dict(x) for x in budgets]
    if cost_model is not None:
        problem["cost_model"] = dict(cost_model)
    if controller is not None:
        problem["controller"] = dict(controller)
    if base_load is not None:
        problem["base_load"] = [int(v) for v in np.asarray(base_load).reshape(-1)]
    if load_model is not None:
        problem["load_model"] = dict(load_model)
    return problem


def _arrays(report: dict) -> dict:
    """The report with its count tables as NumPy arrays."""
    c = report.get("controller")
    if c is not None:
        c["quotas_per_expert"] = np.asarray(c["quotas_per_expert"], dtype=np.int64)
        c["quotas_per_source"] = np.asarray(c["quotas_per_source"], dtype=np.int64).reshape(
            len(c["quotas_per_source"]), -1
        )
        c["replicas_added"] = np.asarray(c["replicas_added"], dtype=np.int64).reshape(-1, 2)
    return report


def plan(
    routed_counts: Any = None,
    placement: Any = None,
    budgets: Any = None,
    *,
    solver: str = "exact",
    policy: Optional[str] = None,
    ilp_time_limit_ms: int = 2000,
    **problem: Any,
) -> dict:
    """Plans one layer call — the plan ``lrmoe plan`` gives for the same problem.

    ``routed_counts`` is ``[n_ranks][n_experts]`` routed pairs per source
    and expert (the controller runs; ``cost_model`` and ``budgets``
    required), or pass ``kept_counts=`` to skip the controller. Other
    problem fields (``cost_model``, ``controller``, ``base_load``,
    ``load_model``, ``n_ranks``) are keywords; see :func:`plan_problem` and
    ``docs/formats.md``. ``solver``: ``exact``, ``ilp`` or ``greedy``;
    ``policy`` overrides the problem's (``uniform``, ``maxmin``).

    Returns the report as a dict (``controller`` with
    ``quotas_per_expert`` and ``quotas_per_source`` as NumPy arrays,
    ``instances``, ``assignment``, ``ranks``, ``peak_load``, …). A problem
    the library refuses raises ``ValueError`` with its one-line error.
    """
    p = plan_problem(routed_counts, placement, budgets, **problem)
    text = _lrmoe.plan_json(json.dumps(p), solver, policy, int(ilp_time_limit_ms))
    return _arrays(json.loads(text))


def _f32(name: str, a: Any, shape: Sequence[int]) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr


class LayerSaved:
    """The forward's state for :meth:`Layer.backward` (opaque)."""

    def __init__(self, native: Any, tokens: int):
        self._native = native
        self.tokens = tokens
        #: Pairs per expert of this call that reached it (a capacity
        #: factor's dropped pairs not counted).
        self.expert_load = np.asarray(native.expert_load(), dtype=np.int64)
        #: The call's auxiliary balancing loss (0 when off).
        self.aux_loss = float(native.aux_loss())


class Layer:
    """The MoE layer on one rank (the Rust host executor), on NumPy arrays.

    ``settings`` are ``[moe]`` keys of ``lrmoe train``'s TOML (``mode``:
    ``full`` / ``lrmoe`` / ``capacity`` / ``replicate``; ``buffer_fraction``,
    ``selection_rule``, ``policy``, ``aux_loss_coeff``, ``tile_trim``, …);
    unknown keys and values out of range raise ``ValueError``.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        n_experts: int,
        top_k: int,
        renormalize: bool = True,
        seed: int = 0,
        **settings: Any,
    ):
        self.hidden, self.ffn, self.n_experts, self.top_k = hidden, ffn, n_experts, top_k
        self.settings = dict(settings)
        self._native = _lrmoe.Layer(
            hidden, ffn, n_experts, top_k, bool(renormalize), json.dumps(self.settings), int(seed)
        )

    def _weights(self, router, gate, up, down):
        h, f, e = self.hidden, self.ffn, self.n_experts
        return (
            _f32("router", router, (h, e)).tobytes(),
            _f32("gate", gate, (e, h, f)).tobytes(),
            _f32("up", up, (e, h, f)).tobytes(),
            _f32("down", down, (e, f, h)).tobytes(),
        )

    def forward(self, router, gate, up, down, x, expert_bias=None):
        """``y`` (``tokens × hidden``) and the state for :meth:`backward`."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: shape {x.shape}, expected (tokens, {self.hidden})")
        w = self._weights(router, gate, up, down)
        bias = None if expert_bias is None else [float(b) for b in np.asarray(expert_bias).reshape(-1)]
        y, native = self._native.forward(*w, np.ascontiguousarray(x).tobytes(), bias)
        saved = LayerSaved(native, x.shape[0])
        return np.frombuffer(y, dtype="<f4").reshape(x.shape).copy(), saved

    def backward(self, router, gate, up, down, saved: LayerSaved, dy):
        """``(dx, grads, stats)``: the input gradient, the weights' gradients
        (``router``, ``gate``, ``up``, ``down``) and the call's statistics
        (``routed_pairs``, ``kept_pairs``, ``kept_fraction``,
        ``expert_load``, ``buffer_bytes``, ``kept`` per pair)."""
        h, f, e = self.hidden, self.ffn, self.n_experts
        dy = _f32("dy", dy, (saved.tokens, h))
        w = self._weights(router, gate, up, down)
        parts, stats = self._native.backward(w, saved._native, dy.tobytes())
        dx, dr, dg, du, dd = (np.frombuffer(p, dtype="<f4").copy() for p in parts)
        grads = {
            "router": dr.reshape(h, e),
            "gate": dg.reshape(e, h, f),
            "up": du.reshape(e, h, f),
            "down": dd.reshape(e, f, h),
        }
        stats = json.loads(stats)
        stats["expert_load"] = np.asarray(stats["expert_load"], dtype=np.int64)
        stats["kept"] = np.asarray(stats["kept"], dtype=bool)
        return dx.reshape(saved.tokens, h), grads, stats
