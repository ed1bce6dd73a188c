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


def test_packed_draft_equals_unpacked_and_saves_the_same_checkpoint():
    """`DFlashDraft.pack` (what the drafter serves with): the same hidden states, context keys and checkpoint names,
    the projections' weights views of the packed ones; packing twice changes nothing."""
    from dflash_core.config import DraftConfig
    from dflash_core.draft import DFlashDraft
    from dflash_core.draft_cache import DraftKVCache

    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, num_target_layers=6, block_size=4, mask_token_id=1)
    draft = DFlashDraft(cfg).eval()
    feats = torch.randn(2, 30, len(cfg.target_layer_ids) * 32)
    block, block_pos = torch.randn(2, 4, 32), torch.arange(30, 34)[None].expand(2, 4)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = DraftKVCache(2)
        out = draft(block, block_pos, feats, torch.arange(30)[None].expand(2, 30), cache)
        return out, cache.k[0][:, :, : cache.length]  # the rows written (the buffer is larger)

    with torch.inference_mode():
        keys = set(draft.state_dict())
        want, want_k = run()
        draft.pack()
        draft.pack()
        got, got_k = run()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert set(draft.state_dict()) == keys
    attn = draft.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.untyped_storage().data_ptr()


@pytest.mark.parametrize("override", [dict(mlp_bias=True), dict(hidden_act="gelu")])
def test_mlp_the_packed_layer_cannot_run_keeps_its_module(override):
    """A Llama MLP with biases, or another activation than SiLU: the layer keeps its MLP module (nothing of the MLP
    packed) and its output still equals transformers'."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, **override)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    layer = model.model.layers[0]
    h = torch.randn(1, 5, 64)
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(h, torch.arange(5)[None])
        want = _reference_layer(layer, h, cos, sin)
        d = dense_layer(layer, 4, 2, 16)
        assert d is not None and d.mlp is layer.mlp
        assert layer.mlp.gate_proj.weight.untyped_storage().data_ptr() != layer.mlp.up_proj.weight.untyped_storage(
        ).data_ptr()
        q, k, v = d.project(h, cos, sin)
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True, scale=16**-0.5)
        torch.testing.assert_close(d.finish(h, attended), want, rtol=1e-5, atol=1e-5)
