"""Attention over a paged KV cache: where a position's keys live, how they are written, and how queries read them.

A paged model keeps per layer one key and one value tensor `[num_blocks * kv_block, kv_heads, head_dim]` of flat
rows: row `b * kv_block + o` is offset `o` of block `b`. A request's block table (`list[int]`) maps its positions to
rows: position p lives at `blocks[p // kv_block] * kv_block + p % kv_block`. Block 0 is the null block: padding
writes there, and table entries past a request's blocks are 0; no real query ever sees its rows, since visibility
is by position (a query at position p sees its row's keys at positions 0 .. p, all inside the row's own blocks).

Two kernels (docs/attention.md). Every eager forward (prefill, ragged batches, shapes beyond the buckets) and
`paged_attention` gather each row's keys through its table and run SDPA with a position mask, on every device:
no compiler, so no prompt shape compiles anything. FlexAttention (`dflash_core/flex_attention.py`) serves only the
compiled static step, and only where `attention_kernel(device)` says "flex" (CUDA by default; `DFLASH_ATTENTION`
overrides): that step builds the flex BlockMask OUTSIDE its compiled function and passes it in
(`PagedAttention.flex`), never inside the graph. `PagedAttention` is the same for every layer of one forward: its
mask (and gather index) is built once and serves them all.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_ENV", "KERNELS", "PagedAttention", "attention_kernel", "explicit_attention", "kv_rows",
           "paged_attention", "prepare", "write_kv", "EXPLICIT_SCORES_BYTES"]

ATTENTION_ENV = "DFLASH_ATTENTION"  # "flex" or "sdpa": the compiled static step's kernel, on any device
KERNELS = ("flex", "sdpa")


def attention_kernel(device: torch.device | str) -> str:
    """The kernel of a compiled static step on `device`: "flex" (FlexAttention over the cache in place, its mask
    built outside the compiled function) or "sdpa" (gather + SDPA). Default: flex on CUDA, sdpa elsewhere;
    `DFLASH_ATTENTION=flex|sdpa` overrides it on every device (flex on CPU runs inductor's C++ flex kernel: a
    test path, not a serving one). Eager forwards use gather + SDPA whatever this says."""
    setting = os.environ.get(ATTENTION_ENV, "").strip().lower()
    if setting:
        if setting not in KERNELS:
            raise ValueError(f"{ATTENTION_ENV}={setting!r}: expected one of {', '.join(KERNELS)}")
        return setting
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def prepare(device: torch.device, kernel: str = "sdpa") -> None:
    """Import the kernel's module now (a runner's constructor), not first inside a compiled region."""
    if kernel == "flex":
        from dflash_core import flex_attention  # noqa: F401


def kv_rows(block_table: torch.Tensor, positions: torch.Tensor, kv_block: int) -> torch.Tensor:
    """Flat cache rows [b, n] of positions [b, n] through the block table [b, M] (M * kv_block > positions)."""
    return block_table.gather(1, positions // kv_block) * kv_block + positions % kv_block


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Keys and values [T, kv_heads, d] into flat rows [T] of one layer's cache (or [b, n, kv_heads, d] into rows
    [b, n]), in place: an `index_put_`, which stays in place under inductor (a compiled step writes into its graph
    input, never a copy of the cache)."""
    k_cache.index_put_((rows,), k)
    v_cache.index_put_((rows,), v)


class PagedAttention:
    """Attention of one forward's queries over any layer's paged cache, its mask built once for every layer.

    block_table [b, M] int64 (entries past a row's blocks: 0); q_pos [b, n] int64, each query's position (padding
    queries: any position >= 0, their output is ignored); query (r, i) sees row r's keys at positions
    0 .. q_pos[r, i]. `num_rows`: the cache's flat rows (num_blocks * kv_block). `kv_len`, when the caller knows it
    on the host: q_pos.max() + 1 over the queries whose output is read; keys from there on are then not gathered,
    and a single query (b == n == 1), which then sits at the last key, runs without a mask.

    The constructor is the gather + SDPA kernel (every eager forward, any device). `PagedAttention.flex(mask,
    kv_block)` is the FlexAttention one, over a BlockMask built by the caller (`paged_block_mask`) outside any
    compiled function and passed into it.
    """

    def __init__(self, block_table: torch.Tensor, q_pos: torch.Tensor, kv_block: int, num_rows: int,
                 kv_len: int | None = None, window: int | None = None) -> None:
        self.kv_block = kv_block
        self.flex_mask: Any = None
        b, m = block_table.shape
        offsets = torch.arange(kv_block, device=block_table.device)
        index = (block_table[:, :, None] * kv_block + offsets).reshape(b, m * kv_block)  # [b, L]: row of position j
        if kv_len is not None:
            index = index[:, :kv_len]
        self.index: torch.Tensor | None = index
        self.q_pos = q_pos
        self.mask: torch.Tensor | None = None
        if kv_len is None or q_pos.shape != (1, 1) or window is not None:
            self.mask = self._mask(window)

    def _mask(self, window: int | None) -> torch.Tensor:
        """[b, 1, n, L]: query (r, i) sees key position j when j <= q_pos[r, i] (and, with a sliding `window`,
        q_pos[r, i] - j < window, transformers' sliding-window rule)."""
        assert self.index is not None
        key_pos = torch.arange(self.index.shape[1], device=self.q_pos.device)[None, None, None, :]
        q = self.q_pos[:, None, :, None]
        mask = key_pos <= q
        return mask if window is None else mask & (key_pos > q - window)

    def windowed(self, window: int) -> PagedAttention:
        """The same queries and keys with a sliding window of `window` positions (its own mask, the gather index
        shared)."""
        self_w = type(self).__new__(type(self))
        self_w.kv_block, self_w.flex_mask, self_w.index, self_w.q_pos = self.kv_block, None, self.index, self.q_pos
        self_w.mask = self_w._mask(window)
        return self_w

    @classmethod
    def flex(cls, mask: Any, kv_block: int) -> PagedAttention:
        """FlexAttention over the cache in place, through `mask` (a `BlockMask` from `paged_block_mask`, built
        outside the compiled function that calls this: built inside it, inductor's flex has given wrong results)."""
        self = cls.__new__(cls)
        self.kv_block, self.flex_mask, self.index, self.mask, self.q_pos = kv_block, mask, None, None, None
        return self

    @classmethod
    def gathered(cls, index: torch.Tensor, mask: torch.Tensor | None, kv_block: int) -> PagedAttention:
        """The gather + SDPA kernel from another instance's `index` and `mask` (a compiled layer region receives
        them as inputs: the mask is built once per forward, not once per layer)."""
        self = cls.__new__(cls)
        self.kv_block, self.flex_mask, self.index, self.mask, self.q_pos = kv_block, None, index, mask, None
        return self

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [b, heads, n, d] over one layer's k_cache [num_blocks * kv_block, kv_heads, d] and v_cache
        [.., kv_heads, dv] -> [b, heads, n, dv] (GQA when heads != kv_heads). `softcap`: scores pass through
        softcap * tanh(score / softcap) (Gemma 2's); `sinks` [heads]: one more logit per head in the softmax whose
        value is dropped (gpt-oss's attention sinks). Either runs the attention as explicit matmuls."""
        if self.flex_mask is not None:
            from dflash_core.flex_attention import flex_attention_over_cache

            return flex_attention_over_cache(q, k_cache, v_cache, self.flex_mask, scale, self.kv_block)
        assert self.index is not None
        # [b, kv_heads, L, d]; index_select copies whole rows (advanced indexing, `k_cache[index]`, costs ~6x on a
        # CPU: its generic kernel walks every element)
        b, length = self.index.shape
        flat = self.index.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
        return explicit_attention(q, keys, values, self.mask, scale, softcap, sinks)


# the float32 scores one chunk of `explicit_attention` holds at once (its rows are chunked to stay under it)
EXPLICIT_SCORES_BYTES = 256 << 20


def explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention as matmuls, for what SDPA has no argument for: q [b, heads, n, d], keys / values
    [b, kv_heads, L, d | dv], mask [b, 1, n, L] (True: visible) -> [b, heads, n, dv]. The query heads of one key
    head multiply its keys together (no copy of the keys per query head), and the rows run in chunks whose scores
    stay under `EXPLICIT_SCORES_BYTES`."""
    b, heads, n, _ = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    per_row = heads * n * (length + 1) * 4
    chunk = max(1, EXPLICIT_SCORES_BYTES // per_row)
    out = []
    for lo in range(0, b, chunk):
        hi = min(b, lo + chunk)
        qc = q[lo:hi].reshape(hi - lo, kv_heads, groups * n, q.shape[3])  # heads h = k * groups + g
        scores = torch.matmul(qc, keys[lo:hi].transpose(2, 3)).float() * scale  # [c, kv_heads, groups * n, L]
        scores = scores.view(hi - lo, heads, n, length)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[lo:hi], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, -1, 1, 1).expand(hi - lo, heads, n, 1)
            scores = torch.cat([scores, sink], dim=-1)
        # every query sees at least its own key, so no row is all -inf
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]  # the sink's share is dropped
        probs = probs.to(values.dtype).reshape(hi - lo, kv_heads, groups * n, length)
        out.append(torch.matmul(probs, values[lo:hi]).view(hi - lo, heads, n, values.shape[3]))
    return torch.cat(out) if len(out) > 1 else out[0]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, q_pos: torch.Tensor,
    scale: float, kv_block: int,
) -> torch.Tensor:
    """Attention of q [b, heads, n, d] over one layer's paged cache k_cache / v_cache
    [num_blocks * kv_block, kv_heads, d]: query (r, i) sees row r's keys at positions 0 .. q_pos[r, i] through
    block_table [b, M] (M * kv_block >= q_pos.max() + 1). Returns [b, heads, n, d]. Gather + SDPA on every device
    (flex: `flex_paged_attention`); several layers of one forward: `PagedAttention`."""
    return PagedAttention(block_table, q_pos, kv_block, k_cache.shape[0])(q, k_cache, v_cache, scale)
