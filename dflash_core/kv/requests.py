"""Each request's KV memory over its life in the engine: admission, its caches, prefix registration, preemption
and release (`RequestMemory`). The engine calls these; the scheduler calls `admit`.

A hybrid target's recurrent state is checkpointed sparsely (see `KVManager` and `dflash_core.runners.hybrid`): at
the last block boundary of the prompt once it is prefilled, and at the last block boundary of the committed
sequence when the request ends or is preempted (the next turn of its conversation, and its own recompute, hit
there)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import overload

from dflash_core.kv.manager import KVManager
from dflash_core.kv.pool import prefix_root
from dflash_core.request_state import EngineRequest
from dflash_core.runners.base import Drafter, TargetRunner

log = logging.getLogger("dflash.engine")


class _Joined(Sequence[int]):
    """prompt + output without copying them (registering a block reads 16 tokens, not the whole sequence)."""

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, int):
            return self.head[i] if i < len(self.head) else self.tail[i - len(self.head)]
        start, stop, _ = i.indices(len(self))
        n = len(self.head)
        return self.head[start:min(stop, n)] + self.tail[max(start - n, 0) : max(stop - n, 0)]


class RequestMemory:
    """A request's slot, blocks and caches (see the module docstring). `width`: the positions a decode step may
    write past a request's position (the draft block), made room for by preemption; `tree_width`: the positions a
    verified tree may write (its nodes and root), taken only from free blocks (`tree_room`)."""

    def __init__(self, kv: KVManager, target: TargetRunner, drafter: Drafter | None, width: int,
                 tree_width: int = 0) -> None:
        self.kv, self.target, self.drafter, self.width, self.tree_width = kv, target, drafter, width, tree_width
        self.root = prefix_root(drafter is not None)  # an engine without a draft caches blocks without its rows
        self.preemptions = 0

    def admit(self, req: EngineRequest) -> bool:
        """A slot and blocks for the request, its cached prefix counted as prefilled; False: it waits."""
        # a preempted request's recompute hits its own blocks: not counted (the hit rate would read high exactly
        # while the pool thrashes)
        kv = self.kv.admit(req.prefill_tokens, count=not req.stats.preemptions, memo=req.block_digests,
                           root=self.root)
        if kv is None:
            return False
        req.kv, req.prefilled = kv, kv.cached
        if not req.stats.preemptions:
            req.stats.cached_tokens = kv.cached
        return True

    def start(self, req: EngineRequest) -> None:
        """Create the request's target cache and draft state over its slot and blocks."""
        kv = req.kv
        assert kv is not None
        # a hybrid's prefix hit carries its state checkpoint at `cached` (else None)
        req.cache = self.target.new_cache(kv.slot, kv.blocks, kv.cached, state=kv.state)
        kv.state = None
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
            self.kv.register(kv, _Joined(req.prompt, req.output), length, self.root)
        if self.kv.checkpoints is None:
            return
        if kv.deferred is not None and kv.registered >= kv.deferred[0]:  # its block is in the index now
            self.kv.save_checkpoint(kv, *kv.deferred, self.target.checkpoint_bytes)
            kv.deferred = None
        done = len(req.prefill_tokens)
        if req.prefilled >= done and req.committed() == done:
            # its prompt (a recompute: its sequence) was just prefilled: its last block boundary, kept until that
            # block enters the index (the draft's context rows of it may still be pending)
            full = done // self.kv.block_size
            if full > kv.checkpointed:
                snap = self.target.checkpoint(req.cache, full * self.kv.block_size)
                if snap is not None and not self.kv.save_checkpoint(kv, full, snap, self.target.checkpoint_bytes):
                    kv.deferred = (full, snap)

    def checkpoint(self, req: EngineRequest) -> None:
        """A hybrid target: checkpoint its state at the end of the request's last registered block, when that is
        new and the runner still has the state there (it keeps those at the last block boundaries it passed)."""
        kv = req.kv
        if kv is None or self.kv.block_size is None or req.cache is None:
            return
        full = kv.registered
        if not self.kv.wants_checkpoint(kv, full):
            return
        snap = self.target.checkpoint(req.cache, full * self.kv.block_size)
        if snap is not None:
            self.kv.save_checkpoint(kv, full, snap, self.target.checkpoint_bytes)

    def release(self, req: EngineRequest) -> None:
        """Drop the caches, then give the slot and blocks back (full written blocks stay in the prefix index)."""
        if req.kv is None:
            return
        if self.drafter is not None and req.draft_state is not None:
            try:  # draft rows held back by plain steps (a CPU's): written, so that the index takes their blocks too
                self.drafter.catch_up([req.draft_state])
            except Exception as exc:  # its blocks then stay out of the index: a cost, not an error
                log.warning("request %d: writing its held-back draft context failed (%s)", req.id, exc)
        self.register(req)
        if self.kv.checkpoints is not None:
            self.checkpoint(req)  # the next turn (its prompt extends this sequence) or its recompute hits here
        req.cache = req.draft_state = None  # both caches dropped before their memory is free again
        self.kv.release(req.kv)
        req.kv = None

    def preempt(self, req: EngineRequest) -> None:
        """Give an admitted request's memory back because the pool ran short (counted in `preemptions`); see
        `recompute`."""
        log.info("request %d preempted (KV blocks ran out); it will be recomputed", req.id)
        self.recompute(req)
        self.preemptions += 1

    def recompute(self, req: EngineRequest) -> None:
        """Give an admitted request's memory back; when admitted again it recomputes its caches (prompt, and output
        but the last token) and decodes on as if nothing happened (the scheduler puts it first in line)."""
        self.release(req)
        if req.output:  # decoding: what its cache held; still prefilling: its prefill as it was
            req.prefill_tokens = (req.prompt + req.output)[: req.position]
        req.prefilled = 0
        req.stats.preemptions += 1

    def recompute_all(self, holders: Sequence[EngineRequest], requeue: Callable[[EngineRequest], None]) -> int:
        """`recompute` every request of `holders` that holds memory, newest first into `requeue` (which puts each
        first in line: the oldest ends up first), then empty the prefix cache, whose blocks hold rows of the caches
        being rebuilt. Returns how many were restarted."""
        held = sorted((r for r in holders if r.kv is not None), key=lambda r: r.id, reverse=True)
        for req in held:
            self.recompute(req)
            requeue(req)
        if self.kv.pool is not None:
            self.kv.pool.reset_prefix_cache()
        return len(held)

    def make_room(
        self, decoding: Sequence[EngineRequest], holders: Sequence[EngineRequest],
        preempt: Callable[[EngineRequest], None],
    ) -> None:
        """Blocks for every decoding request's verify rows (`width` past its position), oldest first; while the
        pool is short, the newest request that holds memory (of `holders`: decoding or still prefilling) is
        preempted (`preempt`), the one that needs the block included when it is the newest."""
        for req in sorted(decoding, key=lambda r: r.id):
            while req.kv is not None and not self.kv.grow(req.kv, req.position + self.width):
                preempt(max((r for r in holders if r.kv is not None), key=lambda r: r.id))
        # A tree's wider rows take free blocks only: never a preemption, so the pool's sizing (a block per request)
        # and admission stay as for chains, and a tree shrinks to what is free (`tree_room`).
        if self.tree_width > self.width:
            for req in sorted(decoding, key=lambda r: r.id):
                if req.kv is not None:
                    self.kv.grow(req.kv, min(req.position + self.tree_width, self._max_len(req)))

    def _max_len(self, req: EngineRequest) -> int:
        """Positions a request's caches may hold: the runner's length (unbounded: as far as a tree reaches)."""
        return self.target.max_len if self.target.max_len is not None else req.position + self.tree_width + 1

    def writable(self, req: EngineRequest) -> int:
        """Positions the request's caches hold now: the runner's length, less where its blocks end."""
        blocks = None if req.kv is None else req.kv.blocks
        if blocks is None or self.kv.block_size is None:
            return self._max_len(req)
        return min(self._max_len(req), len(blocks) * self.kv.block_size)

    def tree_room(self, req: EngineRequest) -> int:
        """Draft nodes a tree of this request may verify now: rows past its position that its blocks hold."""
        return max(0, self.writable(req) - req.position - 1)
