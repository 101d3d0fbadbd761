"""``lrmoe.torch``: the LRMoE MoE layer as a PyTorch module.

``MoE`` is an ``nn.Module`` holding a Qwen3-MoE block's weights (the router
in ``nn.Linear``'s layout, the experts stacked in the layout a grouped GEMM
``x @ W`` reads) whose forward and backward are one
``torch.autograd.Function`` over the Rust layer: the forward computes every
routed pair; the backward keeps, within the controller's per-expert quotas,
the pairs with the highest LRM scores ``g²·‖δ‖²·‖h‖²`` and multiplies only
those (``mode="full"``: every pair, the exact gradient).

**Where it runs.** CPU tensors run the Rust host executor (through NumPy;
bf16 parameters are computed in f32 and their gradients cast back). CUDA
tensors run the device executor on their GPU when the package was built
with its ``cuda`` feature (``lrmoe.cuda_available()``), with no copy: the
tensors' memory is read in place and the results come back as tensors
(DLPack) that own the executor's buffers. The device executor computes in
bf16 (f32 accumulation); bf16 parameters are used as they are, others are
cast for the call and their gradients cast back. The call is ordered after
the work queued on torch's current stream and before what follows it
(CUDA events; the host does not wait). The executor allocates from the
device's stream-ordered memory pool — the pool torch uses under
``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``, where
``torch.cuda.max_memory_allocated`` counts the layer's buffers; under
torch's default caching allocator it does not see them.

``replace_moe_blocks(model, **settings)`` swaps every
``Qwen3MoeSparseMoeBlock`` of a Hugging Face ``transformers`` Qwen3-MoE model
for an ``MoE`` carrying the same weights.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from . import Layer, _lrmoe

__all__ = ["MoE", "replace_moe_blocks", "cuda_available"]


def cuda_available() -> bool:
    """Whether this build of the package has the CUDA path."""
    return bool(getattr(_lrmoe, "cuda", False))


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _cpu_forward(ctx, module, bias, x, weights):
    w = (np.ascontiguousarray(_np32(weights[0]).T),) + tuple(_np32(t) for t in weights[1:])
    y, saved = module._layer.forward(*w, _np32(x), bias)
    ctx.w, ctx.saved = w, saved
    module._after_forward(saved.expert_load, saved.aux_loss)
    return torch.from_numpy(y).to(x.dtype)


def _cpu_backward(ctx, dy):
    dx, g, stats = ctx.module._layer.backward(*ctx.w, ctx.saved, _np32(dy))
    ctx.module.last_stats = stats
    return (
        torch.from_numpy(dx),
        torch.from_numpy(np.ascontiguousarray(g["router"].T)),
        torch.from_numpy(g["gate"]),
        torch.from_numpy(g["up"]),
        torch.from_numpy(g["down"]),
    )


_WEIGHT_NAMES = ("router", "w_gate", "w_up", "w_down")


def _check_call(module, x, weights):
    """The shapes the native layer reads (it trusts the addresses it gets)
    and one device for all: one pass, as cheap as Python allows (it runs
    before the call's first kernel)."""
    h, f, e = module.hidden_size, module.ffn, module.num_experts
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"lrmoe.torch.MoE: input rows of width {x.shape[-1]}, expected {h}")
    dev = x.device
    for name, shape, t in zip(_WEIGHT_NAMES, ((e, h), (e, h, f), (e, h, f), (e, f, h)), weights):
        if t.shape != shape:
            raise ValueError(f"lrmoe.torch.MoE: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != dev:
            raise ValueError(f"lrmoe.torch.MoE: {name} is on {t.device}, the input on {dev}")


def _dev_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous bf16 tensor, with no call where it already is
    one (inside the autograd function: no graph to detach from)."""
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return t if t.is_contiguous() else t.contiguous()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(dev: torch.device) -> int:
    """The address of torch's current stream on ``dev`` (the private
    accessor Triton uses where this torch has it: no Stream object)."""
    if _raw_stream is not None:
        return _raw_stream(dev.index)
    return torch.cuda.current_stream(dev).cuda_stream


def _on_device(dev: torch.device, call):
    """``call()`` with ``dev`` current (the native call binds the device's
    context to the thread, which torch reads as its current device); no
    guard where it already is, the common case."""
    if dev.index == torch.cuda.current_device():
        return call()
    with torch.cuda.device(dev):
        return call()


def _cuda_forward(ctx, module, bias, x, weights):
    dev = x.device
    _check_call(module, x, weights)
    ctx.empty = x.shape[0] == 0
    if ctx.empty:
        # No tokens: nothing to route, nothing to keep.
        ctx.shapes = [t.shape for t in weights]
        module._after_forward(np.zeros(module.num_experts, dtype=np.int64), 0.0)
        return x.new_zeros(x.shape)
    layer = module._device_layer(dev)
    # The device layer's layouts: router hidden × experts; the experts as
    # stored. bf16 tensors are used in place.
    w16 = (_dev_bf16(weights[0].t()),) + tuple(_dev_bf16(t) for t in weights[1:])
    x16 = _dev_bf16(x)
    ptrs = tuple(t.data_ptr() for t in w16)
    stream = _stream(dev)
    y, saved = _on_device(
        dev, lambda: layer.forward(ptrs, x16.data_ptr(), x16.shape[0], stream, bias))
    # The weights stay referenced until the backward has read them.
    ctx.w16, ctx.saved, ctx.stream_dev = w16, saved, dev
    module._after_forward(np.asarray(saved.expert_load(), dtype=np.int64), saved.aux_loss())
    y = torch.from_dlpack(y)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _cuda_backward(ctx, dy):
    if ctx.empty:
        ctx.module.last_stats = {"routed_pairs": 0, "kept_pairs": 0, "kept_fraction": 1.0,
                                 "expert_load": np.zeros(ctx.module.num_experts, dtype=np.int64)}
        return (dy.new_zeros(dy.shape),) + tuple(
            torch.zeros(s, device=dy.device) for s in ctx.shapes)
    dev = ctx.stream_dev
    layer = ctx.module._device_layer(dev)
    dy16 = _dev_bf16(dy)
    ptrs = tuple(t.data_ptr() for t in ctx.w16)
    stream = _stream(dev)
    parts, stats = _on_device(
        dev, lambda: layer.backward(ptrs, ctx.saved, dy16.data_ptr(), stream))
    stats = json.loads(stats)
    stats["expert_load"] = np.asarray(stats["expert_load"], dtype=np.int64)
    ctx.module.last_stats = stats
    dx, dr, dg, du, dd = (torch.from_dlpack(p) for p in parts)
    # The router's gradient in the parameter's layout (one kernel: cast and
    # transpose), so that autograd's accumulation does not copy it again.
    dr = dr.t().to(ctx.dtypes[1], memory_format=torch.contiguous_format)
    return dx, dr, dg, du, dd


class _MoECall(torch.autograd.Function):
    """One layer call: forward on the Rust layer, its LRMoE backward."""

    @staticmethod
    def forward(ctx, module, bias, x, router, w_gate, w_up, w_down):
        weights = (router, w_gate, w_up, w_down)
        ctx.module = module
        ctx.dtypes = tuple(t.dtype for t in (x,) + weights)
        if x.device.type == "cuda":
            if not cuda_available():
                raise NotImplementedError(
                    "lrmoe.torch.MoE: this build of lrmoe has no CUDA path; reinstall with "
                    "`pip install ./python --config-settings=build-args=\"--features cuda\"`"
                )
            ctx.cuda = True
            return _cuda_forward(ctx, module, bias, x, weights)
        for name, t in zip(_WEIGHT_NAMES, weights):
            if t.device.type != "cpu":
                raise ValueError(f"lrmoe.torch.MoE: {name} is on {t.device}, the input on the CPU")
        ctx.cuda = False
        return _cpu_forward(ctx, module, bias, x, weights)

    @staticmethod
    def backward(ctx, dy):
        grads = _cuda_backward(ctx, dy) if ctx.cuda else _cpu_backward(ctx, dy)
        return (None, None) + tuple(
            g if g.dtype == d else g.to(d) for g, d in zip(grads, ctx.dtypes))


class MoE(nn.Module):
    """A Qwen3-MoE sparse MoE block with the LRMoE backward.

    Parameters: ``router`` ``[num_experts, hidden]`` (``nn.Linear``'s
    layout, logits ``x @ router.T``); the experts stacked in the layout of
    ``x @ W``: ``w_gate`` and ``w_up`` ``[num_experts, hidden, ffn]``,
    ``w_down`` ``[num_experts, ffn, hidden]`` (``nn.Linear``'s
    ``gate_proj.weight`` of expert ``e`` is ``w_gate[e].T``).

    ``settings`` are ``lrmoe train``'s ``[moe]`` keys: ``mode`` (``"lrmoe"``
    default, ``"full"``, ``"capacity"``), ``buffer_fraction`` (share of the
    call's routed pairs the backward keeps, default 0.6),
    ``selection_rule`` (``"priority"`` default, ``"top_q"``, ``"random_q"``,
    ``"proportional"``; CUDA: ``"priority"`` and ``"top_q"``), ``policy``,
    ``tile_trim``, ``aux_loss_coeff``, ``expert_bias_rate``
    (DeepSeek-V3's balancing bias, updated after each training forward),
    ``keep_projections`` (CUDA: keep the forward's ``x·W_gate``, ``x·W_up``
    for the backward instead of recomputing them: two grouped GEMMs fewer
    for ``2 · ffn`` bf16 values a routed pair, what PyTorch's block keeps
    for its autograd; default ``True`` under ``mode="full"``, whose exact
    backward reads every pair's projections, and ``False`` otherwise, where
    the backward recomputes only the rows it keeps), …
    Unknown keys raise ``ValueError``.

    After a call: ``last_forward`` (``expert_load``, ``aux_loss``) and,
    after its backward, ``last_stats`` (``routed_pairs``, ``kept_pairs``,
    ``kept_fraction``, ``expert_load``; CPU also ``buffer_bytes`` and the
    ``kept`` flag per pair). ``forward`` returns the output, or
    ``(output, router_logits)`` with ``return_router_logits=True`` (the
    logits are computed by torch from the same router weight, for losses
    that use them).
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
        device: Any = None,
        seed: int = 0,
        return_router_logits: bool = False,
        **settings: Any,
    ):
        super().__init__()
        h, f, e = hidden_size, moe_intermediate_size, num_experts
        self.hidden_size, self.ffn, self.num_experts = h, f, e
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = bool(norm_topk_prob)
        self.seed = int(seed)
        self.return_router_logits = return_router_logits
        rate = float(settings.get("expert_bias_rate", 0.0))
        self._layer = Layer(h, f, e, num_experts_per_tok, norm_topk_prob, seed, **settings)
        self._device_layers: dict = {}
        kw = dict(dtype=dtype or torch.float32, device=device)
        self.router = nn.Parameter(torch.empty(e, h, **kw))
        self.w_gate = nn.Parameter(torch.empty(e, h, f, **kw))
        self.w_up = nn.Parameter(torch.empty(e, h, f, **kw))
        self.w_down = nn.Parameter(torch.empty(e, f, h, **kw))
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float64, device=device))
        self.expert_bias_rate = rate
        self.last_forward: dict = {}
        self.last_stats: dict = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, per expert."""
        with torch.no_grad():
            for p, fan_in in (
                (self.router, self.hidden_size),
                (self.w_gate, self.hidden_size),
                (self.w_up, self.hidden_size),
                (self.w_down, self.ffn),
            ):
                bound = 1.0 / fan_in**0.5
                p.uniform_(-bound, bound)

    def _device_layer(self, dev: torch.device):
        """The device executor of CUDA device ``dev`` (made on first use)."""
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        got = self._device_layers.get(idx)
        if got is None:
            got = _lrmoe.DeviceLayer(
                self.hidden_size, self.ffn, self.num_experts, self.top_k, self.norm_topk_prob,
                json.dumps(self._layer.settings), self.seed, idx,
            )
            self._device_layers[idx] = got
        return got

    def _after_forward(self, load: np.ndarray, aux_loss: float) -> None:
        self.last_forward = {"expert_load": load, "aux_loss": aux_loss}
        if self.training and self.expert_bias_rate > 0:
            # b_e += γ · sign(mean load − load_e), as `lrmoe train` does.
            step = np.sign(load.mean() - load) * self.expert_bias_rate
            self.expert_bias += torch.from_numpy(step).to(self.expert_bias.device)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(
                f"lrmoe.torch.MoE: input rows of width {shape[-1]}, expected {self.hidden_size}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        bias = None
        if self.expert_bias_rate > 0:
            bias = [float(b) for b in self.expert_bias]
        y = _MoECall.apply(self, bias, x, self.router, self.w_gate, self.w_up, self.w_down)
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
        new = MoE(h, f, e, top_k, norm, dtype=router.dtype, device=router.device,
                  return_router_logits=returns_logits, **settings)
        with torch.no_grad():
            # nn.Linear's [out, in] per expert to the x @ W layout.
            new.router.copy_(router)
            new.w_gate.copy_(g.transpose(1, 2))
            new.w_up.copy_(u.transpose(1, 2))
            new.w_down.copy_(d.transpose(1, 2))
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return len(todo)
