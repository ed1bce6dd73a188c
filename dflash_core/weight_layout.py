"""Linear weights stored input-major on a CPU: an `[out, in]` parameter whose memory is laid out `[in, out]`.

A decode step multiplies one or a few rows by every weight matrix once. On the development VM (AMD EPYC, MKL
sgemm, one thread) that product ran at 7-8 GB/s of weights with `nn.Linear`'s own storage (`x @ W.T`, a
transposed operand) and at 12-17 GB/s with the same matrix stored `[in, out]` (`x @ W`, nothing transposed):
1.5-2x as fast at 1-2 rows, 1.2-1.3x at 4-16, no slower at 512 (docs/benchmarks.md, "Weights stored
input-major"). Relaying a matrix copies it once at load (peak memory: the model plus its largest matrix).

Only the storage moves: a parameter keeps its shape `[out, in]`, its identity (a tied embedding stays tied, a draft
sharing the target's output head still shares it) and its values, so every `F.linear(x, w)` and every module runs
unchanged and multiplies by `w.T`, which is now contiguous. An embedding that shares the output head gathers its
rows with a stride (a few tokens a step; a long prompt's prefill pays a little). CUDA keeps the standard layout
(cuBLAS is tuned for it), so do bfloat16 weights on a CPU, and so does anything being trained.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["input_major", "is_input_major", "store_input_major", "stores_input_major"]


def stores_input_major(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether served linear weights are stored input-major: float32 on a CPU (bfloat16 products go through
    oneDNN, where the layout measured mixed: faster at one row, slower at 16)."""
    return device.type == "cpu" and dtype == torch.float32


def is_input_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D weight `[out, in]` is laid out `[in, out]` (its transpose contiguous)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.t().is_contiguous() and not weight.is_contiguous()


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] with the same values, laid out [in, out] (returned as is when it already is)."""
    return weight if is_input_major(weight) else weight.t().contiguous().t()


def store_input_major(model: nn.Module) -> int:
    """Lay every `nn.Linear` weight of `model` out input-major in place (`Parameter.data`, so tied parameters stay
    one). Returns how many parameters moved. Call it before anything packs or views the weights."""
    seen: set[int] = set()
    moved = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        p = module.weight
        if id(p) in seen or p.dim() != 2 or is_input_major(p) or p.shape[0] < 2:
            continue
        seen.add(id(p))
        p.data = input_major(p.data)
        moved += 1
    return moved
