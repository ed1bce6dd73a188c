"""The KV block pool: ids, refs, the prefix cache (exact matching, LRU eviction) and its counters."""

from __future__ import annotations

import pytest

from dflash_core.kv import BlockPool, KVStats, NoFreeBlocksError, blocks_for
from dflash_core.kv import pool as pool_module

BS = 4


def _seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens`, as a request's prefill would, and register its full blocks."""
    blocks = pool.allocate(blocks_for(len(tokens), pool.block_size))
    pool.register(blocks, tokens, len(tokens) // pool.block_size)
    return blocks


def test_blocks_for_is_ceil() -> None:
    assert [blocks_for(p, 4) for p in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_free_and_refs() -> None:
    pool = BlockPool(5, BS)
    assert pool.num_usable == 4 and pool.num_free() == 4 and pool.usage() == 0.0
    a = pool.allocate(3)
    assert 0 not in a and len(set(a)) == 3
    assert all(pool.ref_count(b) == 1 for b in a)
    assert pool.num_free() == 1 and pool.usage() == 0.75
    pool.free(a[:1])
    assert pool.ref_count(a[0]) == 0 and pool.num_free() == 2
    with pytest.raises(ValueError):
        pool.free(a[:1])  # double free
    with pytest.raises(ValueError):
        pool.free([0])  # the null block is never held by a request
    pool.free(a[1:])
    assert pool.num_free() == 4 and pool.usage() == 0.0


def test_null_block_never_handed_out() -> None:
    pool = BlockPool(4, BS)
    for _ in range(3):
        got = pool.allocate(3)
        assert sorted(got) == [1, 2, 3]
        pool.free(got)


def test_no_free_blocks_leaves_state_unchanged() -> None:
    pool = BlockPool(5, BS)
    held = _fill(pool, _seq(8))  # two full blocks, cached
    pool.free(held)  # evictable now
    other = pool.allocate(2)
    before = (pool.num_free(), pool.num_cached(), pool.usage())
    assert not pool.can_allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert (pool.num_free(), pool.num_cached(), pool.usage()) == before
    assert pool.match_prefix(_seq(8)) == held  # the cached blocks survived the failed allocate
    assert isinstance(NoFreeBlocksError(), RuntimeError)
    pool.free(other)


def test_shared_system_prompt_is_matched_and_shared() -> None:
    pool = BlockPool(32, BS)
    system = _seq(10)  # 2 full blocks + 2 tokens
    a_tokens = system + [1, 2, 3]
    a = _fill(pool, a_tokens)
    b_tokens = system + [7, 8, 9, 10, 11]
    hit = pool.match_prefix(b_tokens)
    assert hit == a[:2]  # the third blocks differ after the system prompt's last two tokens
    assert [pool.ref_count(x) for x in hit] == [2, 2]
    b = hit + pool.allocate(blocks_for(len(b_tokens), BS) - len(hit))
    pool.register(b, b_tokens, len(b_tokens) // BS)
    pool.free(a)
    assert [pool.ref_count(x) for x in hit] == [1, 1]
    pool.free(b)
    assert pool.usage() == 0.0
    assert pool.match_prefix(b_tokens) == b[:3]  # b's own full third block is cached now


def test_partial_last_block_never_matched() -> None:
    pool = BlockPool(8, BS)
    tokens = _seq(7)
    blocks = pool.allocate(2)
    pool.register(blocks, tokens, 1)
    assert pool.match_prefix(tokens) == blocks[:1]
    assert pool.match_prefix(tokens[:3]) == []  # shorter than a block
    assert pool.match_prefix(_seq(8), max_blocks=1) == blocks[:1]
    assert pool.match_prefix(_seq(8), max_blocks=0) == []


def test_eviction_lru_last_block_first_and_matched_block_survives() -> None:
    pool = BlockPool(5, BS)  # 4 usable
    tokens = _seq(12)
    blocks = _fill(pool, tokens)  # 3 cached blocks
    pool.free(blocks)
    (fresh,) = pool.allocate(1)  # the free list first: nothing evicted
    assert fresh not in blocks and pool.num_cached() == 3
    (evicted,) = pool.allocate(1)
    assert evicted == blocks[2]  # a request's last block goes first
    assert pool.match_prefix(tokens) == blocks[:2]
    pool.free(blocks[:2])  # matched again: now the most recently used
    pool.free([evicted])  # no longer cached: straight to the free list
    assert pool.allocate(1) == [evicted]
    other = _fill(pool, _seq(4, start=900))  # nothing free: evicts the LRU, blocks[1] (freed reversed: last first)
    assert other == [blocks[1]]
    assert pool.match_prefix(tokens) == blocks[:1]


def test_recently_matched_block_outlives_older_ones() -> None:
    pool = BlockPool(4, BS)  # 3 usable
    x = _fill(pool, _seq(4, start=10))
    y = _fill(pool, _seq(4, start=20))
    pool.free(x)
    pool.free(y)  # LRU order: x, y
    pool.free(pool.match_prefix(_seq(4, start=10)))  # touch x: order y, x
    pool.allocate(1)  # the one never-used free block
    assert pool.allocate(1) == y
    assert pool.match_prefix(_seq(4, start=10)) == x


def test_digest_collision_never_shares_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "block_digest", lambda parent, tokens: b"\x01" * 16)
    pool = BlockPool(16, BS)
    a = _fill(pool, _seq(8, start=0))
    assert pool.match_prefix(_seq(8, start=50)) == []  # same digest, other tokens: a miss
    b = _fill(pool, _seq(8, start=50))  # its blocks collide: left uncached, never confused with a's
    assert pool.match_prefix(_seq(8, start=50)) == []
    got = pool.match_prefix(_seq(8, start=0))
    assert got == a[:1]  # a's second block collided with its first at register: left uncached
    assert pool.num_cached() == 1
    pool.free(got)
    pool.free(a)
    pool.free(b)


def test_collision_deeper_in_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only second blocks collide: the same second-block tokens after another first block must not match.
    real = pool_module.block_digest

    def digest(parent: bytes, tokens: bytes) -> bytes:
        return b"\x02" * 16 if tokens == pool_module.token_bytes([7, 7, 7, 7]) else real(parent, tokens)

    monkeypatch.setattr(pool_module, "block_digest", digest)
    pool = BlockPool(16, BS)
    a = _fill(pool, [1, 1, 1, 1, 7, 7, 7, 7])
    assert pool.match_prefix([2, 2, 2, 2, 7, 7, 7, 7]) == []
    b = _fill(pool, [2, 2, 2, 2, 7, 7, 7, 7])
    assert pool.match_prefix([2, 2, 2, 2, 7, 7, 7, 7]) == b[:1]  # its first block cached, its colliding one not
    assert pool.match_prefix([1, 1, 1, 1, 7, 7, 7, 7]) == a


def test_register_is_idempotent_and_keeps_the_first_duplicate() -> None:
    pool = BlockPool(16, BS)
    tokens = _seq(9)
    a = pool.allocate(3)
    pool.register(a, tokens, 1)
    pool.register(a, tokens, 1)
    pool.register(a, tokens, 2)
    pool.register(a, tokens, 2)
    assert pool.num_cached() == 2
    b = pool.allocate(3)  # the same prompt prefilled concurrently: duplicate blocks
    b_tokens = tokens[:8] + [5, 5, 5, 5]
    pool.register(b, b_tokens, 3)
    assert pool.num_cached() == 3  # b's duplicates were not cached; its own third block was, chained through a's
    assert pool.match_prefix(b_tokens) == [a[0], a[1], b[2]]
    pool.free(a)
    pool.free(b)


def test_evicted_parent_stops_the_chain() -> None:
    pool = BlockPool(5, BS)  # 4 usable
    a = _fill(pool, _seq(4))
    b = pool.allocate(2)
    b_tokens = _seq(4) + [5, 5, 5, 5]
    pool.register(b, b_tokens, 1)  # b[0] duplicates a[0]
    pool.free(a)
    pool.allocate(2)  # the last free one, then evicts a[0]
    pool.register(b, b_tokens, 2)  # hangs on an evicted block: never cached, never matched
    assert pool.match_prefix(b_tokens) == []


def test_disabled_caching_matches_and_counts_nothing() -> None:
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    blocks = _fill(pool, _seq(8))
    assert pool.num_cached() == 0
    assert pool.match_prefix(_seq(8)) == []
    assert (pool.prefix_queries, pool.prefix_hits) == (0, 0)
    pool.free(blocks)
    assert pool.num_free() == 7


def test_usage_counts_only_held_blocks() -> None:
    pool = BlockPool(11, BS)  # 10 usable
    blocks = _fill(pool, _seq(16))
    assert pool.usage() == pytest.approx(0.4)
    hit = pool.match_prefix(_seq(16))  # shared: still 4 blocks held
    assert pool.usage() == pytest.approx(0.4)
    pool.free(blocks)
    assert pool.usage() == pytest.approx(0.4)
    pool.free(hit)
    assert pool.usage() == 0.0 and pool.num_cached() == 4  # cached but evictable: free for usage
    assert pool.reset_prefix_cache() == 4
    assert pool.num_cached() == 0 and pool.num_free() == 10
    assert pool.match_prefix(_seq(16)) == []


def test_reset_keeps_held_blocks() -> None:
    pool = BlockPool(8, BS)
    held = _fill(pool, _seq(8))
    gone = _fill(pool, _seq(4, start=500))
    pool.free(gone)
    assert pool.reset_prefix_cache() == 1
    assert pool.match_prefix(_seq(8)) == held


def test_counters_are_in_tokens() -> None:
    pool = BlockPool(16, BS)
    _fill(pool, _seq(10))
    pool.match_prefix(_seq(10))  # 10 queried, 2 blocks hit
    pool.match_prefix(_seq(3, start=900))  # 3 queried, none hit
    pool.match_prefix(_seq(10), max_blocks=1)  # 10 queried, 1 block hit
    hit = pool.match_prefix(_seq(10), count=False)
    assert (pool.prefix_queries, pool.prefix_hits) == (23, 12)
    pool.record_query(10, len(hit) * BS)
    assert (pool.prefix_queries, pool.prefix_hits) == (33, 20)
    stats = pool.stats(preemptions=3)
    assert stats == KVStats(num_blocks=16, block_size=BS, usage=pool.usage(), prefix_queries=33, prefix_hits=20,
                            preemptions=3)
    with pytest.raises(AttributeError):
        stats.usage = 0.0  # type: ignore[misc]


def test_random_workload_keeps_the_books_and_matches_exactly() -> None:
    import random

    rng = random.Random(0)
    pool = BlockPool(40, BS)
    contents: dict[int, tuple[int, ...]] = {}  # block -> the tokens a request wrote there (what its KV means)
    running: list[tuple[list[int], list[int]]] = []
    for _ in range(400):
        if running and (rng.random() < 0.4 or not pool.can_allocate(6)):
            blocks, _tokens = running.pop(rng.randrange(len(running)))
            pool.free(blocks)
            continue
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]  # a tiny vocabulary: many shared prefixes
        hit = pool.match_prefix(tokens, max_blocks=(len(tokens) - 1) // BS)
        for i, b in enumerate(hit):
            assert contents[b] == tuple(tokens[i * BS : (i + 1) * BS])  # never another sequence's KV
        need = blocks_for(len(tokens), BS) - len(hit)
        if not pool.can_allocate(need):
            pool.free(hit)
            continue
        blocks = hit + pool.allocate(need)
        for i in range(len(hit), len(tokens) // BS):
            contents[blocks[i]] = tuple(tokens[i * BS : (i + 1) * BS])
        pool.register(blocks, tokens, len(tokens) // BS)
        running.append((blocks, tokens))
        held = {b for blocks, _ in running for b in blocks}
        assert pool.num_free() + len(held) == pool.num_usable
        assert pool.usage() == pytest.approx(len(held) / pool.num_usable)
    for blocks, _ in running:
        pool.free(blocks)
    assert pool.usage() == 0.0 and pool.num_free() == pool.num_usable
