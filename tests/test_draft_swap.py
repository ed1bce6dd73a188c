"""Replacing the draft while requests run (`Engine.swap_draft`): output equal to plain decoding, the new weights in
use from the next step, a draft of another shape refused with nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.loading import DEMO_DRAFT, load_models
from dflash_core.sampling import SamplingParams
from tests.helpers import noisy_demo_draft

PROMPTS = [[1, 40, 200, 7], list(range(30, 90)), [5] * 3, list(range(100, 300, 3))]
PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True, seed=3,
                                                                         temperature=0.8),
          SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)]


def engine(backend: str, draft: Path | None = None, speculative: bool = True) -> Engine:
    return load_models(EngineConfig(draft=str(draft) if draft else None, backend=backend, speculative=speculative,
                                    speculation="fixed", device="cpu", dtype="float32", max_model_len=512)).engine


def run_swapping(eng: Engine, swap_to: DFlashDraft, after_steps: int) -> tuple[list[list[int]], int, int]:
    """Every prompt's output, the draft swapped after `after_steps` steps; how many requests restarted, and how
    many blocks the prefix cache held right after the swap."""
    ids = [eng.add_request(p, q) for p, q in zip(PROMPTS, PARAMS)]
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    restarted = cached = -1
    steps = 0
    while any(eng.is_running(i) for i in ids):
        if steps == after_steps:
            restarted = eng.swap_draft(swap_to)
            cached = 0 if eng.kv.pool is None else eng.kv.pool.num_cached()
        for out in eng.step():
            outputs[out.request_id] += out.new_token_ids
        steps += 1
    return [outputs[i] for i in ids], restarted, cached


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_swap_under_load_changes_no_token_and_serves_the_new_weights(tmp_path: Path, backend: str) -> None:
    plain = [o.token_ids for o in run_to_completion(engine(backend, speculative=False), PROMPTS, PARAMS)]
    new_folder = noisy_demo_draft(tmp_path / "new", scale=0.3)
    eng = engine(backend)
    outputs, restarted, cached = run_swapping(eng, DFlashDraft.from_folder(new_folder), after_steps=3)
    assert outputs == plain
    assert restarted == len(PROMPTS)  # all four held memory (prefilled, decoding) when the draft changed
    assert cached == 0  # no block of the old draft's rows is left for a prefix hit
    # from then on the engine proposes exactly as one started with the new draft
    fresh = engine(backend, new_folder)
    prompt = [PROMPTS[1]]
    after = run_to_completion(eng, prompt, PARAMS[:1])[0]
    expected = run_to_completion(fresh, prompt, PARAMS[:1])[0]
    assert after.token_ids == expected.token_ids
    assert after.stats is not None and expected.stats is not None
    assert (after.stats.num_drafts, after.stats.num_accepted_tokens) == (
        expected.stats.num_drafts, expected.stats.num_accepted_tokens)
    demo = run_to_completion(engine(backend), prompt, PARAMS[:1])[0]
    assert demo.stats is not None and demo.stats.num_accepted_tokens != after.stats.num_accepted_tokens


def test_a_draft_of_another_shape_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    eng = engine("native")
    before = {k: v.clone() for k, v in eng.drafter.draft.state_dict().items()}  # type: ignore[union-attr]
    other = DFlashDraft.from_folder(DEMO_DRAFT)
    other.cfg.num_hidden_layers = 1
    smaller = DFlashDraft(other.cfg)
    rid = eng.add_request(PROMPTS[0], PARAMS[0])
    eng.step()
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2 -> 1\).*restart"):
        eng.swap_draft(smaller)
    after = eng.drafter.draft.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng.scheduler.running  # the running request was not restarted
    while eng.is_running(rid):
        eng.step()
    plain = run_to_completion(engine("native", speculative=False), PROMPTS[:1], PARAMS[:1])[0]
    assert eng.stats(rid).generated_tokens == len(plain.token_ids)


def test_an_engine_without_a_draft_has_none_to_replace() -> None:
    with pytest.raises(ValueError, match="without a draft"):
        engine("native", speculative=False).swap_draft(DFlashDraft.from_folder(DEMO_DRAFT))


@pytest.mark.parametrize("arch, backend", [("qwen3_5", "native"), ("qwen3", "generic")])
def test_a_swap_on_a_hybrid_and_on_the_generic_runner_changes_no_token(tmp_path: Path, arch: str,
                                                                        backend: str) -> None:
    """The restart path of a hybrid target (recurrent state recomputed, prefix checkpoints dropped) and of the
    generic runner: output equal to plain decoding across a swap."""
    from tests.helpers import make_draft, make_tiny_pair

    target, draft = make_tiny_pair(tmp_path, arch=arch)
    new = make_draft(tmp_path / "new-draft", vocab_size=DFlashDraft.from_folder(draft).cfg.vocab_size, seed=7)

    def load(speculative: bool) -> Engine:
        return load_models(EngineConfig(target=str(target), draft=str(draft), backend=backend, speculative=speculative,
                                        speculation="fixed", device="cpu", dtype="float32",
                                        max_model_len=512)).engine

    prompts = [[1, 40, 200, 7], list(range(30, 90)), [5] * 3, list(range(100, 300, 3))]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=2)] * 2
    plain = [o.token_ids for o in run_to_completion(load(False), prompts, params)]
    eng = load(True)
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    for step in range(10_000):
        if not any(eng.is_running(i) for i in ids):
            break
        if step == 3:
            assert eng.swap_draft(new) == len(prompts)
        for out in eng.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs[i] for i in ids] == plain
    assert eng.draft_version == 2
