"""What every paged target runner shares: slots, block tables, the pool's geometry and the checks of a forward.

A paged runner keeps per attention layer one key and one value tensor of flat rows `[num_blocks * kv_block, ...]`
(`dflash_core/attention.py`). Each request's cache (`Slot`) carries its block table, the engine's list of block ids
(grown by the engine before each forward); position p lives in row `blocks[p // kv_block] * kv_block + p % kv_block`.
Rolling back is just setting the cache's length: rows past it are never visible before they are overwritten. Two
requests may share read-only blocks of a common prefix (a prefix-cache hit: `new_cache(slot, blocks, cached)`).
Block 0 is the null block, never a request's: padding writes there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_core.attention import PagedAttention, kv_rows
from dflash_core.kv.pool import blocks_for, slot_layout_blocks
from dflash_core.runners.base import TargetOutput, TargetRow, TargetRunner

Rows = Sequence[TargetRow | tuple[list[int], int, Any]]


@dataclass
class Slot:
    """One request's cache: its slot index (from the engine's SlotPool), filled length and block table (the
    engine's list, grown in place; position p is in block `blocks[p // kv_block]`)."""

    index: int
    length: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class Geometry:
    """Where one forward's rows sit, padded to `n` tokens each: positions `pos` [b, n], block tables `table`
    [b, M], the cache rows `write` [b, n] the tokens write, and the attention over them (its mask built once)."""

    b: int
    n: int
    lengths: torch.Tensor  # [b] real tokens per row
    pos: torch.Tensor  # [b, n]
    slots: torch.Tensor  # [b] the rows' slot indices
    table: torch.Tensor  # [b, M] block tables, 0 past a row's blocks
    write: torch.Tensor  # [b, n] cache rows the tokens write
    attention: PagedAttention


class PagedTarget(TargetRunner):
    """A target runner over a paged KV pool: its slots, block ids and the rules a forward's rows keep.

    Subclasses call `_init_paging` in their constructor (after `device` is set) and run the forward.
    """

    prefix_cacheable = True  # a request's state is its KV rows alone: it may start from blocks another one wrote
    fixed_runs: bool
    table_len: int
    kv_bytes_per_block: int
    k_cache: list[torch.Tensor]  # one key tensor of flat rows per cache the model keeps
    v_cache: list[torch.Tensor]

    def _init_paging(self, max_slots: int, max_len: int, num_blocks: int | None, kv_block: int) -> None:
        """The pool's geometry: `max_slots` requests of at most `max_len` positions, `num_blocks` blocks of
        `kv_block` positions (None: each slot a fixed run of blocks after the null block)."""
        self.max_len = int(max_len)  # the longest position + 1 a request may reach
        self.max_slots = int(max_slots)  # concurrent requests (per-slot states of subclasses)
        if kv_block < 1:
            raise ValueError(f"kv_block must be at least 1 (got {kv_block})")
        self.kv_block_size = int(kv_block)
        self.table_len = blocks_for(self.max_len, kv_block)  # the blocks a request's table can reach
        self.fixed_runs = num_blocks is None
        self.num_blocks = (slot_layout_blocks(self.max_slots, self.max_len, kv_block) if num_blocks is None
                           else int(num_blocks))
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, the null block and one more (got {self.num_blocks})")

    @property
    def kv_rows_total(self) -> int:
        """Flat rows of each layer's key / value tensor: num_blocks * kv_block."""
        return self.num_blocks * self.kv_block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the attention KV cache (every cache's keys and values, every block, the null one too)."""
        return sum(t.nbytes for t in (*self.k_cache, *self.v_cache))

    def new_cache(self, slot: int, blocks: list[int] | None = None, cached: int = 0, state: Any = None) -> Slot:
        """The request's cache: slot `slot`, block table `blocks` (the engine's list, kept by reference and grown by
        the engine; None: the slot's own fixed run of blocks, only with the default num_blocks), its first `cached`
        positions already in the cache (a prefix-cache hit)."""
        return Slot(slot, *self._paging(slot, blocks, cached))

    def _paging(self, slot: int, blocks: list[int] | None, cached: int) -> tuple[int, list[int]]:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside the KV cache's {self.max_slots} slots")
        if blocks is None:
            if not self.fixed_runs:
                raise ValueError("new_cache without blocks needs the default num_blocks (a fixed run per slot)")
            first = 1 + slot * self.table_len
            blocks = list(range(first, first + self.table_len))
        elif not all(0 < b < self.num_blocks for b in blocks):
            raise ValueError(f"block ids must lie in 1 .. {self.num_blocks - 1} (0 is the null block): {blocks}")
        if not 0 <= cached <= len(blocks) * self.kv_block_size:
            raise ValueError(f"cached={cached} outside the {len(blocks)} blocks given")
        return cached, blocks

    def crop(self, cache: Slot, length: int) -> None:
        cache.length = min(cache.length, length)

    def _check(self, rows: Rows) -> None:
        """Every row starts inside what its cache holds, and its blocks cover its positions."""
        kvb = self.kv_block_size
        for tokens, start, cache in rows:
            end = start + len(tokens)
            if start > cache.length:  # rows never written would be visible
                raise ValueError(f"a row starts at {start}, past the end of its cache ({cache.length})")
            if end > self.max_len:
                raise ValueError(f"position {end} beyond the KV cache ({self.max_len})")
            if len(cache.blocks) * kvb < end:
                raise ValueError(f"a row's {len(cache.blocks)} blocks of {kvb} positions do not cover its positions "
                                 f"up to {end}")

    @staticmethod
    def tables(rows: Rows, width: int) -> list[list[int]]:
        """The rows' block tables cut or padded with the null block to `width` entries."""
        return [(list(cache.blocks[:width]) + [0] * width)[:width] for _, _, cache in rows]

    def _geometry(self, rows: Rows) -> Geometry:
        """The rows padded to the longest: positions, tables, write rows and the attention (one host-to-device
        copy of the rows' integers)."""
        b = len(rows)
        n = max(len(t) for t, _, _ in rows)
        kvb = self.kv_block_size
        # table entries for every column's position, padding too (0 past a row's blocks: padding writes the null
        # block there, and into the row's own blocks past its end elsewhere, which no query sees before a rewrite)
        width = -(-(max(s for _, s, _ in rows) + n) // kvb)
        kv_len = max(s + len(t) for t, s, _ in rows)
        meta = [[s, len(t), c.index] for t, s, c in rows]
        packed = torch.tensor([m + tb for m, tb in zip(meta, self.tables(rows, width))], device=self.device)
        pos = packed[:, :1] + torch.arange(n, device=self.device)[None]  # [b, n]
        table = packed[:, 3:]
        attention = PagedAttention(table, pos, kvb, self.kv_rows_total, kv_len)
        return Geometry(b, n, packed[:, 1], pos, packed[:, 2], table, kv_rows(table, pos, kvb), attention)

    def _flat(self, rows: Rows, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Each real token of `rows` (geometry `g`) as its (row, column) in the padded [b, n] layout, in order (the
        token count from the host: no device sync)."""
        row_of = torch.repeat_interleave(torch.arange(g.b, device=self.device), g.lengths)
        starts = g.lengths.cumsum(0) - g.lengths
        col_of = torch.arange(sum(len(t) for t, _, _ in rows), device=self.device) - starts[row_of]
        return row_of, col_of

    @staticmethod
    def split_rows(rows: Rows, logits: torch.Tensor, feat: torch.Tensor | None,
                    last_only: bool) -> list[TargetOutput]:
        """Each row's outputs of a forward over the rows' real tokens in order: logits [T, V] (last_only: [b, V]),
        features [T, F]; each row's cache then holds its tokens."""
        outs = []
        first = 0
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            row_logits = logits[r : r + 1] if last_only else logits[first : first + m]
            outs.append(TargetOutput(row_logits, feat[first : first + m] if feat is not None else None))
            first += m
        return outs
