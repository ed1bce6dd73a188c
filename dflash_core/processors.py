"""Per-request logits processing before a token is chosen: grammar mask, min_tokens, logit_bias, penalties.

Every processor sees a block of rows: row i of a verify block follows the history prompt + output + draft[:i], and
its processed logits are exactly those plain decoding would compute at that position (the counts of row i are the
output's counts plus the first i draft tokens, one cumulative sum for the whole block). Order (vLLM's sampler):
grammar mask, min_tokens, logit_bias, then repetition, frequency and presence penalties; temperature, min_p,
top-k and top-p follow in `dflash_core.sampling.processed_probs`. Logprobs stay those of the raw model
distribution: the engine passes the raw logits to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from dflash_core.grammar import GrammarState
from dflash_core.sampling import SamplingParams


class LogitsProcessor(ABC):
    """Processes a request's rows of logits in place of plain decoding's one row at a time."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """logits [n, V] (n <= len(draft) + 1) fp32, row i following prompt + output + draft[:i] -> processed logits
        (may be the same tensor, changed in place)."""


class GrammarMask(LogitsProcessor):
    """Tokens the grammar does not allow at a row get -inf."""

    def __init__(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        masks = self.grammar.masks(list(draft[: logits.shape[0] - 1]))[: logits.shape[0]]
        rows = [i for i, allowed in enumerate(masks) if allowed is not None]
        if rows:  # one copy to the device for the whole block
            allowed = torch.stack([masks[i] for i in rows]).to(logits.device, non_blocking=True)
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits


class MinTokens(LogitsProcessor):
    """Stop tokens (EOS and stop_token_ids) get -inf while fewer than `min_tokens` tokens were generated."""

    def __init__(self, min_tokens: int, stop_ids: Iterable[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = sorted(stop_ids)

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        banned_rows = max(0, min(self.min_tokens - len(output), logits.shape[0]))  # row i has len(output) + i
        if banned_rows and self.stop_ids:
            logits[:banned_rows, self.stop_ids] = float("-inf")
        return logits


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a bias per token id added to the logits (-100 bans a token, +100 forces it)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = list(bias)
        self.values = torch.tensor([float(v) for v in bias.values()])

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        logits[:, self.ids] += self.values.to(logits.device)
        return logits


class Penalties(LogitsProcessor):
    """vLLM's penalties: repetition over prompt + output (a positive logit divided by it, a negative one
    multiplied), then frequency (times the output count) and presence (once per token in the output) subtracted.
    """

    def __init__(self, presence: float, frequency: float, repetition: float, prompt: Sequence[int],
                 vocab_size: int) -> None:
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.vocab_size = vocab_size
        self.prompt = list(prompt)
        self._prompt_seen: torch.Tensor | None = None  # bool [V], on the logits' device once seen
        self._counts: torch.Tensor | None = None
        self._counted = 0  # the output grows only: its counts are updated with the new tokens

    def output_counts(self, output: Sequence[int], device: torch.device) -> torch.Tensor:
        """How often each token occurs in `output` (float [V] on `device`)."""
        if self._counts is None or self._counts.device != device or len(output) < self._counted:
            self._counts = torch.zeros(self.vocab_size, device=device)  # first use, or a different output
            self._counted = 0
        new = list(output[self._counted:])
        if new:
            ids = torch.tensor(new, device=device)
            self._counts += torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size]
            self._counted = len(output)
        return self._counts

    def prompt_seen(self, device: torch.device) -> torch.Tensor:
        if self._prompt_seen is None or self._prompt_seen.device != device:
            ids = torch.tensor(self.prompt, device=device)
            self._prompt_seen = torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size] > 0
        return self._prompt_seen

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        n, device = logits.shape[0], logits.device
        counts = self.output_counts(output, device).expand(n, -1)
        if n > 1:  # row i also counts draft[:i]: a one-hot per draft token, summed down the rows
            steps = torch.zeros(n, self.vocab_size, device=device)
            steps[torch.arange(1, n, device=device), torch.tensor(list(draft[: n - 1]), device=device)] = 1.0
            counts = counts + steps.cumsum(dim=0)
        seen = counts > 0
        if self.repetition != 1.0:
            hit = seen | self.prompt_seen(device)
            scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(hit, scaled, logits)
        if self.frequency != 0.0:
            logits = logits - self.frequency * counts
        if self.presence != 0.0:
            logits = logits - self.presence * seen.float()
        return logits


class Pipeline(LogitsProcessor):
    """Processors applied in order, on a float32 copy of the logits (the raw logits stay for logprobs)."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        logits = logits.float().clone()
        for processor in self.processors:
            logits = processor.apply(logits, output, draft)
        return logits


def build_processor(
    params: SamplingParams, prompt: Sequence[int], stop_ids: Iterable[int], vocab_size: int,
    grammar: GrammarState | None = None,
) -> LogitsProcessor | None:
    """The request's processing in vLLM's order, or None when its parameters change nothing."""
    processors: list[LogitsProcessor] = []
    if grammar is not None:
        processors.append(GrammarMask(grammar))
    if params.min_tokens > 0:
        processors.append(MinTokens(params.min_tokens, stop_ids))
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        processors.append(Penalties(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                                    prompt, vocab_size))
    return Pipeline(processors) if processors else None
