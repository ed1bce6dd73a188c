"""Our layers: RMSNorm and rotary position embeddings (RoPE) with the scaling types draft configs use.

The draft model uses all of them. The native target runner uses `apply_rope` only: it runs the target's own
norms and rotary module (so a target's RoPE scaling is whatever transformers implements for it)."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Qwen3/Llama do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3 style scaling when the config asks for it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} in draft config")
    return inv_freq.float()


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
