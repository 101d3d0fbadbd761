"""lrmoe.torch.MoE against a plain PyTorch Qwen3-MoE block (skipped where
PyTorch is absent)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lrmoe  # noqa: E402
import lrmoe.torch  # noqa: E402
from lrmoe.torch import MoE, replace_moe_blocks  # noqa: E402


class Qwen3MoeMLP(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The `transformers` 4.x block's forward, written out (plain PyTorch)."""

    def __init__(self, h, f, e, k, norm=True):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = e, k, norm
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList([Qwen3MoeMLP(h, f) for _ in range(e)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = self.gate(x)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(chosen == e)
            if tok.numel():
                out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, slot, None])
        return out.view(b, s, h), logits


class TinyModel(nn.Module):
    def __init__(self, vocab=50, h=16, f=24, e=6, k=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList([Qwen3MoeSparseMoeBlock(h, f, e, k) for _ in range(layers)])
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            y, _ = blk(x)
            x = x + y
        return self.head(x)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_close(a, b, what, rel=1e-4):
    err = (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())
    assert err <= rel, f"{what}: {err:.3g}"


def block_and_module(seed=0, dtype=torch.float32, **settings):
    torch.manual_seed(seed)
    blk = Qwen3MoeSparseMoeBlock(16, 24, 6, 2).to(dtype)
    holder = nn.Module()
    holder.blk = blk
    import copy

    swapped = copy.deepcopy(holder)
    assert replace_moe_blocks(swapped, **settings) == 1
    return blk, swapped.blk


def test_full_mode_matches_plain_pytorch_f32():
    blk, moe = block_and_module(mode="full")
    assert isinstance(moe, MoE)
    x = torch.randn(3, 20, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y_ref, logits_ref = blk(x)
    y, logits = moe(x2)
    assert_close(y, y_ref, "y")
    assert_close(logits, logits_ref, "router logits")
    dy = torch.randn_like(y)
    (y_ref * dy).sum().backward()
    (y * dy).sum().backward()
    assert_close(x2.grad, x.grad, "dx")
    assert_close(moe.router.grad, blk.gate.weight.grad, "d router")
    for e in range(6):
        for name, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            ref = getattr(blk.experts[e], name).weight.grad
            assert_close(getattr(moe, ours).grad[e].T, ref, f"d {name}[{e}]")
    assert moe.last_stats["kept_fraction"] == 1.0
    assert moe.last_stats["routed_pairs"] == 120


def test_bf16_parameters_within_bf16_tolerance():
    blk, moe = block_and_module(dtype=torch.bfloat16, mode="full")
    x = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    y_ref, _ = blk(x)
    y, _ = moe(x)
    assert y.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: both sides round differently.
    assert_close(y, y_ref, "y (bf16)", rel=3e-2)


def test_swapped_model_loss_and_gradients_match_the_original():
    torch.manual_seed(3)
    model = TinyModel()
    import copy

    swapped = copy.deepcopy(model)
    assert replace_moe_blocks(swapped, mode="full") == 2
    ids = torch.randint(0, 50, (4, 12))
    tgt = torch.randint(0, 50, (4, 12))
    for m in (model, swapped):
        F.cross_entropy(m(ids).reshape(-1, 50), tgt.reshape(-1)).backward()
    l0 = F.cross_entropy(model(ids).reshape(-1, 50), tgt.reshape(-1))
    l1 = F.cross_entropy(swapped(ids).reshape(-1, 50), tgt.reshape(-1))
    assert_close(l1, l0, "loss")
    g0, g1 = grads_of(model), grads_of(swapped)
    for name in ("embed.weight", "head.weight"):
        assert_close(g1[name], g0[name], name)
    for i in range(2):
        assert_close(g1[f"blocks.{i}.router"], g0[f"blocks.{i}.gate.weight"], f"router {i}")
        stacked = torch.stack([g0[f"blocks.{i}.experts.{e}.down_proj.weight"] for e in range(6)])
        assert_close(g1[f"blocks.{i}.w_down"].transpose(1, 2), stacked, f"down {i}")


def test_kept_set_equals_the_rust_layers_at_r_below_one():
    _, moe = block_and_module(mode="lrmoe", buffer_fraction=0.5, selection_rule="top_q",
                              return_router_logits=False)
    x = torch.randn(64, 16)
    dy = torch.randn(64, 16)
    y = moe(x.clone().requires_grad_(True))
    (y * dy).sum().backward()
    kept_module = moe.last_stats["kept"]
    layer = lrmoe.Layer(16, 24, 6, 2, True, mode="lrmoe", buffer_fraction=0.5,
                        selection_rule="top_q")
    w = (moe.router.detach().numpy().T, moe.w_gate.detach().numpy(),
         moe.w_up.detach().numpy(), moe.w_down.detach().numpy())
    _, saved = layer.forward(*w, x.numpy())
    _, _, stats = layer.backward(*w, saved, dy.numpy())
    np.testing.assert_array_equal(kept_module, stats["kept"])
    assert 0 < moe.last_stats["kept_pairs"] < 128


def test_expert_bias_moves_and_settings_are_checked():
    _, moe = block_and_module(mode="full", expert_bias_rate=0.01)
    moe.train()
    moe(torch.randn(2, 30, 16))
    load = moe.last_forward["expert_load"]
    expect = np.sign(load.mean() - load) * 0.01
    np.testing.assert_allclose(moe.expert_bias.numpy(), expect)
    with pytest.raises(ValueError, match="buffer_fraction"):
        MoE(16, 24, 6, 2, buffer_fraction=0.0)


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and lrmoe.torch.cuda_available()),
    reason="no CUDA device, or lrmoe built without its cuda feature",
)


def rel_norm(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def cuda_pair(seed=0, h=64, f=96, e=8, k=2, **settings):
    """A plain block in f32 on the GPU (the reference) and its swap in bf16.
    The router weights are scaled up so that no token's top-k choice sits
    on a near-tie that bf16 and f32 could break differently."""
    torch.manual_seed(seed)
    blk = Qwen3MoeSparseMoeBlock(h, f, e, k).cuda()
    with torch.no_grad():
        blk.gate.weight.mul_(8.0)
    holder = nn.Module()
    holder.blk = blk
    import copy

    swapped = copy.deepcopy(holder).to(torch.bfloat16)
    assert replace_moe_blocks(swapped, **settings) == 1
    return blk, swapped.blk


# bf16 tolerances: the device executor rounds its inputs, weights and
# every GEMM's output to bf16 (f32 accumulation); against an f32 reference
# of the same (bf16-valued) weights, outputs and gradients stay within 2%
# and 3% of the reference in norm.
@needs_cuda
def test_cuda_full_mode_matches_plain_pytorch():
    blk, moe = cuda_pair(mode="full")
    assert moe.w_gate.is_cuda and moe.w_gate.dtype == torch.bfloat16
    with torch.no_grad():
        # The reference runs on the very weights the module holds.
        blk.gate.weight.copy_(moe.router.float())
        for e in range(8):
            blk.experts[e].gate_proj.weight.copy_(moe.w_gate[e].T.float())
            blk.experts[e].up_proj.weight.copy_(moe.w_up[e].T.float())
            blk.experts[e].down_proj.weight.copy_(moe.w_down[e].T.float())
    x = torch.randn(4, 50, 64, device="cuda").bfloat16()
    xr = x.float().requires_grad_(True)
    xm = x.clone().requires_grad_(True)
    y_ref, _ = blk(xr)
    y, _ = moe(xm)
    assert y.dtype == torch.bfloat16 and y.is_cuda
    assert rel_norm(y, y_ref) < 2e-2
    dy = torch.randn_like(y_ref).bfloat16()
    (y_ref * dy.float()).sum().backward()
    (y.float() * dy.float()).sum().backward()
    assert rel_norm(xm.grad, xr.grad) < 3e-2
    assert rel_norm(moe.router.grad, blk.gate.weight.grad) < 3e-2
    for name, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
        ref = torch.stack([getattr(blk.experts[e], name).weight.grad.T for e in range(8)])
        assert rel_norm(getattr(moe, ours).grad, ref) < 3e-2, name
    assert moe.last_stats["kept_fraction"] == 1.0
    assert moe.last_stats["routed_pairs"] == 400


@needs_cuda
def test_cuda_exact_default_keeps_projections_and_equals_recomputing():
    """``mode="full"`` keeps the forward's projections by default (the
    rule is the library's, unit-tested in Rust); kept or recomputed, the
    backward gives the same bits (same GEMMs on the same rows), with every
    pair kept either way."""
    _, default = cuda_pair(seed=3, mode="full")
    _, kept = cuda_pair(seed=3, mode="full", keep_projections=True)
    _, redo = cuda_pair(seed=3, mode="full", keep_projections=False)
    x = torch.randn(4, 50, 64, device="cuda").bfloat16()
    dy = torch.randn(4, 50, 64, device="cuda").bfloat16()
    outs = []
    for m in (default, kept, redo):
        xm = x.clone().requires_grad_(True)
        y, _ = m(xm)
        y.backward(dy)
        outs.append([y, xm.grad] + [p.grad for p in (m.router, m.w_gate, m.w_up, m.w_down)])
        assert m.last_stats["kept_fraction"] == 1.0
    for ours in outs[1:]:
        for a, b in zip(outs[0], ours):
            assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("settings", [dict(mode="full"),
                                      dict(mode="lrmoe", buffer_fraction=0.5)])
def test_cuda_second_backward_under_retain_graph_equals_the_first(settings):
    """The backward releases the forward's rows once it has gathered the
    kept ones (as autograd frees saved tensors); a second backward of the
    same graph (``retain_graph=True``) gathers them from the input and
    gives the same bits."""
    _, moe = cuda_pair(seed=5, **settings)
    xm = torch.randn(4, 50, 64, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(4, 50, 64, device="cuda").bfloat16()
    y, _ = moe(xm)
    grads = []
    for _ in range(2):
        y.backward(dy, retain_graph=True)
        params = (xm, moe.router, moe.w_gate, moe.w_up, moe.w_down)
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_cuda
def test_cuda_keeps_what_the_cpu_path_keeps_at_r_below_one():
    settings = dict(mode="lrmoe", buffer_fraction=0.5, selection_rule="top_q", tile_trim=0.0)
    _, moe = cuda_pair(seed=1, **settings)
    x = torch.randn(256, 64, device="cuda").bfloat16()
    dy = torch.randn(256, 64, device="cuda").bfloat16()
    y, _ = moe(x.clone().requires_grad_(True))
    (y.float() * dy.float()).sum().backward()
    on_gpu = moe.last_stats
    cpu = MoE(64, 96, 8, 2, True, return_router_logits=True, **settings)
    with torch.no_grad():
        for a, b in zip(cpu.parameters(), moe.parameters()):
            a.copy_(b.float().cpu())
    yc, _ = cpu(x.cpu().float().requires_grad_(True))
    (yc * dy.cpu().float()).sum().backward()
    assert 0 < on_gpu["kept_pairs"] < 512
    assert on_gpu["kept_pairs"] == cpu.last_stats["kept_pairs"]
    np.testing.assert_array_equal(on_gpu["expert_load"], cpu.last_stats["expert_load"])


@needs_cuda
def test_cuda_on_a_side_stream_and_f32_parameters():
    blk, moe = cuda_pair(mode="full")
    moe = moe.float()
    x = torch.randn(2, 40, 64, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y, _ = moe(x)
        y.sum().backward()
    torch.cuda.synchronize()
    y0, _ = moe(x)
    assert y.dtype == torch.float32 and moe.w_gate.grad.dtype == torch.float32
    assert torch.equal(y, y0)


@needs_cuda
def test_cuda_bad_input_gets_a_clear_error():
    _, moe = cuda_pair(mode="full")
    with pytest.raises(ValueError, match="w_gate has shape"):
        bad = MoE(64, 96, 8, 2, dtype=torch.bfloat16, device="cuda", mode="full")
        bad.w_gate = nn.Parameter(torch.zeros(8, 64, 95, device="cuda", dtype=torch.bfloat16))
        bad(torch.randn(3, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="width"):
        moe(torch.randn(3, 32, device="cuda", dtype=torch.bfloat16))
    # A NaN reaches the scores: the backward refuses it (the forward's
    # output carries it, as any layer's would).
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    y, _ = moe(x.requires_grad_())
    with pytest.raises(Exception, match="non-finite"):
        y.float().sum().backward()
    with pytest.raises(ValueError, match="multiples of 8"):
        MoE(60, 96, 8, 2, device="cuda")(torch.randn(2, 60, device="cuda"))
    with pytest.raises(ValueError, match="host executor"):
        MoE(64, 96, 8, 2, device="cuda", selection_rule="random_q")(
            torch.randn(2, 64, device="cuda"))
    # No tokens: an empty output and zero gradients, no call.
    x = torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, _ = moe(x)
    y.sum().backward()
    assert y.shape == (0, 64) and moe.w_gate.grad.abs().sum().item() == 0


def qwen3_moe_config(transformers, hidden, ffn, head_dim):
    """A two-layer, eight-expert, top-2 Qwen3-MoE config of the given widths."""
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=64,
    )


def test_transformers_qwen3_moe_swap_matches():
    transformers = pytest.importorskip("transformers")
    cfg = qwen3_moe_config(transformers, hidden=32, ffn=24, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    import copy

    swapped = copy.deepcopy(model)
    assert replace_moe_blocks(swapped, mode="full") == 2
    ids = torch.randint(0, 64, (2, 16))
    out0 = model(input_ids=ids, labels=ids)
    out1 = swapped(input_ids=ids, labels=ids)
    assert_close(out1.loss, out0.loss, "loss")
    out0.loss.backward()
    out1.loss.backward()
    g0 = model.model.embed_tokens.weight.grad
    g1 = swapped.model.embed_tokens.weight.grad
    assert_close(g1, g0, "embedding gradient")


@needs_cuda
def test_transformers_qwen3_moe_swap_matches_on_cuda():
    transformers = pytest.importorskip("transformers")
    cfg = qwen3_moe_config(transformers, hidden=64, ffn=32, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).cuda().bfloat16()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(50.0)  # decisive routing: no bf16 near-ties
    import copy

    swapped = copy.deepcopy(model)
    assert replace_moe_blocks(swapped, mode="full") == 2
    assert isinstance(swapped.model.layers[0].mlp, MoE)
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    out0 = model(input_ids=ids, labels=ids)
    out1 = swapped(input_ids=ids, labels=ids)
    assert abs(out1.loss.item() - out0.loss.item()) <= 2e-2 * abs(out0.loss.item())
    out0.loss.backward()
    out1.loss.backward()
    g0 = model.model.embed_tokens.weight.grad
    g1 = swapped.model.embed_tokens.weight.grad
    assert rel_norm(g1, g0) < 5e-2
