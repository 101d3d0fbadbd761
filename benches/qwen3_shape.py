"""The Qwen3-MoE shape the PyTorch peers build (torch_qwen3_moe.py,
torch_parts.py), from a Hugging Face config.json: one definition of which
fields they read and their defaults. No torch import: testable anywhere.
"""
import json
from types import SimpleNamespace


def load(path, layers=None):
    """The shape in `path`'s config.json, `layers` of its layers (all when
    None): L, D, H, KV, DH, E, K, FF, V, EPS, THETA."""
    c = json.load(open(path))
    d, h = c["hidden_size"], c["num_attention_heads"]
    return SimpleNamespace(
        L=layers or c["num_hidden_layers"], D=d, H=h, KV=c["num_key_value_heads"],
        DH=c.get("head_dim", d // h), E=c["num_experts"], K=c["num_experts_per_tok"],
        FF=c["moe_intermediate_size"], V=c["vocab_size"],
        EPS=c.get("rms_norm_eps", 1e-6), THETA=c.get("rope_theta", 1e4))
