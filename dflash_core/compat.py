"""One home for what differs between the torch and transformers releases we support (torch >= 2.11, transformers
>= 5.17: the GPU host's image has torch 2.11 and transformers 5.17; CI's main suite runs the newest pins and a short
job, `.ci/core_torch211.sh`, the core tests on the oldest)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def rotary_positions(rotary: nn.Module, pos: torch.Tensor) -> torch.Tensor:
    """``pos`` [b, n] as ``rotary`` (a model's ``rotary_emb``) takes it. Qwen3.5's multimodal rotary reads one row
    of positions per grid axis (t, h, w): transformers >= 5.24 broadcasts [b, n] to [3, b, n] itself, 5.17 indexes
    a [3, b, n] tensor and fails on [b, n]. A text token has the same position on all three axes, so [3, b, n] is
    right on both (an expanded view: no copy)."""
    if getattr(rotary, "mrope_section", None) is not None and pos.dim() == 2:
        return pos.expand(3, *pos.shape)
    return pos


def chunk_gated_delta_rule(linear_attn: nn.Module) -> Callable[..., Any]:
    """transformers' chunked delta rule (its own prefill) from ``linear_attn``'s modeling module, taking q/k with
    fewer heads than v: transformers >= 5.24 repeats each q/k head over its ``hv // hk`` value heads inside the
    function, 5.17 does it in the layer before the call (its function needs as many q/k heads as v heads).
    Repeated here first, the call is the same on both (5.24 then sees equal head counts and repeats nothing)."""
    rule = vars(sys.modules[type(linear_attn).__module__])["torch_chunk_gated_delta_rule"]

    @functools.wraps(rule)
    def grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hk, hv = key.shape[2], value.shape[2]
        if hk != hv:  # [b, n, heads, d]: each q/k head serves hv // hk consecutive value heads
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        return rule(query, key, value, *args, **kwargs)

    return grouped
