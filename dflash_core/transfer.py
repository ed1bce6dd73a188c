"""Host <-> device transfers of a step, through one staging buffer each way, counted.

A step sends its integer inputs (token ids, positions, slots, ...) to the device in ONE copy: `HostToDevice.send`
packs every array into a persistent int64 host buffer (pinned on CUDA, so the copy is a true async DMA) and copies
it with one non_blocking copy into a persistent device buffer, then hands back views of that buffer. It reads the
step's choices back with ONE `to_host`. Both are counted in a module-level `TransferCounts`, which tests read
through `count_transfers()`.
"""

from __future__ import annotations

import array as array_module
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dflash_core.overlap import run_held


@dataclass
class TransferCounts:
    """Copies made through this module: host-to-device (`h2d`) and device-to-host (`d2h`)."""

    h2d: int = 0
    d2h: int = 0

    def copy(self) -> TransferCounts:
        return TransferCounts(self.h2d, self.d2h)


COUNTS = TransferCounts()  # the process-wide counters
_ACTIVE: list[TransferCounts] = []  # the counters of the open `count_transfers()` blocks


def _count(h2d: int = 0, d2h: int = 0) -> None:
    for counts in (COUNTS, *_ACTIVE):
        counts.h2d += h2d
        counts.d2h += d2h


@contextmanager
def count_transfers() -> Iterator[TransferCounts]:
    """Counts the transfers made inside the block (the yielded counts grow while it runs)."""
    counts = TransferCounts()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.remove(counts)


def _shape(array: Any) -> tuple[int, ...]:
    """The shape of a rectangular nested list (or a tensor / scalar)."""
    if isinstance(array, torch.Tensor):
        return tuple(array.shape)
    shape: list[int] = []
    while isinstance(array, (list, tuple)):
        shape.append(len(array))
        if not array:
            break
        array = array[0]
    return tuple(shape)


def _flatten(array: Any, depth: int) -> list[int]:
    if depth == 0:
        return [int(array)]
    if depth == 1:
        return list(array)
    out: list[int] = []
    for item in array:
        out.extend(_flatten(item, depth - 1))
    return out


class HostToDevice:
    """One step's integer inputs to `device` in one copy, through persistent staging buffers.

    `send(*arrays)` -> one int64 tensor per array, on the device, shaped like it. An array is a rectangular nested
    list of ints (any rank), an int, or a host integer tensor (copied as its values, converted to int64). The views
    alias the device buffer: they are valid until the next `send` on this object (a step uses them before its next
    step sends).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._device = torch.empty(0, dtype=torch.int64, device=self.device)
        self._copied: Any = None  # the CUDA event after the last copy out of the pinned buffer

    def _reserve(self, n: int) -> None:
        """Grow (never shrink) both buffers to hold at least n values."""
        if n <= self._host.numel():
            return
        size = max(n, 2 * self._host.numel(), 64)
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=self.pinned)
        self._device = torch.empty(size, dtype=torch.int64, device=self.device)

    def send(self, *arrays: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        shapes = [_shape(a) for a in arrays]
        sizes = [math.prod(s) for s in shapes]
        total = sum(sizes)
        self._reserve(total)
        if self._copied is not None:
            # The previous async copy out of the pinned buffer must be done before it is overwritten (it is, in
            # practice: the step after it read its choices back): an event wait, not a stream sync.
            self._copied.synchronize()
            self._copied = None
        at = 0
        for array, shape, size in zip(arrays, shapes, sizes):
            if size:
                segment = self._host[at : at + size]
                if isinstance(array, torch.Tensor):  # e.g. a packed bitmask: copied as it is, no Python list
                    segment.copy_(array.reshape(-1))
                else:
                    values = array_module.array("q", _flatten(array, len(shape)))  # no torch.tensor: no copy to count
                    segment.copy_(torch.frombuffer(values, dtype=torch.int64))
            at += size
        if total:
            self._device[:total].copy_(self._host[:total], non_blocking=True)
            if self.pinned:
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))
            _count(h2d=1)
        views: list[torch.Tensor] = []
        at = 0
        for shape, size in zip(shapes, sizes):
            views.append(self._device[at : at + size].view(shape))
            at += size
        return tuple(views)


def to_host(t: torch.Tensor) -> list:
    """`t.tolist()`, counted as one device-to-host transfer. On a GPU the host waits here for the step's kernels:
    what this thread holds runs first (`dflash_core/overlap.py`), overlapping them."""
    _count(d2h=1)
    run_held()
    return t.tolist()
