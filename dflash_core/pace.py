"""How fast decode steps go (``DecodePace``): a decode step's running average time, the speedup estimate over
plain steps, and the prefill room a step leaves while streams decode. All from measured step costs: device time
(``dflash_core.timing``), read after the step's sync."""

from __future__ import annotations

from dflash_core.speculation import StepCosts

MIN_PREFILL_ROOM = 32  # prefill tokens a step always has room for, however fast its decode step
PREFILL_SHARE = 0.5  # a step's prefill chunk may cost this much of a decode step while streams run


class DecodePace:
    """The engine's measurements of its decode steps (reset after warm-up)."""

    def __init__(self) -> None:
        self.decode_seconds: float | None = None  # a decode step's time (draft + verify), running average
        self.speedup: float | None = None  # committed tokens per second over a plain step's, running average

    def observe(self, costs: StepCosts, rows: int, committed: int, seconds: float, speculative: bool) -> None:
        """A decode step of ``rows`` requests committed ``committed`` tokens in ``seconds``. The speedup estimate
        (``speculative`` steps only): this step's tokens per second over a plain step's (measured costs)."""
        plain = costs.plain_step(rows)
        if speculative and plain > 0 and seconds > 0 and committed:
            ratio = (committed / seconds) / (rows / plain)
            self.speedup = ratio if self.speedup is None else self.speedup + 0.1 * (ratio - self.speedup)
        self.decode_seconds = seconds if self.decode_seconds is None else self.decode_seconds + 0.2 * (
            seconds - self.decode_seconds)

    def prefill_room(self, costs: StepCosts, prefill_chunk: int | None) -> int | None:
        """The most prefill tokens whose measured forward takes at most PREFILL_SHARE of a decode step (a power of
        two, MIN_PREFILL_ROOM at least, below ``prefill_chunk``); None while no decode step is measured."""
        if self.decode_seconds is None:
            return None
        room = MIN_PREFILL_ROOM
        while room < (prefill_chunk or 1 << 20) and costs.target(2 * room) <= PREFILL_SHARE * self.decode_seconds:
            room *= 2
        return room
