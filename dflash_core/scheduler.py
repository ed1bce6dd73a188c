"""The scheduler: the one place that holds waiting, prefilling and running requests, and plans each step.

A step has a token budget (`max_num_batched_tokens`, as in vLLM): prefill chunks first, at most `prefill_chunk`
prompt tokens per step over all prefilling requests, so that a long prompt never stalls running streams by more
than one chunk; the verify rows of the running requests get the rest (one token each at least). Several new
requests are prefilled in one forward; a request takes a slot when its prefill starts and waits, in order, while
no slot is free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from dflash_core.slots import SlotPool


class Schedulable(Protocol):
    """What the scheduler reads of a request (the engine's request record)."""

    prompt: list[int]
    prefilled: int  # prompt tokens already in the target cache
    aborted: bool


@dataclass
class Chunk:
    """Prompt tokens `start .. start + len(tokens)` of one request, prefilled this step."""

    req: Schedulable
    start: int
    tokens: list[int]

    @property
    def last(self) -> bool:
        """The chunk ends the prompt: its forward gives the first generated token."""
        return self.start + len(self.tokens) == len(self.req.prompt)


@dataclass
class StepPlan:
    """What one step does."""

    aborted: list[Schedulable] = field(default_factory=list)
    starting: list[Schedulable] = field(default_factory=list)  # take a slot now (their first chunk is below)
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Schedulable] = field(default_factory=list)
    verify_budget: int | None = None  # verify tokens the running requests may use (None: no bound)


class Scheduler:
    """Waiting (no slot yet), prefilling (a slot, part of the prompt cached) and running (decoding) requests."""

    def __init__(self, slots: SlotPool, max_num_batched_tokens: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        if max_num_batched_tokens is not None and max_num_batched_tokens < 2:
            raise ValueError("max_num_batched_tokens must be >= 2")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill chunk size must be >= 1")
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Schedulable] = deque()
        self.prefilling: list[Schedulable] = []
        self.running: list[Schedulable] = []

    def add(self, req: Schedulable) -> None:
        self.waiting.append(req)

    def started(self, req: Schedulable) -> None:
        """The request took its slot (its first chunk runs this step)."""
        self.waiting.remove(req)
        self.prefilling.append(req)

    def prefilled(self, req: Schedulable) -> None:
        """Its whole prompt is cached: it decodes from the next step on."""
        self.prefilling.remove(req)
        self.running.append(req)

    def remove(self, req: Schedulable) -> None:
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
                return

    def num_waiting(self) -> int:
        """Requests not yet decoding (waiting for a slot, or being prefilled)."""
        return len(self.waiting) + len(self.prefilling)

    def num_running(self) -> int:
        return len(self.running)

    def schedule(self, prefill_room: int | None = None) -> StepPlan:
        """Plan one step: aborted requests, prefill chunks (continuing ones first, then new ones in arrival
        order while slots are free), and the running requests with the verify tokens left in the budget.
        `prefill_room` lowers this step's prefill tokens below the chunk size (the engine sizes it so that a
        chunk takes about as long as a decode step while streams run)."""
        plan = StepPlan()
        for queue in (self.running, self.prefilling, self.waiting):
            plan.aborted += [r for r in queue if r.aborted]
        decode = [r for r in self.running if not r.aborted]
        budget = self.max_num_batched_tokens
        room = self.prefill_chunk
        if prefill_room is not None:
            room = prefill_room if room is None else min(room, prefill_room)
        if budget is not None:
            room = min(room if room is not None else budget, max(budget - len(decode), 1))
        free = self.slots.num_free()
        candidates = [r for r in self.prefilling if not r.aborted]
        for r in self.waiting:
            if r.aborted:
                continue
            if free is not None and free <= 0:
                break
            candidates.append(r)
            plan.starting.append(r)
            if free is not None:
                free -= 1
        used = 0
        for r in candidates:
            if room is not None and used >= room:
                if r in plan.starting:
                    plan.starting.remove(r)
                continue
            n = len(r.prompt) - r.prefilled
            if room is not None:
                n = min(n, room - used)
            plan.prefill.append(Chunk(r, r.prefilled, r.prompt[r.prefilled : r.prefilled + n]))
            used += n
        plan.decode = decode
        if budget is not None:
            plan.verify_budget = max(budget - used, len(decode))
        return plan
