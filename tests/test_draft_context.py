"""The draft's context from a prefill is written chunk by chunk, never carried whole by the next proposal.

A long prompt arrives while other requests decode: its prefill runs in chunks, and each chunk's target features
go to the draft's cache when the chunk runs (a forward bounded by the chunk). The next batched proposal then
carries at most a block of new context rows per request, instead of a batch padded to the long prompt (issue 23,
finding 7: [8, 8192, hidden x layers] for Qwen3-8B). The proposals are those of a drafter that keeps every
feature for its next proposal, and the output is plain decoding's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.runners.base import DraftRequest
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.sampling import SamplingParams
from tests.helpers import Proposal as RecordedProposal
from tests.helpers import RecordingDrafter, make_tiny_pair
from tests.test_engine import tokens

BLOCK = 8
CHUNK = 32
LONG = 200
NEW_TOKENS = 24


class ScoredRecorder(RecordingDrafter):
    """A RecordingDrafter that passes the inner drafter's probabilities through and records them per prompt: a
    context row written at the wrong place changes the draft's distribution even where its argmax holds."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.scores: dict[tuple[int, ...], list[list[float]]] = {}

    def propose_scored(self, items: Any, sampling: Any = None, candidates: int = 0) -> Any:
        inner_items = [DraftRequest(st.inner, last, pos, n) for st, last, pos, n in items]
        outs = self.inner.propose_scored(inner_items, sampling, candidates)
        for (st, last, pos, _), out in zip(items, outs):
            self.proposals.append(RecordedProposal(st.prompt, last, pos, list(out.tokens)))
            self.scores.setdefault(st.prompt, []).append(list(out.confidence))
        return outs


class ContextProbe:
    """Wraps a DFlashDraft: the context rows every proposal forward and every context write receives."""

    def __init__(self, inner: DFlashDraft) -> None:
        self.inner = inner
        self.forward_rows: list[tuple[int, ...]] = []  # ctx_features' shape [b, c, F] of each proposal
        self.written_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, block_emb: torch.Tensor, block_pos: torch.Tensor, ctx: Any, *args: Any, **kw: Any) -> Any:
        self.forward_rows.append(tuple(ctx.shape) if ctx is not None else (block_emb.shape[0], 0))
        return self.inner(block_emb, block_pos, ctx, *args, **kw)

    def write_context(self, ctx: torch.Tensor, *args: Any) -> None:
        self.written_rows.append(ctx.shape[1])
        self.inner.write_context(ctx, *args)


class KeepAllDrafter(DFlashDrafter):
    """Every feature waits for the next proposal (the drafter before chunked context writes)."""

    def extend_context(self, state: Any, features: torch.Tensor) -> None:
        state.pending.append(features)
        state.pending_rows += features.shape[0]

    def catch_up(self, states: Any) -> None:
        pass  # nothing is written before a proposal either


@pytest.fixture(scope="module", params=["native", "hf"])
def models(request, tmp_path_factory):
    target_dir, draft_dir = make_tiny_pair(tmp_path_factory.mktemp("ctx"), arch="qwen3")
    return load_models(EngineConfig(str(target_dir), str(draft_dir), backend=request.param,
                                    max_running_requests=4))


def prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(3)
    short = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 11)]
    return short, torch.randint(4, vocab, (LONG,), generator=g).tolist()


def run(models, drafter) -> dict[tuple[int, ...], list[int]]:
    """The short requests decode a few steps, then the long prompt arrives; every request's tokens."""
    target = models.engine.target
    engine = Engine(target, drafter, eos_token_ids=[], prefill_chunk=CHUNK, max_model_len=models.engine.max_model_len)
    short, long = prompts(target.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    ids = {engine.add_request(p, params): tuple(p) for p in short}
    outs: dict[int, list] = {}

    def step() -> None:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)

    for _ in range(3):
        step()
    ids[engine.add_request(long, params)] = tuple(long)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished()
    return {prompt: tokens(outs[rid]) for rid, prompt in ids.items()}


def drafter_for(models, cls: type[DFlashDrafter], window: int | None) -> DFlashDrafter:
    target = models.engine.target
    slots = dict(max_slots=4, max_len=target.max_len) if models.backend == "native" else {}
    return cls(ContextProbe(models.engine.drafter.draft), target, BLOCK, window=window, **slots)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window24"])
def test_prefill_context_written_per_chunk(models, window):
    plain = run(models, None)
    drafter = drafter_for(models, DFlashDrafter, window)
    recorder = ScoredRecorder(drafter)
    out = run(models, recorder)
    assert out == plain  # exactness: plain decoding's tokens
    probe = drafter.draft
    batched = models.backend == "native"  # hf: a per-request draft cache, one proposal forward per request
    assert len(probe.forward_rows) > 3 and (max(b for b, *_ in probe.forward_rows) > 1) == batched
    # no proposal carries more than a block of new context rows per request, whatever the prompt's length
    assert max(c for _, c, *_ in probe.forward_rows) <= BLOCK, probe.forward_rows
    # the prompt went to the draft's cache in writes bounded by the prefill chunk (plus the rows a request may hold
    # back: a block's worth, four on a CPU's batched drafter)
    assert drafter.pending_limit == BLOCK * (4 if batched else 1)
    assert probe.written_rows and max(probe.written_rows) <= CHUNK + drafter.pending_limit, probe.written_rows

    # the proposals are those of a drafter that carries all context into its next proposal
    keep_all = drafter_for(models, KeepAllDrafter, window)
    ref_recorder = ScoredRecorder(keep_all)
    assert run(models, ref_recorder) == plain
    # what the chunked writes avoid: the prompt's rows (a window's last rows) in one padded proposal
    assert max(c for _, c, *_ in keep_all.draft.forward_rows) >= min(LONG - CHUNK, window or LONG)
    for prompt in out:
        assert [p.tokens for p in recorder.by_prompt(prompt)] == [p.tokens for p in ref_recorder.by_prompt(prompt)]
        mine, ref = recorder.scores[tuple(prompt)], ref_recorder.scores[tuple(prompt)]
        assert len(mine) == len(ref) == len(recorder.by_prompt(prompt)) > 0
        for a, b in zip(mine, ref):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), (a, b)
