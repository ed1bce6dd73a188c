"""Integer-quantized linear layers in compressed-tensors' `pack-quantized` format (W4A16, W8A16: weight-only).

A checkpoint's layer holds `weight_packed` [out, ceil(in * bits / 32)] int32 (the signed values offset by
2^(bits-1) and packed densely, element i at bit i * bits of its row, little-endian words), `weight_scale`
[out, ceil(in / group)] (one scale per `group` inputs of a row, the last group possibly partial; [out, 1] per
channel) and `weight_shape` ([out, in]).
The weight is symmetric: `value * scale`. This is what compressed-tensors' compressor writes for GPTQ- and AWQ-style
4-bit schemes and what vLLM serves as W4A16.

A forward unpacks and dequantizes the layer's weight into the compute dtype and multiplies (`F.linear`), with
compressed-tensors' arithmetic (values cast to the scale's dtype, times the scale, then cast), so the weight equals
the one transformers' own forward decompresses from the same checkpoint, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_core.quant.base import GroupedIntLinear


def unpack_uint(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """[rows, words] int32 of densely packed unsigned `bits`-bit codes (code i of a row at bit i * bits, words
    little-endian) -> [rows, columns] uint8."""
    rows = packed.shape[0]
    if bits == 4:  # a 4-bit value never straddles a byte: split bytes (little-endian words)
        nibbles = packed.contiguous().view(torch.uint8)
        values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1)
    elif bits == 8:
        values = packed.contiguous().view(torch.uint8).view(rows, -1)
    else:
        raise ValueError(f"{bits}-bit packed weights are not served (4 and 8 are)")
    return values[:, :columns]


def pack_uint(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack_uint`'s inverse: [rows, columns] unsigned `bits`-bit codes -> [rows, ceil(columns * bits / 32)] int32
    (code i of a row at bit i * bits, words little-endian; a last word's unused codes zero)."""
    per_word = 32 // bits
    rows, columns = codes.shape
    padded = torch.zeros(rows, -(-columns // per_word) * per_word, dtype=torch.int64, device=codes.device)
    padded[:, :columns] = codes.to(torch.int64)
    shifts = torch.arange(0, 32, bits, device=codes.device)
    words = (padded.view(rows, -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """[rows, words] int32 of densely packed `bits`-bit values (offset by 2^(bits-1)) -> [rows, columns] int8."""
    return (unpack_uint(packed, bits, columns).to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def dequantize_groups(values: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """int8 `values` [out, in] times `scale` [out, ceil(in / group)] (each scale over its `group` inputs; the last
    group may be partial), computed in the scale's dtype, cast to `dtype`."""
    rows, cols = values.shape
    w = values.to(scale.dtype)
    if cols % group == 0:  # the scales broadcast over a view of the groups
        return (w.view(rows, cols // group, group) * scale[:, :, None]).view(rows, cols).to(dtype)
    return (w * scale.repeat_interleave(group, dim=1)[:, :cols]).to(dtype)


class PackedIntLinear(GroupedIntLinear):
    """A linear layer with `bits`-bit symmetric integer weights packed in int32 and per-group (or per-channel)
    scales; parameter names as compressed-tensors' checkpoints: `weight_packed`, `weight_scale`, `weight_shape`."""

    storage = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(
        self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool, dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        """`group_size`: inputs per scale (None: one scale per output channel)."""
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group = group_size or in_features
        groups = -(-in_features // self.group)
        self.compute_dtype = dtype
        words = -(-in_features * bits // 32)
        self.weight_packed = nn.Parameter(torch.empty(out_features, words, dtype=torch.int32, device=device),
                                          requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=dtype, device=device),
                                         requires_grad=False)
        self.weight_shape = nn.Parameter(torch.tensor([out_features, in_features], device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    def dequantized(self) -> torch.Tensor:
        """The weight in the compute dtype, as the checkpoint means it."""
        values = unpack_int32(self.weight_packed, self.bits, self.in_features)
        return dequantize_groups(values, self.weight_scale, self.group, self.compute_dtype)

    def int_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored codes (the values offset by 2^(bits-1)), that offset as every zero point, the scales."""
        codes = unpack_uint(self.weight_packed, self.bits, self.in_features)
        return codes, torch.full_like(self.weight_scale, 1 << (self.bits - 1)), self.weight_scale

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group={self.group}")
