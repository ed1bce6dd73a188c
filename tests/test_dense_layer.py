"""The native runner's packed layers (`DenseLayer`): for each family, one layer's output equals the transformers
layer's, the packed weights share the model's storage (no second copy), and the transformers model still gives the
same logits once packed."""

from __future__ import annotations

import pytest
import torch

from dflash_core.runners.dense import DenseLayer, dense_layer
from dflash_core.runners.native import NativeTarget
from tests.helpers import make_target


def _reference_layer(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' own layer on h [1, n, H], causal over its n positions."""
    n = h.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = layer(h, attention_mask=mask, position_embeddings=(cos, sin), position_ids=torch.arange(n)[None])
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "qwen3_moe"])
def test_packed_layer_equals_transformers_layer(arch):
    model = make_target(None, arch=arch, layers=2, seed=7).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 9, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(h, torch.arange(9)[None])
        want = [_reference_layer(layer, h, cos, sin) for layer in model.model.layers]
        logits = model(torch.arange(4, 20)[None]).logits
        packed = [dense_layer(layer, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
                  for layer in model.model.layers]
        assert all(isinstance(d, DenseLayer) for d in packed)

        def ptr(t: torch.Tensor) -> int:
            return t.untyped_storage().data_ptr()

        # the q/k/v (and gate/up) weights are now views of the packed tensors: no second copy
        for layer, d in zip(model.model.layers, packed, strict=True):
            attn = layer.self_attn
            assert ptr(attn.q_proj.weight) == ptr(attn.k_proj.weight) == ptr(attn.v_proj.weight) == ptr(d.qkv)
            if d.mlp is None:
                assert ptr(layer.mlp.gate_proj.weight) == ptr(layer.mlp.up_proj.weight) == ptr(d.gate_up)
        assert (arch == "qwen3_moe") == any(d.mlp is not None for d in packed)  # a sparse MoE keeps its module
        torch.testing.assert_close(model(torch.arange(4, 20)[None]).logits, logits, rtol=0, atol=0)
        for d, w in zip(packed, want, strict=True):
            q, k, v = d.project(h, cos, sin)
            groups = q.shape[1] // k.shape[1]
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.transpose(1, 2).repeat_interleave(groups, 1), is_causal=True,
                scale=head_dim**-0.5)
            torch.testing.assert_close(d.finish(h, attended), w, rtol=1e-5, atol=1e-5)


def test_native_runner_packs_every_plain_layer():
    model = make_target(None, arch="qwen3", layers=3, seed=1)
    runner = NativeTarget(model, [0], max_slots=2, max_len=64)
    assert all(isinstance(runner.layer_module(i), DenseLayer) for i in range(3))
