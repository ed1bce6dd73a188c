"""Each request's KV memory over its life in the engine: admission, its caches, prefix registration, preemption
and release (`RequestMemory`). The engine calls these; the scheduler calls `admit`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dflash_core.kv.manager import KVManager
from dflash_core.request_state import EngineRequest
from dflash_core.runners.base import Drafter, TargetRunner

log = logging.getLogger("dflash.engine")


class RequestMemory:
    """A request's slot, blocks and caches (see the module docstring). `width`: the positions a decode step may
    write past a request's position (the draft block)."""

    def __init__(self, kv: KVManager, target: TargetRunner, drafter: Drafter | None, width: int) -> None:
        self.kv, self.target, self.drafter, self.width = kv, target, drafter, width
        self.preemptions = 0

    def admit(self, req: EngineRequest) -> bool:
        """A slot and blocks for the request, its cached prefix counted as prefilled; False: it waits."""
        kv = self.kv.admit(req.prefill_tokens)
        if kv is None:
            return False
        req.kv, req.prefilled = kv, kv.cached
        if not req.resumed:
            req.stats.cached_tokens = kv.cached
        return True

    def start(self, req: EngineRequest) -> None:
        """Create the request's target cache and draft state over its slot and blocks."""
        kv = req.kv
        assert kv is not None
        req.cache = self.target.new_cache(kv.slot, kv.blocks, kv.cached)
        if self.drafter is not None:
            req.draft_state = self.drafter.new_state(kv.slot, req.prompt, kv.blocks, kv.cached)

    def register(self, req: EngineRequest) -> None:
        """Enter the request's full blocks whose target and draft rows are both written in the prefix index."""
        kv = req.kv
        if kv is None or kv.blocks is None or self.kv.block_size is None or req.cache is None:
            return
        length = req.committed()
        if self.drafter is not None and req.draft_state is not None:
            length = min(length, self.drafter.context_written(req.draft_state))
        if length // self.kv.block_size > kv.registered:
            self.kv.register(kv, (req.prompt + req.output)[:length], length)

    def release(self, req: EngineRequest) -> None:
        """Drop the caches, then give the slot and blocks back (full written blocks stay in the prefix index)."""
        if req.kv is None:
            return
        self.register(req)
        req.cache = req.draft_state = None  # both caches dropped before their memory is free again
        self.kv.release(req.kv)
        req.kv = None

    def preempt(self, req: EngineRequest) -> None:
        """Give a running request's memory back; when admitted again it recomputes its cache (prompt and output but
        the last token) and decodes on as if nothing happened (the scheduler puts it first in line)."""
        log.info("request %d preempted (KV blocks ran out); it will be recomputed", req.id)
        self.release(req)
        req.prefill_tokens = (req.prompt + req.output)[: req.position]
        req.prefilled = 0
        req.stats.preemptions += 1
        self.preemptions += 1

    def make_room(
        self, reqs: Sequence[EngineRequest], running: Sequence[EngineRequest],
        preempt: Callable[[EngineRequest], None],
    ) -> list[EngineRequest]:
        """Blocks for every decoding request's verify rows (`width` past its position), oldest first; while the
        pool is short, the newest of `running` is preempted (`preempt`). Returns those that decode this step."""
        for req in sorted(reqs, key=lambda r: r.id):
            while req.kv is not None and not self.kv.grow(req.kv, req.position + self.width):
                preempt(max((r for r in running if r.kv is not None), key=lambda r: r.id))
        return [r for r in reqs if r.kv is not None]
