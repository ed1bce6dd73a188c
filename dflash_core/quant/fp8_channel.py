"""FP8 linear layers with a scale per output channel: compressed-tensors' `float-quantized` format (FP8 W8A16, and
FP8-dynamic W8A8, the layout of most published "-FP8-dynamic" checkpoints).

A checkpoint's layer holds `weight` [out, in] in `float8_e4m3fn` and `weight_scale` [out, 1] (or one per tensor);
the weight is `weight * weight_scale`. With dynamic activations the layer's input is quantized to FP8 in each
forward, one scale per token (its largest magnitude maps to FP8's largest value), and the product is of the
quantized input.

Without a kernel a forward computes exactly what compressed-tensors' own forward does (`fake_quantize_tokens`, then
the dequantized weight): quantize and dequantize the input, dequantize the weight in the scale's dtype, multiply.
On CUDA (sm89+) `RowWiseFp8Kernel` multiplies the FP8 values themselves by `torch._scaled_mm` with the per-token
and per-channel scales, once a probe on the device has checked it (`quant/base.py`).
"""

from __future__ import annotations

import torch

from dflash_core.quant.base import ChannelScaledLinear, Product, QuantizedLinear, QuantKernel
from dflash_core.quant.fp8 import FP8_DTYPE, FP8_MAX

# the kernel's relative error against the fake-quantized product it stands in for: the same FP8 values, summed in
# another order (~1e-6 in float32) and, in bf16, rounded once instead of through the dequantized operands (~3e-3);
# a wrong layout or scale is off by tens of percent
TOLERANCE = 2e-2


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Each token's (row's) FP8 scale, [..., 1]: its largest magnitude over FP8's largest value (compressed-tensors'
    arithmetic; a row of zeros gets the dtype's eps)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return scale.masked_fill(scale == 0, torch.finfo(scale.dtype).eps)


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x quantized to FP8 per token (per row of its last dimension) and back, with compressed-tensors' arithmetic.
    compressed-tensors' token strategy keeps the first two dimensions of what it is given, so its scales are per
    token for the [batch, tokens, hidden] inputs the runners pass (bit for bit equal here) and one per tensor for a
    2-D input; here they are per row for any rank (as vLLM's per-token FP8)."""
    scale = token_scales(x)
    q = torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype)
    return (q.to(scale.dtype) * scale).to(x.dtype)


class Fp8ChannelLinear(ChannelScaledLinear):
    """A linear layer with FP8 weights and a scale per output channel (or per tensor), optionally quantizing its
    input to FP8 per token; parameter names as compressed-tensors' checkpoints: `weight`, `weight_scale`, `bias`."""

    value_dtype = FP8_DTYPE
    kind = "fp8"

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_tokens(x) if self.dynamic_activations else x


class RowWiseFp8Kernel(QuantKernel):
    """`torch._scaled_mm` with per-token activation scales and per-channel weight scales (cuBLAS's row-wise FP8 GEMM,
    sm89+) for FP8-dynamic layers: the same products as the fake-quantized forward, summed in another order. torch
    writes its row-wise output in bf16 only: a float16 or float32 model fails the probe and keeps the kernel-free
    forward."""

    name = "row-wise FP8 GEMM (torch._scaled_mm)"
    layer_type = Fp8ChannelLinear
    tolerance = TOLERANCE

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{device.type}: the kernel is CUDA's"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"sm{major}{minor}: FP8 GEMMs need sm89 or newer"
        return None

    def eligible(self, layer: QuantizedLinear) -> bool:
        """Dynamic activations (a weight-only layer keeps full-precision inputs), sides multiples of 16 (cuBLAS)."""
        assert isinstance(layer, Fp8ChannelLinear)
        return layer.dynamic_activations and layer.in_features % 16 == 0 and layer.out_features % 16 == 0

    def prepare(self, layer: QuantizedLinear) -> Product:
        assert isinstance(layer, Fp8ChannelLinear)
        weight_t = layer.weight.t()  # [in, out], column-major: as cuBLAS takes the second operand
        scale_b = layer.weight_scale.float().reshape(1, -1).expand(1, layer.out_features).contiguous()

        def product(x: torch.Tensor) -> torch.Tensor:
            # the FP8 values and scales the kernel-free forward computes (in x's dtype), the scales as float32
            scale_a = token_scales(x)
            q = torch.clamp(x / scale_a, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            return torch._scaled_mm(q, weight_t, scale_a=scale_a.float(), scale_b=scale_b, out_dtype=x.dtype)

        return product
