"""A transformers decoder layer (Qwen3, Llama, Qwen2, Qwen3-MoE) as a few tensor ops over packed weights.

The native runner's layers run through `DenseLayer` instead of the transformers modules: a step's fixed cost on a
CPU (and its host time on a GPU) is mostly per-op and per-module overhead, not arithmetic. The query, key and value
projections are ONE matrix multiply (their weights packed into one tensor), so are the MLP's gate and up
projections; the q/k norms of Qwen3 and RoPE run once over the queries and keys together; no `nn.Module.__call__`
per projection. About 25 ops a layer instead of about 80.

The math is transformers' (float32 norms cast back before the weight, as its RMSNorm; SiLU-gated MLP), and the
packed weights are the model's own storage: the original modules' weights become views of the packed tensors, so
memory does not grow and the transformers model still runs. A layer whose MLP is not a bias-free SiLU gate/up/down
(a sparse MoE block, another activation, biases) keeps its MLP module. The runner owns the packing: build it after
the model is on its device and dtype, and do not move or reload the model under it (the packed tensors and the q/k
norm weights would no longer be the model's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.layers import apply_rope, pack_linears, rms_norm

__all__ = ["DenseLayer", "dense_layer", "norm_eps"]


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (transformers names it `variance_epsilon`, torch `eps`)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    raise ValueError(f"{type(norm).__name__} has no epsilon")


class DenseLayer(nn.Module):
    """One decoder layer's weights, packed: `project` (norm, QKV, q/k norm, RoPE) before attention and `finish`
    (output projection, residual, MLP) after it. The caller attends (its own cache and kernel)."""

    def __init__(self, layer: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        # the MLP's kind first: nothing is packed for a layer that is refused
        dense_mlp = all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
                        ) and not hasattr(mlp, "experts")  # quantized projections (`dflash_core/quant/`): its own
        if dense_mlp:
            act = getattr(mlp, "act_fn", None)
            if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
                dense_mlp = False  # another activation: the module runs it
            elif any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
                dense_mlp = False  # Llama's mlp_bias: the module runs it
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.norm_in, self.norm_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = norm_eps(layer.input_layernorm)
        self.qkv, self.qkv_bias = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        # [heads + kv_heads, d]: q_norm's weight for each query head, then k_norm's for each key head (Qwen3; Llama
        # and Qwen2 have none)
        self.qk_norm: torch.Tensor | None
        self.qk_eps = 0.0
        qk_norm = None
        if hasattr(attn, "q_norm"):
            self.qk_eps = norm_eps(attn.q_norm)
            qk_norm = torch.cat([attn.q_norm.weight.detach().expand(num_heads, head_dim),
                                 attn.k_norm.weight.detach().expand(num_kv_heads, head_dim)])
        self.register_buffer("qk_norm", qk_norm)
        self.mlp: nn.Module | None = None
        if dense_mlp:
            self.intermediate = mlp.gate_proj.weight.shape[0]
            self.gate_up, _ = pack_linears([mlp.gate_proj, mlp.up_proj])
            self.down = mlp.down_proj.weight
        else:
            self.mlp = mlp  # a sparse MoE block, another activation, biases: its own forward

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [b, heads, n, d], keys [b, kv_heads, n, d] (normed and rotated) and values [b, n, kv_heads, d]
        of the layer's input h [b, n, H]."""
        b, n = h.shape[0], h.shape[1]
        qkv = F.linear(rms_norm(h, self.norm_in, self.eps), self.qkv, self.qkv_bias)
        qk = qkv[..., : self.q_size + self.kv_size].view(b, n, self.heads + self.kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.qk_eps)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)
        v = qkv[..., self.q_size + self.kv_size :].view(b, n, self.kv_heads, self.head_dim)
        return qk[:, : self.heads], qk[:, self.heads :], v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output: h plus the output projection of `attended` [b, heads, n, d], then plus the MLP."""
        b, n = h.shape[0], h.shape[1]
        h = h + F.linear(attended.transpose(1, 2).reshape(b, n, -1), self.o, self.o_bias)
        x = rms_norm(h, self.norm_post, self.eps)
        if self.mlp is not None:
            return h + self.mlp(x)
        gate, up = F.linear(x, self.gate_up).split(self.intermediate, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


def dense_layer(layer: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> DenseLayer | None:
    """`layer` packed, or None when it is not a plain self-attention decoder layer (its modules then run it)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj")):
        return None  # not the projections packed here (or quantized ones, `dflash_core/quant/`): its modules run it
    if attn.q_proj.weight.shape[0] != num_heads * head_dim:  # a gated query (Qwen3.5's full attention) or else
        return None
    try:
        return DenseLayer(layer, num_heads, num_kv_heads, head_dim)
    except ValueError:
        return None
