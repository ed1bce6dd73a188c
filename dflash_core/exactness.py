"""Comparing greedy outputs across batch shapes in bf16: the near-tie policy.

A 16-row verify block and a 1-row plain step (or a batch of 1 and a batch of 32) run different kernels and reduce
in a different order; in float32 the demo pair's outputs are token-identical, in bf16 they are not promised to be.
The written policy (docs/gpu.md, "bf16 and exactness"): two greedy sequences of the same target from the same
prompt are *consistent* when they are equal, or when at their first differing position the target's own logits
there (after the prompt and the shared prefix) have their top two within `near_tie_margin(top1)` of each other:
the target itself could not tell the two tokens apart at bf16's resolution, so either pick is a correct greedy
decode and everything after it legitimately differs. A divergence with a wider gap is a bug and is reported with
its position, both tokens and the gap.

The margin, `BF16_REL_MARGIN * |top1| + BF16_ABS_MARGIN`: bf16 keeps 8 significant bits, so one logit of
magnitude x is rounded to a spacing of up to 2^-7 x, and two rounded logits can swap when their gap is below one
such unit; the differing reduction order of the two shapes adds a few more units through the layers (the native
runner's bf16 logits stay within 2^-6 of the largest logit of transformers' bf16 forward, tests/test_bf16.py), so
the relative part is 2^-6 (two units at the top logit's magnitude). The absolute part, 2^-4, covers logits near
zero, where the relative term vanishes but errors carried in from the hidden state do not.

The logits at the divergence are computed in the same dtype by the same runner, one plain forward of the prompt
and the shared prefix (`runner_logits`): the question is whether *this* model in *this* precision was on a knife
edge there, and a float32 reference would need a second copy of the weights (twice the memory of a bf16 8B target
on the card) and would measure a different model's gap. The margin is set wide enough to cover that forward's own
bf16 noise in the gap. float32 comparisons do not use this: they stay exact equality.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

BF16_REL_MARGIN = 2.0**-6  # of |top-1 logit|: two bf16 units at the top logit's magnitude
BF16_ABS_MARGIN = 2.0**-4  # for logits near zero


def near_tie_margin(top1: float, rel: float = BF16_REL_MARGIN, abs_: float = BF16_ABS_MARGIN) -> float:
    """The largest top-1 minus top-2 logit gap that still counts as a near-tie in bf16."""
    return rel * abs(top1) + abs_


@dataclass(frozen=True)
class Divergence:
    """Where two greedy sequences first differ and what the target's logits said there."""

    position: int  # index into the generated tokens
    tokens: tuple[int | None, int | None]  # each sequence's token there (None: that sequence had ended)
    top2: tuple[float, float] | None  # the target's two largest logits there (None: a length mismatch)
    gap: float | None
    margin: float | None
    near_tie: bool

    def __str__(self) -> str:
        if self.top2 is None:
            return f"sequences differ in length at position {self.position} (tokens {self.tokens}), not a near-tie"
        verdict = "a near-tie" if self.near_tie else "NOT a near-tie"
        return (f"first divergence at position {self.position}: tokens {self.tokens}, target's top two logits "
                f"{self.top2[0]:.4f} and {self.top2[1]:.4f}, gap {self.gap:.4f} vs margin {self.margin:.4f}: {verdict}")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(
    a: Sequence[int], b: Sequence[int], logits_at: Callable[[Sequence[int]], torch.Tensor],
    rel: float = BF16_REL_MARGIN, abs_: float = BF16_ABS_MARGIN,
) -> Divergence | None:
    """None when `a == b`; else the first `Divergence`, its `near_tie` true when the target's top two logits there
    are within `near_tie_margin` (the sequences are then consistent). `logits_at(prefix)` returns the target's 1-D
    logits for the next token after the prompt and the generated `prefix`. A length difference (one sequence a strict
    prefix of the other) is refused: with the same max_tokens, two greedy runs end on a differing token or not at
    all."""
    i = first_divergence(a, b)
    if i is None:
        return None
    tokens = (a[i] if i < len(a) else None, b[i] if i < len(b) else None)
    if None in tokens:
        return Divergence(i, tokens, None, None, None, False)
    logits = logits_at(a[:i]).float().reshape(-1)
    top = torch.topk(logits, 2).values.tolist()
    gap, margin = top[0] - top[1], near_tie_margin(top[0], rel, abs_)
    return Divergence(i, tokens, (top[0], top[1]), gap, margin, gap <= margin)


def runner_logits(
    target: Any, prompt: Sequence[int], slot: int = 0, blocks: list[int] | None = None
) -> Callable[[Sequence[int]], torch.Tensor]:
    """`logits_at` for `compare_greedy` from a target runner (native, hybrid or hf): one plain forward of the prompt
    and the prefix into a fresh cache of `slot` (free it first: it is overwritten), in the runner's own dtype. On a
    runner an engine owns, `blocks` are blocks no request holds (`KVManager.borrow`) long enough for the forward."""

    def logits_at(prefix: Sequence[int]) -> torch.Tensor:
        cache = target.new_cache(slot, blocks)
        with torch.inference_mode():
            out = target.forward([*prompt, *prefix], 0, cache, features=False, last_only=True)
        return out.logits.reshape(-1)

    return logits_at
