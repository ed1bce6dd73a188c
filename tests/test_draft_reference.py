"""The engine's cached, batched draft proposals equal the draft run from scratch on the committed prefix.

The reference recomputes everything at every step without any cache: the target's features of the whole committed
prefix by a fresh transformers forward (hidden state i + 1 for target layer i), then the DFlash draft on all of them
plus the block. Rejected rows entering the draft's context, a target cache that keeps a rejected token (hf; the
native cache overwrites such a row before any query sees it) or a feature read from the wrong layer all make the
engine's proposals differ from it. Uses the bundled demo pair, whose trained draft is really accepted, on both
target backends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.cpu_step.fused import CPU_STEP_ENV
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.loading import LoadedModels, load_models
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.sampling import SamplingParams
from tests.helpers import Proposal, RecordingDrafter
from tests.test_engine import run_all, tokens

BLOCK = 8
NEW_TOKENS = 40
QUESTIONS = [
    "There are 10 shelves with 11 oranges in each. How many oranges are there in total?",
    "Ana travels by bike at 59 km per hour for 8 hours. How far does Ana go?",
    "Write a Python function is_even that checks whether a number is even.",
]


@pytest.fixture(scope="module", params=["hf", "native"])
def demo(request) -> LoadedModels:
    return load_models(EngineConfig(block_size=BLOCK, backend=request.param, max_running_requests=4))


def demo_prompts(models: LoadedModels, n: int) -> list[list[int]]:
    """n questions in the demo's style, chat-templated and tokenized."""
    tok = models.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS[:n]]
    return [tok(text, add_special_tokens=False).input_ids for text in texts]


def fresh_drafter(models: LoadedModels) -> DFlashDrafter:
    """A new drafter over the loaded draft: its slot cache holds nothing from earlier tests (stale rows could
    hide a context row that was never written)."""
    target = models.engine.target
    slots = dict(max_slots=4, max_len=target.max_len) if models.backend == "native" else {}
    return DFlashDrafter(models.engine.drafter.draft, target, BLOCK, **slots)


@torch.inference_mode()
def reference_logits(
    model: torch.nn.Module, draft: DFlashDraft, prefix: list[int], last_token: int, n: int
) -> torch.Tensor:
    """Draft logits [n, V] for the n tokens after `last_token` (at position len(prefix)), computed from scratch:
    transformers' own hidden states of the whole prefix (no cache), then the draft without a cache."""
    out = model(input_ids=torch.tensor([prefix]), use_cache=False, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in draft.cfg.target_layer_ids], dim=-1)
    position = len(prefix)
    block = torch.full((1, n + 1), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = last_token
    emb = draft.embed(block, model.get_input_embeddings().weight)
    block_pos = torch.arange(position, position + n + 1)[None]
    hidden = draft(emb, block_pos, feats[None], torch.arange(position)[None])
    return draft.logits(hidden[0, 1:], model.get_output_embeddings().weight).float()


def assert_proposals_match_reference(
    model: torch.nn.Module, draft: DFlashDraft, sequences: dict[tuple[int, ...], list[int]], proposals: list[Proposal]
) -> None:
    """Every recorded proposal is the from-scratch draft's argmax (ties within 1e-3 tolerated).

    `sequences` maps each prompt to its request's whole output: the committed prefix at any step is a prefix of
    prompt + output, since output only grows.
    """
    assert proposals
    for prop in proposals:
        seq = list(prop.prompt) + sequences[prop.prompt]
        assert seq[prop.position] == prop.last_token  # the engine's bookkeeping: last token at its position
        logits = reference_logits(model, draft, seq[: prop.position], prop.last_token, len(prop.tokens))
        for k, tok in enumerate(prop.tokens):
            best = float(logits[k].max())
            assert float(logits[k, tok]) >= best - 1e-3, (
                f"position {prop.position} row {k}: engine proposed {tok}, reference {int(logits[k].argmax())}")


def test_cached_batched_proposals_equal_from_scratch_draft(demo):
    """Greedy and sampled requests side by side: every step's proposals equal the reference draft's."""
    recorder = RecordingDrafter(fresh_drafter(demo))
    engine = Engine(demo.engine.target, recorder, eos_token_ids=[], max_model_len=demo.engine.max_model_len)
    prompts = demo_prompts(demo, 3)
    params = [SamplingParams(max_tokens=NEW_TOKENS), SamplingParams(max_tokens=NEW_TOKENS - 7),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=5)]
    ids = {engine.add_request(p, sp): tuple(p) for p, sp in zip(prompts, params)}
    outs = run_all(engine)
    sequences = {prompt: tokens(outs[rid]) for rid, prompt in ids.items()}
    drafted = [s for steps in outs.values() for s in steps if s.num_draft_tokens]
    lengths = [s.acceptance_length for s in drafted]
    # partial acceptances (accepted and rejected rows in one block) and fully accepted blocks both occur
    assert sum(1 < length < BLOCK for length in lengths) >= 3 and max(lengths) == BLOCK, lengths
    assert len(recorder.proposals) == len(drafted)
    assert_proposals_match_reference(demo.engine.target.model, demo.engine.drafter.draft, sequences,
                                     recorder.proposals)


def one_context_row_per_position(state: Any, last_token: int, position: int, n: int) -> None:
    """A per-request draft cache plus the pending features hold exactly one row for each position before
    `position` (the slot cache is written by position and has no such count)."""
    if state.cache is not None:
        assert state.cache.length + sum(f.shape[0] for f in state.pending) == position


class FailingDraft:
    """Wraps a DFlashDraft: the chosen call (counting from 1) raises, before the real forward or after it ran
    (its context already written to the draft cache)."""

    def __init__(self, inner: DFlashDraft, fail_call: int, after: bool) -> None:
        self.inner = inner
        self.fail_call = fail_call
        self.after = after
        self.calls = 0
        self.failed_batch = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, block_emb: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        fail = self.calls == self.fail_call
        if fail:
            self.failed_batch = block_emb.shape[0]
        if fail and not self.after:
            raise RuntimeError("injected draft failure")
        out = self.inner(block_emb, *args, **kwargs)
        if fail:
            raise RuntimeError("injected draft failure")
        return out


@pytest.mark.parametrize("after", [False, True], ids=["before-forward", "after-forward"])
def test_failed_draft_forward_consumes_nothing(demo, after, monkeypatch):
    """One failure inside a batched draft call: after the retry, every request drafts exactly as without it."""
    monkeypatch.setenv(CPU_STEP_ENV, "torch")  # the failure is injected into the PyTorch draft module
    prompts = demo_prompts(demo, 3)

    def run(drafter: DFlashDrafter) -> tuple[dict, RecordingDrafter]:
        recorder = RecordingDrafter(drafter, check=one_context_row_per_position)
        engine = Engine(demo.engine.target, recorder, eos_token_ids=[], max_model_len=demo.engine.max_model_len)
        ids = {engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)): tuple(p) for p in prompts}
        outs = run_all(engine)
        stats = {prompt: engine.stats(rid) for rid, prompt in ids.items()}
        return {prompt: (tokens(outs[rid]), stats[prompt]) for rid, prompt in ids.items()}, recorder

    clean, clean_rec = run(fresh_drafter(demo))
    # hf: one forward per request, so call 5 is a later request of the second step (an earlier one succeeded);
    # native: one forward for all requests, so call 2 is the second step's batched call.
    fail_call = 5 if demo.backend == "hf" else 2
    drafter = fresh_drafter(demo)
    failing = drafter.draft = FailingDraft(drafter.draft, fail_call, after)
    faulty, faulty_rec = run(drafter)
    assert failing.calls > fail_call
    if demo.backend == "native":
        assert failing.failed_batch == len(prompts)
    for prompt in clean:
        out_clean, st_clean = clean[prompt]
        out_faulty, st_faulty = faulty[prompt]
        assert out_faulty == out_clean
        assert st_faulty.acceptance_lengths == st_clean.acceptance_lengths
        assert st_faulty.num_accepted_tokens == st_clean.num_accepted_tokens
        assert st_faulty.accepted_per_position == st_clean.accepted_per_position
        assert [p.tokens for p in faulty_rec.by_prompt(prompt)] == [p.tokens for p in clean_rec.by_prompt(prompt)]
    # the comparison means something: the draft is really accepted
    assert all(st.mean_acceptance_length > 2.0 for _, st in clean.values())
