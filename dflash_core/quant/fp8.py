"""FP8 linear layers: weights kept in float8 (e4m3) in memory with their scales, multiplied in the compute dtype.

The format is the one Qwen's official FP8 checkpoints (and DeepSeek-V3's, and transformers' `FineGrainedFP8Config`)
use: `weight` [out, in] in `float8_e4m3fn`, `weight_scale_inv` [ceil(out / b0), ceil(in / b1)] in float32 (one
scale per b0 x b1 block of the weight; a scalar when the checkpoint scales per tensor), and the real weight is
`weight * weight_scale_inv` block by block.

A forward dequantizes the layer's weight into the compute dtype and multiplies (`F.linear`): the weights stay one
byte each in memory and only one layer's full-precision copy lives at a time. On CUDA (sm90) a layer multiplies
by cuBLAS's block-scaled FP8 GEMM instead, once `quant/fp8_kernels.py` has checked it on the device.

The dequantization is transformers' arithmetic (float32 product, then cast), so a dequantized weight equals the one
transformers' own forward uses for the same checkpoint (on a CPU), bit for bit, and greedy outputs match it.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_core.quant.base import QuantizedLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: the largest e4m3 magnitude


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` [out, in] (FP8) times its per-block scales [ceil(out / b0), ceil(in / b1)] (or one scalar when
    `block` is None), in float32, cast to `dtype`."""
    w = weight.to(torch.float32)
    if block is None:
        return (w * scale_inv.to(torch.float32)).to(dtype)
    rows, cols = w.shape
    b0, b1 = block
    # the scales expanded over rows only (a small tensor), and broadcast over each block's columns through a view
    scale = scale_inv.to(torch.float32).repeat_interleave(b0, dim=0)[:rows]
    full, rest = divmod(cols, b1)
    out = torch.empty_like(w)
    out[:, : full * b1] = (w[:, : full * b1].view(rows, full, b1) * scale[:, :full, None]).view(rows, full * b1)
    if rest:
        out[:, full * b1 :] = w[:, full * b1 :] * scale[:, full:]
    return out.to(dtype)


class Fp8Linear(QuantizedLinear):
    """A linear layer whose weight is FP8 with block-wise (or per-tensor) scales; parameter names as the
    checkpoints': `weight`, `weight_scale_inv`, `bias`."""

    def __init__(
        self, in_features: int, out_features: int, block: tuple[int, int] | None, bias: bool, dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(block) if block is not None else None
        self.compute_dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        # per tensor: [1, 1], as transformers' FP8 op writes a per-tensor scale
        scales = (-(-out_features // self.block[0]), -(-in_features // self.block[1])) if self.block else (1, 1)
        self.weight_scale_inv = nn.Parameter(torch.ones(scales, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    def dequantized(self) -> torch.Tensor:
        """The weight in the compute dtype, as the checkpoint means it."""
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, fp8=e4m3"
