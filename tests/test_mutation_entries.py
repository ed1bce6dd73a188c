"""scripts/mutation_check.py's planted bugs stay in step with the code: each original text occurs exactly once in
its file, so a refactor that moves the code fails here at once instead of in the (slow) mutation run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_mutation_entry_matches_the_code_once() -> None:
    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module
    spec.loader.exec_module(module)
    stale = [
        f"{m.name}: {m.file} holds {(REPO / m.file).read_text().count(original)} copies of {original[:40]!r}"
        for m in module.MUTATIONS
        for original, _ in m.edits
        if (REPO / m.file).read_text().count(original) != 1
    ]
    assert not stale, stale
