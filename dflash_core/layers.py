"""Our layers: RMSNorm and rotary position embeddings (RoPE) with every scaling type transformers defines.

The draft model uses all of them. The native target runner uses `rms_norm`, `pack_linears` and `apply_rope` (its
packed layers, `runners/dense.py`) and the target's own rotary module (so a target's RoPE scaling is whatever
transformers implements for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.weight_layout import is_input_major

# Types no draft can use (none today; the table stays so that a future type can be refused with its reason).
REFUSED_ROPE_TYPES: dict[str, str] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op (normed in float32, cast back to x's dtype, then times the weight).
    `weight` may have more dimensions than one (per-head weights: [heads, d] over x [..., heads, d])."""
    if x.dtype == torch.float32:
        # float32: the cast back is nothing, so torch's fused norm is the same arithmetic (bit for bit) in one op
        # instead of five; the weight goes on after it, per head when it has more dimensions
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    y = x.float()
    y = y * torch.rsqrt(torch.mean(y * y, -1, keepdim=True).add_(eps))
    return weight * y.to(x.dtype)


def pack_linears(linears: list[nn.Linear]) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The linears' weights (and biases) as one packed tensor each; each linear's own becomes a view of it. Weights
    stored input-major (`dflash_core/weight_layout.py`) pack input-major."""
    weights = [lin.weight.detach() for lin in linears]
    if all(is_input_major(w) for w in weights):
        packed = torch.cat([w.t() for w in weights], dim=1).t()
    else:
        packed = torch.cat(weights)
    weight = nn.Parameter(packed, requires_grad=False)
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("some projections have a bias and some do not")
    bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False) if all(
        has_bias) else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight.data[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.data[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Qwen3/Llama do (`rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class RopeFrequencies:
    """Inverse frequencies of the rotated dims (`rotary_dim / 2` of them) and the factor on cos/sin.

    `attention_scaling` is transformers' post-processing factor (YaRN, LongRoPE). LongRoPE also has
    `long_inv_freq`, which (as in transformers) a forward uses once its sequence length exceeds
    `original_max_position_embeddings`.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    original_max_position_embeddings: int | None = None


def rope_type(params: dict[str, Any] | None) -> str:
    """The RoPE type a `rope_parameters` / `rope_scaling` dict names ("default" when none)."""
    params = params or {}
    return str(params.get("rope_type", params.get("type")) or "default")


def rope_type_error(kind: str) -> str | None:
    """Why a RoPE type cannot run in the draft, or None when it can."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in REFUSED_ROPE_TYPES:
        return f"RoPE type {kind!r} is not supported for drafts: {REFUSED_ROPE_TYPES[kind]}"
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(sorted({"default", *ROPE_INIT_FUNCTIONS} - set(REFUSED_ROPE_TYPES)))
        return f"unknown RoPE type {kind!r} (known: {known})"
    return None


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int = 40960,
    hidden_size: int | None = None,
    num_attention_heads: int | None = None,
) -> RopeFrequencies:
    """RoPE frequencies for a draft config: "default" here, every other type by transformers' own init function.

    `scaling` is the draft's `rope_parameters` (or legacy `rope_scaling`) dict; its `partial_rotary_factor` makes
    only the first `int(head_dim * factor)` dims rotate.
    """
    kind = rope_type(scaling)
    error = rope_type_error(kind)
    if error:
        raise ValueError(error)
    params = {k: v for k, v in (scaling or {}).items() if k != "type"}
    if kind == "default":
        dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return RopeFrequencies(inv_freq.float())
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # the attributes transformers' init functions read; standardize_rope_params fills their defaults
    config = PretrainedConfig()
    config.rope_parameters = {**params, "rope_type": kind, "rope_theta": float(theta)}
    config.head_dim = head_dim
    config.hidden_size = hidden_size or head_dim
    config.num_attention_heads = num_attention_heads or 1
    config.max_position_embeddings = max_position_embeddings
    init = ROPE_INIT_FUNCTIONS[kind]
    if kind == "dynamic":
        # transformers keeps the base frequencies up to max_position_embeddings and re-derives longer sequences'
        # from each forward's length (a state shared by every sequence; cached keys keep older rotations). Here:
        # the base set up to max_position_embeddings, as transformers, and past it ONE set for every request, the
        # one at `factor x max_position_embeddings`, as vLLM's dynamic NTK (exactness is unaffected either way).
        factor = float(config.rope_parameters.get("factor", 1.0))
        base, scaling_factor = init(config, None)
        long, _ = init(config, None, seq_len=int(max_position_embeddings * factor))
        return RopeFrequencies(base.float(), float(scaling_factor), long.float(), max_position_embeddings)
    inv_freq, scaling_factor = init(config, None)
    if kind != "longrope":
        return RopeFrequencies(inv_freq.float(), float(scaling_factor))
    original = int(config.rope_parameters["original_max_position_embeddings"])
    long_inv_freq, _ = init(config, None, seq_len=original + 1)
    return RopeFrequencies(inv_freq.float(), float(scaling_factor), long_inv_freq.float(), original)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, n, d]; cos/sin: [b, n, r] with r <= d (partial rotary: the last d - r dims pass through)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos[:, None] + rotate_half(x) * sin[:, None]
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos[:, None] + rotate_half(rot) * sin[:, None], rest], dim=-1)
