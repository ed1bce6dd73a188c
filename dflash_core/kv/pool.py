"""The block pool: the engine's one free-list of KV block ids, ref-counted, with a prefix cache.

Ids `1 .. num_blocks-1` are handed out; id 0 is the null block (padding writes land there) and never is. Every
request holds its blocks with a reference; a prefix-cache hit shares a block between requests by taking another.

Prefix cache (modelled on vLLM's automatic prefix caching, our own code):
- Only FULL blocks are cached. A block's key is a digest chained from its parent's digest and its own token ids
  (`block_digest`), so equal digests mean equal whole prefixes up to a hash collision.
- A digest is never trusted alone: each cached block keeps its token ids and the serial of the cached block it was
  chained to, and a lookup checks both. A serial is unique per registration (a block id is reused, a serial never),
  so a collision, or a parent that was evicted and whose id now holds other tokens, is a miss, never a wrong KV.
- A block whose refs drop to 0 stays cached but becomes evictable (an OrderedDict in LRU order); `allocate` takes
  never-cached free ids first, then evicts least recently used first. `free` walks a request's table backwards, so
  its last blocks (the least shared: a long common prefix outlives its tails) are evicted first, as vLLM does.
- `register` is idempotent without per-request state: every processed block of a held table carries a link
  (its digest and the serial of the cached block holding its content: itself, or an equal block registered first),
  so a call walks back from the newest full block to the last linked one and hashes only the new blocks: amortised
  O(1) per block. A chain object per request would hash as much, but it is one more thing the engine must create,
  keep in step with the table and drop on preemption; the links die with the blocks (at 0 refs) by themselves.

Counters follow vLLM's `prefix_cache_queries` / `prefix_cache_hits` (tokens queried / tokens found cached) and
`kv_cache_usage_perc` (fraction of usable blocks held by requests; cached-but-unreferenced blocks count as free).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT_DIGEST = bytes(16)  # the parent digest of a sequence's first block
_DEAD = None  # link of a block whose chain cannot be cached (a digest collision or an evicted parent)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as int64 bytes: what a block's digest covers and what a lookup compares exactly."""
    return array("q", token_ids).tobytes()


def block_digest(parent: bytes, tokens: bytes) -> bytes:
    """16-byte blake2b over the parent digest and a block's token ids as int64 bytes (`token_bytes`)."""
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


# Where the chains of an engine without a draft start: its blocks hold no draft rows, so an engine with a draft
# sharing the pool (the benchmarks' plain twin beside the DFlash engine) never matches them, nor they its blocks.
TARGET_ONLY_ROOT = block_digest(ROOT_DIGEST, b"target rows only")


def prefix_root(with_draft: bool) -> bytes:
    """The parent digest of a sequence's first block for an engine whose blocks hold the draft's rows or not."""
    return ROOT_DIGEST if with_draft else TARGET_ONLY_ROOT


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks needed to hold `positions` positions (ceil)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    return max(0, -(-positions // block_size))


DEFAULT_KV_BLOCK = 16  # positions per KV block (`--kv-block-size`'s default)


def slot_layout_blocks(max_slots: int, max_len: int, kv_block: int) -> int:
    """Blocks of a runner built without an engine's pool: each slot a fixed run of `max_len` positions, after the
    null block."""
    return max_slots * blocks_for(max_len, kv_block) + 1


class NoFreeBlocksError(RuntimeError):
    """Fewer blocks than asked can be had (free plus evictable); nothing was taken."""


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the KV cache for metrics. `preemptions` is the engine's count (the pool does not preempt)."""

    num_blocks: int
    block_size: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int = 0


@dataclass(slots=True)
class _Cached:
    """What the prefix index knows about one registered block."""

    digest: bytes
    tokens: bytes  # its token ids as int64 bytes
    parent_serial: int  # 0: the first block of a sequence
    serial: int


class BlockPool:
    """Ref-counted KV block ids with an LRU prefix cache over full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs the null block and at least one usable block")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_usable = num_blocks - 1
        self._ref = [0] * num_blocks
        self._ref[0] = 1  # the null block is never free
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # a stack: pop() gives the lowest id first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, 0 refs; first = least recently used
        self._index: dict[bytes, int] = {}  # digest -> block id
        self._cached: dict[int, _Cached] = {}  # block id -> its entry (exactly the blocks in _index)
        self._live: dict[int, int] = {}  # serial -> block id, for registered blocks
        self._link: dict[int, tuple[bytes, int] | None] = {}  # held block -> (digest, serial of holder) or _DEAD
        self._serial = 0
        # told the serial of every registration that leaves the index (evicted or reset): what hangs on a cached
        # block's content (a hybrid target's state checkpoint) is dropped with it
        self.on_uncache: Callable[[int], None] | None = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- allocation -------------------------------------------------------------------------------------------

    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free()

    def allocate(self, n: int) -> list[int]:
        """`n` fresh block ids (1 ref each); NoFreeBlocksError, changing nothing, when fewer can be had."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.num_free():
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free()} can be had")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one ref of each block (pass a request's table in order). At 0 refs a cached block becomes
        evictable, the table's LAST blocks first in line; any other goes back to the free list."""
        for block in reversed(blocks):
            ref = self._ref[block]
            if block == 0 or ref <= 0:
                raise ValueError(f"block {block} is not held")
            self._ref[block] = ref - 1
            if ref > 1:
                continue
            if block in self._cached:
                self._evictable[block] = None  # most recently used end: evicted after older ones
            else:
                self._link.pop(block, None)
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (ref > 0); vLLM's kv_cache_usage_perc."""
        return (self.num_usable - self.num_free()) / self.num_usable

    # ---- prefix cache -----------------------------------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], max_blocks: int | None = None, *, count: bool = True, take: bool = True,
        memo: list[bytes] | None = None, root: bytes = ROOT_DIGEST,
    ) -> list[int]:
        """The longest run of cached full blocks from the start of `token_ids` (at most `max_blocks`), each taken
        (+1 ref; `take=False`: only looked up, see `take`). Counts `len(token_ids)` queried tokens and the matched
        blocks' tokens as hits (`count=False`: neither; see `record_query`). `memo`: the caller's list of this
        sequence's block digests, reused and extended (a request retried every step is hashed once). `root`: where
        the chain starts (`prefix_root`), as it was registered."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks is not None:
            n = min(n, max(0, max_blocks))
        raw = token_bytes(token_ids[: n * bs])  # one conversion; each block is then a cheap bytes slice
        step = bs * 8
        out: list[int] = []
        parent, parent_serial = root, 0
        for i in range(n):
            tokens = raw[i * step : (i + 1) * step]
            if memo is not None and i < len(memo):
                digest = memo[i]
            else:
                digest = block_digest(parent, tokens)
                if memo is not None:
                    memo.append(digest)
            block = self._index.get(digest)
            if block is None:
                break
            entry = self._cached[block]
            if entry.tokens != tokens or entry.parent_serial != parent_serial:
                break  # a digest collision: never hand out another sequence's KV
            out.append(block)
            parent, parent_serial = digest, entry.serial
        if take:
            self.take(out)
        if count:
            self.record_query(len(token_ids), len(out) * bs)
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """Hold cached blocks a lookup found (+1 ref each; an unreferenced one stops being evictable)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of these blocks nobody holds (taking them would take them out of `num_free`)."""
        return sum(self._ref[b] == 0 for b in blocks)

    def record_query(self, queried: int, hits: int) -> None:
        """Count one prefix lookup in tokens; for a caller that matched with `count=False` and counts only the
        lookup that admitted its request (a failed admission retried every step would count each retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += queried
            self.prefix_hits += hits

    def register(self, blocks: Sequence[int], token_ids: Sequence[int], num_full: int,
                 root: bytes = ROOT_DIGEST) -> None:
        """Cache `blocks[:num_full]`, full and holding `token_ids[:num_full * block_size]`; idempotent (blocks
        already processed are skipped). A digest already cached by another block keeps that block. `root`: where
        the chain starts (`prefix_root`)."""
        if not self.enable_prefix_caching or num_full <= 0:
            return
        bs = self.block_size
        if len(blocks) < num_full or len(token_ids) < num_full * bs:
            raise ValueError("register: fewer blocks or tokens than num_full full blocks")
        link = self._link
        start = num_full
        while start > 0 and blocks[start - 1] not in link:
            start -= 1
        if start == num_full:
            return
        if start == 0:
            parent, parent_serial = root, 0
        else:
            prev = link[blocks[start - 1]]
            if prev is _DEAD:  # nothing after a dead link can be cached: mark them, so no later call walks back
                for b in blocks[start:num_full]:
                    link[b] = _DEAD
                return
            parent, parent_serial = prev
        step = bs * 8
        raw = token_bytes(token_ids[start * bs : num_full * bs])
        for i in range(start, num_full):
            block = blocks[i]
            if self._ref[block] <= 0:
                raise ValueError(f"register: block {block} is not held")
            if parent_serial and parent_serial not in self._live:
                # the cached block this chain hangs on was evicted: nothing after it could ever be matched
                for b in blocks[i:num_full]:
                    link[b] = _DEAD
                return
            tokens = raw[(i - start) * step : (i - start + 1) * step]
            digest = block_digest(parent, tokens)
            holder = self._index.get(digest)
            if holder is None:
                self._serial += 1
                self._index[digest] = block
                self._cached[block] = _Cached(digest, tokens, parent_serial, self._serial)
                self._live[self._serial] = block
                link[block] = (digest, self._serial)
                parent, parent_serial = digest, self._serial
            else:
                entry = self._cached[holder]
                if entry.tokens != tokens or entry.parent_serial != parent_serial:
                    for b in blocks[i:num_full]:  # a collision: this chain stays uncached
                        link[b] = _DEAD
                    return
                link[block] = (digest, entry.serial)  # equal content cached first: keep it, chain through it
                parent, parent_serial = digest, entry.serial

    def reset_counters(self) -> None:
        """Zero the prefix-cache query and hit counters (after the engine's warm-up requests)."""
        self.prefix_queries = self.prefix_hits = 0

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (vLLM's /reset_prefix_cache); returns how many."""
        dropped = len(self._evictable)
        for block in self._evictable:
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
        return dropped

    def num_cached(self) -> int:
        """Blocks in the prefix index (held or evictable)."""
        return len(self._cached)

    def serial(self, block: int) -> int | None:
        """The registration serial of the cached content `block` holds (its own, or that of the equal block
        cached first), while that content is in the index; None for a block not (or no longer) registered."""
        link = self._link.get(block)
        if link is None:
            return None
        return link[1] if link[1] in self._live else None

    def stats(self, preemptions: int = 0) -> KVStats:
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            usage=self.usage(),
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            preemptions=preemptions,
        )

    def _uncache(self, block: int) -> None:
        entry = self._cached.pop(block)
        del self._index[entry.digest]
        del self._live[entry.serial]
        self._link.pop(block, None)
        if self.on_uncache is not None:
            self.on_uncache(entry.serial)
