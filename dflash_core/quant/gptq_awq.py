"""4- and 8-bit integer linear layers in GPTQ's and AWQ's own checkpoint formats (weight-only, with zero points).

Both keep unsigned integer codes packed in int32 words, a scale and a zero point per group of inputs and output
channel, and mean the weight `scale * (code - zero)`:

- **GPTQ** (`quant_method: gptq`, as GPTQModel / AutoGPTQ write it): `qweight` [in * bits / 32, out] (codes packed
  along the inputs: input i of a column at word i * bits // 32, bit (i * bits) % 32), `qzeros` [groups, out * bits / 32]
  (packed along the outputs), `scales` [groups, out] float16, `g_idx` [in] (each input's group: `i // group_size`, or
  any order under act-order, `desc_act`). Its original format ("gptq", v1) stores each zero point minus one,
  subtracted from the packed word as a whole (borrows included); "gptq_v2" stores it as it is.
- **AWQ** (`quant_method: awq`, version "gemm", as AutoAWQ / GPTQModel write it): `qweight` [in, out / 8] and
  `qzeros` [groups, out / 8], both packed along the outputs in AWQ's interleaved order (the 8 codes of a word are
  outputs 0, 2, 4, 6, 1, 3, 5, 7 of its eight), `scales` [groups, out] float16; input i is in group i // group_size.

A forward dequantizes the layer's weight with the formats' own arithmetic (the integer difference, times the scale in
the scale's dtype, then cast to the compute dtype: GPTQModel's reference kernels) and multiplies (`F.linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_core.quant.base import GroupedIntLinear
from dflash_core.quant.packed_int import pack_uint, unpack_uint

# AWQ's order of the 8 outputs in a packed word, undone: output k of the 8 is code AWQ_UNDO[k] of the word
AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)


def _dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """`scales[g] * (codes - zeros[g])` for each input's group g = `groups[i]`: codes [in, out] and zeros
    [groups, out] unsigned, scales [groups, out]; the product in the scale's dtype, returned [out, in] in `dtype`."""
    diff = codes.to(torch.int16) - zeros.to(torch.int16)[groups]
    return (scales[groups] * diff.to(scales.dtype)).t().to(dtype)


class _ZeroPointLinear(GroupedIntLinear):
    """The parameters GPTQ and AWQ layers share: `qweight`, `qzeros`, `scales` (float16, as the checkpoints hold
    them), `bias`; `bits`, `group` (inputs per group)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool,
                 dtype: torch.dtype, qweight_shape: tuple[int, int], device: torch.device | str | None) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights are not served (4 and 8 are)")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group = group_size if group_size and group_size > 0 else in_features
        self.compute_dtype = dtype
        groups = -(-in_features // self.group)
        per_word = 32 // bits

        def param(*shape: int, kind: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=kind, device=device), requires_grad=False)

        self.qweight = param(*qweight_shape, kind=torch.int32)
        self.qzeros = param(groups, -(-out_features // per_word), kind=torch.int32)
        self.scales = param(groups, out_features, kind=torch.float16)
        self.bias = param(out_features, kind=dtype) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group={self.group}")


class GptqLinear(_ZeroPointLinear):
    """A GPTQ layer: parameters named as its checkpoints (`qweight`, `qzeros`, `scales`, `g_idx`, `bias`);
    `zero_offset` 1 for the original format (zeros stored minus one), 0 for "gptq_v2"."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool,
                 dtype: torch.dtype, zero_offset: int, device: torch.device | str | None = None) -> None:
        words = -(-in_features * bits // 32)
        super().__init__(in_features, out_features, bits, group_size, bias, dtype, (words, out_features), device)
        self.zero_offset = zero_offset
        self.g_idx = nn.Parameter(torch.arange(in_features, device=device, dtype=torch.int32) // self.group,
                                  requires_grad=False)

    def _zero_words(self) -> torch.Tensor:
        """`qzeros` with the original format's offset undone as GPTQModel undoes it: one added to every code of a
        word at once, so a stored -1 (a zero point of 0) borrows from its neighbour and the sum carries into it."""
        if not self.zero_offset:
            return self.qzeros
        ones = sum(1 << shift for shift in range(0, 32, self.bits))  # 0x11111111 (4-bit), 0x01010101 (8-bit)
        words = (self.qzeros.long() + ones) & 0xFFFFFFFF
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    storage = ("qweight", "qzeros", "scales", "g_idx")

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [in, out], zero points [groups, out])."""
        codes = unpack_uint(self.qweight.t(), self.bits, self.in_features).t()
        return codes, unpack_uint(self._zero_words(), self.bits, self.out_features)

    def dequantized(self) -> torch.Tensor:
        codes, zeros = self._codes()
        return _dequantize(codes, zeros, self.scales, self.g_idx.long(), self.compute_dtype)

    def int_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        in_order = torch.arange(self.in_features, device=self.g_idx.device) // self.group
        if not torch.equal(self.g_idx.long(), in_order):
            return None  # act-order: a group's inputs are scattered
        codes, zeros = self._codes()
        return codes.t(), zeros.t(), self.scales.t()


class AwqLinear(_ZeroPointLinear):
    """An AWQ ("gemm") layer: parameters named as its checkpoints (`qweight`, `qzeros`, `scales`, `bias`)."""

    storage = ("qweight", "qzeros", "scales")

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None, bias: bool,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        if bits != 4 or out_features % 8:
            raise ValueError(f"AWQ layers of {bits}-bit weights and {out_features} outputs are not served (4-bit, "
                             "outputs a multiple of 8)")
        super().__init__(in_features, out_features, bits, group_size, bias, dtype, (in_features, out_features // 8),
                         device)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[rows, out / 8] words -> [rows, out] codes in the outputs' order (AWQ's interleave undone)."""
        codes = unpack_uint(packed, self.bits, self.out_features)
        return codes.view(codes.shape[0], -1, 8)[:, :, list(AWQ_UNDO)].reshape(codes.shape)

    def dequantized(self) -> torch.Tensor:
        groups = torch.arange(self.in_features, device=self.qweight.device) // self.group
        return _dequantize(self._unpack(self.qweight), self._unpack(self.qzeros), self.scales, groups,
                           self.compute_dtype)

    def int_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._unpack(self.qweight).t(), self._unpack(self.qzeros).t(), self.scales.t()


def quantize_int4(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """`weight` [out, in] as a `GptqLinear` of GPTQ's v2 format holds it (`qweight`, `qzeros`, `scales`, `g_idx`):
    round to nearest, 4-bit codes with a float16 scale and a zero point per `group` inputs, the group's minimum and
    maximum (and 0) exactly representable ends (`--quantization int4`)."""
    out, inputs = weight.shape
    w = weight.float()
    g_idx = torch.arange(inputs, device=w.device) // group
    groups = -(-inputs // group)
    padded = torch.zeros(out, groups * group, device=w.device)
    padded[:, :inputs] = w
    blocks = padded.view(out, groups, group)
    lo = blocks.amin(-1).clamp(max=0)
    hi = blocks.amax(-1).clamp(min=0)
    if inputs % group:  # the last group's padding is not a weight: its range is the real inputs'
        tail = w[:, (groups - 1) * group:]
        lo[:, -1], hi[:, -1] = tail.amin(-1).clamp(max=0), tail.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scales.float()[:, g_idx]) + zeros[:, g_idx], 0, 15).to(torch.uint8)
    # qweight: input i of a column at word i // 8 (codes packed along the inputs); qzeros along the outputs
    return {"qweight": pack_uint(codes, 4).t().contiguous(), "qzeros": pack_uint(zeros.t(), 4),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
