"""Events from the worker thread to the asyncio event loops that wait for them (thread-safe)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("dflash.worker")

Delivery = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[Any]", Any]  # (loop, queue, event)


def _deliver(items: list[Delivery]) -> None:
    for _, queue, event in items:
        try:
            queue.put_nowait(event)
        except Exception:  # one request's queue must not cost the others their events
            log.exception("delivering a worker event failed")


def post_all(items: list[Delivery]) -> None:
    """Put each event on its queue from its loop's thread, in order: one wake-up of each loop for all of its
    events, rather than one per event (a step of N streams wakes the loop once)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for item in items:
        by_loop.setdefault(item[0], []).append(item)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, group)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
