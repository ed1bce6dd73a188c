"""The slot pool: one free-list for every slot-indexed cache (target KV rows and draft context rows)."""

from __future__ import annotations

import pytest

from dflash_core.slots import NoFreeSlotError, SlotPool


def test_bounded_pool_hands_out_lowest_free_first_and_refuses_when_full() -> None:
    pool = SlotPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert not pool.has_free() and pool.num_free() == 0 and pool.num_held() == 3
    with pytest.raises(NoFreeSlotError):
        pool.allocate()
    pool.release(2)
    pool.release(0)
    assert pool.allocate() == 0 and pool.allocate() == 2  # deterministic reuse: lowest index first


def test_releasing_a_slot_twice_or_never_held_is_an_error() -> None:
    pool = SlotPool(2)
    slot = pool.allocate()
    pool.release(slot)
    with pytest.raises(ValueError, match="not held"):
        pool.release(slot)
    with pytest.raises(ValueError, match="not held"):
        pool.release(1)
    assert pool.num_free() == 2


def test_unbounded_pool_grows_and_reuses_released_slots() -> None:
    pool = SlotPool(None)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.has_free() and pool.num_free() is None
    pool.release(1)
    assert pool.allocate() == 1 and pool.allocate() == 4


def test_a_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError):
        SlotPool(0)
