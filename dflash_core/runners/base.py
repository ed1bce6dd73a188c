"""The two interfaces the engine drives: a target runner (verifies) and a drafter (proposes).

Invariants every implementation keeps (docs/architecture.md explains them):
- Caches are keyed by position: row j of a request's cache holds position j. Rolling back is cropping to a length;
  rows past it are never visible and are overwritten by the next forward.
- A target forward at positions `start ..` may be given only `start <= cache length`.
- The feature of target layer i is transformers' hidden state i + 1 (the last layer's comes after the final
  norm), concatenated over the draft's `layer_ids`.
- Slot-indexed state is indexed by the request's slot from the engine's `SlotPool`; a runner never allocates
  slots itself.
- Paged caches (the native target, the batched DFlash drafter) share ONE block-id space handed out by the engine:
  position p of a request lives at offset p % kv_block of block `blocks[p // kv_block]` of its block table, the
  same list object for its target cache and its draft state (grown in place by the engine). Block 0 is the null
  block: padding rows write there and no request owns it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

if TYPE_CHECKING:
    from dflash_core.sampling import SamplingParams
    from dflash_core.tree import DraftTree


@dataclass
class TargetOutput:
    """What a target forward returns for one request's rows."""

    logits: torch.Tensor  # [n, V] float32
    features: torch.Tensor | None  # [n, len(layer_ids) * H], or None when not asked for


class TargetRow(NamedTuple):
    """One request's part of a batched target forward: tokens at positions start.., and its cache."""

    token_ids: list[int]
    start: int
    cache: Any


class TargetRunner(ABC):
    """Runs the target model for the engine: prefill and verify forwards over per-request caches.

    Attributes every runner sets: `backend` (its name), `config` (the model's text config), `device`, `dtype`,
    `vocab_size`, `num_layers`, `hidden_size`, `max_position_embeddings`, `layer_ids` (target layers whose
    hidden states are the draft's features), `max_slots` (concurrent requests, None when caches are per-request and
    unbounded) and `max_len` (the longest position + 1 a request may reach, None when unbounded).

    A paged runner also sets `kv_block_size` (positions per KV block; None on runners that are not paged),
    `num_blocks` (blocks of its KV tensors, the null block 0 included: the engine's block pool is sized from it),
    `kv_bytes_per_block` and `prefix_cacheable` (whether a request may start from cached blocks: False where state
    outside the blocks, a hybrid's recurrent state, is not checkpointed).
    """

    backend: ClassVar[str]
    config: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_position_embeddings: int
    layer_ids: list[int]
    max_slots: int | None
    max_len: int | None
    kv_block_size: int | None = None
    num_blocks: int | None = None
    prefix_cacheable: bool = False
    # state outside the blocks (a hybrid's recurrent state): the checkpoints a prefix hit resumes from. A runner
    # with such state sets `checkpoint_limits` (count, bytes) of the KV manager's store and `checkpoint_bytes`; the
    # KV manager turns `checkpointing` on when prefix caching is on.
    checkpoint_limits: tuple[int, int] | None = None
    checkpoint_bytes: int = 0
    checkpointing: bool = False
    verifies_trees: bool = False  # `forward_tree` and `compact` work (a tree's nodes may share positions)

    @property
    def compiled_steps(self) -> bool:
        """Whether its decode steps run compiled graphs (`forward_tree` runs the eager forward)."""
        return False

    @property
    def cpu_step(self) -> str:
        """What runs the forwards on a CPU: "fused" (one C call that releases the GIL, `dflash_core/cpu_step/`) or
        "torch" (PyTorch's operators)."""
        return "torch"

    @property
    def pads_rows(self) -> bool:
        """Whether a batched forward pads its rows to the widest (a step then costs rows x widest tokens), rather
        than running each row's own tokens; the width policy prices verify rows by it."""
        return True

    @property
    @abstractmethod
    def embed_weight(self) -> torch.Tensor:
        """The input embedding table [V, H] (the draft shares it)."""

    @property
    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """The output head [V, H] (the draft shares it)."""

    @abstractmethod
    def new_cache(self, slot: int, blocks: list[int] | None = None, cached: int = 0, state: Any = None) -> Any:
        """A cache for the request holding `slot`. Paged runners: `blocks` is its block table (the engine's list,
        grown in place before each forward; None: the slot's own fixed run of blocks, valid only when `num_blocks`
        is the default) and `cached` the leading positions already in those blocks (a prefix-cache hit); `state`:
        the checkpoint at `cached` (`checkpoint`), for runners with state outside the blocks."""

    def checkpoint(self, cache: Any, position: int) -> Any:
        """The request's state outside the blocks at `position` (a block boundary), for a later `new_cache(...,
        state=)`; None when the runner has none there (runners whose state is their KV rows: always)."""
        return None

    @abstractmethod
    def crop(self, cache: Any, length: int) -> None:
        """Roll the cache back to its first `length` positions (no-op when it is shorter)."""

    @abstractmethod
    def forward_batch(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], features: bool, last_only: bool = False
    ) -> list[TargetOutput]:
        """Every row's logits (all rows, or the last only) and, with `features`, its draft features; each row's
        cache then holds its tokens."""

    def forward_tree(self, rows: Sequence[TargetRow], trees: Sequence[DraftTree], features: bool
                     ) -> list[TargetOutput]:
        """Verify rows whose tokens are trees (`dflash_core.tree`): row r's tokens are trees[r].tokens, token i at
        position start + depth(i), its keys in cache row start + i, seeing the cache before `start` and its own
        ancestors. Every token's logits (and features); `compact` then keeps the accepted path. Only runners that
        set `verifies_trees`."""
        raise NotImplementedError(f"{type(self).__name__} does not verify trees")

    def compact(self, cache: Any, start: int, keep: Sequence[int]) -> None:
        """After `forward_tree`: the tree rows start + keep[d] become positions start + d (keep[0] = 0, increasing),
        and the cache holds start + len(keep) positions."""
        raise NotImplementedError(f"{type(self).__name__} does not verify trees")

    def forward(
        self, token_ids: list[int], start: int, cache: Any, features: bool, last_only: bool = False
    ) -> TargetOutput:
        """One request's tokens at positions start.. (prefill or verify)."""
        return self.forward_batch([TargetRow(token_ids, start, cache)], features, last_only)[0]

    def warm_up(self) -> float:
        """Compile (and on CUDA record the graphs of) the runner's static shapes; the seconds it took (0.0: nothing
        to warm up). Run by `Engine.warm_up`, on the thread that will run the steps: recorded graphs are per
        thread."""
        return 0.0


class DraftRequest(NamedTuple):
    """What the engine asks a drafter for one request: `n` tokens after `last_token` at `position`."""

    state: Any
    last_token: int
    position: int
    n: int


class DraftSampling(NamedTuple):
    """How a drafter draws one request's proposal instead of taking its argmax: each token from the draft's
    distribution processed with `params` (temperature, min-p, top-k, top-p), the draw of the token at position t
    the keyed race of (`seed`, t) (`dflash_core.sampling.race_choice`). The request's own seed couples the draft's
    draws with the target's; a salted one makes them independent (`dflash_core.rejection`)."""

    params: SamplingParams
    seed: int


class Proposal(NamedTuple):
    """A drafter's proposal for one request: tokens, and the draft's probability of each (its confidence). A sampled
    proposal (`DraftSampling`) carries `dist`, the distributions [len(tokens), V] over the target's vocabulary its
    tokens were drawn from, and confidences that are functions of those distributions (their largest probability),
    never of the tokens drawn: the width policy cuts proposals by them, and a cut that depended on a drawn token
    would skew rejection sampling's law."""

    tokens: list[int]
    confidence: list[float]
    dist: torch.Tensor | None = None
    # asked for (`candidates`): each position's top candidates (target ids) and their log-probabilities, most
    # likely first, [len(tokens)][k] each: a tree's material (`dflash_core.tree`)
    candidates: tuple[list[list[int]], list[list[float]]] | None = None


class Drafter(ABC):
    """Proposes draft tokens; the engine verifies them with the target, so a drafter affects speed, never output.

    Context arrives through `extend_context` (the target features of committed positions, in order) and is
    consumed by the next proposal (or written to the drafter's cache before it); a proposal that raises must consume
    nothing, so the engine can retry it.
    """

    block_size: int
    max_slots: int | None = None  # concurrent requests of a batched drafter (None: per-request state, no limit)
    # whether a request's state may start from cached blocks (`new_state(cached=...)`): the engine enables prefix
    # caching only when the target and the drafter both can
    prefix_cacheable: bool = False

    @abstractmethod
    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> Any:
        """Per-request state for the request holding `slot`. A paged drafter keeps its context rows in `blocks`, the
        request's block table (the same list as its target cache's; None: the slot's own fixed run of blocks), of
        which the first `cached` positions already hold them (a prefix-cache hit); other drafters ignore both."""

    @property
    def compiled_whole_step(self) -> bool:
        """Whether a proposal runs as one compiled graph that chooses the argmax inside it (drawn proposals and a
        tree's candidates then run the eager step)."""
        return False

    def context_written(self, state: Any) -> int:
        """Leading positions whose context rows are in the drafter's shared (paged) cache: the engine enters a full
        block in the prefix index only once both models' rows of it are written. 0: nothing shareable."""
        return 0

    @abstractmethod
    def extend_context(self, state: Any, features: torch.Tensor) -> None:
        """Target features [n, F] of the next committed positions."""

    def catch_up(self, states: Sequence[Any]) -> None:
        """Write the context rows these requests' states hold back beyond what a proposal's own forward takes (a
        CPU's run of plain steps, `DFlashDrafter`): right before a proposal, so that the proposal's timed forward
        is the proposal's alone, and when a request is released, so that the prefix index takes its blocks. A
        wrapping drafter forwards it. Default: nothing held back."""
        return None

    @abstractmethod
    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        """Each item's `n` proposed tokens, in item order."""

    def propose(self, state: Any, last_token: int, position: int, n: int) -> list[int]:
        """One request's proposal: `n` tokens after `last_token` at `position`."""
        return self.propose_batch([DraftRequest(state, last_token, position, n)])[0]

    def warm_up(self) -> float:
        """As `TargetRunner.warm_up`: the drafter's static shapes, on the thread that will run the steps."""
        return 0.0

    def replace_draft(self, draft: Any) -> None:
        """Propose with `draft` (a draft network loaded from a folder) from now on; ValueError, with nothing
        changed, when this drafter cannot take it. Every request's context rows are stale afterwards: the engine
        restarts the requests (`Engine.swap_draft`)."""
        raise ValueError(f"{type(self).__name__} cannot change its draft while serving")

    def propose_scored(
        self, items: Sequence[DraftRequest], sampling: Sequence[DraftSampling | None] | None = None,
        candidates: int = 0,
    ) -> list[Proposal]:
        """Each item's proposal with the draft's probability of every proposed token (the width policy cuts a
        proposal where the running product falls low); `sampling[i]`, when given, asks for item i's tokens drawn
        (`DraftSampling`); `candidates` > 0 for each position's top candidates (`Proposal.candidates`). A drafter
        without probabilities proposes deterministically (no `dist`: a one-hot law), reports 1.0 and no
        candidates."""
        return [Proposal(tokens, [1.0] * len(tokens)) for tokens in self.propose_batch(items)]


class PerRequestDrafter(Drafter):
    """A drafter that proposes for one request at a time; `propose_batch` loops over `propose`."""

    @abstractmethod
    def propose(self, state: Any, last_token: int, position: int, n: int) -> list[int]:
        """`n` tokens proposed after `last_token` at `position`."""

    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose(*item) for item in items]
