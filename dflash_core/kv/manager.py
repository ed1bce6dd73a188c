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

A hybrid target (Gated DeltaNet layers: a recurrent state per request, not rows per position) resumes a cached
prefix only where its state was checkpointed (`CheckpointStore`): its prefix hit is trimmed back to the last
matched block that has one, and the admitted request carries that checkpoint to `new_cache`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_core.kv.pool import ROOT_DIGEST, BlockPool, blocks_for
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
    state: Any = None  # a hybrid's state checkpoint at `cached` (given to new_cache, then dropped)
    checkpointed: int = 0  # leading full blocks whose end has a state checkpoint (hybrid targets)
    deferred: tuple[int, Any] | None = None  # (full blocks, checkpoint) kept until that block enters the index


class CheckpointStore:
    """A hybrid target's recurrent-state checkpoints, each at the END of one cached block, keyed by that block's
    registration serial in the pool (`BlockPool.serial`): a serial is never reused, and the pool drops the entry
    when the block leaves the prefix index (`BlockPool.on_uncache`), so a checkpoint is never applied to other
    content. Bounded: at most `max_count` checkpoints and `max_bytes` bytes, least recently used dropped first."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max(1, max_count), max_bytes
        self._entries: OrderedDict[int, tuple[Any, int]] = OrderedDict()  # serial -> (checkpoint, bytes)
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, serial: object) -> bool:
        return serial in self._entries

    def get(self, serial: int | None) -> Any:
        """The checkpoint at the end of the block with this serial (now most recently used), or None."""
        if serial is None or serial not in self._entries:
            return None
        self._entries.move_to_end(serial)
        return self._entries[serial][0]

    def put(self, serial: int, checkpoint: Any, nbytes: int) -> None:
        """Keep `checkpoint` (`nbytes` bytes) for the block with this serial; older ones go to stay in bounds."""
        if nbytes > self.max_bytes:
            return
        self.drop(serial)
        self._entries[serial] = (checkpoint, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_count or self.nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.nbytes -= size

    def drop(self, serial: int) -> None:
        """Forget the checkpoint of this serial (its block left the prefix index); nothing when there is none."""
        entry = self._entries.pop(serial, None)
        if entry is not None:
            self.nbytes -= entry[1]


class KVManager:
    """Slots and blocks for the engine's requests (see the module docstring)."""

    def __init__(
        self, slots: SlotPool, pool: BlockPool | None, reserve: int, checkpoints: CheckpointStore | None = None,
    ) -> None:
        self.slots = slots
        self.pool = pool
        self.reserve = reserve
        self.block_size = pool.block_size if pool is not None else None
        self.checkpoints = checkpoints  # a hybrid target's state checkpoints (None: its state is its KV rows)
        if checkpoints is not None and pool is not None:
            pool.on_uncache = checkpoints.drop

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
        pool = checkpoints = None
        if target.kv_block_size is not None:
            cacheable = target.prefix_cacheable and (drafter is None or drafter.prefix_cacheable)
            pool = BlockPool(target.num_blocks, target.kv_block_size, enable_prefix_caching and cacheable)
            if pool.enable_prefix_caching and target.checkpoint_limits is not None:  # a hybrid target
                checkpoints = CheckpointStore(*target.checkpoint_limits)
                target.checkpointing = True  # it keeps each request's state at its last block boundary
        return cls(slots, pool, reserve=drafter.block_size if drafter is not None else 1, checkpoints=checkpoints)

    def admit(self, tokens: list[int], count: bool = True, memo: list[bytes] | None = None,
              root: bytes = ROOT_DIGEST) -> RequestKV | None:
        """A slot, the cached prefix of `tokens` and blocks for the rest plus the reserve; None (nothing taken) when
        no slot is free or the blocks cannot be had now. `count`: the lookup counts in the prefix-cache queries and
        hits (not a preempted request's recompute, which would read as hits while the pool thrashes). `memo`: the
        request's block digests, kept between tries (`BlockPool.match_prefix`); `root`: the engine's chains'
        start (`prefix_root`)."""
        if not self.slots.has_free():
            return None
        if self.pool is None:
            return RequestKV(self.slots.allocate(), None)
        bs = self.pool.block_size
        most = (len(tokens) - 1) // bs  # cached blocks a hit may give
        if blocks_for(len(tokens) + self.reserve, bs) - most > self.pool.num_free():
            return None  # not even a whole hit would fit now
        hit = self.pool.match_prefix(tokens, max_blocks=most, count=False, take=False, memo=memo, root=root)
        state = None
        if self.checkpoints is not None and hit:  # a hybrid resumes only where its state was checkpointed
            keep = len(hit)
            while keep > 0 and (state := self.checkpoints.get(self.pool.serial(hit[keep - 1]))) is None:
                keep -= 1
            hit = hit[:keep]
        need = blocks_for(len(tokens) + self.reserve, bs) - len(hit)
        if not self.pool.can_allocate(need + self.pool.num_evictable(hit)):  # taking the hit uses free blocks too
            return None
        self.pool.take(hit)
        if count:  # counted once, when admitted (not per retry)
            self.pool.record_query(len(tokens), len(hit) * bs)
        blocks = hit + self.pool.allocate(need)
        return RequestKV(self.slots.allocate(), blocks, cached=len(hit) * bs, registered=len(hit), state=state,
                         checkpointed=len(hit))

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

    def register(self, kv: RequestKV, tokens: Sequence[int], length: int, root: bytes = ROOT_DIGEST) -> None:
        """Enter the full blocks among the first `length` positions (holding `tokens[:length]`, with both models'
        rows written) in the prefix index, chained from `root` (`prefix_root`); blocks entered before are skipped."""
        if kv.blocks is None or self.pool is None:
            return
        full = min(length, len(tokens)) // self.pool.block_size
        if full > kv.registered:
            self.pool.register(kv.blocks, tokens, full, root)
            kv.registered = full

    def save_checkpoint(self, kv: RequestKV, full: int, checkpoint: Any, nbytes: int) -> bool:
        """Keep a hybrid's state `checkpoint` at the end of the request's first `full` blocks, which must be in the
        prefix index (False, nothing kept, when the last of them is not)."""
        if self.checkpoints is None or self.pool is None or kv.blocks is None or not 0 < full <= kv.registered:
            return False
        serial = self.pool.serial(kv.blocks[full - 1])
        if serial is None:
            return False
        if serial not in self.checkpoints:
            self.checkpoints.put(serial, checkpoint, nbytes)
        kv.checkpointed = max(kv.checkpointed, full)
        return True

    def wants_checkpoint(self, kv: RequestKV, full: int) -> bool:
        """Whether a checkpoint at the end of the request's first `full` blocks would be new (cheap: no state
        is copied to ask)."""
        if self.checkpoints is None or self.pool is None or kv.blocks is None or not 0 < full <= kv.registered:
            return False
        if full <= kv.checkpointed:
            return False
        serial = self.pool.serial(kv.blocks[full - 1])
        return serial is not None and serial not in self.checkpoints

    def release(self, kv: RequestKV) -> None:
        """Give the request's blocks and slot back (its registered blocks stay cached until evicted)."""
        if kv.blocks is not None and self.pool is not None:
            self.pool.free(kv.blocks)
            kv.blocks = []
        kv.state = kv.deferred = None
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
