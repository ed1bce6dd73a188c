"""Speculative rejection sampling (`--spec-sampling rejection`): the draft's tokens accepted with probability
min(1, p / q), lossless for any draft distribution q.

Row j of a request's verify block holds the target's processed distribution p_j (after the output and the draft's
tokens x_0 .. x_{j-1}); x_j was drawn from the draft's distribution q_j (a one-hot when the drafter proposed it
deterministically). x_j is accepted when u_j q_j(x_j) < p_j(x_j); at the first rejection the token is drawn from the
residual max(p_j - q_j, 0), renormalised, and when every draft token is accepted the bonus token is the target's own
draw from p_n. Each committed token then follows p exactly (Leviathan et al. 2023, Chen et al. 2023), and the
acceptance rate at a position is sum_x min(p(x), q(x)), where matching the target's own draw accepts a draft token x
with probability p(x) only.

Every random number is position-keyed (`dflash_core.sampling`), with the request's seed salted apart per use: the
draft's draws (`SALT_DRAFT`), the acceptance tests (`SALT_ACCEPT`) and the residual draws (`SALT_RESIDUAL`) are
independent of each other and of the target's own draws, which give the bonus token. The draft's and the residual
draws take one uniform each (`inverse_cdf_choice`: a cumulative sum, not V hashes). A seeded request is then
reproducible for the same speculation (the same cuts), but its text depends on where the steps cut: the default
`keyed` mode keeps seeded text independent of speculation.

What makes it lossless, beyond the rule: whether position j is verified must not depend on x_j (a cut that drops
unlikely draft tokens and draws from p instead skews the law). The width policy cuts from the drafter's confidences,
which for a sampled proposal are functions of the distributions, never of the tokens drawn (`Drafter.propose_scored`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_core.runners.base import DraftSampling
from dflash_core.sampling import Block, SamplingParams, _keys, _signed, _uniforms, inverse_cdf_choice

SALT_DRAFT = 0x5DEECE66D2C6B1A7  # xor-ed into a request's seed: independent streams of the same position keys
SALT_ACCEPT = 0x2545F4914F6CDD1D
SALT_RESIDUAL = 0x9FB21C651E98DF25


def salted(seed: int, salt: int) -> int:
    """The seed of one of a request's independent streams (64 bits)."""
    return (seed ^ salt) & ((1 << 64) - 1)


def rejects(mode: str, params: SamplingParams) -> bool:
    """A request's draft tokens are accepted by rejection sampling: a sampled request without a grammar in mode
    "rejection" (a grammar cuts proposals at a token it refuses, a cut this law does not allow)."""
    return mode == "rejection" and not params.greedy and params.structured is None


def draft_sampling(mode: str, params: SamplingParams, seed: int) -> DraftSampling | None:
    """How the draft proposes for a request (None: its argmax): when it `rejects`, drawn from the draft's
    distribution at the request's sampling parameters, by draws independent of the target's."""
    return DraftSampling(params, salted(seed, SALT_DRAFT)) if rejects(mode, params) else None


def rejection_choices(probs: torch.Tensor, dist: torch.Tensor, draft: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """The outcome at each draft row (of any requests): probs [n, V] the target's processed rows, dist [n, V] the
    draft's distributions the tokens draft [n] (int64) were drawn from (a one-hot for a deterministic proposal),
    seeds [n] the row's request's seed (its int64 bits) and positions [n] int64 of the tokens. Row j holds x_j when
    the test accepts it, else the residual draw, which is never x_j (its residual mass is 0 when rejected): the
    engine's prefix match then keeps exactly the accepted tokens followed by the residual one."""
    x = draft[:, None]
    p_x = probs.gather(1, x).squeeze(1)
    q_x = dist.gather(1, x).squeeze(1).to(p_x.dtype)
    residual = (probs - dist.to(probs.dtype)).clamp_min_(0.0)
    # p <= q everywhere means p == q (both sum to 1), where nothing is rejected; rounding may leave an empty residual
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs.scatter(1, x, 0.0), residual)
    u = _uniforms(_keys(seeds ^ _signed(SALT_ACCEPT), positions), 0, 1).squeeze(1)
    accept = u * q_x.double() < p_x.double()
    drawn = inverse_cdf_choice(residual, seeds ^ _signed(SALT_RESIDUAL), positions)
    return torch.where(accept, draft, drawn)


def rejection_rows(blocks: Sequence[Block | None], sampled: list[tuple[int, torch.Tensor, int]],
                    drafts: dict[int, torch.Tensor], probs: torch.Tensor, chosen: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """`chosen` (the sampled rows' own draws, `choose_step`'s) with the draft rows of the blocks in `drafts` (their
    tokens on the device, by block index) decided by rejection sampling, all of them in one `rejection_choices`
    call. `sampled`: (block index, processed rows, _) of the sampled blocks, in the order of the rows of `probs`."""
    spans, at = [], 0
    for i, x, _ in sampled:
        if i in drafts:
            spans.append((i, at, drafts[i].shape[0]))
        at += x.shape[0]
    dists = [blocks[i].dist for i, _, _ in spans]  # type: ignore[union-attr]
    if any(d is None for d in dists):  # a deterministic proposal: its law is a one-hot at its token
        dists = [torch.zeros_like(probs[a : a + n]).scatter_(1, drafts[i][:, None], 1.0) if d is None else d
                 for (i, a, n), d in zip(spans, dists)]
    picked = torch.cat([torch.arange(a, a + n, device=probs.device) for _, a, n in spans])
    decided = rejection_choices(probs[picked], torch.cat(dists), torch.cat([drafts[i] for i, _, _ in spans]),
                                seeds[picked], positions[picked])
    return chosen.index_copy(0, picked, decided)
