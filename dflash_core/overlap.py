"""Host work held back until the thread next waits for the device, so that it overlaps the device's work.

The server's worker thread hands each step's events to the event loop's thread (`server/handoff.py`). Posted
when the step ends, they wake the loop while the worker runs the next step's Python (scheduling, inputs): the two
threads want the GIL at once and one of them waits. Held until the worker enters a wait that releases the GIL
(the fused CPU step's C call; on a GPU the step's first device-to-host copy, where the host waits for the kernels:
the draft's proposals, else the target's choices), the loop's work runs on another core during the forward
instead. A step's events are then posted one step's host preparation later (about 0.1-0.3 ms on the development
CPU): the worker runs what it holds before anything else it posts, before a call between steps (a draft swap),
and before it blocks for lack of work, so that nothing is held longer and events keep their order.

It pays where a forward has such a wait (`pays_to_hold`). PyTorch's operators on a CPU compute as they are called
and give the GIL up at each one: the first wait comes after the forward, and work held for it would only be late,
so a PyTorch forward on a CPU runs what is held first (the native target's, for the prefills and trees the fused
step leaves to it).

`hold` and `run_held` act on the calling thread's work only: other threads (a benchmark's engine, a helper's
forward) run none of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("dflash.overlap")


class _Held(threading.local):
    """One thread's held work, in order."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []


_held = _Held()


def pays_to_hold(device: str, cpu_step: str) -> bool:
    """Whether the forwards on `device` wait for it with the GIL released: a GPU's (the host waits at the step's
    device-to-host copy while the kernels run), or the fused CPU step's (`cpu_step` "fused": one C call)."""
    return not device.startswith("cpu") or cpu_step == "fused"


def hold(work: Callable[[], None]) -> None:
    """Run `work` at this thread's next `run_held` (in the order held)."""
    _held.work.append(work)


def run_held() -> None:
    """Run what this thread holds: right before it waits for the device without the GIL, or where it must not
    hold any longer. A failing piece is logged; the rest still run (the caller is a forward)."""
    if not _held.work:
        return
    held, _held.work = _held.work, []
    for work in held:
        try:
            work()
        except Exception:
            log.exception("held host work failed")
