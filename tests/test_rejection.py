"""Rejection sampling of draft tokens (`--spec-sampling rejection`): the committed tokens follow the target's law
exactly (chi-square, for the rule alone and through the engine with a drawn draft that is often wrong), the drafts'
draws follow the distributions they report, their confidences do not depend on the draws, and greedy output stays
the target's own with a real DFlash and DFlash 2 draft.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from dflash_core.config import EngineConfig
from dflash_core.draft_sampling import RowSampling
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.loading import load_models
from dflash_core.rejection import SALT_DRAFT, rejection_choices, salted
from dflash_core.runners.base import DraftSampling, Proposal
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams, _signed, race_among, race_choice
from tests.test_dflash2 import dflash2_draft
from tests.test_draft_reference import demo_prompts
from tests.test_engine import run_all, tokens
from tests.test_sampling_reference import (
    CHI_PARAMS,
    CHI_PROMPT,
    DEPTH,
    TreeArgmaxDrafter,
    exact_tree,
    law_p_values,
    leaf_law,
)

P = torch.tensor([0.30, 0.22, 0.15, 0.12, 0.09, 0.07, 0.05, 0.0])  # the target's law; token 7 impossible
Q = torch.tensor([0.10, 0.30, 0.05, 0.20, 0.05, 0.05, 0.05, 0.20])  # a draft's, often wrong


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts[t] - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("drawn", [True, False], ids=["drawn-draft", "deterministic-draft"])
def test_the_rule_keeps_the_target_law_and_accepts_the_overlap(drawn: bool) -> None:
    """20,000 positions of one target law P and draft law Q: the committed tokens fit P (chi-square with 6 degrees
    of freedom below its 0.999 quantile; the impossible token never comes) and the acceptance rate is
    sum min(P, Q) for a drawn draft, P(x) for a deterministic one (within 5 standard deviations)."""
    n = 20_000
    seeds = torch.full((n,), _signed(salted(77, 0)), dtype=torch.int64)
    positions = torch.arange(n, dtype=torch.int64)
    probs = P.expand(n, -1).contiguous()
    if drawn:
        dist = Q.expand(n, -1).contiguous()
        draft = race_choice(dist, seeds ^ _signed(SALT_DRAFT), positions)
        rate = float(torch.minimum(P, Q).sum())
    else:
        draft = torch.full((n,), 1, dtype=torch.int64)
        dist = torch.zeros(n, 8).scatter_(1, draft[:, None], 1.0)
        rate = float(P[1])
    chosen = rejection_choices(probs, dist, draft, seeds, positions)
    counts = Counter(chosen.tolist())
    assert counts[7] == 0
    assert chi_square(counts, P, n) < chi2.ppf(0.999, 6), sorted(counts.items())
    accepted = float((chosen == draft).double().mean())
    assert abs(accepted - rate) < 5 * (rate * (1 - rate) / n) ** 0.5, (accepted, rate)


def test_a_race_among_candidates_is_the_whole_rows_race() -> None:
    """Candidates that hold all of a row's mass draw the token the race over the whole vocabulary draws."""
    g = torch.Generator().manual_seed(3)
    probs = torch.zeros(64, 500)
    cand = torch.stack([torch.randperm(500, generator=g)[:6] for _ in range(64)])
    weights = torch.softmax(torch.randn(64, 6, generator=g), dim=-1)
    probs.scatter_(1, cand, weights)
    seeds, positions = torch.randint(0, 2**62, (64,), generator=g), torch.arange(64) * 7
    whole = race_choice(probs, seeds, positions)
    among = cand.gather(1, race_among(weights, cand, seeds, positions)[:, None]).squeeze(1)
    assert torch.equal(whole, among)


# ---- through the engine: a drawn draft, often wrong, and the exact law of the target ----

class TreeSamplingDrafter(TreeArgmaxDrafter):
    """Draws its proposals from a law Q of its own at every prefix of the exact tree: the target's support with its
    probabilities flattened (p^0.3), plus a token the target never emits; confidences: Q's largest probability."""

    def __init__(self, tree: dict, block_size: int, vocab: int) -> None:
        super().__init__(tree, block_size)
        self.vocab = vocab

    def law(self, node: tuple[int, ...]) -> torch.Tensor:
        q = torch.zeros(self.vocab, dtype=torch.float64)
        support, probs, _ = self.tree.get(node, ([0, 1, 2], [1 / 3] * 3, 0))
        for t, p in zip(support, probs):
            q[t] = p ** 0.3
        q[next(t for t in range(self.vocab) if t not in support)] = 0.4
        return q / q.sum()

    def propose_scored(self, items, sampling=None, candidates=0):  # noqa: ANN001, ANN201
        out = []
        for (state, last, position, n), how in zip(items, sampling or [None] * len(items)):
            if how is None:
                tokens_ = self.propose(state, last, position, n)
                out.append(Proposal(tokens_, [1.0] * n))
                continue
            if state["last"] is not None:
                state["seq"] = (state["seq"] + [state["last"]] + state["proposals"])[:position]
            state["last"] = last
            node = tuple(state["seq"][len(CHI_PROMPT):] + [last])
            rng = random.Random(f"{how.seed}:{position}")
            drawn, rows = [], []
            for _ in range(n):
                q = self.law(node)
                drawn.append(rng.choices(range(self.vocab), weights=q.tolist())[0])
                rows.append(q.float())
                node += (drawn[-1],)
            state["proposals"] = drawn
            out.append(Proposal(drawn, [float(r.max()) for r in rows], torch.stack(rows)))
        return out


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    from tests.helpers import make_target

    return make_target(None, "qwen3")


@pytest.mark.parametrize("drawn", [True, False], ids=["drawn-draft", "argmax-draft"])
def test_the_engine_keeps_the_exact_target_law(tiny_model, drawn: bool) -> None:
    """800 seeded requests of 5 tokens under rejection sampling with a drawn draft that is often wrong (or a
    drafter that ignores the request to draw: its argmax proposals are one-hot laws): the joint law of the outputs
    and each position's marginal fit the exact law of the target (chi-square p > 0.001), with draft tokens both
    accepted and rejected, and a token the target never emits never committed."""
    samples_n = 800
    tree = exact_tree(tiny_model)
    leaves = leaf_law(tree)
    target = NativeTarget(tiny_model, None, max_slots=samples_n, max_len=len(CHI_PROMPT) + 2 * DEPTH + 2)
    drafter = TreeSamplingDrafter(tree, DEPTH, target.vocab_size) if drawn else TreeArgmaxDrafter(tree, DEPTH)
    engine = Engine(target, drafter, eos_token_ids=[], spec_sampling="rejection")
    ids = [engine.add_request(CHI_PROMPT, SamplingParams(max_tokens=DEPTH, seed=s, **CHI_PARAMS))
           for s in range(samples_n)]
    outs = run_all(engine)
    samples = Counter(tuple(tokens(outs[i])) for i in ids)
    stats = [engine.stats(i) for i in ids]
    assert sum(s.num_accepted_tokens for s in stats) > samples_n
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > samples_n
    assert all(seq in leaves for seq in samples), "an output the target's law gives probability 0"

    p_values = law_p_values(samples, leaves, samples_n)
    assert min(p_values.values()) > 1e-3, p_values


# ---- real drafts: what they draw, and the engine's output ----

@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def pair(request, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    draft = None
    if request.param == "dflash2":
        draft = tmp_path_factory.mktemp("dflash2") / "draft"
        dflash2_draft(Path(draft))
    return load_models(EngineConfig(draft=None if draft is None else str(draft), block_size=8,
                                    max_running_requests=4, speculation="fixed", spec_sampling="rejection"))


@torch.inference_mode()
def test_a_drawn_proposal_follows_the_distribution_it_reports(pair) -> None:  # noqa: ANN001
    """2,000 rows of one block hidden state, each with its own seed: position 1's reported distribution is the
    draft's (its softmax at the temperature within the top 8; DFlash 2: the selector's scores after the first
    token) and the tokens drawn there fit it (chi-square at its 0.999 quantile); the confidences and that
    distribution are the same whatever the seed (functions of the distribution, not of the draw)."""
    draft = pair.engine.drafter.draft
    lm_head = pair.engine.target.lm_head_weight
    n, w = 2000, 3
    hidden = torch.randn(1, w, draft.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).expand(n, -1, -1)
    params = SamplingParams(temperature=0.9, top_k=8)
    rows = RowSampling([DraftSampling(params, seed) for seed in range(n)], torch.device("cpu"))
    first = torch.full((n,), 5)
    positions = torch.arange(40, 40 + w).expand(n, -1)
    drawn, conf, dist = draft.sample(hidden, first, lm_head, rows, positions)
    assert torch.equal(drawn[:, 0], first) and (conf[:, 0] == 1).all()
    torch.testing.assert_close(dist.sum(-1), torch.ones(n, w - 1))
    assert (dist.gather(2, drawn[:, 1:, None]) > 0).all()
    law = dist[0, 0]  # position 1's
    torch.testing.assert_close(dist[:, 0], law.expand(n, -1))  # position 1's law: of the known first token only
    torch.testing.assert_close(conf, conf[:1].expand(n, -1))  # every position's: of the logits, not the draws
    logits = draft.logits(hidden[0], lm_head).float()
    sel = draft.candidate_selector
    if sel is None:  # the draft's softmax at the temperature, its top 8
        top = torch.topk(logits[1], 8)
        want = torch.zeros_like(law).index_copy(0, top.indices, torch.softmax(top.values / 0.9, dim=-1))
    else:  # the selector's scores after the first token (`tests/test_dflash2.py`'s equations), softmax at T
        unary, cand = torch.topk(logits[1], sel.top_k)
        hp = sel.hidden_projection(hidden[0, 1])
        pair = (sel.predecessor_codebook[5] * hp * sel.successor_codebook[cand]).sum(-1)
        want = torch.zeros_like(law).index_copy(0, cand, torch.softmax((unary + pair) / 0.9, dim=-1))
    torch.testing.assert_close(law, want)
    counts = Counter(drawn[:, 1].tolist())
    support = int((law > 0).sum())
    assert len(counts) > 1 and support <= 8
    assert chi_square(counts, law, n) < chi2.ppf(0.999, support - 1), sorted(counts.items())


def test_rejection_mode_serves_greedy_unchanged_and_sampled_reproducibly(pair) -> None:  # noqa: ANN001
    """Greedy requests in rejection mode give plain decoding's tokens; a seeded sampled request gives the same text
    twice (fixed speculation), draws its drafts (some accepted, some not) and stays in the vocabulary."""
    engine = pair.engine
    prompts = demo_prompts(pair, 3)
    plain = load_models(EngineConfig(speculative=False)).engine
    greedy = SamplingParams(max_tokens=24)
    expected = run_to_completion(plain, [prompts[0]], [greedy])[0].token_ids
    assert tokens(run_all_one(engine, prompts[0], greedy)) == expected
    sampled = [SamplingParams(max_tokens=32, temperature=t, seed=11 + i) for i, t in enumerate((0.7, 1.0))]
    first = [tokens(run_all_one(engine, p, sp)) for p, sp in zip(prompts[1:], sampled)]
    second = [tokens(run_all_one(engine, p, sp)) for p, sp in zip(prompts[1:], sampled)]
    assert first == second
    assert all(len(t) == 32 and max(t) < engine.target.vocab_size for t in first)


def run_all_one(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(list(prompt), params)
    outs = run_all(engine)[rid]
    stats = engine.stats(rid)
    if not params.greedy:
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # drawn drafts accepted and rejected
    engine.release(rid)
    return outs


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="spec_sampling must be one of keyed, rejection"):
        EngineConfig(spec_sampling="typical")
