"""DeepSeek sparse attention (GLM-5's `glm_moe_dsa`) on the generic runner: its compressed latents and indexer
keys in the paged pool.

A DSA layer reads its history from the cache it is given, compressed: `cache.update(latent, rope_key, layer)` and,
on a layer with its own indexer, `cache.update_indexer(index_key, layer)`; it expands the latents into per-head
keys and values itself, and its indexer picks each query's top-k keys. `PagedLatents` is that cache over the pages:
each layer keeps one latent tensor `[rows, kv_lora_rank + qk_rope_head_dim]` (the latent and the rotated key part,
side by side) and, with an indexer, one key tensor `[rows, index_head_dim]`; a forward writes its tokens' rows
and hands back the whole history of every row, concatenated (row 0's positions 0 .., then row 1's ...). The mask
the forward passes (`history_mask`) lets a query see only its own row's keys up to its position, for the indexer's
scores and for attention; the attention function then keeps each query's top-k keys (`sparse_attention`), as
transformers' SDPA path does. Every row's history is expanded and scored against every query of the forward, so a
forward of several requests costs the sum of their histories per query: exact, not yet fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash_core.attention import kv_rows

__all__ = ["DSALayout", "PagedLatents", "dsa_layout", "history_mask", "sparse_attention"]


@dataclass(frozen=True)
class DSALayout:
    """The pages of a DSA model: per layer its latent width (latent + rotated key) and, for layers with their own
    indexer, the indexer key width."""

    latent_dims: tuple[int, ...]
    index_dims: dict[int, int]

    def bytes_per_row(self, dtype_bytes: int) -> int:
        return (sum(self.latent_dims) + sum(self.index_dims.values())) * dtype_bytes


def dsa_layout(cfg: Any) -> DSALayout:
    """The pages `cfg` (a `glm_moe_dsa` text config) needs."""
    layers = int(cfg.num_hidden_layers)
    latent = int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    kinds = list(getattr(cfg, "indexer_types", None) or ["full"] * layers)
    return DSALayout((latent,) * layers, {i: int(cfg.index_head_dim) for i, kind in enumerate(kinds)
                                          if kind != "shared"})


class PagedLatents:
    """The cache a DSA model reads in one forward: writes the forward's tokens at `write` (flat rows [T]) and returns
    every row's history, the flat rows `history` [L] concatenated."""

    def __init__(self, latents: list[torch.Tensor], index_keys: dict[int, torch.Tensor], rank: int,
                 write: torch.Tensor, history: torch.Tensor) -> None:
        self.latents, self.index_keys, self.rank = latents, index_keys, rank
        self.write, self.history = write, history

    def update(self, latent: torch.Tensor, rope_key: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [1, 1, T, rank], rope_key [1, 1, T, rope] of the new tokens -> the history's, [1, 1, L, .]."""
        pages = self.latents[layer_idx]
        pages.index_put_((self.write,), torch.cat([latent[0, 0], rope_key[0, 0]], dim=-1))
        seen = pages.index_select(0, self.history)[None, None]
        return seen[..., : self.rank], seen[..., self.rank :]

    def update_indexer(self, key: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """The indexer's keys [1, T, D] of the new tokens -> the history's, [1, L, D]."""
        pages = self.index_keys[layer_idx]
        pages.index_put_((self.write,), key[0])
        return pages.index_select(0, self.history)[None]


def history_mask(table: torch.Tensor, starts: list[int], lengths: list[int], kv_block: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the concatenated history's flat rows [L], the mask [1, 1, T, L]) of a forward whose row r has `lengths[r]`
    tokens from position `starts[r]`, its block table `table[r]`: query t of row r sees the history's keys of row r
    at positions up to its own."""
    ends = [s + n for s, n in zip(starts, lengths)]
    key_row = torch.repeat_interleave(torch.arange(len(ends), device=device), torch.tensor(ends, device=device))
    first = torch.tensor([0, *ends], device=device).cumsum(0)[:-1]
    key_pos = torch.arange(sum(ends), device=device) - first[key_row]
    history = kv_rows(table[key_row], key_pos[:, None], kv_block)[:, 0]
    query_row = torch.repeat_interleave(torch.arange(len(ends), device=device), torch.tensor(lengths, device=device))
    q_first = torch.tensor([0, *lengths], device=device).cumsum(0)[:-1]
    query_pos = (torch.arange(sum(lengths), device=device) - q_first[query_row]
                 + torch.tensor(starts, device=device)[query_row])
    mask = (key_row[None, :] == query_row[:, None]) & (key_pos[None, :] <= query_pos[:, None])
    return history, mask[None, None]


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     indices: torch.Tensor | None, scale: float) -> torch.Tensor:
    """query [1, heads, T, dk] over the history's key [1, heads, L, dk] / value [1, heads, L, dv], seeing what `mask`
    [1, 1, T, L] allows among each query's top-k keys `indices` [1, T, k] (None: all) -> [1, T, heads, dv]."""
    if indices is not None:
        chosen = torch.zeros(mask.shape[2:], dtype=torch.bool, device=mask.device)
        chosen.scatter_(-1, indices[0].long(), True)
        mask = mask & chosen[None, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)
