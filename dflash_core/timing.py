"""Device time of a step's forwards (``DeviceTimer``), read only after the step's own host sync.

A GPU runs the kernels a forward enqueues after the host has moved on: a host clock read when the forward returns
sees only the launches, and the device time shows up later, where the host waits (the step's one ``.tolist()``).
The width policy's costs must be the device's, so every span is stopped when its work is enqueued and its seconds
are read only after the host has synced with the device:

- on CUDA, ``torch.cuda.Event(enable_timing=True)`` pairs recorded on the current stream around the work; a span's
  seconds are known once its end event has completed (``query()``: never a wait of its own);
- elsewhere, ``time.perf_counter``: a span ends when the host has the work's results, i.e. at the ``synced()``
  that follows it (a device that queues work is timed up to the host's wait for it).

``StepClock`` is what the engine uses: spans, each handed to its cost table (a sink) once its seconds are known.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class DeviceTimer:
    """Spans of device work: ``start()`` before the work is enqueued, ``stop(mark)`` after; ``synced()`` right after
    the host has waited for the device; ``seconds(span)`` after that (None while the device has not finished it)."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self, mark: Any) -> Any:
        raise NotImplementedError

    def synced(self) -> None:
        """The host has just waited for the device (the step's own sync)."""

    def seconds(self, span: Any) -> float | None:
        raise NotImplementedError


class HostTimer(DeviceTimer):
    """``time.perf_counter`` spans that end at the host's next sync after them (CPU, or any device without
    events)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._open: list[list[float | None]] = []

    def start(self) -> float:
        return self.clock()

    def stop(self, mark: float) -> list[float | None]:
        span: list[float | None] = [mark, None]
        self._open.append(span)
        return span

    def synced(self) -> None:
        now = self.clock()
        for span in self._open:
            span[1] = now
        self._open.clear()

    def seconds(self, span: list[float | None]) -> float | None:
        start, end = span
        return None if end is None or start is None else end - start


class CudaTimer(DeviceTimer):
    """CUDA event pairs on the current stream; a span's seconds once its end event has completed."""

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return mark, end

    def seconds(self, span: tuple[torch.cuda.Event, torch.cuda.Event]) -> float | None:
        start, end = span
        return start.elapsed_time(end) / 1000.0 if end.query() else None


def device_timer(device: torch.device | str | None) -> DeviceTimer:
    """Events on a CUDA device, the host clock elsewhere."""
    return CudaTimer() if torch.device(device or "cpu").type == "cuda" else HostTimer()


class StepClock:
    """The engine's spans: ``stop(mark, sink)`` queues the span for its sink (a cost table's ``add``, bound to its
    token count); ``synced()``, called right after each host sync, hands every span the device has finished to its
    sink. A span whose work has no sync of its own in its step (a prefill chunk before the last) is read at a later
    one."""

    def __init__(self, timer: DeviceTimer) -> None:
        self.timer = timer
        self._pending: list[tuple[Any, Callable[[float], None]]] = []

    def start(self) -> Any:
        return self.timer.start()

    def stop(self, mark: Any, sink: Callable[[float], None] | None = None) -> Any:
        span = self.timer.stop(mark)
        if sink is not None:
            self._pending.append((span, sink))
        return span

    def synced(self) -> None:
        self.timer.synced()
        waiting = []
        for span, sink in self._pending:
            seconds = self.timer.seconds(span)
            if seconds is None:
                waiting.append((span, sink))
            else:
                sink(seconds)
        self._pending = waiting

    def seconds(self, span: Any) -> float | None:
        return self.timer.seconds(span)
