"""A request's share of the KV memory: its slot and, on a paged runner, its blocks.

`KVManager` is the engine's one place for admitting a request into the KV memory, growing it, entering its full
blocks in the prefix index and giving everything back. It holds:
- the slot pool: the cap on running requests (`--max-num-seqs`), and the index of a hybrid target's per-request
  recurrent state;
- the block pool (`dflash_core.kv.pool`), when the target runner is paged: one block-id space for the target's and
  the draft's pages.

Admission takes the longest cached prefix of the request's tokens (never all of them: the last prompt token is
always computed, since its logits choose the first token) and new blocks for the rest plus `reserve` positions
(one verify block), all or nothing. Growing takes blocks as positions are needed; when the pool is empty the
engine preempts (it releases a request and recomputes it later).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_core.kv.pool import BlockPool, blocks_for
from dflash_core.slots import SlotPool

if TYPE_CHECKING:
    from dflash_core.runners.base import Drafter, TargetRunner


@dataclass
class RequestKV:
    """One admitted request's KV memory."""

    slot: int
    blocks: list[int] | None  # its block table (None: the runner is not paged); grown in place
    cached: int = 0  # leading positions whose KV came from the prefix cache at admission
    registered: int = 0  # leading full blocks already entered in the prefix index


class KVManager:
    """Slots and blocks for the engine's requests (see the module docstring)."""

    def __init__(self, slots: SlotPool, pool: BlockPool | None, reserve: int) -> None:
        self.slots = slots
        self.pool = pool
        self.reserve = reserve
        self.block_size = pool.block_size if pool is not None else None

    @classmethod
    def for_runners(
        cls, target: TargetRunner, drafter: Drafter | None, max_slots: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> KVManager:
        """The KV memory of an engine over these runners: slots up to the smallest cap, and the target's block pool
        when it is paged (prefix caching where both runners can reuse cached blocks). Engines that share runners
        must share this object."""
        limits = [n for n in (max_slots, target.max_slots, drafter and drafter.max_slots) if n is not None]
        slots = SlotPool(min(limits) if limits else None)
        pool = None
        if target.kv_block_size is not None:
            cacheable = target.prefix_cacheable and (drafter is None or drafter.prefix_cacheable)
            pool = BlockPool(target.num_blocks, target.kv_block_size, enable_prefix_caching and cacheable)
        return cls(slots, pool, reserve=drafter.block_size if drafter is not None else 1)

    def admit(self, tokens: list[int]) -> RequestKV | None:
        """A slot, the cached prefix of `tokens` and blocks for the rest plus the reserve; None (nothing taken) when
        no slot is free or the blocks cannot be had now."""
        if not self.slots.has_free():
            return None
        if self.pool is None:
            return RequestKV(self.slots.allocate(), None)
        bs = self.pool.block_size
        hit = self.pool.match_prefix(tokens, max_blocks=(len(tokens) - 1) // bs, count=False)
        need = blocks_for(len(tokens) + self.reserve, bs) - len(hit)
        if not self.pool.can_allocate(need):
            self.pool.free(hit)
            return None
        self.pool.record_query(len(tokens), len(hit) * bs)  # counted once, when admitted (not per retry)
        blocks = hit + self.pool.allocate(need)
        return RequestKV(self.slots.allocate(), blocks, cached=len(hit) * bs, registered=len(hit))

    def grow(self, kv: RequestKV, positions: int) -> bool:
        """Blocks for the first `positions` positions; False (nothing taken) when the pool cannot give them."""
        if kv.blocks is None or self.pool is None:
            return True
        need = blocks_for(positions, self.pool.block_size) - len(kv.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        kv.blocks.extend(self.pool.allocate(need))
        return True

    def register(self, kv: RequestKV, tokens: list[int], length: int) -> None:
        """Enter the full blocks among the first `length` positions (holding `tokens[:length]`, with both models'
        rows written) in the prefix index; blocks entered before are skipped."""
        if kv.blocks is None or self.pool is None:
            return
        full = min(length, len(tokens)) // self.pool.block_size
        if full > kv.registered:
            self.pool.register(kv.blocks, tokens, full)
            kv.registered = full

    def release(self, kv: RequestKV) -> None:
        """Give the request's blocks and slot back (its registered blocks stay cached until evicted)."""
        if kv.blocks is not None and self.pool is not None:
            self.pool.free(kv.blocks)
            kv.blocks = []
        self.slots.release(kv.slot)

    @contextmanager
    def borrow(self, positions: int) -> Iterator[list[int] | None]:
        """Blocks for `positions` positions that no request holds, given back on exit: for a forward outside the
        engine (a test, an exactness check) on runners an engine owns. None when not paged."""
        if self.pool is None:
            yield None
            return
        blocks = self.pool.allocate(blocks_for(positions, self.pool.block_size))
        try:
            yield blocks
        finally:
            self.pool.free(blocks)
