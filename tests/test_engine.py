"""The engine is lossless: greedy output equals the target's own greedy decoding, sampling follows its law."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_core import sampling
from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.outputs import StepOutput
from dflash_core.runners.base import PerRequestDrafter
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair


class ScriptedDrafter(PerRequestDrafter):
    """Proposes the target's true greedy continuation for the first k tokens of each block, then wrong tokens.

    k cycles through `pattern`, so short and full acceptances (and the bonus token) all occur.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], block_size: int, vocab: int,
                 pattern: tuple[int, ...] = (15, 3, 0, 7, 15, 1, 11)) -> None:
        self.references = references
        self.block_size = block_size
        self.vocab = vocab
        self.pattern = pattern

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> tuple[list[int], itertools.cycle]:
        return list(prompt_token_ids) + self.references[tuple(prompt_token_ids)], itertools.cycle(self.pattern)

    def extend_context(self, state: tuple, features: torch.Tensor) -> None:
        assert features.ndim == 2

    def propose(self, state: tuple, last_token: int, position: int, n: int) -> list[int]:
        seq, pattern = state
        good = next(pattern)
        truth = [seq[position + k] if position + k < len(seq) else 0 for k in range(1, n + 1)]
        return [t if k < good else (t + 1) % self.vocab for k, t in enumerate(truth)]


class OracleDrafter(PerRequestDrafter):
    """Proposes the target's own greedy continuation of the actual committed sequence (a perfect greedy draft)."""

    def __init__(self, model, block_size: int) -> None:
        self.model = model
        self.block_size = block_size

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> dict:
        return {"seq": list(prompt_token_ids), "last": None, "proposals": []}

    def extend_context(self, state: dict, features: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def propose(self, state: dict, last_token: int, position: int, n: int) -> list[int]:
        if state["last"] is not None:
            state["seq"] = (state["seq"] + [state["last"]] + state["proposals"])[:position]
        state["last"] = last_token
        seq = state["seq"] + [last_token]
        for _ in range(n):
            seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argmax()))
        state["proposals"] = seq[position + 1:]
        return state["proposals"]


def predicted_acceptance(max_tokens: int, block_size: int, pattern: tuple[int, ...]) -> list[int]:
    """The acceptance length of every verify step of a ScriptedDrafter request (no stop token): k = the pattern's
    next value drafts are right, so min(k, width) are accepted, width being B - 1 or less near max_tokens."""
    lengths, produced, cycle = [], 1, itertools.cycle(pattern)
    while produced < max_tokens:
        width = min(block_size, max_tokens - produced) - 1
        accepted = min(next(cycle), width) if width > 0 else 0  # no draft, no pattern step
        lengths.append(accepted + 1)
        produced += accepted + 1
    return lengths


def run_all(engine: Engine) -> dict[int, list[StepOutput]]:
    """Step until idle; the StepOutputs of each request in order."""
    outs: dict[int, list[StepOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens(steps: list[StepOutput]) -> list[int]:
    return [t for s in steps for t in s.new_token_ids]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decoding (transformers generate, EOS disabled)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=[("qwen3", "hf"), ("llama", "native"), ("qwen3_5", "native")],
                ids=["qwen3-hf", "llama-native", "qwen3_5-native"])
def pair(request, tmp_path_factory) -> tuple[Path, Path, object]:
    arch, backend = request.param
    target_dir, draft_dir = make_tiny_pair(tmp_path_factory.mktemp(arch), arch=arch)
    models = load_models(EngineConfig(str(target_dir), str(draft_dir), backend=backend))
    return target_dir, draft_dir, models


PROMPT_LENGTHS = (1, 7, 64, 200)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def references(pair) -> dict[tuple[int, ...], list[int]]:
    models = pair[2]
    g = torch.Generator().manual_seed(0)
    refs = {}
    for n in PROMPT_LENGTHS:
        prompt = torch.randint(4, models.engine.target.vocab_size, (n,), generator=g).tolist()
        refs[tuple(prompt)] = hf_greedy(models.engine.target.model, prompt, NEW_TOKENS)
    return refs


@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
def test_greedy_identical_with_scripted_draft(pair, references, block_size):
    target = pair[2].engine.target
    drafter = ScriptedDrafter(references, block_size, target.vocab_size) if block_size > 1 else None
    engine = Engine(target, drafter, eos_token_ids=[])
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): ref for p, ref in references.items()}
    outs = run_all(engine)
    for rid, ref in ids.items():
        assert tokens(outs[rid]) == ref
        assert outs[rid][-1].finish_reason == "length"
        if block_size == 16:
            assert max(s.acceptance_length for s in outs[rid]) == 16  # a fully accepted block plus its bonus


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_identical_with_real_draft(pair, references, block_size):
    _, draft_dir, _ = pair
    models = load_models(EngineConfig(str(pair[0]), str(draft_dir), block_size=block_size, backend=pair[2].backend))
    engine = models.engine
    engine.eos_token_ids = []
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): ref for p, ref in references.items()}
    outs = run_all(engine)
    for rid, ref in ids.items():
        assert tokens(outs[rid]) == ref


def test_stop_token_and_max_tokens_inside_accepted_block(pair, references):
    target = pair[2].engine.target
    prompt, ref = next((p, r) for p, r in references.items() if len(p) == 64)
    # EOS: the first occurrence of the token at index 9 ends the output, inside a block of 15 accepted drafts.
    eos = ref[9]
    cut = ref.index(eos) + 1
    engine = Engine(target, ScriptedDrafter(references, 16, target.vocab_size, pattern=(15,)), eos_token_ids=[eos])
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=NEW_TOKENS))
    outs = run_all(engine)[rid]
    assert tokens(outs) == ref[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == eos
    # ignore_eos keeps going; an explicit stop token id still stops.
    engine = Engine(target, ScriptedDrafter(references, 16, target.vocab_size, pattern=(15,)), eos_token_ids=[eos])
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert tokens(run_all(engine)[rid]) == ref
    # max_tokens landing inside an accepted block.
    engine = Engine(target, ScriptedDrafter(references, 16, target.vocab_size, pattern=(15,)), eos_token_ids=[])
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=13))
    outs = run_all(engine)[rid]
    assert tokens(outs) == ref[:13] and outs[-1].finish_reason == "length"


def test_statistics_add_up(pair, references):
    target = pair[2].engine.target
    prompt, ref = next((p, r) for p, r in references.items() if len(p) == 7)
    eos = ref[20]
    engine = Engine(target, ScriptedDrafter(references, 16, target.vocab_size), eos_token_ids=[eos])
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=NEW_TOKENS))
    outs = run_all(engine)[rid]
    st = engine.stats(rid)
    generated = tokens(outs)
    cut = sum(s.acceptance_length for s in outs) + 1 - len(generated)  # +1: the prefill token
    assert st.generated_tokens == len(generated) == 1 + sum(st.acceptance_lengths) - cut
    assert 0 <= cut < 16
    assert st.acceptance_lengths == [s.acceptance_length for s in outs if not s.is_prefill]
    assert st.num_accepted_tokens == sum(st.accepted_per_position) == sum(a - 1 for a in st.acceptance_lengths)
    # accepted at position k implies accepted at every earlier position
    assert all(x >= y for x, y in zip(st.accepted_per_position, st.accepted_per_position[1:]))
    assert st.accepted_per_position[0] <= st.num_drafts
    for k, count in enumerate(st.accepted_per_position):
        assert count == sum(1 for a in st.acceptance_lengths if a - 1 > k)
    assert st.mean_acceptance_length == pytest.approx(1 + st.num_accepted_tokens / st.num_drafts)
    # exactly the scripted acceptances, up to the step that hit the stop token
    predicted = predicted_acceptance(NEW_TOKENS, 16, ScriptedDrafter(references, 16, 1).pattern)
    assert st.acceptance_lengths == predicted[: len(st.acceptance_lengths)]
    assert st.num_drafts == len(st.acceptance_lengths) and st.num_accepted_tokens >= 15
    assert st.prefill_time > 0 and st.decode_time > 0


SAMPLED = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=1234)


def test_seeded_sampling_reproducible_and_equal_to_plain_sampling(pair):
    target_dir, draft_dir, models = pair
    prompt = [5, 6, 7, 8, 9]
    outs = []
    for block_size in (16, 16, 1):
        config = EngineConfig(str(target_dir), str(draft_dir), block_size=block_size, backend=models.backend)
        engine = load_models(config).engine
        rid = engine.add_request(prompt, SamplingParams(**{**SAMPLED.__dict__, "stop_token_ids": []}))
        outs.append(tokens(run_all(engine)[rid]))
    assert outs[0] == outs[1]
    # position-keyed sampling: the same seed gives the same text with and without speculation
    assert outs[0] == outs[2]


def test_isolation_interleaved_and_abort(pair):
    target_dir, draft_dir, _ = pair
    engine = load_models(EngineConfig(str(target_dir), str(draft_dir), backend=pair[2].backend)).engine
    engine.eos_token_ids = []
    main_params = SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=7)
    solo_id = engine.add_request([20, 21, 22], main_params)
    solo = tokens(run_all(engine)[solo_id])

    others = [
        ([30] * 50, SamplingParams(max_tokens=5)),
        ([40, 41], SamplingParams(max_tokens=60, temperature=1.0, seed=3)),
        (list(range(4, 120)), SamplingParams(max_tokens=17, temperature=0.5, top_p=0.8)),
    ]
    ids = [engine.add_request(p, s) for p, s in others[:2]]
    main_id = engine.add_request([20, 21, 22], main_params)
    ids.append(engine.add_request(*others[2]))
    outs: dict[int, list[StepOutput]] = {}
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        if step == 3:
            engine.abort(ids[1])
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert tokens(outs[main_id]) == solo
    assert outs[ids[1]][-1].finish_reason == "abort"
    assert len(tokens(outs[ids[0]])) == 5 and len(tokens(outs[ids[2]])) == 17
    assert engine.num_running() == 0


def test_bad_requests_rejected(pair):
    engine = pair[2].engine
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([5] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([10**6], SamplingParams())


def test_engine_error_fails_one_request_only(pair):
    target = pair[2].engine.target

    class FailingDrafter(ScriptedDrafter):
        def propose(self, state, last_token, position, n):
            if state[0][:2] == [7, 8]:
                raise RuntimeError("draft exploded")
            return super().propose(state, last_token, position, n)

    refs = {(5, 6): hf_greedy(target.model, [5, 6], 4), (7, 8): [0] * 4}
    engine = Engine(target, FailingDrafter(refs, 4, target.vocab_size), eos_token_ids=[])
    good = engine.add_request([5, 6], SamplingParams(max_tokens=4))
    bad = engine.add_request([7, 8], SamplingParams(max_tokens=4))
    outs = run_all(engine)
    assert outs[bad][-1].finish_reason == "error" and "draft exploded" in outs[bad][-1].error
    assert tokens(outs[good]) == refs[(5, 6)] and outs[good][-1].finish_reason == "length"



def _huge_top_k_beside_greedy(pair) -> tuple[list[StepOutput], list[StepOutput], list[int], list[int]]:
    """A sampled request with top_k 2**63 in one step with a greedy one: (its outputs, the greedy one's, the sampled
    request alone with top_k disabled, the greedy one alone)."""
    engine = pair[2].engine
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = []
    for prompt, params in (([20, 21, 22], sampled), ([5, 6], greedy)):
        rid = engine.add_request(prompt, params)
        alone.append(tokens(run_all(engine)[rid]))
    big = engine.add_request([20, 21, 22], SamplingParams(**{**sampled.__dict__, "top_k": 2**63}))
    plain = engine.add_request([5, 6], greedy)
    outs = run_all(engine)
    return outs[big], outs[plain], *alone


def test_a_top_k_past_the_vocabulary_keeps_every_token(pair):
    """vLLM's top_k has no upper bound: k at least the vocabulary is no restriction, whatever its size (2**63 does
    not fit the step's int64 column: it broke the whole step's batch, every request in it answered 500)."""
    big, plain, big_alone, plain_alone = _huge_top_k_beside_greedy(pair)
    assert tokens(big) == big_alone and tokens(plain) == plain_alone


def test_a_request_that_breaks_the_batched_choice_fails_alone(pair, monkeypatch):
    """Whatever of one request makes the step's batched choice raise, the others' choices are made without it."""
    monkeypatch.setattr(sampling, "TOP_K_ALL", 2**70)  # the clamp undone: packing the request's top_k raises
    big, plain, _, plain_alone = _huge_top_k_beside_greedy(pair)
    assert big[-1].finish_reason == "error" and "Overflow" in big[-1].error
    assert tokens(plain) == plain_alone and plain[-1].finish_reason == "length"


class FaultyTarget:
    """Wraps a target; the verify forwards that include one request (recognised by its prompt at prefill) fail.

    `fail_calls` lists which of those forwards fail (counting from 1; None: every one from the second on).
    `mid_model` raises inside the model halfway through its layers (the first layers already wrote their cache
    rows), else after the whole forward (every row written). On hf a batch runs row after row, as
    HFTarget.forward_batch does, so the rows before the failing one have already appended to their caches.
    """

    def __init__(self, inner: Any, bad_prompt: list[int], fail_calls: set[int] | None, mid_model: bool) -> None:
        self.inner = inner
        self.bad_prompt = list(bad_prompt)
        self.fail_calls = fail_calls
        self.mid_model = mid_model
        self.bad_cache = None
        self.calls = self.failures = 0
        self._armed = False
        self._hook = None
        if mid_model:
            layers = inner.model.model.layers
            self._hook = layers[len(layers) // 2].input_layernorm.register_forward_pre_hook(self._fire)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fire(self, module: torch.nn.Module, args: tuple) -> None:
        if self._armed:
            self._armed = False
            raise RuntimeError("injected fault inside the model")

    def _call(self, fn: Callable, caches: list, *args: Any) -> Any:
        fail = False
        if self.bad_cache is not None and any(c is self.bad_cache for c in caches):
            self.calls += 1
            fail = self.calls >= 2 if self.fail_calls is None else self.calls in self.fail_calls
            self.failures += fail
        self._armed = fail and self.mid_model
        try:
            out = fn(*args)
        finally:
            self._armed = False
        if fail:  # a fault after the forward (or a mid-model one that did not fire)
            raise RuntimeError("injected fault after the forward")
        return out

    def forward(self, token_ids: list[int], start: int, cache: Any, features: bool, last_only: bool = False) -> Any:
        if start == 0 and list(token_ids) == self.bad_prompt:
            self.bad_cache = cache
        return self._call(self.inner.forward, [cache], token_ids, start, cache, features, last_only)

    def forward_batch(self, rows: list[tuple[list[int], int, Any]], features: bool, last_only: bool = False) -> list:
        for t, s, c in rows:  # prefills are batched: recognise the bad prompt's cache here too
            if s == 0 and list(t) == self.bad_prompt:
                self.bad_cache = c
        if self.inner.backend == "hf":
            return [self.forward(t, s, c, features, last_only) for t, s, c in rows]
        return self._call(self.inner.forward_batch, [c for _, _, c in rows], rows, features, last_only)


@pytest.mark.parametrize("mode", ["persistent", "transient-mid-model"])
def test_verify_failure_in_one_row_leaves_the_others_exact(pair, references, mode):
    """A verify forward fails for one request of a batch: every other request (and, when the fault was
    transient, that one too) still returns exactly its solo greedy output."""
    target = pair[2].engine.target
    prompts = list(references)
    bad = prompts[2]  # on hf two rows run (and append to their caches) before it fails
    persistent = mode == "persistent"
    faulty = FaultyTarget(target, list(bad), None if persistent else {2}, mid_model=not persistent)
    try:
        engine = Engine(faulty, ScriptedDrafter(references, 8, target.vocab_size), eos_token_ids=[])
        ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): p for p in prompts}
        outs = run_all(engine)
    finally:
        faulty.close()
    assert faulty.failures >= 1
    for rid, p in ids.items():
        if persistent and p == bad:
            assert outs[rid][-1].finish_reason == "error" and "injected" in outs[rid][-1].error
        else:
            assert tokens(outs[rid]) == references[p], len(p)
            assert outs[rid][-1].finish_reason == "length"
    assert engine.num_running() == 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-6])
def test_tiny_temperature_is_greedy(pair, references, temperature):
    """A positive temperature below 1e-5 decodes greedily (no NaN probabilities, no garbage token 0)."""
    target = pair[2].engine.target
    engine = Engine(target, ScriptedDrafter(references, 8, target.vocab_size), eos_token_ids=[])
    ids = {}
    for i, p in enumerate(references):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=temperature, top_p=0.9, top_k=5,
                                seed=i if i % 2 else None)
        ids[engine.add_request(list(p), params)] = p
    outs = run_all(engine)
    for rid, p in ids.items():
        assert tokens(outs[rid]) == references[p]
