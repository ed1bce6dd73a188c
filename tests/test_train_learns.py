"""dflash-train learns: a short run lowers the loss and raises the engine's measured acceptance length.

A tiny random target has no structure that carries over to new prompts, so acceptance is measured on the
training prompts themselves: the point is that the recipe fits the target's continuations (a run with zero
gradients, a wrong label shift or features from the wrong positions does not), not that it generalises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_core import train
from tests.helpers import make_target, make_tokenizer

STEPS = 600


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("learns")
    target = root / "target"
    tok = make_tokenizer(target)
    make_target(target, vocab_size=len(tok))
    data = root / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Tell me about {i} foxes and {i * 7} hens"}]} for i in range(32)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "target": target, "data": data}


def run(setup: dict[str, Path], steps: int) -> dict[str, Any]:
    """Train for ``steps`` and evaluate with the engine on 6 of the training prompts; the run's summary."""
    out = setup["root"] / f"draft_{steps}"
    rc = train.main([
        "--target", str(setup["target"]), "--data", str(setup["data"]), "--output", str(out),
        "--steps", str(steps), "--batch-size", "8", "--anchors", "4", "--block-size", "8",
        "--max-new-tokens", "48", "--lr", "3e-3", "--cache-hidden", "--threads", "1", "--seed", "0",
        "--eval-data", str(setup["data"]), "--eval-n", "6", "--eval-max-new-tokens", "48",
    ])
    assert rc == 0
    return json.loads((out / "train_summary.json").read_text())


def test_short_run_lowers_loss_and_raises_acceptance(setup: dict[str, Path]) -> None:
    untrained = run(setup, 1)
    trained = run(setup, STEPS)
    assert trained["final_loss"] < 0.5 * untrained["final_loss"], (untrained["final_loss"], trained["final_loss"])
    before, after = untrained["eval"]["acceptance_length"], trained["eval"]["acceptance_length"]
    assert before < 1.5, before  # the untrained draft is (almost) never right
    assert after > before + 1.5, (before, after)
    assert trained["eval"]["drafts"] > 0
