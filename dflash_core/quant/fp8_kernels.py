"""FP8 matrix multiplies on CUDA: cuBLAS's block-scaled FP8 GEMM through torch's `scaled_mm` (Hopper and newer).

The weight keeps its checkpoint's 128 x 128 block scales; the activations are quantized to FP8 on the fly, one
scale per 1 x 128 group of a row (the recipe of DeepSeek-V3's and Qwen's FP8 checkpoints, and of vLLM's and
transformers' block-FP8 kernels). cuBLAS wants the activation scales outer-dimension-major ([M, K/128] with stride
(1, M)), the weight as a column-major view, M a multiple of 4 and the weight scales' K blocks padded to a multiple
of 4; `block_fp8_linear` pads, multiplies and crops.

The multiply is a torch custom op (`dflash::fp8_block_linear`), so a compiled step treats it as one opaque call
(inductor need not know `scaled_mm`) and a CUDA graph records the cuBLAS call like any other.

Whether it runs is decided once per loaded model on its device (`choose_kernel`): the kernel multiplies a layer's
weight by random activations and must agree with the dequantized product to within FP8's activation rounding; a
device, torch or layer that cannot (no CUDA, before sm90, a torch without block-scaled `scaled_mm`, shapes that do
not tile by 128, an error, a disagreement) keeps the dequantizing forward, and the start-up log says which and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.quant.fp8 import FP8_DTYPE, Fp8Linear

log = logging.getLogger("dflash.quant")

BLOCK = 128
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# the kernel's relative error against the dequantized product that is accepted: FP8 activations round each value
# by up to 2^-4 relative, which over a sum of K products is a few percent at most (measured ~2-3%)
TOLERANCE = 0.06


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as FP8, one scale per 1 x 128 group: (q [M, K], scales [M, K / 128])."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, k), scale


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


def eligible(layer: Fp8Linear) -> bool:
    """A layer the kernel can multiply: 128 x 128 blocks and both sides multiples of 128."""
    return layer.block == (BLOCK, BLOCK) and layer.in_features % BLOCK == 0 and layer.out_features % BLOCK == 0


@dataclass(frozen=True)
class KernelChoice:
    """What `choose_kernel` decided: whether FP8 layers multiply by cuBLAS, how many, and why (or why not)."""

    used: bool
    layers: int
    reason: str
    error: float | None = None  # the probe's relative error against the dequantized product


def unavailable(device: torch.device) -> str | None:
    """Why this device and torch cannot run the block-scaled kernel, or None."""
    if device.type != "cuda":
        return f"{device.type}: the kernel is CUDA's"
    if not hasattr(F, "ScalingType") or not hasattr(F.ScalingType, "BlockWise128x128"):
        return f"torch {torch.__version__} has no block-scaled scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"sm{major}{minor}: cuBLAS's block-scaled FP8 GEMM needs sm90 or newer"
    return None


def probe(layer: Fp8Linear, rows: int = 8) -> float:
    """The kernel's relative error on `layer` against the dequantized product (raises what the kernel raises)."""
    g = torch.Generator(device=layer.weight.device).manual_seed(0)
    x = torch.randn(rows, layer.in_features, generator=g, device=layer.weight.device).to(layer.compute_dtype)
    ref = F.linear(x, layer.dequantized()).float()
    out = fp8_block_linear(x, layer.weight, padded_weight_scales(layer.weight_scale_inv)).float()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-12))


def choose_kernel(model: nn.Module, device: torch.device) -> KernelChoice:
    """Turn the kernel on for `model`'s eligible FP8 layers when this device runs it correctly (one probe); log the
    choice. Layers stay on the dequantizing forward otherwise."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not layers:
        return KernelChoice(False, 0, "no FP8 layers")
    fit = [m for m in layers if eligible(m)]
    reason = unavailable(device) or (None if fit else "no layer tiles by 128 x 128")
    error = None
    if reason is None:
        try:
            error = probe(fit[0])
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # cuBLAS or torch refusing the call
            reason = f"the kernel failed its probe: {str(exc).splitlines()[0][:200]}"
        else:
            if not error < TOLERANCE:
                reason = f"the kernel disagreed with the dequantized product (relative error {error:.3g})"
    choice = KernelChoice(reason is None, len(fit) if reason is None else 0,
                          reason or f"cuBLAS block-scaled FP8 GEMM (probe error {error:.3g})", error)
    for layer in fit if choice.used else ():
        layer.use_kernel(padded_weight_scales(layer.weight_scale_inv))
    log.info("FP8 matrix multiplies: %s", f"{choice.layers} of {len(layers)} layers by {choice.reason}"
             if choice.used else f"dequantized per layer ({choice.reason})")
    return choice
