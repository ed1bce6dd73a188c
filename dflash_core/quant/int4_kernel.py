"""torch's own int4 GEMM ("tinygemm": `torch._weight_int4pack_mm`, CUDA sm80+, bf16) for 4-bit layers in groups of
inputs: GPTQ (in-order groups), AWQ and compressed-tensors' packed int4 (`GroupedIntLinear`).

Why this kernel: it ships inside torch (nothing to install, maintained with it, the one torchao's int4 weight-only
path calls on CUDA), and it takes any zero point: tinygemm's weight is `(code - 8) * scale + zero` per group, and
a checkpoint's `(code - z) * scale` is that with `zero = (8 - z) * scale`. What it costs: activations and scales in
bf16 (a float16 or float32 model keeps the kernel-free forward), groups of 32 to 256 inputs (Qwen's and most
checkpoints use 128), sides multiples of 8 and 32. Its product differs from the kernel-free one in rounding (the
scale and zero rounded to bf16, the sums in another order), so, like the FP8 kernels, it runs only where a probe on
the device agrees (`quant/base.py`).

Once on, the kernel's packed weight (half a byte a weight, as the checkpoint's) replaces the layer's own tensors
(`adopt`), so the weights stay 4-bit in memory; the start-up memory line counts the packed tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_core.quant.base import GroupedIntLinear, Product, QuantizedLinear, QuantKernel

# the group sizes tinygemm takes
GROUPS = (32, 64, 128, 256)
# the kernel's relative error against the kernel-free product (bf16 scales and zeros, sums in another order:
# ~3e-3); a wrong packing or zero point is off by tens of percent
TOLERANCE = 2e-2


def inner_k_tiles(in_features: int) -> int | None:
    """The largest of tinygemm's inner tile counts (8, 4, 2) whose width (16 each) divides `in_features`."""
    return next((t for t in (8, 4, 2) if in_features % (16 * t) == 0), None)


def tinygemm_operands(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales and zeros [groups, out, 2] bf16) for codes [out, in] (0..15), zero points and scales
    [out, groups]: laid out by torch's own conversion for the device the codes are on."""
    scale = scales.float()
    zero = (8 - zeros.float()) * scale  # (code - z) * scale == (code - 8) * scale + (8 - z) * scale
    scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    if codes.is_cuda:  # two codes a byte, the even input in the high nibble
        pairs = (codes[:, ::2].to(torch.uint8) << 4) | codes[:, 1::2].to(torch.uint8)
        return torch._convert_weight_to_int4pack(pairs.contiguous(), tiles), scales_zeros
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), tiles), scales_zeros


class Int4Kernel(QuantKernel):
    """tinygemm for 4-bit grouped layers, bf16 only; CUDA (sm80+) here: on a CPU the kernel-free forward serves
    (tests turn the kernel on there, where torch runs the same arithmetic, to check it)."""

    name = "int4 GEMM (torch._weight_int4pack_mm)"
    layer_type = GroupedIntLinear
    tolerance = TOLERANCE

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{device.type}: the kernel is CUDA's"
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}: the int4 GEMM needs sm80 or newer" if major < 8 else None

    def eligible(self, layer: QuantizedLinear) -> bool:
        """4-bit, bf16, groups tinygemm takes, sides it tiles, groups of consecutive inputs (not act-order)."""
        assert isinstance(layer, GroupedIntLinear)
        return (layer.bits == 4 and layer.compute_dtype == torch.bfloat16 and layer.group in GROUPS
                and layer.in_features % layer.group == 0 and layer.out_features % 8 == 0
                and inner_k_tiles(layer.in_features) is not None and layer.int_groups() is not None)

    def prepare(self, layer: QuantizedLinear) -> Product:
        assert isinstance(layer, GroupedIntLinear)
        groups = layer.int_groups()
        assert groups is not None
        return Int4Product(*tinygemm_operands(*groups, inner_k_tiles(layer.in_features)), layer.group)

    def adopt(self, layer: QuantizedLinear) -> None:
        """The packed weight replaces the checkpoint's tensors: held once, counted as the layer's parameters."""
        assert isinstance(layer, GroupedIntLinear) and isinstance(layer.kernel, Int4Product)
        layer.release()
        layer.int4_weight = nn.Parameter(layer.kernel.weight, requires_grad=False)
        layer.int4_scales_zeros = nn.Parameter(layer.kernel.scales_zeros, requires_grad=False)


class Int4Product:
    """tinygemm's product with one layer's operands (`Product`)."""

    def __init__(self, weight: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> None:
        self.weight, self.scales_zeros, self.group = weight, scales_zeros, group
        self.mm = torch._weight_int4pack_mm if weight.is_cuda else torch._weight_int4pack_mm_for_cpu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm(x, self.weight, self.group, self.scales_zeros)
