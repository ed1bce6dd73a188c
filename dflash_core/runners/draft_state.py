"""A DFlash drafter's request state (`DFlashState`: its slot, its caches, the context rows it holds back) and its
place in the target's block-id space (`paged_layout`; `table_rows` and `table_blocks` read a block table)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_core.draft_cache import DraftKVCache
from dflash_core.kv.pool import DEFAULT_KV_BLOCK, blocks_for, slot_layout_blocks
from dflash_core.runners.base import TargetRunner


@dataclass
class DFlashState:
    """One request's draft state, as `DFlashDrafter.new_state` made it."""

    slot: int  # the request's slot (its fixed run of blocks when the engine gives no block table)
    cache: DraftKVCache | None = None  # per-request cache (unbatched drafter)
    blocks: list[int] | None = None  # block table (paged drafter): the target cache's list, grown by the engine
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet in the draft cache
    pending_rows: int = 0  # their rows
    written: int = 0  # positions before the pending ones: in the draft cache (per-request: or skipped by a window)


def paged_layout(target: TargetRunner, max_slots: int, max_len: int) -> tuple[int, int]:
    """(kv_block, num_blocks) of the target's block-id space. A runner that is not paged (no `kv_block_size`)
    gets the native runner's default: blocks of 16, `max_slots` requests of `max_len` positions, plus the null
    block."""
    kv_block = target.kv_block_size or DEFAULT_KV_BLOCK  # declared by TargetRunner: None when not paged
    num_blocks = target.num_blocks if target.kv_block_size is not None else None
    if num_blocks is None:
        num_blocks = slot_layout_blocks(max_slots, max_len, kv_block)
    return kv_block, int(num_blocks)


def table_rows(blocks: list[int] | None, kv_block: int, start: int, end: int) -> list[int]:
    """The flat cache rows of positions start..end-1 through a block table of `kv_block`-position blocks."""
    assert blocks is not None
    if end > len(blocks) * kv_block:
        raise ValueError(f"positions up to {end} need {blocks_for(end, kv_block)} blocks; the table has "
                         f"{len(blocks)}")
    return [blocks[p // kv_block] * kv_block + p % kv_block for p in range(start, end)]


def table_blocks(blocks: list[int] | None, first: int, m: int) -> list[int]:
    """Blocks first..first+m-1 of a table, 0 (the null block) past its end."""
    assert blocks is not None
    row = blocks[first : first + m]
    return row + [0] * (m - len(row))
