"""The engine's record of one request (``EngineRequest``): what the scheduler, the step loop and the width policy
read and update while it waits, prefills and decodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_core.grammar import GrammarState
from dflash_core.processors import LogitsProcessor
from dflash_core.sampling import SamplingParams
from dflash_core.speculation import SpecState
from dflash_core.stats import RequestStats


@dataclass
class EngineRequest:
    """A request inside the engine: its prompt, parameters, slot and caches, output so far, and per-step state."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    stats: RequestStats
    slot: int | None = None  # from the engine's SlotPool, held from prefill to the end
    cache: Any = None
    draft_state: Any = None
    output: list[int] = field(default_factory=list)
    position: int = 0  # position of output[-1], the one generated token not yet in the target cache
    aborted: bool = False
    prefilled: int = 0  # prompt tokens in the target cache (chunked prefill)
    spec: SpecState | None = None  # the width policy's history of this request
    drafted: bool = False  # it drafted in the current step
    processor: LogitsProcessor | None = None  # penalties, logit_bias, min_tokens, grammar mask (None: none)
    grammar: GrammarState | None = None  # structured output: the grammar over the committed tokens
