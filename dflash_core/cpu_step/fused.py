"""The native target's forward on a CPU as ONE call into `fused_step.c`: `FusedCpuStep`.

Serves `NativeTarget.forward_batch` (prefill, plain steps, verify blocks, any mix of requests; trees keep the
PyTorch forward) where the target runs in float32 on a CPU with every layer a packed `DenseLayer` with its SiLU
MLP and weights stored input-major. Each request's tokens run unpadded; the C code writes each token's keys and
values into the runner's own paged cache tensors and attends through the request's block table, so the two
forwards can take turns on one cache. The call releases the GIL: the HTTP side runs on another core meanwhile.

`DFLASH_CPU_STEP` picks it: `auto` (default: fused where it applies and builds), `fused` (fail at start-up where it
cannot), `torch` (never). Why it exists, and what it gains: docs/benchmarks.md ("Side by side with llama.cpp").
"""

from __future__ import annotations

import ctypes
import logging
import os
from array import array
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from dflash_core.cpu_step.abi import Batch, LayerTensors, ModelView, Scratch, bound_library, float_ptr, int_ptr
from dflash_core.cpu_step.build import CpuStepUnavailable
from dflash_core.overlap import run_held
from dflash_core.runners.base import TargetOutput
from dflash_core.runners.dense import DenseLayer, norm_eps
from dflash_core.runners.paged import PagedTarget, Rows
from dflash_core.weight_layout import is_input_major, store_input_major, stores_input_major

__all__ = ["CPU_STEP_ENV", "CPU_STEP_MODES", "FUSED_PREFILL_TOKENS", "FusedCpuStep", "FusedTarget", "cpu_step_mode",
           "fused_cpu_step", "fused_or_none", "lay_out_for_fused_step", "threads_reason", "unsupported"]

log = logging.getLogger("dflash.cpu_step")

T = TypeVar("T")
CPU_STEP_ENV = "DFLASH_CPU_STEP"
# a prefill forward of more tokens than this runs the PyTorch forward: on hundreds of rows MKL's products run about
# twice as fast as the C's (one thread, 512 x 1024 x 4096: 146 against 74 GFLOP/s on the development VM), and
# per-op overhead no longer counts (the demo target, whose attention weighs more, ran equal up to 1,900 tokens)
FUSED_PREFILL_TOKENS = 256
CPU_STEP_MODES = ("auto", "fused", "torch")


class FusedTarget(Protocol):
    """What the fused step reads from a target runner (`NativeTarget` is one)."""

    device: torch.device
    dtype: torch.dtype
    dense: list[DenseLayer | None]  # each layer packed, or None
    embed_weight: torch.Tensor
    lm_head: torch.nn.Module
    lm_head_weight: torch.Tensor
    norm: torch.nn.Module  # the final norm
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, positions [1, n]) -> cos, sin
    layer_ids: list[int]
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_block_size: int
    max_len: int
    scaling: float

    def layer_kv(self, li: int) -> tuple[torch.Tensor, torch.Tensor]: ...

def cpu_step_mode() -> str:
    """`DFLASH_CPU_STEP`'s value: auto (default), fused or torch."""
    mode = os.environ.get(CPU_STEP_ENV, "").strip().lower() or "auto"
    if mode not in CPU_STEP_MODES:
        raise ValueError(f"{CPU_STEP_ENV}={mode!r}: expected one of {', '.join(CPU_STEP_MODES)}")
    return mode


def threads_reason(mode: str) -> str | None:
    """Why `auto` leaves the forward to PyTorch at this thread count, or None: the C runs on one thread, so where
    torch was given more (`--threads N`) its multi-threaded forward keeps them (`fused` forces the C)."""
    threads = torch.get_num_threads()
    if mode == "auto" and threads > 1:
        return f"torch runs {threads} threads and the fused step one ({CPU_STEP_ENV}=fused forces it)"
    return None


def lay_out_for_fused_step(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Store `model`'s linear weights input-major where the fused step may run it (float32 on a CPU, not turned
    off), as the loader does for every served CPU float32 model: a runner built on a model from elsewhere (a test,
    the Python API) gets the fused step too. In place, values unchanged; idempotent."""
    if cpu_step_mode() != "torch" and stores_input_major(device, dtype):
        store_input_major(model)


def unsupported(target: FusedTarget) -> str | None:
    """Why the fused step cannot run `target`, or None when it can."""
    if target.device.type != "cpu" or target.dtype != torch.float32:
        return f"it runs float32 on a CPU (the target is {target.dtype} on {target.device.type})"
    for li, dense in enumerate(target.dense):
        if dense is None or dense.mlp is not None:
            return f"layer {li} is not a plain attention layer with a SiLU-gated MLP"
        if not all(is_input_major(w) for w in (dense.qkv, dense.o, dense.gate_up, dense.down)):
            return f"layer {li}'s weights are not stored input-major"
    if not is_input_major(target.lm_head_weight) or target.lm_head.bias is not None:
        return "the output head is not stored input-major, or has a bias"
    if target.embed_weight.dim() != 2:
        return "an embedding that is not one matrix"
    return None


def target_view(target: FusedTarget) -> ModelView:
    """`target`'s tensors described to C (a target `unsupported` accepts)."""
    layers = []
    for li, dense in enumerate(target.dense):
        assert dense is not None and dense.mlp is None
        layers.append(LayerTensors(dense.norm_in, dense.norm_post, dense.qkv, dense.qkv_bias, dense.qk_norm, dense.o,
                                   dense.o_bias, dense.gate_up, dense.down, *target.layer_kv(li)))
    first = target.dense[0]
    assert first is not None
    if any(d is None or d.eps != first.eps or d.qk_eps != first.qk_eps for d in target.dense) or (
            norm_eps(target.norm) != first.eps):
        raise CpuStepUnavailable("norms of different epsilons")
    probe = torch.zeros(1, dtype=target.dtype)
    return ModelView(layers, lambda pos: target.rotary(probe, pos), target.max_len, embed=target.embed_weight,
                     final_norm=target.norm.weight, lm_head=target.lm_head_weight, hidden=target.hidden_size,
                     heads=target.num_heads, kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                     inter=first.intermediate, vocab=target.vocab_size, kv_block=target.kv_block_size,
                     eps=first.eps, qk_eps=first.qk_eps, scale=target.scaling)


class FusedCpuStep:
    """`target`'s forward (a `FusedTarget` that `unsupported` accepts) as one C call per forward."""

    def __init__(self, target: FusedTarget, lib: ctypes.CDLL) -> None:
        self.target = target
        self._lib = lib
        self.view = target_view(target)
        self._scratch = Scratch()

    @staticmethod
    def serves(rows: Rows, last_only: bool) -> bool:
        """Whether this forward runs here: every decode and verify step, and prefills up to
        `FUSED_PREFILL_TOKENS` tokens."""
        return not last_only or sum(len(t) for t, _, _ in rows) <= FUSED_PREFILL_TOKENS

    def forward(self, rows: Rows, features: bool, last_only: bool) -> list[TargetOutput]:
        """`NativeTarget.forward_batch` of `rows` (checked by the caller): logits [n, V] of each row's tokens
        (last_only: of its last), and its draft features when asked."""
        t = self.target
        kvb = t.kv_block_size
        ids: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        heads: list[int] = []
        for r, (tokens, start, _cache) in enumerate(rows):
            ids += tokens
            pos += range(start, start + len(tokens))
            seq += [r] * len(tokens)
            heads += [len(ids) - 1] if last_only else range(len(ids) - len(tokens), len(ids))
        context = max(pos) + 1
        width = -(-context // kvb)
        tables = [b for _, _, cache in rows for b in (list(cache.blocks[:width]) + [0] * width)[:width]]
        hidden = [i + 1 for i in t.layer_ids] if features else []
        T = len(ids)
        ints = array("q", ids + pos + seq + tables + hidden + heads)
        base, size = ints.buffer_info()[0], ints.itemsize

        def at(offset: int) -> ctypes._Pointer:  # type: ignore[type-arg]
            return int_ptr(base + offset * size)

        logits = torch.empty(len(heads), t.vocab_size, dtype=torch.float32)
        feat = torch.empty(T, len(hidden) * t.hidden_size, dtype=torch.float32) if hidden else None
        o_tab = 3 * T
        o_hid = o_tab + len(tables)
        o_heads = o_hid + len(hidden)
        batch = Batch(T, at(0), at(T), at(2 * T), at(o_tab), len(rows), width, context, at(o_hid), len(hidden),
                      float_ptr(feat), at(o_heads), len(heads), float_ptr(logits),
                      float_ptr(self._scratch.at_least(self._lib.dflash_scratch_floats(
                          ctypes.byref(self.view.model), T, context))))
        self.run_kernel(batch)
        return PagedTarget.split_rows(rows, logits, feat, last_only)

    def run_kernel(self, batch: Batch) -> None:
        """The C call itself (`dflash-bench profile` times it apart from the Python around it); what this thread
        holds runs first (`dflash_core/overlap.py`: the event loop's work then overlaps the call)."""
        run_held()
        if self._lib.dflash_forward(ctypes.byref(self.view.model), ctypes.byref(batch)) != 0:
            raise ValueError(f"a position beyond the rotary table ({self.target.max_len})")


def fused_or_none(what: str, reason: str | None, build: Callable[[ctypes.CDLL], T], refuse: bool,
                  on_cpu: bool) -> T | None:
    """One fused step as `DFLASH_CPU_STEP` asks, for the target or the draft (`what`): `build(library)` where
    nothing stands in the way (`reason` None: it applies, at this thread count); else None, logged once on a CPU,
    or (`refuse`: the mode is `fused` where the caller says it must run) a ValueError with the reason."""
    if reason is None:
        try:
            return build(bound_library())
        except CpuStepUnavailable as e:
            reason = str(e)
    if refuse:
        raise ValueError(f"{CPU_STEP_ENV}=fused: the fused CPU step cannot run this {what}: {reason}")
    if on_cpu:
        log.info("fused CPU %s off: %s (the PyTorch forward runs)", "step" if what == "target" else "draft step",
                 reason)
    return None


def fused_cpu_step(target: FusedTarget) -> FusedCpuStep | None:
    """The fused step for `target` as `DFLASH_CPU_STEP` asks: None where it is off, or (auto) where it does not
    apply or cannot be built (logged once); `fused` raises a ValueError with the reason instead."""
    mode = cpu_step_mode()
    if mode == "torch":
        return None
    return fused_or_none("target", unsupported(target) or threads_reason(mode),
                         lambda lib: FusedCpuStep(target, lib), mode == "fused", target.device.type == "cpu")
