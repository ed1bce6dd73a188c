"""Where a draft keeps its context keys and values: one request's growing buffer (`DraftKVCache`, optionally a
ring of a window's rows), or every request's rows paged in the target's block-id space (`PagedDraftCache`, viewed per
batched call through `PagedBatch`)."""

from __future__ import annotations

import torch

from dflash_core.attention import write_kv
from dflash_core.config import DraftConfig

__all__ = ["DraftKVCache", "PagedBatch", "PagedDraftCache", "gather_blocks", "write_context_rows"]


class DraftKVCache:
    """One request's context keys/values, one buffer per layer; row j holds position j.

    With a `window` N the buffer is a ring of N rows: position j lives in row j % N and only the last N positions
    are kept. `length` counts every position either way (rollback is by length).
    """

    def __init__(self, num_layers: int, window: int | None = None) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.window = window
        self._end = 0  # the length once this call's rows are in (ring positions are relative to it)

    def skip(self, n: int) -> None:
        """Count `n` positions that fall out of the window before they would be written (windowed only)."""
        self.length += n

    def update(
        self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Write new rows at [length, length + n) (when given); return all rows so far (a ring: the last N)."""
        n = 0 if k is None else k.shape[2]
        self._end = self.length + n
        if self.window is not None:
            return self._update_ring(layer, k, v, n)
        if n:
            buf_k = self.k[layer]
            if buf_k is None or buf_k.shape[2] < self.length + n:
                cap = max(64, 2 * (self.length + n))
                new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
                new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
                if buf_k is not None:
                    new_k[:, :, : self.length] = buf_k[:, :, : self.length]
                    new_v[:, :, : self.length] = self.v[layer][:, :, : self.length]
                self.k[layer], self.v[layer] = new_k, new_v
            self.k[layer][:, :, self.length : self.length + n] = k
            self.v[layer][:, :, self.length : self.length + n] = v
        if self.k[layer] is None:
            return None, None
        end = self.length + n
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def _update_ring(
        self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None, n: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        window, end = int(self.window), self._end
        if n:
            if self.k[layer] is None:
                self.k[layer] = k.new_zeros(k.shape[0], k.shape[1], window, k.shape[3])
                self.v[layer] = v.new_zeros(v.shape[0], v.shape[1], window, v.shape[3])
            keep = min(n, window)  # older rows of this call would be overwritten within it
            rows = torch.arange(end - keep, end, device=k.device) % window
            self.k[layer][:, :, rows] = k[:, :, n - keep :]
            self.v[layer][:, :, rows] = v[:, :, n - keep :]
        if self.k[layer] is None:
            return None, None
        filled = min(end, window)
        return self.k[layer][:, :, :filled], self.v[layer][:, :, :filled]

    def key_positions(self, batch: int, n: int, device: torch.device) -> torch.Tensor:
        """Positions [batch, n] of the n keys `update` returned: row c is position c, in a ring the window's
        position congruent to c."""
        rows = torch.arange(n, device=device)
        if self.window is not None:
            rows = self._end - 1 - (self._end - 1 - rows) % self.window
        return rows.expand(batch, n)

    def commit(self, n: int) -> None:
        """Called once every layer has written its `n` new rows."""
        self.length += n


def write_context_rows(kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """New context keys / values [b, kv_heads, c, d] into flat rows [b, c] of one layer's paged tensors."""
    write_kv(kc, vc, rows.reshape(-1), k.transpose(1, 2).reshape(-1, *kc.shape[1:]),
             v.transpose(1, 2).reshape(-1, *vc.shape[1:]))


def gather_blocks(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                  kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys / values [b, kv_heads, M * kv_block, d] of the blocks of table [b, M], by block: one index per
    block, and a view of the cache (never a copy of it)."""
    keys = kc.view(-1, kv_block, *kc.shape[1:])[table].flatten(1, 2).transpose(1, 2)
    values = vc.view(-1, kv_block, *vc.shape[1:])[table].flatten(1, 2).transpose(1, 2)
    return keys, values


class PagedDraftCache:
    """Context keys/values of every request, paged in the target's block-id space: per layer one key and one value
    tensor `[num_blocks * kv_block, kv_heads, head_dim]` (lists, so that a compiled step writes each in place).

    Row `b * kv_block + o` is offset o of block b; position p of a request lives in row
    `blocks[p // kv_block] * kv_block + p % kv_block` of its block table (the same table as its target cache: block
    i has storage in both models' tensors). Block 0 is the null block: padding rows of a batch write there, and no
    query sees it (visibility is by position).
    """

    def __init__(
        self, cfg: DraftConfig, num_blocks: int, kv_block: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (num_blocks * kv_block, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.num_blocks, self.kv_block = num_blocks, kv_block

    @property
    def nbytes(self) -> int:
        """Bytes of the context keys and values (every layer)."""
        return sum(t.nbytes for t in (*self.k, *self.v))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds over every layer, keys and values."""
        return self.nbytes // self.num_blocks

    def batch(
        self, rows: torch.Tensor | None, table: torch.Tensor | None, base: torch.Tensor | None = None
    ) -> PagedBatch:
        return PagedBatch(self, rows, table, base)


class PagedBatch:
    """One batched draft call's view of a PagedDraftCache.

    `rows` [b, c]: the flat rows the call's new context rows go to (padding: rows of block 0). `table` [b, M]: the
    blocks whose keys the queries attend over, row r's column j being its block `base[r] + j` (`base` None: 0; a
    window gathers only the blocks it covers), entries past a request's blocks 0; None: the call only writes. The
    gathered keys are at positions `(base + j) * kv_block + o`; the caller hides those a query must not see.
    """

    def __init__(
        self, cache: PagedDraftCache, rows: torch.Tensor | None, table: torch.Tensor | None,
        base: torch.Tensor | None = None,
    ) -> None:
        self.cache, self.rows, self.table, self.base = cache, rows, table, base

    def update(
        self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Write new rows k, v [b, kv_heads, c, d] (when given); return the table's keys/values [b, kv_heads, L, d]."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if k is not None and v is not None and k.shape[2]:
            assert self.rows is not None
            write_context_rows(kc, vc, self.rows, k, v)
        if self.table is None:
            return None, None
        return gather_blocks(kc, vc, self.table, self.cache.kv_block)

    def key_positions(self, batch: int, n: int, device: torch.device) -> torch.Tensor:
        """Positions [batch, n] of the keys `update` returned."""
        pos = torch.arange(n, device=device)
        if self.base is None:
            return pos.expand(batch, n)
        return self.base[:, None] * self.cache.kv_block + pos[None]

    def commit(self, n: int) -> None:
        pass
