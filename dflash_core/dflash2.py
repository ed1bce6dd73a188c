"""DFlash 2 drafts (`architectures: ["DFlash2DraftModel"]`): the layers they add to a DFlash draft (their config:
`dflash_core.config.DFlash2Config`).

- **A grouped dynamic causal convolution** (`GroupedDynamicConv`) around each layer's attention and MLP, on the
  block's query rows only (the residual stream and the context keys are not convolved): with K taps,
  `out[i, c] = sum_{t < K} (base[s, t, c] + delta[i, s, t, c // group]) * x[i - t, c]`, zero where `i - t` falls
  before the block's first row; `delta = kernel_projection(h)` (of the sublayer's normed input h) holds both
  kernels' dynamic parts: s = 0 convolves the sublayer's input (`prepare`), s = 1 its output (`finish`).
- **A candidate selector** (`CandidateSelector`) that chooses the proposal as one path through each position's
  top-k candidates of the draft's logits: position l's candidates are scored `unary[l, c] + sum_r A[pred, r] *
  hp[l, r] * B[cand[l, c], r]` (A, B: codebooks over the vocabulary, hp = hidden_projection(h_l), pred = the token
  chosen before, the block's first token for l = 0), and the walk takes the best one at each position.

The draft's logits take `output_multiplier` and `final_logit_softcapping`, its embeddings `input_embedding_scale`,
its attention may be non-causal within a sliding window: those are `DraftConfig` fields every draft reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.config import DFlash2Config
from dflash_core.sampling import race_among

if TYPE_CHECKING:
    from dflash_core.draft_sampling import RowSampling


class GroupedDynamicConv(nn.Module):
    """The causal convolution of a sublayer's query rows [b, q, H] (each row of the batch one block)."""

    def __init__(self, hidden_size: int, cfg: DFlash2Config) -> None:
        super().__init__()
        self.taps, self.group = cfg.conv_kernel_size, cfg.conv_group_size
        self.groups = hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.groups, bias=False)

    def _conv(self, x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x [b, q, H] convolved with base [K, H] + delta [b, q, K, G] (per group of channels)."""
        q = x.shape[1]
        kernel = base + delta.repeat_interleave(self.group, dim=-1)  # [b, q, K, H]
        out = kernel[:, :, 0] * x
        for t in range(1, self.taps):  # x shifted t rows down the block, zeros before its first row
            out = out + kernel[:, :, t] * F.pad(x, (0, 0, t, 0))[:, :q]
        return out

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved (kernel 0), and the dynamic part of kernel 1 for `finish`."""
        b, q, _ = h.shape
        delta = self.kernel_projection(h).view(b, q, 2, self.taps, self.groups)
        return self._conv(h, self.base_kernel[0], delta[:, :, 0]), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output convolved (kernel 1)."""
        return self._conv(y, self.base_kernel[1], delta)


class CandidateSelector(nn.Module):
    """Chooses the proposal among each position's top-k candidates (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, cfg: DFlash2Config) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(hidden_size, cfg.selector_rank, bias=False)

    def _pair(self, hp: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """The low-rank term of candidates cand [b, K] after the tokens pred [b]: hp [b, r] the row's projection."""
        a, s = self.predecessor_codebook.float(), self.successor_codebook.float()
        return torch.einsum("br,bkr->bk", a[pred] * hp, s[cand])

    def walk(
        self, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy path over a block's rows: hidden [b, w, H] and logits [b, w, V] of the block's rows (row 0,
        the known first token, proposes nothing), first [b] the block's first token. Returns the chosen tokens
        [b, w] (column 0: `first`) and each one's probability among its position's candidates (softmax of the
        scores; column 0: 1), the draft's confidence."""
        b, w, _ = logits.shape
        unary, cand = torch.topk(logits.float(), self.top_k, dim=-1)  # [b, w, K]
        hp = self.hidden_projection(hidden).float()  # [b, w, r]
        tokens, probs = [first], [torch.ones(b, device=logits.device)]
        for pos in range(1, w):
            scores = unary[:, pos] + self._pair(hp[:, pos], tokens[-1], cand[:, pos])
            best = scores.argmax(dim=-1)  # the first of equal scores
            tokens.append(cand[:, pos].gather(1, best[:, None]).squeeze(1))
            probs.append(torch.softmax(scores, dim=-1).gather(1, best[:, None]).squeeze(1))
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def sample_walk(
        self, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor, rows: RowSampling,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`walk` drawing each position's token from its candidates' distribution (the scores processed with the
        row's sampling parameters, `RowSampling`) by the keyed race of (the row's seed, its position [b, w]) over the
        candidates' token ids. Returns the tokens [b, w], the confidences [b, w] (the largest probability of the
        position's candidates by their logits alone: not of the token drawn before, nor of the one drawn) and the
        distributions [b, w - 1, V] the proposals (columns 1 ..) were drawn from (zero outside the candidates)."""
        b, w, vocab = logits.shape
        unary, cand = torch.topk(logits.float(), self.top_k, dim=-1)  # [b, w, K]
        hp = self.hidden_projection(hidden).float()
        conf = rows.processed(unary.reshape(b * w, -1), repeat=w).amax(dim=-1).view(b, w)
        dists = torch.zeros(b, w - 1, vocab, device=logits.device)
        tokens = [first]
        for pos in range(1, w):
            q = rows.processed(unary[:, pos] + self._pair(hp[:, pos], tokens[-1], cand[:, pos]))
            at = race_among(q, cand[:, pos], rows.seeds, positions[:, pos])
            tokens.append(cand[:, pos].gather(1, at[:, None]).squeeze(1))
            dists[:, pos - 1].scatter_(1, cand[:, pos], q)
        conf[:, 0] = 1.0
        return torch.stack(tokens, dim=1), conf, dists
