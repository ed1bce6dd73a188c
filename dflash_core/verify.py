"""The verify side of a decode step: what each request's row holds (a chain, cut where a grammar refuses, or a
tree), and the target's own choice at every row of the step."""

from __future__ import annotations

import logging

import torch

from dflash_core.rejection import rejects
from dflash_core.request_state import EngineRequest
from dflash_core.runners.base import Drafter, Proposal, TargetOutput, TargetRunner
from dflash_core.sampling import Block, choose_step
from dflash_core.speculation import WidthPolicy
from dflash_core.tree import DraftTree, build_tree

log = logging.getLogger("dflash.engine")


def tree_budget_for(speculation: str, tree_budget: int, target: TargetRunner, drafter: Drafter | None) -> int:
    """The tree budget an engine verifies with: 0 where the target cannot verify trees, and under the adaptive
    policy where the steps are compiled (a tree step runs eagerly, at a cost the policy does not measure apart from
    the compiled chains'); `--speculation tree` keeps trees there. Says so once where it changes the setting."""
    if not tree_budget or drafter is None:
        return 0
    if not target.verifies_trees:
        if speculation == "tree":
            log.warning("--speculation tree: the %s backend verifies chains only (every step verifies the full "
                        "block)", target.backend)
        return 0
    if speculation == "adaptive" and (target.compiled_steps or drafter.compiled_whole_step):
        log.info("adaptive speculation weighs chains only with compiled steps (a tree runs eagerly); "
                 "--speculation tree verifies trees")
        return 0
    return tree_budget


def grammar_cut(req: EngineRequest, proposals: list[int]) -> list[int]:
    """The proposals before the first one the grammar rejects: it could never be the target's choice."""
    if req.grammar is None or not proposals:
        return proposals
    try:
        return proposals[: req.grammar.walk(proposals)]
    except Exception:  # verify without a draft; the grammar fails again in _accept, inside this request's guard
        log.warning("request %d: grammar walk failed", req.id, exc_info=True)
        return []


def step_choices(
    plans: list[tuple[EngineRequest, DraftTree]], outs: list[TargetOutput | BaseException],
    dists: dict[int, torch.Tensor | None], spec_sampling: str,
) -> list[list[int] | BaseException]:
    """The target's own choice at every verify row of every request, as ONE batched computation for the step
    (`sampling.choose_step`): the inputs of every request's processing in one copy to the device, the rows
    stacked, and ONE transfer of all choices to the host (a request whose processing fails gets its exception).
    Row i of a request picks the token at position req.position + 1 + depth(i) (a chain: + i); a request that
    `rejects` has its draft rows decided by rejection sampling against its proposal's distributions (`dists`)."""
    blocks = []
    for (req, tree), out in zip(plans, outs):
        dist, props = dists.get(req.id), tree.proposals
        blocks.append(None if isinstance(out, BaseException) else Block(
            out.logits, req.params, req.seed, req.position + 1, req.processor, req.output, props,
            rejection=rejects(spec_sampling, req.params), dist=None if dist is None else dist[: len(props)],
            positions=None if tree.is_chain else [req.position + 1 + d for d in tree.depths]))
    try:
        return choose_step(blocks)
    except Exception:  # something of one request broke the step's batch: each alone, so it fails by itself
        log.warning("the step's batched choice failed; choosing request by request", exc_info=True)
        return [_alone(block) for block in blocks]


def _alone(block: Block | None) -> list[int] | BaseException:
    try:
        return choose_step([block])[0]
    except Exception as exc:
        return exc


def verify_plans(
    proposed: list[tuple[EngineRequest, Proposal]], keep: list[int], policy: WidthPolicy, tree_ok: list[bool],
    room: list[int], budget: int | None,
) -> list[tuple[EngineRequest, DraftTree]]:
    """Each request's verify row: its proposal cut to keep[r] tokens (and where its grammar refuses one) as a chain,
    or, where tree_ok[r] and the policy chooses it (`WidthPolicy.tree_sizes`), the tree of the top prefixes of its
    candidates (`build_tree`) of at most room[r] nodes (the rows its cache may write past its position)."""
    chains = [DraftTree.chain(req.output[-1], grammar_cut(req, prop.tokens[:k])) for (req, prop), k in zip(proposed,
                                                                                                        keep)]
    if not policy.uses_trees or not any(ok and prop.candidates for (_, prop), ok in zip(proposed, tree_ok)):
        return [(req, chain) for (req, _), chain in zip(proposed, chains)]  # no row has a tree's material
    trees = [build_tree(req.output[-1], *prop.candidates, min(policy.tree_budget, space))
             if ok and prop.candidates and space > 0 else None
             for (req, prop), ok, space in zip(proposed, tree_ok, room)]
    sizes = policy.tree_sizes(
        [policy.expected_chain(prop.confidence[: len(chain.proposals)]) for (_, prop), chain in zip(proposed, chains)],
        [chain.size for chain in chains], [None if t is None else t.node_probs() for t in trees], budget)
    return [(req, chain if not n or tree is None else tree.prefix(n))
            for (req, _), chain, tree, n in zip(proposed, chains, trees, sizes)]
