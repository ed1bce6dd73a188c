"""The slot pool: the cap on running requests (`--max-num-seqs`).

An admitted request holds ONE slot index from admission to its end (or a preemption). KV memory itself is paged
(`dflash_core/kv/`); the slot names what is still per request: a hybrid target's recurrent and convolution state,
and, for runners built without an engine's block pool (tests, benches), the request's fixed run of blocks. The
engine takes the slot before it creates the caches and gives it back only after they are dropped, and a request
waits (not fails) while no slot is free.
"""

from __future__ import annotations


class NoFreeSlotError(RuntimeError):
    """Every slot is held by a running request."""


class SlotPool:
    """Slots `0 .. capacity-1`, lowest free first; `capacity` None means unbounded (per-request caches)."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1)) if capacity is not None else []
        self._held: set[int] = set()
        self._next = 0  # unbounded pools: the next never-used index

    def has_free(self) -> bool:
        return self.capacity is None or bool(self._free)

    def num_free(self) -> int | None:
        """Free slots (None when unbounded)."""
        return None if self.capacity is None else len(self._free)

    def num_held(self) -> int:
        return len(self._held)

    def allocate(self) -> int:
        """A free slot index; NoFreeSlotError when all are held."""
        if self._free:
            slot = self._free.pop()
        elif self.capacity is None:
            slot, self._next = self._next, self._next + 1
        else:
            raise NoFreeSlotError(f"all {self.capacity} KV-cache slots are in use")
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back (releasing a free slot is a bug and raises)."""
        if slot not in self._held:
            raise ValueError(f"slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)  # lowest index first: deterministic reuse
