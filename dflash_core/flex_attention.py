"""Paged attention with FlexAttention: the kernel of the compiled static step on CUDA (see docs/attention.md).

The runner builds the step's mask with `paged_block_mask` OUTSIDE its compiled function (once per step, on the
device) and passes it in, where `flex_attention_over_cache` traces the kernel call into the step's graph. Built
inside a compiled graph (its mask_mod reading a tensor computed there), inductor's flex has returned wrong results
(CPU, torch 2.13). Eager forwards never come here (gather + SDPA, `dflash_core/attention.py`).

`flex_paged_attention` has the signature and the semantics of `dflash_core.attention.paged_attention`, but reads
the physical cache in place: the keys of one layer, `[num_blocks * kv_block, kv_heads, d]`, are viewed (no copy) as
ONE flex sequence `[1, kv_heads, num_blocks * kv_block, d]` shared by every row of the batch (flex broadcasts a
key batch of 1 when the block mask carries the query batch), and a `BlockMask` built from the block table tells
the kernel which KV blocks each row reads: the KV block size of the mask is `kv_block` (a cache block is a mask
block), its `kv_indices` are the row's physical block ids in logical order, so no context is gathered and no dense
mask is built. Blocks every query of a row sees in whole are "full" blocks (no mask evaluated); the last one or two
are "partial": there a `mask_mod` maps the physical key index back to its logical position (through a per-row
inverse of the block table) and compares it with the query's position.

The mask's column count is the cache's block count (flex requires `columns * kv_block >= keys`, and a fixed width
is what keeps a growing key bucket from changing any shape the kernel sees). Importable without CUDA; on CPU the
same code runs through inductor's C++ flex kernel (what the tests check, `DFLASH_ATTENTION=flex`), but the CPU
serving path stays gather + SDPA (`dflash_core/attention.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# The sparse Q block size of the mask: one Q block holds every query of a row (n <= 16 for decode and verify),
# and 128 is flex's default, which its kernels' BLOCK_M divides.
Q_BLOCK = 128


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process, for `flex_paged_attention` called outside a compiled region (tests
    and checks only: eager flex materialises the scores). dynamic=False: it compiles per batch and query width."""
    return torch.compile(flex_attention, dynamic=False)


def _row_blocks(block_table: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    """[b, 1, 1, width] int32: column k is block_table[r, start[r] + k] (the last column repeats past the end)."""
    m = block_table.shape[1]
    cols = (start[:, None] + torch.arange(width, device=block_table.device)).clamp(max=m - 1)
    return torch.gather(block_table, 1, cols).to(torch.int32)[:, None, None, :]


def paged_block_mask(block_table: torch.Tensor, q_pos: torch.Tensor, kv_block: int, num_rows: int) -> BlockMask:
    """The BlockMask of a paged step: row r's query i sees row r's keys at logical positions 0 .. q_pos[r, i].

    block_table [b, M] int64 (entries past a row's blocks are 0, the null block), q_pos [b, n] int64, num_rows the
    cache's flat row count (num_blocks * kv_block). Built once per step, it serves every layer of that step.
    """
    b, n = q_pos.shape
    num_blocks = num_rows // kv_block
    device = block_table.device
    used = q_pos.amax(dim=1) // kv_block + 1  # blocks the row's queries touch, in logical order
    full = (q_pos.amin(dim=1) + 1) // kv_block  # blocks every query of the row sees whole: no mask_mod there
    partial = used - full
    # Inverse of the table, per row: physical block -> logical block index, -1 where the row has none. Entries past
    # `used` (the null block 0 repeated) are left out; amax makes the scatter deterministic.
    logical = torch.arange(block_table.shape[1], device=device).expand(b, -1)
    logical = torch.where(logical < used[:, None], logical, -1).to(torch.int32)
    inverse = torch.full((b, num_blocks), -1, dtype=torch.int32, device=device)
    inverse = inverse.scatter_reduce(1, block_table, logical, reduce="amax")

    def mask_mod(r: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        blk = inverse[r, kv_idx // kv_block]
        return (blk >= 0) & (blk * kv_block + kv_idx % kv_block <= q_pos[r, q_idx])

    zero = torch.zeros_like(full)
    return BlockMask.from_kv_blocks(
        partial.to(torch.int32)[:, None, None],
        _row_blocks(block_table, full, num_blocks),
        full.to(torch.int32)[:, None, None],
        _row_blocks(block_table, zero, num_blocks),
        BLOCK_SIZE=(Q_BLOCK, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(n, num_rows),
        compute_q_blocks=False,  # the Q-major indices serve the backward pass only
    )


def flex_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    q_pos: torch.Tensor, scale: float, kv_block: int,
) -> torch.Tensor:
    """Attention of q [b, heads, n, d] over the paged cache of one layer; returns [b, heads, n, d].

    k_cache / v_cache [num_blocks * kv_block, kv_heads, d]; block_table [b, M]; q_pos [b, n]: query (r, i) sees
    row r's keys at positions 0 .. q_pos[r, i] (GQA when heads != kv_heads). Outside a compiled region flex runs
    compiled (`torch.compile(flex_attention)`). Do not call it inside a compiled function: it would build the mask
    in that graph (wrong results seen on CPU); build it outside with `paged_block_mask` and pass it in.
    """
    mask = paged_block_mask(block_table, q_pos, kv_block, k_cache.shape[0])
    return flex_attention_over_cache(q, k_cache, v_cache, mask, scale, kv_block)


def flex_attention_over_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: BlockMask, scale: float, kv_block: int,
) -> torch.Tensor:
    """The kernel call of `flex_paged_attention`, with a mask from `paged_block_mask` built once per step outside
    the compiled function this runs in (the runner's static step)."""
    # [rows, kv_heads, d] -> [1, kv_heads, rows, d]: a strided view of the cache, never a copy.
    k = k_cache.unsqueeze(0).transpose(1, 2)
    v = v_cache.unsqueeze(0).transpose(1, 2)
    options: dict[str, Any] | None = None
    if q.is_cuda:
        # The triton kernels tile keys by BLOCK_N, which must divide the mask's KV block (16 by default, below
        # their default tiles of 64/128); the decode kernel clamps its tile itself, the main one (taken when the
        # batch is dynamic or the GQA ratio is not a power of two) raises unless told.
        options = {"BLOCK_N": min(kv_block, 64)}
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    out = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)
    return out  # type: ignore[return-value]
