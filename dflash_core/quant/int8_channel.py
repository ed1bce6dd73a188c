"""INT8 linear layers with a scale per output channel: compressed-tensors' `int-quantized` format (W8A8 INT8, the
"quantized.w8a8" checkpoints llm-compressor writes, and its weight-only W8A16 variant).

A checkpoint's layer holds `weight` [out, in] int8 and `weight_scale` [out, 1] (or one per tensor): the weight is
`weight * weight_scale`, symmetric. With dynamic activations (W8A8) the layer's input is quantized to int8 in each
forward, one scale per token (its largest magnitude over 127.5, as compressed-tensors computes it), and the product
is of the quantized input.

Without a kernel a forward computes what compressed-tensors' own forward does: quantize and dequantize the input,
dequantize the weight in the scale's dtype, multiply. `Int8Kernel` multiplies the int8 values themselves
(`torch._int_mm`, exact int32 sums; torch's own kernel on CUDA and CPU) and scales the sums by the token and channel
scales, once a probe on the device has checked it (`quant/base.py`).
"""

from __future__ import annotations

import torch

from dflash_core.quant.base import ChannelScaledLinear, Product, QuantizedLinear, QuantKernel

# compressed-tensors' symmetric int8 scale: the largest magnitude maps to half of the 255 steps
HALF_RANGE = 127.5
# the kernel's relative error against the fake-quantized product: the same int8 values, their sums exact in int32
# instead of rounded in float; a wrong layout or scale is off by tens of percent
TOLERANCE = 2e-2
# torch._int_mm on CUDA takes more than 16 rows
MIN_ROWS = 17


def int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 values per token (rounded, in x's dtype) and the tokens' scales [..., 1], with compressed-tensors'
    arithmetic (a token of zeros gets the dtype's eps as its scale)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / HALF_RANGE
    scale = scale.masked_fill(scale == 0, torch.finfo(scale.dtype).eps)
    return torch.round(torch.clamp(x / scale, -128, 127)), scale


def fake_quantize_int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per token (per row of its last dimension) and back, as compressed-tensors' forward."""
    q, scale = int8_tokens(x)
    return (q.to(scale.dtype) * scale).to(x.dtype)


class Int8ChannelLinear(ChannelScaledLinear):
    """A linear layer with int8 weights and a scale per output channel (or per tensor), optionally quantizing its
    input to int8 per token; parameter names as compressed-tensors' checkpoints: `weight`, `weight_scale`, `bias`."""

    value_dtype = torch.int8
    kind = "int8"

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_int8_tokens(x) if self.dynamic_activations else x


class Int8Kernel(QuantKernel):
    """`torch._int_mm` (int8 x int8 -> int32) for W8A8 layers, the sums scaled by the token and channel scales.
    CUDA only here: on a CPU the kernel-free forward serves (tests turn the kernel on there to check it)."""

    name = "int8 GEMM (torch._int_mm)"
    layer_type = Int8ChannelLinear
    tolerance = TOLERANCE

    def unavailable(self, device: torch.device) -> str | None:
        return None if device.type == "cuda" else f"{device.type}: the kernel is CUDA's"

    def eligible(self, layer: QuantizedLinear) -> bool:
        """Dynamic activations (a weight-only layer keeps full-precision inputs), sides multiples of 8 (CUDA)."""
        assert isinstance(layer, Int8ChannelLinear)
        return layer.dynamic_activations and layer.in_features % 8 == 0 and layer.out_features % 8 == 0

    def prepare(self, layer: QuantizedLinear) -> Product:
        assert isinstance(layer, Int8ChannelLinear)
        weight_t = layer.weight.t()  # [in, out], column-major
        scale_w = layer.weight_scale.float().reshape(1, -1)

        def product(x: torch.Tensor) -> torch.Tensor:
            q, scale = int8_tokens(x)  # the values and scales the kernel-free forward computes
            rows = q.shape[0]
            if rows < MIN_ROWS:  # CUDA's kernel takes more than 16 rows: zero rows pad, their sums are dropped
                q = torch.cat((q, q.new_zeros(MIN_ROWS - rows, q.shape[1])))
            sums = torch._int_mm(q.to(torch.int8), weight_t)[:rows]
            return (sums.float() * scale.float() * scale_w).to(x.dtype)

        return product
