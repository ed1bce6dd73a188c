"""The C side of the fused CPU step as Python sees it: ctypes mirrors of `fused_step.c`'s structs, its functions'
signatures, and `ModelView`, a model's tensors described to C (pointers, sizes, the rotary table).

Field order and types follow the C structs exactly; keep the two in step. A `ModelView` holds every tensor its
struct points into, so none is freed while C may read it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_core.cpu_step.build import CpuStepUnavailable, load_library

__all__ = ["Batch", "DraftBatch", "LayerTensors", "ModelView", "Scratch", "bound_library", "float_ptr", "int_ptr"]

_f = ctypes.POINTER(ctypes.c_float)
_i = ctypes.POINTER(ctypes.c_int64)
_i64 = ctypes.c_int64
_c = ctypes.c_float


class Layer(ctypes.Structure):
    _fields_ = [(n, _f) for n in ("norm_in", "norm_post", "qkv", "qkv_bias", "qk_norm", "o", "o_bias", "gate_up",
                                  "down", "k_cache", "v_cache")]


class Model(ctypes.Structure):
    _fields_ = [*((n, _i64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "layers", "vocab",
                                      "rot_dim", "kv_block", "max_pos")),
                ("eps", _c), ("qk_eps", _c), ("scale", _c), ("embed", _f), ("embed_row", _i64), ("embed_col", _i64),
                ("final_norm", _f), ("lm_head", _f), ("cos", _f), ("sin", _f), ("layer", ctypes.POINTER(Layer)),
                ("fc", _f), ("hidden_norm", _f), ("feat", _i64), ("embed_scale", _c)]


class Batch(ctypes.Structure):
    """A target forward's tokens (`dflash_forward`)."""

    _fields_ = [("tokens", _i64), ("ids", _i), ("pos", _i), ("seq", _i), ("tables", _i), ("requests", _i64),
                ("table_len", _i64), ("context", _i64), ("hidden_ids", _i), ("n_hidden", _i64), ("features", _f),
                ("head_rows", _i), ("n_head", _i64), ("logits", _f), ("scratch", _f)]


class DraftBatch(ctypes.Structure):
    """A draft forward's blocks and new context rows (`dflash_draft_forward`)."""

    _fields_ = [("requests", _i64), ("width", _i64), ("ids", _i), ("start", _i), ("block_len", _i),
                ("n_ctx", _i64), ("ctx", _f), ("ctx_pos", _i), ("ctx_row", _i), ("tables", _i), ("table_len", _i64),
                ("pos", _i), ("context", _i64), ("hidden", _f), ("scratch", _f)]


def float_ptr(t: torch.Tensor | None) -> ctypes._Pointer | None:  # type: ignore[type-arg]
    """A float32 tensor's data as a C pointer (None: NULL)."""
    return None if t is None else ctypes.cast(t.data_ptr(), _f)


def int_ptr(address: int) -> ctypes._Pointer:  # type: ignore[type-arg]
    """An int64 array at `address` as a C pointer."""
    return ctypes.cast(address, _i)


def bound_library() -> ctypes.CDLL:
    """The built library with its functions' signatures set."""
    lib = load_library()
    model = ctypes.POINTER(Model)
    for name, batch in (("dflash_forward", Batch), ("dflash_draft_forward", DraftBatch)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _i64, [model, ctypes.POINTER(batch)]
    lib.dflash_scratch_floats.restype = _i64
    lib.dflash_scratch_floats.argtypes = [model, _i64, _i64]
    lib.dflash_draft_scratch_floats.restype = _i64
    lib.dflash_draft_scratch_floats.argtypes = [model, _i64, _i64, _i64, _i64]
    return lib


class Scratch:
    """A forward's float32 work space for C, grown (doubling) as calls need more and kept between calls."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def at_least(self, floats: int) -> torch.Tensor:
        if self._buffer.numel() < floats:
            self._buffer = torch.empty(max(floats, 2 * self._buffer.numel()), dtype=torch.float32)
        return self._buffer


@dataclass
class LayerTensors:
    """One decoder layer's tensors as C reads them (weights input-major; None: absent)."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: torch.Tensor  # packed query / key / value weight [Q + 2 KV, H], stored [H, Q + 2 KV]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [heads + kv_heads, d]
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor  # [rows, kv_heads, d]
    v_cache: torch.Tensor


class ModelView:
    """A model described to C: `model` (the struct) and every tensor it points into, kept alive.

    `rope(positions)` gives cos / sin [1, n, r] of integer positions [1, n]; its table covers 0 .. max_pos - 1.
    The sizes come as keyword arguments named as the struct's fields.
    """

    def __init__(self, layers: Sequence[LayerTensors], rope: object, max_pos: int, *, embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor | None = None, fc: torch.Tensor | None = None,
                 hidden_norm: torch.Tensor | None = None, embed_scale: float = 1.0, **sizes: float) -> None:
        with torch.inference_mode():
            cos, sin = rope(torch.arange(max_pos)[None])  # type: ignore[operator]
        self._cos, self._sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        rot = int(self._cos.shape[-1])
        if rot % 2 or rot > sizes["head_dim"]:
            raise CpuStepUnavailable(f"a rotary table of {rot} dims for heads of {sizes['head_dim']}")
        keep = [self._cos, self._sin, embed, final_norm, lm_head, fc, hidden_norm]
        self._layers = (Layer * len(layers))()
        for li, lt in enumerate(layers):
            parts = (lt.norm_in, lt.norm_post, lt.qkv, lt.qkv_bias, None if lt.qk_norm is None else
                     lt.qk_norm.contiguous(), lt.o, lt.o_bias, lt.gate_up, lt.down, lt.k_cache, lt.v_cache)
            for p in (lt.norm_in, lt.norm_post, lt.qkv_bias, lt.o_bias, lt.k_cache, lt.v_cache):
                if p is not None and not p.is_contiguous():
                    raise CpuStepUnavailable("norm weights, biases or KV cache tensors that are not contiguous")
            keep += parts
            self._layers[li] = Layer(*(float_ptr(p) for p in parts))
        for t in (final_norm, hidden_norm):
            if t is not None and not t.is_contiguous():
                raise CpuStepUnavailable("a norm weight that is not contiguous")
        if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in keep):
            raise CpuStepUnavailable("tensors that are not float32 on the CPU")
        # the tensors themselves (detached: their storage), so a parameter given new data later frees nothing C reads
        self._keep = [t.detach() for t in keep if t is not None]
        self.model = Model(layers=len(layers), rot_dim=rot, max_pos=max_pos, embed=float_ptr(embed),
                           embed_row=embed.stride(0), embed_col=embed.stride(1), final_norm=float_ptr(final_norm),
                           lm_head=float_ptr(lm_head), cos=float_ptr(self._cos), sin=float_ptr(self._sin),
                           layer=self._layers, fc=float_ptr(fc), hidden_norm=float_ptr(hidden_norm),
                           embed_scale=embed_scale, **sizes)
