"""The engine is lossless: greedy output equals the target's own greedy decoding, sampling follows its law."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from dflash_core.engine import Engine, StepOutput
from dflash_core.loading import load_models
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair


class ScriptedDrafter:
    """Proposes the target's true greedy continuation for the first k tokens of each block, then wrong tokens.

    k cycles through `pattern`, so short and full acceptances (and the bonus token) all occur.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], block_size: int, vocab: int,
                 pattern: tuple[int, ...] = (15, 3, 0, 7, 15, 1, 11)) -> None:
        self.references = references
        self.block_size = block_size
        self.vocab = vocab
        self.pattern = pattern

    def new_state(self, prompt_token_ids: list[int]) -> tuple[list[int], itertools.cycle]:
        return list(prompt_token_ids) + self.references[tuple(prompt_token_ids)], itertools.cycle(self.pattern)

    def extend_context(self, state: tuple, features: torch.Tensor) -> None:
        assert features.ndim == 2

    def propose(self, state: tuple, last_token: int, position: int, n: int) -> list[int]:
        seq, pattern = state
        good = next(pattern)
        truth = [seq[position + k] if position + k < len(seq) else 0 for k in range(1, n + 1)]
        return [t if k < good else (t + 1) % self.vocab for k, t in enumerate(truth)]


class OracleDrafter:
    """Proposes the target's own greedy continuation of the actual committed sequence (a perfect greedy draft)."""

    def __init__(self, model, block_size: int) -> None:
        self.model = model
        self.block_size = block_size

    def new_state(self, prompt_token_ids: list[int]) -> dict:
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


@pytest.fixture(scope="module", params=[("qwen3", "hf"), ("llama", "native")], ids=["qwen3-hf", "llama-native"])
def pair(request, tmp_path_factory) -> tuple[Path, Path, object]:
    arch, backend = request.param
    target_dir, draft_dir = make_tiny_pair(tmp_path_factory.mktemp(arch), arch=arch)
    models = load_models(str(target_dir), str(draft_dir), backend=backend)
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
    models = load_models(str(pair[0]), str(draft_dir), block_size=block_size, backend=pair[2].backend)
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
    assert st.prefill_time > 0 and st.decode_time > 0


SAMPLED = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=1234)


def test_seeded_sampling_reproducible_and_equal_to_plain_sampling(pair):
    target_dir, draft_dir, models = pair
    prompt = [5, 6, 7, 8, 9]
    outs = []
    for block_size in (16, 16, 1):
        engine = load_models(str(target_dir), str(draft_dir), block_size=block_size, backend=models.backend).engine
        rid = engine.add_request(prompt, SamplingParams(**{**SAMPLED.__dict__, "stop_token_ids": []}))
        outs.append(tokens(run_all(engine)[rid]))
    assert outs[0] == outs[1]
    # position-keyed sampling: the same seed gives the same text with and without speculation
    assert outs[0] == outs[2]


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("chi2"), arch="qwen3")
    return load_models(str(target_dir), None).engine.target


def test_sampling_distribution_matches_target(qwen3_target):
    """Chi-square: tokens sampled inside verified blocks follow plain sampling's law (different seeds)."""
    from scipy.stats import chi2_contingency

    target = qwen3_target
    prompt = [11, 12, 13]
    n = 200
    counts = []
    for spec, seeds in ((True, range(n)), (False, range(n, 2 * n))):
        drafter = OracleDrafter(target.model, 3) if spec else None
        engine = Engine(target, drafter, eos_token_ids=[])
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=20, seed=s))
               for s in seeds]
        outs = run_all(engine)
        counts.append([tuple(tokens(outs[i])[:3]) for i in ids])
        if spec:
            assert sum(st.num_accepted_tokens for st in map(engine.stats, ids)) > n // 4  # drafts were accepted
    for index in (1, 2):  # tokens produced by verify steps
        values = sorted({c[index] for run in counts for c in run})
        table = [[sum(1 for c in run if c[index] == v) for v in values] for run in counts]
        keep = [j for j in range(len(values)) if table[0][j] + table[1][j] >= 10]
        rare = [sum(row[j] for j in range(len(values)) if j not in keep) for row in table]
        table = [[row[j] for j in keep] + ([r] if sum(rare) else []) for row, r in zip(table, rare)]
        assert len(table[0]) >= 2
        _, p_value, _, _ = chi2_contingency(table)
        assert p_value > 1e-3, (index, table)


def test_isolation_interleaved_and_abort(pair):
    target_dir, draft_dir, _ = pair
    engine = load_models(str(target_dir), str(draft_dir), backend=pair[2].backend).engine
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
