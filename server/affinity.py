"""The server's event loop and worker thread on one core (``--one-core``).

The two threads take turns holding the GIL: each torch op the worker runs releases it and may let the loop in,
and the worker then waits for it back until the loop's Python is done. On different cores every such hand-off is
a cross-core wake-up (an inter-processor interrupt, expensive in a VM); on one core it is a plain context switch.
With one torch thread on a CPU device the worker's ops are small and the loop's work interleaves with them
rather than overlapping them: on the 2-core development VM one streamed plain-decoding request ran 7-18% faster
with the two threads on one core, eight DFlash streams 6% faster (docs/benchmarks.md, "The serving paths").
The fused CPU step (`dflash_core/cpu_step/`) turns that around: a forward is one C call that releases the GIL, the
worker posts a step's events as it enters it (`dflash_core/overlap.py`), and the loop's work runs on the other
core meanwhile, so the default is off there (one stream 5-11% faster, eight 5-14%).

Pinned after warm-up: torch's intra-op threads, created earlier, keep the whole set. Threads and processes that
the pinned threads start later would inherit the single core: pool threads get the original set back when they
first run a call wrapped by ``unpinned``, and helper processes are started from inside ``spawning``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dflash_core.overlap import pays_to_hold

_original: set[int] | None = None  # the process's cores before pinning (None: nothing pinned)
_pinned: int | None = None  # the core the worker and the event loop were pinned to
_released = threading.local()  # a pool thread that is back on the original cores
F = TypeVar("F", bound=Callable[..., Any])


def supported() -> bool:
    """Thread affinity can be set here (Linux), and the process may use more than one core."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1


def default_on(device: str, torch_threads: int, cpu_step: str) -> bool:
    """On by default for a CPU device with one torch thread whose forwards run PyTorch's operators (`cpu_step`
    "torch", the case measured); off where they run as one fused C call ("fused"), and elsewhere opt-in."""
    return device == "cpu" and torch_threads == 1 and not pays_to_hold(device, cpu_step)


def current_core() -> int | None:
    """The core the calling thread last ran on (Linux's /proc), or None."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[36])  # field 39, "processor"
    except (OSError, ValueError, IndexError):
        return None


def choose_core() -> int:
    """The core the calling thread runs on (so that several servers on one machine spread out as the scheduler
    placed them), else the lowest of the process's set."""
    cores = os.sched_getaffinity(0)
    here = current_core()
    return here if here in cores else min(cores)


def pin_current_thread(core: int) -> None:
    """The calling thread onto `core`; the process's set before is remembered first (for `unpinned` and
    `spawning`)."""
    global _pinned
    _remember_original()
    os.sched_setaffinity(0, {core})
    _pinned = core


@contextlib.contextmanager
def sharing_one_core(thread_ids: list[int]) -> Iterator[int]:
    """The threads (native ids of this process) on one core for the block, then back on the cores they had
    (`dflash-bench profile`'s worker path, which measures what the server does)."""
    before = {tid: os.sched_getaffinity(tid) for tid in thread_ids}
    saved = _original
    core = choose_core()
    _remember_original()
    try:
        for tid in thread_ids:
            os.sched_setaffinity(tid, {core})
        yield core
    finally:
        for tid, cores in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores)
        _set_original(saved)


def release_current_thread() -> None:
    """The calling thread back on the process's cores from before any pin (an in-process server that has stopped:
    tests run many, on the thread that ran their event loops); what other threads pinned stays as it is."""
    if _original is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, _original)


def _set_original(cores: set[int] | None) -> None:
    global _original
    _original = cores


def _remember_original() -> None:
    """The process's cores before anything is pinned (kept from the first pin on)."""
    if _original is None:
        _set_original(os.sched_getaffinity(0))


def cores_beside_the_worker() -> set[int] | None:
    """The process's cores but the one the worker was pinned to, for background work (`--adapt-draft`'s
    training); None when nothing is pinned or no other core is left."""
    if _original is None or _pinned is None:
        return None
    rest = _original - {_pinned}
    return rest or None


def unpinned(fn: F) -> F:
    """`fn`, run by a pool thread on the server's original cores: the pool's threads are started by the pinned
    event-loop thread and would otherwise share its core with the worker."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _original is not None and not getattr(_released, "done", False):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, _original)
            _released.done = True
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """The calling (pinned) thread back on the original cores while it starts a process, which inherits the
    mask at its fork: a helper started on the worker's core would compete with it for that core from its first
    instruction (measured: a parse helper started beside a running stream took over 30 s to start)."""
    if _original is None:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _original)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
