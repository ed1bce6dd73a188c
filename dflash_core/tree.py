"""Tree verification (DDTree): a DFlash draft's per-position candidates verified as a tree in ONE target row.

A DFlash draft gives a distribution for every position of its block in one forward, and those distributions do not
depend on the tokens before them. A chain verifies the argmax path; a tree verifies the `budget` most likely
prefixes of the block (`build_tree`): nodes are paths of (depth, rank) scored by the summed log-probabilities of
their tokens, taken best first from a heap, so the tree holds exactly the top-`budget` prefixes and a node's parent
always comes before it. The verify row is [root, nodes in that order]: the root is the request's last committed
token at position `start`, node i sits at position start + depth(i), its keys in cache row start + i, and it sees
the committed cache and its own ancestors (`visibility`). The target chooses its own token after every node
(greedy, or the position-keyed draw at start + depth + 1, as plain decoding does), and the accepted path is followed
from the root while the target's choice is one of the node's children (`DraftTree.path`): output identical to plain
decoding. The accepted nodes' keys and values then move to rows start + 1 .. (`TargetRunner.compact`), and only
their features reach the draft. A chain is the tree whose nodes are one path (`DraftTree.chain`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

TREE_TOP_K = 8  # candidates per position the draft reports for a tree: siblings per node at most


@dataclass
class DraftTree:
    """A verify row's tokens as a tree: node 0 the root (the last committed token), then the draft's nodes."""

    tokens: list[int]
    parents: list[int]  # parents[0] = -1; parents[i] < i
    depths: list[int]  # the root 0; a node's position is start + depth
    logp: list[float]  # summed log-probability of the node's path (the root 0)
    children: list[dict[int, int]] = field(default_factory=list)  # per node: token -> child index

    def __post_init__(self) -> None:
        if not self.children:
            self.children = [{} for _ in self.tokens]
            for i in range(1, len(self.tokens)):
                self.children[self.parents[i]][self.tokens[i]] = i

    @classmethod
    def chain(cls, root: int, proposals: Sequence[int]) -> DraftTree:
        """The chain of `proposals` after `root` (no scores: 0)."""
        n = len(proposals)
        return cls([root, *proposals], list(range(-1, n)), list(range(n + 1)), [0.0] * (n + 1))

    @property
    def size(self) -> int:
        """Tokens of the verify row: the root and the nodes."""
        return len(self.tokens)

    @property
    def proposals(self) -> list[int]:
        """The draft's tokens (the nodes), in row order."""
        return self.tokens[1:]

    @cached_property
    def is_chain(self) -> bool:
        """Whether its nodes are one path (asked several times a step per row: worked out once; a tree's lists are
        not changed after it is built)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def visibility(self) -> list[list[int]]:
        """[N][N] 0/1: node i sees node j when j is i or one of its ancestors."""
        rows: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            row = list(rows[parent]) if parent >= 0 else [0] * self.size
            row[i] = 1
            rows.append(row)
        return rows

    def path(self, chosen: Sequence[int]) -> list[int]:
        """The accepted nodes from the root (row indices, the root first): while the target's choice after a node
        (`chosen[node]`) is one of its children, go to that child."""
        node, path = 0, [0]
        while (child := self.children[node].get(chosen[node])) is not None:
            node = child
            path.append(node)
        return path

    def prefix(self, n: int) -> DraftTree:
        """The tree of its root and first n nodes (a node's parent comes before it: still a tree)."""
        return DraftTree(self.tokens[: n + 1], self.parents[: n + 1], self.depths[: n + 1], self.logp[: n + 1])

    def node_probs(self) -> list[float]:
        """Each node's path probability, in row order (best first for a `build_tree` tree)."""
        return [math.exp(lp) for lp in self.logp[1:]]

    def expected_accepted(self) -> float:
        """The draft's expectation of the accepted nodes: the sum of every node's path probability."""
        return sum(self.node_probs())


def build_tree(root: int, top_ids: Sequence[Sequence[int]], top_logp: Sequence[Sequence[float]],
               budget: int) -> DraftTree:
    """The `budget` most likely prefixes of a block whose position d (1 ..) has the candidates top_ids[d - 1] with
    log-probabilities top_logp[d - 1] (sorted, most likely first): best first from a heap seeded with the first
    candidate at depth 1; emitting a node pushes its next sibling and its first child. Ties: the earlier pushed."""
    depth_max = len(top_ids)
    tree = DraftTree([root], [-1], [0], [0.0])
    if depth_max == 0 or budget <= 0:
        return tree
    order = 0  # a tie-breaker that keeps the heap's order deterministic
    # (-score, order, depth, rank, parent): the best first
    heap: list[tuple[float, int, int, int, int]] = [(-top_logp[0][0], order, 1, 0, 0)]
    while heap and tree.size - 1 < budget:
        neg, _, depth, rank, parent = heapq.heappop(heap)
        node = tree.size
        token = int(top_ids[depth - 1][rank])
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.logp.append(-neg)
        tree.children.append({})
        tree.children[parent][token] = node
        base = -neg - top_logp[depth - 1][rank]  # the parent's score
        if rank + 1 < len(top_ids[depth - 1]):
            order += 1
            heapq.heappush(heap, (-(base + top_logp[depth - 1][rank + 1]), order, depth, rank + 1, parent))
        if depth < depth_max:
            order += 1
            heapq.heappush(heap, (-(-neg + top_logp[depth][0]), order, depth + 1, 0, node))
    return tree


def tree_mask(mask: torch.Tensor, vis: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """A causal-by-row attention mask [b, 1, n, L] (query i of row r sees key rows up to start[r] + i) cut to the
    trees: key row start[r] + k is visible to query i only when vis[r, i, k] (bool [b, n, n]: k is i or one of its
    ancestors). Keys before start[r] stay as they are; keys past the row's tree are hidden by causality already."""
    b, n, length = mask.shape[0], vis.shape[1], mask.shape[-1]
    rel = torch.arange(length, device=mask.device)[None, :] - start[:, None]  # [b, L]: k, the key's tree index
    seen = vis.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, length))  # [b, n, L]
    return mask & ((rel < 0)[:, None, :] | seen)[:, None]
