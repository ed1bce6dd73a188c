"""Tree verification (`dflash_core.tree`, `--speculation tree`): the tree holds exactly the top prefixes; one tree
row's logits at every node equal the target's forward of that node's path; the accepted path compacted into the
cache continues as if it had been decoded; the engine's output equals plain decoding, greedy and seeded, with trees
really verified; requests that cannot take a tree (logits processing, rejection sampling) keep their chain; and
the adaptive policy weighs a tree against the chain by the measured costs.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.kv.manager import KVManager
from dflash_core.kv.pool import BlockPool, blocks_for
from dflash_core.loading import load_models
from dflash_core.runners.base import TargetRow
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from dflash_core.slots import SlotPool
from dflash_core.speculation import LinearCost, StepCosts, WidthPolicy
from dflash_core.tree import DraftTree, build_tree
from dflash_core.verify import tree_budget_for
from tests.helpers import make_target
from tests.test_draft_reference import demo_prompts


def candidates(depth: int, k: int, seed: int) -> tuple[list[list[int]], list[list[float]]]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randperm(300, generator=g)[:k].tolist() for _ in range(depth)]
    logp = [torch.log_softmax(torch.randn(k + 3, generator=g) * 2, dim=0).sort(descending=True).values[:k].tolist()
            for _ in range(depth)]
    return ids, logp


@pytest.mark.parametrize("budget", [1, 5, 17, 40])
def test_the_tree_is_the_top_prefixes(budget: int) -> None:
    """Every prefix of ranks, scored by its summed log-probabilities, enumerated: the tree's nodes are the `budget`
    best, each after its parent, with the tokens and depths of their ranks."""
    ids, logp = candidates(depth=4, k=3, seed=budget)
    tree = build_tree(7, ids, logp, budget)
    scored = {}
    for d in range(1, 5):
        for ranks in itertools.product(range(3), repeat=d):
            scored[tuple(ids[i][r] for i, r in enumerate(ranks))] = sum(logp[i][r] for i, r in enumerate(ranks))
    best = sorted(scored.values(), reverse=True)[:budget]

    def path_tokens(i: int) -> tuple[int, ...]:
        out = []
        while i > 0:
            out.append(tree.tokens[i])
            i = tree.parents[i]
        return tuple(reversed(out))

    assert tree.size == budget + 1 and tree.tokens[0] == 7 and tree.parents[0] == -1
    assert all(tree.parents[i] < i for i in range(1, tree.size))
    assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, tree.size))
    for i in range(1, tree.size):
        assert math.isclose(tree.logp[i], scored[path_tokens(i)], abs_tol=1e-9)
    assert sorted(tree.logp[1:], reverse=True) == pytest.approx(best)  # exactly the top scores (ties aside)
    assert tree.prefix(3).size == 4 and not tree.is_chain or budget == 1


def test_visibility_and_the_accepted_path() -> None:
    """A hand-built tree: each node sees itself and its ancestors; the walk follows the target's choices."""
    #        0 (root 9)
    #      /   \
    #   1 (4)  2 (5)
    #    |       \
    #   3 (6)    4 (7)
    tree = DraftTree([9, 4, 5, 6, 7], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [0.0] * 5)
    assert tree.visibility() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                 [1, 0, 1, 0, 1]]
    assert tree.path([5, 0, 7, 0, 0]) == [0, 2, 4]  # root -> 5 -> 7, then the target's own token
    assert tree.path([4, 1, 1, 2, 2]) == [0, 1]  # 4 accepted, then the target says 1: not a child
    assert tree.path([3, 0, 0, 0, 0]) == [0]
    chain = DraftTree.chain(9, [4, 6])
    assert chain.is_chain and not tree.is_chain and chain.path([4, 6, 1]) == [0, 1, 2]


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return make_target(None, "qwen3", layers=3)


@torch.inference_mode()
def test_a_tree_row_equals_the_forward_of_each_path_and_compacts(tiny) -> None:
    """Two requests' trees (of different sizes) in one forward: each node's logits and features equal the model's
    full forward of the prompt and the node's path; after compacting an accepted path, the next token's logits
    equal the full forward of prompt + path + that token."""
    target = NativeTarget(tiny, [0, 2], max_slots=2, max_len=64)
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    trees = [build_tree(p[-1], *candidates(4, 3, seed=s), budget) for s, (p, budget) in
             enumerate(zip(prompts, (9, 5)))]
    caches = [target.new_cache(i) for i in range(2)]
    for p, c in zip(prompts, caches):
        target.forward(p[:-1], 0, c, features=False)
    rows = [TargetRow(t.tokens, len(p) - 1, c) for t, p, c in zip(trees, prompts, caches)]
    outs = target.forward_tree(rows, trees, features=True)

    def full(seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = tiny(torch.tensor([seq]), output_hidden_states=True, use_cache=False)
        return out.logits[0, -1].float(), torch.cat([out.hidden_states[1][0, -1], out.hidden_states[3][0, -1]])

    for tree, p, out in zip(trees, prompts, outs):
        assert out.logits.shape[0] == tree.size and out.features.shape[0] == tree.size
        for i in range(tree.size):
            path, node = [], i
            while node > 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            logits, feats = full(p + path[::-1])
            torch.testing.assert_close(out.logits[i], logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out.features[i], feats, rtol=1e-4, atol=1e-4)
    tree, p, cache = trees[0], prompts[0], caches[0]
    deepest = max(range(tree.size), key=lambda i: (tree.depths[i], i))
    keep, node = [], deepest
    while node >= 0:
        keep.append(node)
        node = tree.parents[node]
    keep = keep[::-1]
    assert keep != list(range(len(keep)))  # rows really move
    start = len(p) - 1
    target.compact(cache, start, keep)
    assert cache.length == start + len(keep)
    accepted = [tree.tokens[i] for i in keep[1:]]
    nxt = target.forward([3], cache.length, cache, features=False)
    torch.testing.assert_close(nxt.logits[0], full(p + accepted + [3])[0], rtol=1e-4, atol=1e-4)


# ---- the engine ----

class PinnedCost(LinearCost):
    """A cost line the test fixes: the steps' own measurements (a loaded machine's) leave it as it is."""

    def __init__(self, seconds_by_tokens: dict[int, float]) -> None:
        super().__init__()
        for tokens, seconds in seconds_by_tokens.items():
            super().add(tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def plain_engine():  # noqa: ANN201
    return load_models(EngineConfig(speculative=False)).engine


@pytest.mark.parametrize("speculation", ["tree", "adaptive"])
def test_tree_output_equals_plain_decoding(plain_engine, speculation: str) -> None:  # noqa: ANN001
    """Greedy and seeded requests, four at once, on the demo pair: the tokens of plain decoding, with trees
    verified (rows wider than a chain of the same budget, and longer acceptances than any chain's block)."""
    models = load_models(EngineConfig(speculation=speculation, tree_budget=24, max_running_requests=4))
    engine = models.engine
    if speculation == "adaptive":  # measured costs that make every extra token nearly free, pinned
        engine.policy.costs = StepCosts(PinnedCost({1: 1e-3, **{t: 1e-3 + t * 1e-7 for t in (2, 4, 8, 16, 32, 64)}}),
                                        PinnedCost({t: 1e-3 for t in (2, 4, 8, 16, 32, 64)}))
    prompts = demo_prompts(models, 3)
    prompts.append(prompts[0])
    params = [SamplingParams(max_tokens=48), SamplingParams(max_tokens=40, temperature=0.8, seed=3),
              SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, seed=4), SamplingParams(max_tokens=33)]
    widths: list[int] = []
    steps = []
    original = engine._accept

    def spy(req, tree, out, chosen):  # noqa: ANN001, ANN202
        step = original(req, tree, out, chosen)
        widths.append(tree.size)
        steps.append((tree.is_chain, step.acceptance_length))
        return step

    engine._accept = spy
    outs = run_to_completion(engine, prompts, params)
    expected = run_to_completion(plain_engine, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    trees = [length for chain, length in steps if not chain]
    assert trees and max(widths) > engine.block_size  # trees ran, wider than the block
    assert max(trees) >= 2  # and accepted nodes (compacted rows) fed the following steps


def test_tree_forwards_are_timed_apart_from_chain_forwards() -> None:
    """The policy prices trees by tree forwards (`StepCosts.tree`): tree verifies are timed into that table, and
    chain verifies, plain steps and prefills into the target's, never the other way round."""
    for mode in ("tree", "fixed"):
        models = load_models(EngineConfig(speculation=mode, tree_budget=16, max_running_requests=1))
        run_to_completion(models.engine, demo_prompts(models, 1), [SamplingParams(max_tokens=32)])
        costs = models.engine.policy.costs
        assert bool(costs.tree.samples) == (mode == "tree") and costs.target.samples  # (the prefill: a target's)
        if mode == "tree":  # every decode step was a tree: the target's table holds only the prefill's forward
            assert all(tokens > 16 + 1 for tokens, _ in costs.target.samples)


def test_requests_that_cannot_take_a_tree_keep_their_chain(plain_engine) -> None:  # noqa: ANN001
    """A request with a repetition penalty (its rows are processed per path) and one under rejection sampling run
    beside tree requests: they verify chains, and every output is still plain decoding's (the rejection one: within
    its own law, so only the greedy and penalised ones are compared)."""
    models = load_models(EngineConfig(speculation="tree", tree_budget=16, max_running_requests=4,
                                      spec_sampling="rejection"))
    engine = models.engine
    prompts = demo_prompts(models, 3)
    params = [SamplingParams(max_tokens=32), SamplingParams(max_tokens=32, repetition_penalty=1.3),
              SamplingParams(max_tokens=32, temperature=0.9, seed=8)]
    kinds: dict[int, set[bool]] = {}
    original = engine._accept

    def spy(req, tree, out, chosen):  # noqa: ANN001, ANN202
        kinds.setdefault(req.id, set()).add(tree.is_chain)
        return original(req, tree, out, chosen)

    engine._accept = spy
    outs = run_to_completion(engine, prompts, params)
    expected = run_to_completion(plain_engine, prompts[:2], params[:2])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in expected]
    ids = [o.request_id for o in outs]
    assert False in kinds[ids[0]]  # the plain greedy request verified trees
    assert kinds[ids[1]] == {True} and kinds[ids[2]] == {True}


def test_a_tree_takes_free_blocks_only(plain_engine) -> None:  # noqa: ANN001
    """A pool that holds one request of max_model_len and no more (the memory plan's minimum): a tree request runs
    to the length limit without one preemption (trees shrink to the blocks held, never preempt for their rows), with
    plain decoding's tokens, and verified trees wider than the block while blocks were free."""
    models = load_models(EngineConfig(max_running_requests=1), warm_up=False)
    target, drafter = models.engine.target, models.engine.drafter
    length = 100  # not a multiple of the KV block: the last steps have no block to spare
    kv = KVManager(SlotPool(1), BlockPool(blocks_for(length + 16 + 1, 16) + 1, 16, True), reserve=16)
    engine = Engine(target, drafter, eos_token_ids=[], max_model_len=length, kv=kv, speculation="tree",
                    tree_budget=32)
    widths: list[int] = []
    original = engine._accept

    def spy(req, tree, out, chosen):  # noqa: ANN001, ANN202
        widths.append(tree.size)
        return original(req, tree, out, chosen)

    engine._accept = spy
    steps = itertools.count()
    step = engine.step

    def bounded_step():  # noqa: ANN202  (a request preempting itself for its tree's rows would step forever)
        assert next(steps) < 200, "the request never finishes"
        return step()

    engine.step = bounded_step
    prompt = [demo_prompts(models, 1)[0][:40]]  # to position 100: a tree's 33 rows past it need a 9th block
    params = [SamplingParams(max_tokens=length - len(prompt[0]), ignore_eos=True)]
    out = run_to_completion(engine, prompt, params)[0]
    assert out.error is None and engine.memory.preemptions == 0
    assert out.token_ids == run_to_completion(plain_engine, prompt, params)[0].token_ids
    assert max(widths) > engine.block_size


def test_the_tree_budget_an_engine_takes() -> None:
    """Trees need a runner that verifies them; the adaptive policy weighs them only where the steps run eagerly
    (a compiled step's tree would run eagerly at an unmeasured cost); `--speculation tree` keeps them."""
    def target(trees: bool = True, compiled: bool = False) -> Any:
        return SimpleNamespace(verifies_trees=trees, compiled_steps=compiled, backend="native")

    eager, whole_step = SimpleNamespace(compiled_whole_step=False), SimpleNamespace(compiled_whole_step=True)
    assert tree_budget_for("adaptive", 32, target(), eager) == 32
    assert tree_budget_for("adaptive", 32, target(trees=False), eager) == 0
    assert tree_budget_for("tree", 32, target(trees=False), eager) == 0
    assert tree_budget_for("adaptive", 32, target(compiled=True), eager) == 0
    assert tree_budget_for("adaptive", 32, target(), whole_step) == 0
    assert tree_budget_for("tree", 32, target(compiled=True), whole_step) == 32
    assert tree_budget_for("tree", 32, target(), None) == 0


def test_hybrid_targets_verify_chains_only() -> None:
    from dflash_core.runners.hybrid import HybridTarget

    assert NativeTarget.verifies_trees and not HybridTarget.verifies_trees


def test_the_adaptive_policy_weighs_the_tree_against_the_chain() -> None:
    """With nearly free extra tokens a confident tree beats its chain; with tokens that cost as much as the whole
    step the chain stays; `--speculation tree` takes the budget whatever the costs; the step's budget bounds it."""
    def policy(mode: str, per_token: float, tree_fixed: float = 1e-2) -> WidthPolicy:
        p = WidthPolicy(16, mode, padded=False, tree_budget=32)
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            p.costs.target.add(tokens, 1e-2 + tokens * per_token)
            p.costs.tree.add(tokens, tree_fixed + tokens * per_token)
            p.costs.draft.add(tokens, 1e-3)
        return p

    probs = [0.9 ** (i // 2 + 1) for i in range(32)]  # a tree whose nodes are likely
    chain_gain, chain_tokens = 3.0, 4  # a chain of 3 draft tokens expecting 3 accepted
    assert policy("adaptive", 1e-6).tree_sizes([chain_gain], [chain_tokens], [probs]) == [32]
    # tokens as dear as the step: the tree's smallest size (8 nodes, 6.2 expected) pays less per second
    assert policy("adaptive", 1e-1).tree_sizes([chain_gain], [chain_tokens], [probs]) == [0]
    assert policy("tree", 1e-1).tree_sizes([chain_gain], [chain_tokens], [probs]) == [32]
    assert policy("adaptive", 1e-6).tree_sizes([chain_gain], [chain_tokens], [probs], budget=20) == [16]
    assert policy("adaptive", 1e-6).tree_sizes([chain_gain], [chain_tokens], [None]) == [0]
    assert policy("fixed", 1e-6).tree_sizes([chain_gain], [chain_tokens], [probs]) == [0]
    # a tree forward priced by its own measurements (on a CPU PyTorch's forward with a tree mask, against the
    # fused step's C call for a chain): five times a chain's of as many tokens makes the chain the better step,
    # where the chain's costs alone chose the 32-node tree
    assert policy("adaptive", 1e-6, tree_fixed=5e-2).tree_sizes([chain_gain], [chain_tokens], [probs]) == [0]


def test_the_draft_context_after_a_tree_step_is_the_accepted_path() -> None:
    """After every tree step the draft's context holds the accepted path's features (not the first rows of the
    tree): every later proposal equals the from-scratch draft's over the committed sequence."""
    from dflash_core.engine import Engine
    from tests.test_draft_context import ScoredRecorder
    from tests.test_draft_reference import assert_proposals_match_reference, fresh_drafter
    from tests.test_engine import run_all, tokens

    models = load_models(EngineConfig(max_running_requests=4))
    recorder = ScoredRecorder(fresh_drafter(models))
    engine = Engine(models.engine.target, recorder, eos_token_ids=[], max_model_len=models.engine.max_model_len,
                    speculation="tree", tree_budget=16)
    ids = {engine.add_request(p, SamplingParams(max_tokens=32)): tuple(p) for p in demo_prompts(models, 2)}
    outs = run_all(engine)
    tree_steps = [s for steps in outs.values() for s in steps if s.verify_width == 17]
    assert tree_steps and max(s.acceptance_length for s in tree_steps) >= 3
    sequences = {prompt: tokens(outs[rid]) for rid, prompt in ids.items()}
    assert_proposals_match_reference(models.engine.target.model, models.engine.drafter.draft, sequences,
                                     recorder.proposals)
