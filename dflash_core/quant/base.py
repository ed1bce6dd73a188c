"""What every quantized linear layer is (`QuantizedLinear`) and what a device kernel for one is (`QuantKernel`).

A quantized layer keeps its checkpoint's tensors and can always give its weight back in the compute dtype
(`dequantized`); its forward multiplies by that, unless a kernel has been turned on for it. A kernel is turned on
only where it runs correctly: `choose_kernel` multiplies a layer of each of the model's shapes by it on the device,
at 1, 16 and 256 rows, and compares the products with the dequantized ones (`probe`); a device or torch that
cannot, an error or a disagreement keeps the dequantizing forward, and the start-up log says which and why.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("dflash.quant")

# a kernel's product for rows [M, in_features] of the compute dtype -> [M, out_features]
Product = Callable[[torch.Tensor], torch.Tensor]


class QuantizedLinear(nn.Module, ABC):
    """A linear layer whose weight is held quantized: `in_features`, `out_features`, `compute_dtype`, `bias`."""

    in_features: int
    out_features: int
    compute_dtype: torch.dtype
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.kernel: Product | None = None  # set by `choose_kernel` where a device kernel multiplies this layer

    @abstractmethod
    def dequantized(self) -> torch.Tensor:
        """The weight [out_features, in_features] in the compute dtype, as the checkpoint means it."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the format multiplies it (a W8A8 format quantizes it; weight-only formats: as it is)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(self.activations(x), self.dequantized(), self.bias)
        y = self.kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class GroupedIntLinear(QuantizedLinear):
    """A layer of `bits`-bit integer codes with a scale and a zero point per group of `group` inputs (GPTQ, AWQ,
    compressed-tensors' packed ints); `storage`: the names of the tensors that hold them."""

    bits: int
    group: int
    storage: tuple[str, ...]

    @abstractmethod
    def int_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes [out, in] unsigned, zero points [out, groups] as codes, scales [out, groups]) where each group is
        `group` consecutive inputs; None where it is not (GPTQ's act-order)."""

    def release(self) -> None:
        """Drop the checkpoint's tensors (a kernel that holds the weight in its own layout has taken over; the
        kernel-free forward cannot run after this)."""
        for name in self.storage:
            tensor = getattr(self, name)
            tensor.data = tensor.new_empty(0)


class ChannelScaledLinear(QuantizedLinear):
    """A layer of one-byte values (`value_dtype`: FP8 or int8) with a scale per output channel (or per tensor),
    optionally quantizing its input per token in each forward (`dynamic_activations`); parameter names as
    compressed-tensors' checkpoints: `weight`, `weight_scale`, `bias`. `kind` names the values in its repr."""

    value_dtype: torch.dtype
    kind: str

    def __init__(
        self, in_features: int, out_features: int, per_tensor: bool, dynamic_activations: bool, bias: bool,
        dtype: torch.dtype, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.dynamic_activations = dtype, dynamic_activations
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.value_dtype, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty((1,) if per_tensor else (out_features, 1), dtype=dtype,
                                                     device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    def dequantized(self) -> torch.Tensor:
        """The weight in the compute dtype: the values times their channel's scale, in the scale's dtype."""
        return (self.weight.to(self.weight_scale.dtype) * self.weight_scale).to(self.compute_dtype)

    def extra_repr(self) -> str:
        acts = f"{self.kind} per token" if self.dynamic_activations else "full precision"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} weights, "
                f"activations {acts}")


class QuantKernel(ABC):
    """A device kernel for one kind of quantized layer."""

    name: str  # what the log calls it
    layer_type: type[QuantizedLinear]
    tolerance: float  # the relative error against the dequantized product a probe accepts

    @abstractmethod
    def unavailable(self, device: torch.device) -> str | None:
        """Why this device and torch cannot run the kernel, or None."""

    @abstractmethod
    def eligible(self, layer: QuantizedLinear) -> bool:
        """Whether the kernel can multiply `layer` (its shapes, its scales)."""

    @abstractmethod
    def prepare(self, layer: QuantizedLinear) -> Product:
        """The kernel's product for `layer` (its operands laid out as the kernel wants them, once)."""

    def adopt(self, layer: QuantizedLinear) -> None:  # noqa: B027  (a hook: most kernels keep the layer's tensors)
        """After the kernel is on for `layer`: what it does with the layer's own tensors (by default, nothing)."""


@dataclass(frozen=True)
class KernelChoice:
    """What `choose_kernel` decided: whether the kernel multiplies the layers, how many, and why (or why not)."""

    used: bool
    layers: int
    reason: str
    error: float | None = None  # the probe's relative error against the dequantized product


# the row counts a probe multiplies: a decode step's one row, a verify block's, a prefill chunk's
PROBE_ROWS = (1, 16, 256)


def probe(product: Product, layer: QuantizedLinear, rows: tuple[int, ...] = PROBE_ROWS) -> float:
    """`product`'s largest relative error on `layer` against the layer's own kernel-free product (its activations as
    the format takes them, times the dequantized weight), over `rows` rows each (raises what the kernel raises)."""
    device = next(layer.parameters()).device
    g = torch.Generator(device=device).manual_seed(0)
    weight, worst = layer.dequantized(), 0.0
    for n in rows:
        x = torch.randn(n, layer.in_features, generator=g, device=device).to(layer.compute_dtype)
        ref = F.linear(layer.activations(x), weight).float()
        worst = max(worst, float((product(x).float() - ref).norm() / ref.norm().clamp(min=1e-12)))
    return worst


def choose_kernel(model: nn.Module, device: torch.device, kernel: QuantKernel) -> KernelChoice:
    """Turn `kernel` on for `model`'s eligible layers of its type when this device runs it correctly (one probe);
    log the choice. Layers stay on the dequantizing forward otherwise."""
    layers = [m for m in model.modules() if isinstance(m, kernel.layer_type)]
    if not layers:
        return KernelChoice(False, 0, f"no {kernel.layer_type.__name__} layers")
    fit = [m for m in layers if kernel.eligible(m)]
    reason = kernel.unavailable(device) or (None if fit else "no layer has the shapes it multiplies")
    error = None
    # one layer of each shape the model has, at each probed row count
    shapes = {(m.out_features, m.in_features): m for m in reversed(fit)}
    for layer in shapes.values() if reason is None else ():
        try:
            error = max(error or 0.0, probe(kernel.prepare(layer), layer))
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # the library refusing the call
            reason = f"the kernel failed its probe: {str(exc).splitlines()[0][:200]}"
            break
        if not error < kernel.tolerance:
            reason = f"the kernel disagreed with the dequantized product (relative error {error:.3g})"
            break
    choice = KernelChoice(reason is None, len(fit) if reason is None else 0,
                          reason or f"{kernel.name} (probe error {error:.3g})", error)
    for layer in fit if choice.used else ():
        layer.kernel = kernel.prepare(layer)
        kernel.adopt(layer)
    log.info("%s matrix multiplies: %s", kernel.layer_type.__name__,
             f"{choice.layers} of {len(layers)} layers by {choice.reason}" if choice.used
             else f"dequantized per layer ({choice.reason})")
    return choice
