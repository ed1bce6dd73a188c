"""The scheduler: the one place that holds waiting, prefilling and running requests, and plans each step.

A step has a token budget (`max_num_batched_tokens`, as in vLLM): prefill chunks first, at most `prefill_chunk`
prompt tokens per step over all prefilling requests, so that a long prompt never stalls running streams by more
than one chunk; the verify rows of the running requests get the rest (one token each at least). Several new
requests are prefilled in one forward. A request is admitted (the engine's `admit`: a slot and KV blocks, its cached
prefix already counted as prefilled) when its first chunk is planned; while admission fails, later requests wait in
order behind it. A preempted request goes back to the front of the waiting queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class Schedulable(Protocol):
    """What the scheduler reads of a request (the engine's request record)."""

    prefill_tokens: list[int]  # what its prefill computes (the prompt; after a preemption, more)
    prefilled: int  # tokens of prefill_tokens already in the target cache
    aborted: bool


@dataclass
class Chunk:
    """Prompt tokens `start .. start + len(tokens)` of one request, prefilled this step."""

    req: Schedulable
    start: int
    tokens: list[int]

    @property
    def last(self) -> bool:
        """The chunk ends the prefill: its forward gives the first generated token (none when resuming)."""
        return self.start + len(self.tokens) == len(self.req.prefill_tokens)


@dataclass
class StepPlan:
    """What one step does."""

    aborted: list[Schedulable] = field(default_factory=list)
    starting: list[Schedulable] = field(default_factory=list)  # admitted now (their first chunk is below)
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Schedulable] = field(default_factory=list)
    verify_budget: int | None = None  # verify tokens the running requests may use (None: no bound)


class Scheduler:
    """Waiting (not admitted yet), prefilling (admitted, part of the prompt cached) and running (decoding) requests.

    `admit(req)` is the engine's admission: True when it gave the request a slot and KV blocks (and set its
    `prefilled` to the cached prefix); False leaves it, and every request after it, waiting.
    """

    def __init__(self, admit: Callable[[Schedulable], bool], max_num_batched_tokens: int | None = None,
                 prefill_chunk: int | None = None) -> None:
        if max_num_batched_tokens is not None and max_num_batched_tokens < 2:
            raise ValueError("max_num_batched_tokens must be >= 2")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError("prefill chunk size must be >= 1")
        self.admit = admit
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

    def preempted(self, req: Schedulable) -> None:
        """It gave its KV memory back: it waits again, first in line."""
        self.remove(req)
        self.waiting.appendleft(req)

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
        used = 0
        for r in self.prefilling:
            if r.aborted:
                continue
            if room is not None and used >= room:
                break
            used += self._chunk(plan, r, room, used)
        for r in list(self.waiting):
            if r.aborted:
                continue
            if (room is not None and used >= room) or not self.admit(r):
                break  # in order: nothing overtakes a request that cannot start yet
            self.started(r)
            plan.starting.append(r)
            used += self._chunk(plan, r, room, used)
        plan.decode = decode
        if budget is not None:
            plan.verify_budget = max(budget - used, len(decode))
        return plan

    @staticmethod
    def _chunk(plan: StepPlan, r: Schedulable, room: int | None, used: int) -> int:
        """Plan r's next chunk within the room left; the tokens it takes."""
        n = len(r.prefill_tokens) - r.prefilled
        if room is not None:
            n = min(n, room - used)
        plan.prefill.append(Chunk(r, r.prefilled, r.prefill_tokens[r.prefilled : r.prefilled + n]))
        return n
