"""The engine's KV memory bookkeeping (`KVManager`): admission is all or nothing, a cached prefix never covers the
last prompt token, growth takes blocks as positions are needed, and released blocks stay matchable."""

from __future__ import annotations

from dflash_core.kv.manager import KVManager
from dflash_core.kv.pool import BlockPool
from dflash_core.slots import SlotPool


def _manager(blocks: int = 9, slots: int = 4, reserve: int = 4) -> KVManager:
    return KVManager(SlotPool(slots), BlockPool(blocks, 4), reserve=reserve)


def test_admission_takes_blocks_for_the_prompt_and_the_reserve() -> None:
    kv = _manager()
    a = kv.admit(list(range(10)))  # 10 + 4 positions: 4 blocks of 4
    assert a is not None and len(a.blocks) == 4 and a.cached == 0 and 0 not in a.blocks
    assert kv.admit(list(range(100, 120))) is None  # 24 positions: 6 blocks, 4 left: nothing taken
    assert kv.pool.num_free() == 4 and kv.slots.num_free() == 3


def test_a_released_prefix_is_matched_but_never_the_last_prompt_token() -> None:
    kv = _manager()
    a = kv.admit(list(range(12)))
    kv.register(a, list(range(12)), 12)
    kv.release(a)
    b = kv.admit(list(range(12)))  # all three blocks cached, but the last token must be computed
    assert b is not None and b.cached == 8
    c = kv.admit(list(range(13)))
    assert c is not None and c.cached == 12 and c.blocks[:2] == b.blocks[:2]  # shared, read-only
    assert all(kv.pool.ref_count(x) == 2 for x in b.blocks[:2])
    assert kv.pool.prefix_hits == 20 and kv.pool.prefix_queries == 12 + 12 + 13


def test_growth_and_failure_leave_the_table_whole() -> None:
    kv = _manager(blocks=6)
    a = kv.admit([1, 2, 3])  # 7 positions: 2 blocks
    assert a is not None and kv.grow(a, 16) and len(a.blocks) == 4
    assert not kv.grow(a, 24) and len(a.blocks) == 4  # 6 blocks needed, 5 usable: nothing taken
    kv.release(a)
    assert kv.pool.num_free() == 5 and kv.slots.num_free() == 4


def test_a_request_retried_every_step_is_hashed_once(monkeypatch) -> None:  # noqa: ANN001
    """A head-of-line request that cannot be admitted keeps its block digests (`memo`): retries hash nothing new,
    and a failed try takes no block (cached blocks stay evictable, in their order)."""
    import dflash_core.kv.pool as pool_mod

    digests = []
    real = pool_mod.block_digest
    monkeypatch.setattr(pool_mod, "block_digest", lambda p, t: digests.append(1) or real(p, t))
    kv = _manager(blocks=40, reserve=4)
    tokens = list(range(100, 100 + 4 * 20))
    a = kv.admit(tokens)
    kv.register(a, tokens, len(tokens))
    kv.release(a)  # 20 cached, evictable blocks
    held = kv.pool.allocate(kv.pool.num_free() - 20)  # room for the hit only: the request cannot be admitted
    digests.clear()
    memo: list[bytes] = []
    for _ in range(5):
        assert kv.admit([*tokens, 1], memo=memo) is None
    assert len(digests) == 20 and len(memo) == 20
    assert kv.pool.num_free() == 20  # the cached blocks are still evictable: the tries took none
    kv.pool.free(held)
    b = kv.admit([*tokens, 1], memo=memo)
    assert b is not None and b.cached == 80 and len(digests) == 20


def test_a_chain_after_a_dead_link_is_marked_once() -> None:
    """A block whose cached parent was evicted ends its chain: the blocks after it are marked when registered, so
    a long request's later registrations do not walk back over them again."""
    pool = BlockPool(8, 4)
    tokens = list(range(100, 132))
    a = pool.allocate(1)
    pool.register(a, tokens, 1)
    b = pool.allocate(1)
    pool.register(b, tokens, 1)  # equal content: b chains through a's cached block
    pool.free(a)
    pool.reset_prefix_cache()  # a's block leaves the index
    b += pool.allocate(3)
    pool.register(b, tokens, 2)
    pool.register(b, tokens, 4)
    assert all(blk in pool._link for blk in b[:4])
