"""The bf16 cross-shape policy (dflash_core/exactness.py) on synthetic logits: equal sequences pass, a first
divergence at a near-tie passes, a clear divergence or a length mismatch is refused with its report; and
`runner_logits` gives the target's own next-token logits after the prompt and the prefix. The demo pair in bf16 is
checked under the policy in tests/test_bf16.py."""

from __future__ import annotations

import pytest
import torch

from dflash_core.exactness import (
    BF16_ABS_MARGIN,
    BF16_REL_MARGIN,
    compare_greedy,
    first_divergence,
    near_tie_margin,
    runner_logits,
)
from dflash_core.runners.native import NativeTarget
from tests.helpers import make_target


def _logits(top1: float, top2: float, vocab: int = 8) -> torch.Tensor:
    x = torch.full((vocab,), -10.0)
    x[3], x[5] = top1, top2
    return x


def _never(prefix):
    raise AssertionError("no logits are needed for equal sequences")


def test_margin():
    assert near_tie_margin(16.0) == 16.0 * BF16_REL_MARGIN + BF16_ABS_MARGIN
    assert near_tie_margin(-16.0) == near_tie_margin(16.0)
    assert near_tie_margin(0.0) == BF16_ABS_MARGIN


def test_equal_sequences_pass():
    assert compare_greedy([1, 2, 3], [1, 2, 3], _never) is None
    assert compare_greedy([], [], _never) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_near_tie_divergence_is_accepted():
    seen = []

    def logits_at(prefix):
        seen.append(list(prefix))
        return _logits(20.0, 20.0 - 0.25)  # margin at 20: 20 / 64 + 1 / 16 = 0.375

    d = compare_greedy([1, 2, 3, 5, 6], [1, 2, 5, 3, 7], logits_at)
    assert seen == [[1, 2]]  # the logits after the shared prefix only
    assert d is not None and d.near_tie and d.position == 2 and d.tokens == (3, 5)
    assert d.gap == pytest.approx(0.25) and d.margin == pytest.approx(0.375)
    assert "a near-tie" in str(d)


def test_clear_divergence_is_refused_with_report():
    d = compare_greedy([1, 2, 3], [1, 4, 3], lambda prefix: _logits(20.0, 19.0))
    assert d is not None and not d.near_tie
    assert (d.position, d.tokens, d.top2, d.gap) == (1, (2, 4), (20.0, 19.0), 1.0)
    assert "position 1" in str(d) and "gap 1.0000" in str(d) and "NOT a near-tie" in str(d)
    # near zero the absolute slack decides: 0.05 passes, 0.1 does not
    assert compare_greedy([1], [2], lambda prefix: _logits(0.0, -0.05)).near_tie
    assert not compare_greedy([1], [2], lambda prefix: _logits(0.0, -0.1)).near_tie


def test_length_mismatch_is_refused():
    d = compare_greedy([1, 2], [1, 2, 3], _never)
    assert d is not None and not d.near_tie and d.tokens == (None, 3) and d.top2 is None
    assert "length" in str(d)


def test_runner_logits_is_the_targets_next_token():
    model = make_target(None, arch="qwen3", seed=5)
    target = NativeTarget(model, [0, 2, 3], max_slots=2, max_len=64)
    prompt, prefix = [5, 9, 17, 40], [7, 11]
    full = target.forward([*prompt, *prefix], 0, target.new_cache(1), features=False).logits
    got = runner_logits(target, prompt)(prefix)
    assert got.shape == (full.shape[-1],)
    torch.testing.assert_close(got, full[-1])
