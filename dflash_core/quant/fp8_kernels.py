"""FP8 matrix multiplies on CUDA: cuBLAS's block-scaled FP8 GEMM through torch's `scaled_mm` (Hopper, sm90).

The weight keeps its checkpoint's 128 x 128 block scales; the activations are quantized to FP8 on the fly, one
scale per 1 x 128 group of a row (the recipe of DeepSeek-V3's and Qwen's FP8 checkpoints, and of vLLM's and
transformers' block-FP8 kernels). cuBLAS wants the activation scales outer-dimension-major ([M, K/128] with stride
(1, M)), the weight as a column-major view, M a multiple of 4 and the weight scales' K blocks padded to a multiple
of 4; `block_fp8_linear` pads, multiplies and crops.

The multiply is a torch custom op (`dflash::fp8_block_linear`), so a compiled step treats it as one opaque call
(inductor need not know `scaled_mm`) and a CUDA graph records the cuBLAS call like any other.

Whether it runs is decided once per loaded model on its device (`quant/base.py`'s `choose_kernel` with
`BlockFp8Kernel`): the kernel multiplies a layer's weight by random activations and must agree with the dequantized
product to within FP8's activation rounding; a device, torch or layer that cannot (no CUDA, a torch without
block-scaled `scaled_mm`, another architecture than sm90 (torch runs this recipe on Hopper only), shapes that do not
tile by 128, an error, a disagreement) keeps the dequantizing forward, and the start-up log says which and why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_core.quant.base import Product, QuantizedLinear, QuantKernel
from dflash_core.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear

BLOCK = 128
# the kernel's relative error against the dequantized product that is accepted: FP8 activations round each value
# by up to 2^-4 relative, which over a sum of K products is a few percent at most (measured ~2-3%)
TOLERANCE = 0.06


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as FP8, one scale per 1 x 128 group: (q [M, K], scales [M, K / 128])."""
    m, k = x.shape
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(m, k), scale


def padded_weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """A weight's [N / 128, K / 128] scales with K blocks padded to a multiple of 4 (cuBLAS's alignment)."""
    pad = -scale_inv.shape[1] % 4
    return F.pad(scale_inv, (0, pad)).contiguous() if pad else scale_inv.contiguous()


@torch.library.custom_op("dflash::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (compute dtype) times `weight` [N, K] (FP8) transposed, with the weight's padded 128 x 128 scales
    (`padded_weight_scales`): [M, N] in x's dtype."""
    m = x.shape[0]
    if m % 4:
        x = F.pad(x, (0, 0, 0, -m % 4))
    q, scale = quantize_activations(x)
    out = F.scaled_mm(q, weight.t(), scale.t().contiguous().t(), F.ScalingType.BlockWise1x128, scales.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out[:m]


@fp8_block_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class BlockFp8Kernel(QuantKernel):
    """cuBLAS's block-scaled FP8 GEMM for `Fp8Linear` layers of 128 x 128 blocks."""

    name = "cuBLAS block-scaled FP8 GEMM"
    layer_type = Fp8Linear
    tolerance = TOLERANCE

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{device.type}: the kernel is CUDA's"
        if not hasattr(F, "ScalingType") or not hasattr(F.ScalingType, "BlockWise128x128"):
            return f"torch {torch.__version__} has no block-scaled scaled_mm"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:  # torch runs the 1x128 / 128x128 recipe on Hopper only
            return f"sm{major}{minor}: torch's block-scaled FP8 GEMM runs on sm90 (Hopper) only"
        return None

    def eligible(self, layer: QuantizedLinear) -> bool:
        """128 x 128 blocks and both sides multiples of 128."""
        assert isinstance(layer, Fp8Linear)
        return layer.block == (BLOCK, BLOCK) and layer.in_features % BLOCK == 0 and layer.out_features % BLOCK == 0

    def prepare(self, layer: QuantizedLinear) -> Product:
        assert isinstance(layer, Fp8Linear)
        weight, scales = layer.weight, padded_weight_scales(layer.weight_scale_inv)
        return lambda x: torch.ops.dflash.fp8_block_linear(x, weight, scales)
