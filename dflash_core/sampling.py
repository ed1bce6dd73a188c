"""Sampling parameters, processed distributions and position-keyed sampling.

Every sampled token is drawn by inverse CDF with a uniform number that depends only on (seed, position). The token
at a position is then the same function of the target's distribution whether it was reached by plain decoding or
by verifying a draft block, so a seeded request gives the same text with and without speculation, and a request's
randomness never depends on what else runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's rule): logits / t would overflow to inf / NaN
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """Per-request decoding settings (OpenAI semantics; top_k 0 or -1 disables it)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)  # texts that end the output before them (the detokenizer's job)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one so small that dividing by it overflows (< SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or a fresh random one."""
    return random.getrandbits(63) if seed is None else int(seed) & _MASK64


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position) (splitmix64)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM order); rows renormalised. logits [n, V] -> probs [n, V] fp32.

    top-k keeps every token whose scaled logit is >= the k-th largest, so ties at the k-th value are all kept (as
    vLLM does). top-p keeps, in order of decreasing probability (ties: lower token id first), each token whose
    preceding mass is < top_p, so the token that crosses top_p is kept and the most likely token always is.
    A greedy request (temperature < SAMPLING_EPS) gets a one-hot at the argmax; the result never holds NaN.
    """
    logits = logits.float()
    onehot = torch.zeros_like(logits).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if params.greedy:
        return onehot
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep[..., 0] = True
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    # Guard: a row that still went non-finite (inf logits from the model) falls back to its argmax.
    bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    return torch.where(bad, onehot, probs)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> list[int]:
    """The target's own choice for each row of logits [n, V]; row i picks the token at `first_position + i`."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = processed_probs(logits, params)
    cdf = probs.cumsum(dim=-1)
    u = torch.tensor(
        [position_uniform(seed, first_position + i) for i in range(logits.shape[0])],
        dtype=cdf.dtype,
        device=cdf.device,
    )
    u = u * cdf[:, -1]
    idx = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    # Guard against rounding at the top of the CDF: never pick a zero-probability tail token.
    last_nonzero = vocab_last_nonzero(probs)
    return torch.minimum(idx, last_nonzero).tolist()


def vocab_last_nonzero(probs: torch.Tensor) -> torch.Tensor:
    """Index of the last token with non-zero probability in each row."""
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device).expand_as(probs)
    return torch.where(probs > 0, positions, torch.zeros_like(positions)).amax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, chosen: list[int], k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens under the raw model distribution, with the top-k alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(chosen, device=logp.device)
    chosen_lp = logp.gather(-1, idx[:, None])[:, 0].tolist()
    if k > 0:
        top_v, top_i = logp.topk(k, dim=-1)
        tops = [list(zip(ti, tv)) for ti, tv in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen_lp, tops))
