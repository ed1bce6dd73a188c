"""Paged attention's gather path (every eager forward, any device) equals dense attention over a contiguous cache:
shuffled block ids, GQA, one query and sixteen, rows at different positions, padding queries and padding rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_core import attention
from dflash_core.attention import PagedAttention, attention_kernel, kv_rows, paged_attention, write_kv

KV_BLOCK = 4
HEADS, KV_HEADS, D = 8, 2, 16


def _dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Reference: each row's contiguous keys [b, kv_heads, L, d], a query at p sees positions 0 .. p."""
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    mask = torch.arange(keys.shape[2])[None, None, None, :] <= q_pos[:, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)


def _paged(g: torch.Generator, lengths: list[int], num_blocks: int) -> tuple:
    """Random contiguous keys/values per row, scattered into a paged cache through shuffled block tables."""
    ids = torch.randperm(num_blocks - 1, generator=g) + 1  # never the null block
    k_cache = torch.randn(num_blocks * KV_BLOCK, KV_HEADS, D, generator=g)  # stale rows: garbage, never seen
    v_cache = torch.randn(num_blocks * KV_BLOCK, KV_HEADS, D, generator=g)
    width = max(-(-n // KV_BLOCK) for n in lengths)
    tables, dense_k, dense_v, at = [], [], [], 0
    for n in lengths:
        used = -(-n // KV_BLOCK)
        blocks = ids[at : at + used].tolist()
        at += used
        tables.append(blocks + [0] * (width - used))
        k, v = torch.randn(n, KV_HEADS, D, generator=g), torch.randn(n, KV_HEADS, D, generator=g)
        rows = kv_rows(torch.tensor([tables[-1]]), torch.arange(n)[None], KV_BLOCK)[0]
        write_kv(k_cache, v_cache, rows, k, v)
        pad = width * KV_BLOCK - n
        dense_k.append(F.pad(k, (0, 0, 0, 0, 0, pad)).transpose(0, 1))
        dense_v.append(F.pad(v, (0, 0, 0, 0, 0, pad)).transpose(0, 1))
    return k_cache, v_cache, torch.tensor(tables), torch.stack(dense_k), torch.stack(dense_v)


def test_kv_rows_and_write_kv_follow_the_block_table():
    table = torch.tensor([[5, 2, 7], [3, 0, 0]])
    pos = torch.tensor([[0, 3, 4, 9], [1, 2, 3, 0]])
    assert kv_rows(table, pos, KV_BLOCK).tolist() == [[20, 23, 8, 29], [13, 14, 15, 12]]
    k_cache, v_cache = torch.zeros(32, 1, 2), torch.zeros(32, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, torch.tensor([9, 0, 31]), k, -k)
    assert torch.equal(k_cache[[9, 0, 31]], k) and torch.equal(v_cache[[9, 0, 31]], -k)
    assert k_cache.abs().sum() == k.abs().sum()  # nothing else written


@pytest.mark.parametrize("n", [1, 16])
def test_gather_path_equals_dense_attention(n: int):
    g = torch.Generator().manual_seed(n)
    lengths = [37, 16, 5, 60]  # row ends inside a block, on a block edge, in the first block
    k_cache, v_cache, table, dense_k, dense_v = _paged(g, lengths, num_blocks=40)
    # each row's queries are its last n positions (a verify block); a row shorter than n pads with position 0
    q_pos = torch.tensor([[max(0, L - n + i) for i in range(n)] for L in lengths])
    q = torch.randn(len(lengths), HEADS, n, D, generator=g)
    out = paged_attention(q, k_cache, v_cache, table, q_pos, D**-0.5, KV_BLOCK)
    ref = _dense(q, dense_k, dense_v, q_pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the table may be wider than the keys (a key bucket): entries past a row's blocks are the null block
    wide = torch.cat([table, torch.zeros(len(lengths), 5, dtype=table.dtype)], dim=1)
    out_wide = paged_attention(q, k_cache, v_cache, wide, q_pos, D**-0.5, KV_BLOCK)
    torch.testing.assert_close(out_wide, ref, rtol=1e-5, atol=1e-5)


def test_padding_rows_and_known_key_length():
    """Padding rows (a null-block table, position 0) compute something finite and leave real rows alone; with the
    key length known on the host the gather stops there, and a single query drops its mask, same result."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, table, dense_k, dense_v = _paged(g, [23, 9], num_blocks=12)
    padded = torch.cat([table, torch.zeros(2, table.shape[1], dtype=table.dtype)])
    q_pos = torch.tensor([[20, 21, 22], [6, 7, 8], [0, 0, 0], [0, 0, 0]])
    q = torch.randn(4, HEADS, 3, D, generator=g)
    out = paged_attention(q, k_cache, v_cache, padded, q_pos, D**-0.5, KV_BLOCK)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:2], _dense(q[:2], dense_k, dense_v, q_pos[:2]), rtol=1e-5, atol=1e-5)
    one = PagedAttention(table[:1], torch.tensor([[22]]), KV_BLOCK, k_cache.shape[0], kv_len=23)
    assert one.mask is None and one.index is not None and one.index.shape == (1, 23)
    ref = _dense(q[:1, :, 2:], dense_k[:1], dense_v[:1], torch.tensor([[22]]))
    torch.testing.assert_close(one(q[:1, :, 2:], k_cache, v_cache, D**-0.5), ref, rtol=1e-5, atol=1e-5)
    many = PagedAttention(table, q_pos[:2], KV_BLOCK, k_cache.shape[0], kv_len=23)
    assert many.mask is not None  # several queries: the mask stays
    torch.testing.assert_close(many(q[:2], k_cache, v_cache, D**-0.5), out[:2], rtol=1e-5, atol=1e-5)


def test_kernel_choice_and_its_override(monkeypatch):
    """attention_kernel: flex on CUDA, gather + SDPA elsewhere; DFLASH_ATTENTION overrides it on every device. The
    eager forward's PagedAttention gathers whatever the setting (no flex, so no compile per prompt shape)."""
    monkeypatch.delenv("DFLASH_ATTENTION", raising=False)
    assert attention_kernel(torch.device("cuda")) == "flex" and attention_kernel("cpu") == "sdpa"
    monkeypatch.setenv("DFLASH_ATTENTION", "sdpa")
    assert attention_kernel("cuda") == "sdpa"
    monkeypatch.setenv("DFLASH_ATTENTION", " Flex ")
    assert attention_kernel("cpu") == "flex"
    eager = PagedAttention(torch.tensor([[3, 1]]), torch.tensor([[5, 6]]), KV_BLOCK, 16)
    assert eager.flex_mask is None and eager.index is not None
    monkeypatch.setenv("DFLASH_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DFLASH_ATTENTION"):
        attention_kernel("cuda")


@pytest.mark.parametrize("chunked", [False, True])
def test_sliding_window_softcap_and_sinks_equal_their_definitions(chunked, monkeypatch):
    """A windowed PagedAttention sees only keys within `window` positions of each query (transformers' rule:
    q - k < window), and the explicit path's softcap and attention sinks follow their definitions, written out here
    from scratch for each query (chunked: one row per chunk of the explicit path)."""
    if chunked:
        monkeypatch.setattr(attention, "EXPLICIT_SCORES_BYTES", 1)
    g = torch.Generator().manual_seed(5)
    lengths = [37, 9]
    k_cache, v_cache, table, dense_k, dense_v = _paged(g, lengths, num_blocks=20)
    q_pos = torch.tensor([[33, 34, 35, 36], [5, 6, 7, 8]])
    q = torch.randn(2, HEADS, 4, D, generator=g)
    sinks = torch.randn(HEADS, generator=g)
    window, cap, scale = 6, 2.0, D**-0.5
    base = PagedAttention(table, q_pos, KV_BLOCK, k_cache.shape[0], kv_len=37)
    windowed = base.windowed(window)
    rep = HEADS // KV_HEADS
    for softcap, sink in ((None, None), (cap, None), (None, sinks), (cap, sinks)):
        out = windowed(q, k_cache, v_cache, scale, softcap, sink)
        for r in range(2):
            for i in range(4):
                p = int(q_pos[r, i])
                seen = [j for j in range(p + 1) if p - j < window]
                for h in range(HEADS):
                    keys, values = dense_k[r, h // rep, seen], dense_v[r, h // rep, seen]
                    scores = keys @ q[r, h, i] * scale
                    if softcap is not None:
                        scores = torch.tanh(scores / softcap) * softcap
                    logits = scores if sink is None else torch.cat([scores, sink[h : h + 1]])
                    probs = torch.softmax(logits, dim=0)[: len(seen)]
                    torch.testing.assert_close(out[r, h, i], probs @ values, rtol=1e-5, atol=1e-5)
    # without a window every earlier key is seen: the SDPA path equals the dense reference
    torch.testing.assert_close(base(q, k_cache, v_cache, scale), _dense(q, dense_k, dense_v, q_pos), rtol=1e-5,
                               atol=1e-5)
