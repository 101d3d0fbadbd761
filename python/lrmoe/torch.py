"""``lrmoe.torch``: the LRMoE MoE layer as a PyTorch module.

``MoE`` is an ``nn.Module`` holding a Qwen3-MoE block's weights (router and
experts as ``nn.Parameter``s, in ``nn.Linear``'s layouts) whose forward and
backward are one ``torch.autograd.Function`` over the Rust layer: the
forward computes every routed pair; the backward keeps, within the
controller's per-expert quotas, the pairs with the highest LRM scores
``g²·‖δ‖²·‖h‖²`` and multiplies only those (``mode="full"``: every pair,
the exact gradient).

**Where it runs.** CPU tensors run the Rust host executor (through NumPy;
bf16 parameters are computed in f32 and their gradients cast back). CUDA
tensors are not supported yet: the device executor's zero-copy path on
torch's stream is unfinished, and a CUDA input raises ``NotImplementedError``
rather than copying silently.

``replace_moe_blocks(model, **settings)`` swaps every
``Qwen3MoeSparseMoeBlock`` of a Hugging Face ``transformers`` Qwen3-MoE model
for an ``MoE`` carrying the same weights.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from . import Layer

__all__ = ["MoE", "replace_moe_blocks"]


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


class _MoECall(torch.autograd.Function):
    """One layer call: forward on the Rust layer, its LRMoE backward."""

    @staticmethod
    def forward(ctx, module, bias, x, router, gate_proj, up_proj, down_proj):
        for t in (x, router, gate_proj, up_proj, down_proj):
            if t.device.type != "cpu":
                raise NotImplementedError(
                    "lrmoe.torch.MoE: only CPU tensors are supported so far "
                    f"(got a {t.device.type} tensor); the CUDA path is unfinished"
                )
        # The Rust layer's layouts: router hidden × experts, gate/up
        # hidden × ffn and down ffn × hidden per expert.
        w = (
            np.ascontiguousarray(_np32(router).T),
            np.ascontiguousarray(_np32(gate_proj).transpose(0, 2, 1)),
            np.ascontiguousarray(_np32(up_proj).transpose(0, 2, 1)),
            np.ascontiguousarray(_np32(down_proj).transpose(0, 2, 1)),
        )
        y, saved = module._layer.forward(*w, _np32(x), bias)
        ctx.module, ctx.w, ctx.saved = module, w, saved
        ctx.dtypes = (x.dtype, router.dtype, gate_proj.dtype, up_proj.dtype, down_proj.dtype)
        module._after_forward(saved)
        return torch.from_numpy(y).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        dx, g, stats = ctx.module._layer.backward(*ctx.w, ctx.saved, _np32(dy))
        ctx.module.last_stats = stats
        xd, rd, gd, ud, dd = ctx.dtypes
        return (
            None,
            None,
            torch.from_numpy(dx).to(xd),
            torch.from_numpy(np.ascontiguousarray(g["router"].T)).to(rd),
            torch.from_numpy(np.ascontiguousarray(g["gate"].transpose(0, 2, 1))).to(gd),
            torch.from_numpy(np.ascontiguousarray(g["up"].transpose(0, 2, 1))).to(ud),
            torch.from_numpy(np.ascontiguousarray(g["down"].transpose(0, 2, 1))).to(dd),
        )


class MoE(nn.Module):
    """A Qwen3-MoE sparse MoE block with the LRMoE backward.

    Parameters (``nn.Linear`` layouts, experts stacked): ``router``
    ``[num_experts, hidden]``, ``gate_proj`` and ``up_proj``
    ``[num_experts, ffn, hidden]``, ``down_proj`` ``[num_experts, hidden, ffn]``.

    ``settings`` are ``lrmoe train``'s ``[moe]`` keys: ``mode`` (``"lrmoe"``
    default, ``"full"``, ``"capacity"``), ``buffer_fraction`` (share of the
    call's routed pairs the backward keeps, default 0.6),
    ``selection_rule`` (``"priority"`` default, ``"top_q"``, ``"random_q"``,
    ``"proportional"``), ``policy``, ``tile_trim``, ``aux_loss_coeff``,
    ``expert_bias_rate`` (DeepSeek-V3's balancing bias, updated after each
    training forward), … Unknown keys raise ``ValueError``.

    After a call: ``last_forward`` (``expert_load``, ``aux_loss``) and,
    after its backward, ``last_stats`` (``routed_pairs``, ``kept_pairs``,
    ``kept_fraction``, ``expert_load``, ``buffer_bytes``, ``kept``).
    ``forward`` returns the output, or ``(output, router_logits)`` with
    ``return_router_logits=True`` (the logits are computed by torch from
    the same router weight, for losses that use them).
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool = True,
        *,
        dtype: Optional[torch.dtype] = None,
        seed: int = 0,
        return_router_logits: bool = False,
        **settings: Any,
    ):
        super().__init__()
        h, f, e = hidden_size, moe_intermediate_size, num_experts
        self.hidden_size, self.ffn, self.num_experts = h, f, e
        self.top_k = num_experts_per_tok
        self.return_router_logits = return_router_logits
        rate = float(settings.get("expert_bias_rate", 0.0))
        self._layer = Layer(h, f, e, num_experts_per_tok, norm_topk_prob, seed, **settings)
        dtype = dtype or torch.float32
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype))
        self.gate_proj = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(e, f, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, f, dtype=dtype))
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float64))
        self.expert_bias_rate = rate
        self.last_forward: dict = {}
        self.last_stats: dict = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, per expert."""
        with torch.no_grad():
            for p, fan_in in (
                (self.router, self.hidden_size),
                (self.gate_proj, self.hidden_size),
                (self.up_proj, self.hidden_size),
                (self.down_proj, self.ffn),
            ):
                bound = 1.0 / fan_in**0.5
                p.uniform_(-bound, bound)

    def _after_forward(self, saved) -> None:
        load = saved.expert_load
        self.last_forward = {"expert_load": load, "aux_loss": saved.aux_loss}
        if self.training and self.expert_bias_rate > 0:
            # b_e += γ · sign(mean load − load_e), as `lrmoe train` does.
            step = np.sign(load.mean() - load) * self.expert_bias_rate
            self.expert_bias += torch.from_numpy(step)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        bias = None
        if self.expert_bias_rate > 0:
            bias = [float(b) for b in self.expert_bias]
        y = _MoECall.apply(
            self, bias, x, self.router, self.gate_proj, self.up_proj, self.down_proj
        )
        y = y.reshape(shape)
        if self.return_router_logits:
            return y, nn.functional.linear(x, self.router)
        return y

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, ffn={self.ffn}, experts={self.num_experts}, "
            f"top_k={self.top_k}, settings={self._layer.settings}"
        )


def _expert_weights(block: nn.Module):
    """``(gate_proj, up_proj, down_proj)`` stacked ``[E, F, H]``, ``[E, F, H]``,
    ``[E, H, F]`` from a Qwen3-MoE block's experts (a ``ModuleList`` of MLPs
    with ``gate_proj``/``up_proj``/``down_proj`` linears, or fused
    ``gate_up_proj`` ``[E, 2F, H]`` and ``down_proj`` ``[E, H, F]`` tensors)."""
    ex = block.experts
    if isinstance(ex, nn.ModuleList):
        g = torch.stack([m.gate_proj.weight for m in ex])
        u = torch.stack([m.up_proj.weight for m in ex])
        d = torch.stack([m.down_proj.weight for m in ex])
        return g, u, d
    gu = getattr(ex, "gate_up_proj", None)
    dn = getattr(ex, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor):
        f = gu.shape[1] // 2
        return gu[:, :f], gu[:, f:], dn
    raise ValueError(f"{type(block).__name__}: experts of an unknown layout")


def _returns_tuple(block: nn.Module, hidden: int, like: torch.Tensor) -> bool:
    """Whether ``block`` returns a tuple (hidden states, router logits)."""
    with torch.no_grad():
        out = block(torch.zeros(1, 1, hidden, dtype=like.dtype, device=like.device))
    return isinstance(out, tuple)


def replace_moe_blocks(model: nn.Module, **settings: Any) -> int:
    """Swaps every ``Qwen3MoeSparseMoeBlock`` in ``model`` for an ``MoE``
    with the same weights (copied) and the given ``[moe]`` settings.
    Returns how many blocks were replaced. The new block returns what the
    old one did — ``(hidden_states, router_logits)`` (``transformers`` 4.x)
    or the hidden states alone (5.x) — found by calling the old block once
    on one zero token; ``return_router_logits=`` in ``settings`` says it
    instead. Both layouts of the experts are read: a ``ModuleList`` of MLPs
    (4.x) and the fused ``gate_up_proj``/``down_proj`` tensors (5.x)."""
    settings = dict(settings)
    ret = settings.pop("return_router_logits", None)
    todo = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod).__name__ == "Qwen3MoeSparseMoeBlock"
    ]
    for name, block in todo:
        router = block.gate.weight
        g, u, d = _expert_weights(block)
        e, f, h = g.shape
        top_k = int(getattr(block, "top_k", getattr(block.gate, "top_k", 0)))
        norm = bool(getattr(block, "norm_topk_prob", getattr(block.gate, "norm_topk_prob", True)))
        returns_logits = ret if ret is not None else _returns_tuple(block, h, router)
        new = MoE(h, f, e, top_k, norm, dtype=router.dtype, return_router_logits=returns_logits,
                  **settings)
        with torch.no_grad():
            new.router.copy_(router)
            new.gate_proj.copy_(g)
            new.up_proj.copy_(u)
            new.down_proj.copy_(d)
        new.to(router.device)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return len(todo)
