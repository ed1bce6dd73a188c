"""Speculation statistics: the one definition of mean acceptance length, per request and summed.

Mean acceptance length is vLLM's: ``1 + accepted / drafts``, the tokens one draft/verify step commits on average
(1.0 when nothing was drafted). Every report (responses' ``dflash`` field, ``/metrics``, ``dflash-bench``,
``dflash-train``'s evaluation, the demo's model card) computes it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def mean_acceptance_length(num_accepted_tokens: float, num_drafts: int) -> float:
    """1 + accepted / drafts (vLLM's definition); 1.0 when nothing was drafted."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0


@dataclass
class SpecSummary:
    """Speculative-decoding counters of one request, or a sum over requests (`+`)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __add__(self, other: SpecSummary) -> SpecSummary:
        return SpecSummary(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    def to_dict(self) -> dict[str, Any]:
        """The ``dflash`` field of responses."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }


@dataclass
class RequestStats:
    """What one request did: speculation counters and timings (kept by the engine)."""

    prompt_tokens: int
    block_size: int
    generated_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed by each decode step
    prefill_time: float = 0.0
    decode_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details)
    preemptions: int = 0  # times its KV memory was given back and recomputed

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * max(self.block_size - 1, 0)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    def summary(self) -> SpecSummary:
        """The counters a response reports."""
        return SpecSummary(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def record_step(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one decode step that verified `num_draft_tokens` proposals and accepted a prefix of them."""
        self.acceptance_lengths.append(num_accepted_tokens + 1)
        if num_draft_tokens:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted_tokens
            for k in range(num_accepted_tokens):
                self.accepted_per_position[k] += 1
