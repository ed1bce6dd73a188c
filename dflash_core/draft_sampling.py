"""Sampled draft proposals: each block row's token drawn from the draft's processed distribution instead of taken
as its argmax (`DraftSampling`: temperature > 0 under `--spec-sampling rejection`).

Row j of a block proposes the token at position p + j; its draw (`inverse_cdf_choice`, keyed by the row's seed
and p + j) is from the draft's distribution q_j, processed with the request's temperature, min-p, top-k and top-p
(`processed_rows`, the target's own processing) and laid over the target's vocabulary (a reduced draft vocabulary
maps through `d2t`). The confidence of a row is q_j's largest probability: a function of the distribution, not of
the token drawn (`Proposal`). A DFlash 2 draft samples its selector's walk instead (`CandidateSelector.sample_walk`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash_core.runners.base import DraftSampling
from dflash_core.sampling import _MASK64, _signed, filters_used, inverse_cdf_choice, processed_rows


class RowSampling:
    """The per-row sampling parameters of a proposal's sampled rows, on the device ([b] each)."""

    def __init__(self, sampling: Sequence[DraftSampling], device: torch.device) -> None:
        ps = [s.params for s in sampling]
        # float32 as the target's rows get them (a Python float rounded to float32)
        floats = torch.tensor([[p.temperature, p.min_p, p.top_p] for p in ps], dtype=torch.float32).to(device)
        ints = torch.tensor([[p.top_k, _signed(s.seed & _MASK64)] for p, s in zip(ps, sampling)],
                            dtype=torch.int64).to(device)
        self.temperature, self.min_p, self.top_p = floats.unbind(1)
        self.top_k, self.seeds = ints.unbind(1)
        self.use = filters_used(ps)

    def processed(self, scores: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """Probabilities of scores [b * repeat, C] (row r of the parameters for `repeat` consecutive rows)."""
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if repeat == 1 else t.repeat_interleave(repeat)
        return processed_rows(scores, rows(self.temperature), rows(self.min_p), rows(self.top_k), rows(self.top_p),
                              **self.use)


def sample_dense(logits: torch.Tensor, first: torch.Tensor, rows: RowSampling, positions: torch.Tensor, vocab: int,
                 target_ids: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """A DFlash draft's sampled block: logits [b, w, V_draft] of its rows (float32), first [b] the block's first
    tokens, positions [b, w] of the rows' tokens; `target_ids` maps a reduced vocabulary's ids to the target's
    (vocab of them; None: the draft's vocabulary is the target's).
    Returns the tokens [b, w] (column 0: `first`), the confidences [b, w] (column 0: 1) and the distributions
    [b, w - 1, vocab] of the proposals (columns 1 ..)."""
    b, w, v_draft = logits.shape
    q = rows.processed(logits[:, 1:].reshape(b * (w - 1), v_draft), repeat=w - 1)
    if target_ids is not None:
        ids = target_ids(torch.arange(v_draft, device=q.device)).expand_as(q)
        q = torch.zeros(q.shape[0], vocab, device=q.device, dtype=q.dtype).scatter_(1, ids, q)
    seeds = rows.seeds.repeat_interleave(w - 1)
    drawn = inverse_cdf_choice(q, seeds, positions[:, 1:].reshape(-1)).view(b, w - 1)
    tokens = torch.cat([first[:, None], drawn], dim=1)
    conf = torch.cat([torch.ones(b, 1, device=q.device), q.amax(dim=-1).view(b, w - 1)], dim=1)
    return tokens, conf, q.view(b, w - 1, vocab)
