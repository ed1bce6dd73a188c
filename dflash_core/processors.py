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
from typing import Any

import torch

from dflash_core.grammar import GrammarState, pack_masks, unpack_masks
from dflash_core.sampling import SamplingParams, float_bits, staging_for

Arrays = list[Any]  # host integer arrays (nested lists of ints, or host integer tensors) for `HostToDevice.send`


class LogitsProcessor(ABC):
    """Processes a request's rows of logits in place of plain decoding's one row at a time.

    In two halves, so that a step sends the inputs of every request in one copy: `inputs` (host: what the block
    needs on the device, read from the output and the draft), then `apply_inputs` (device: those arrays, sent).
    `apply` does both, with a copy of its own.
    """

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        """The host arrays `apply_inputs` needs for this block (reads only logits' shape and device)."""
        return []

    @abstractmethod
    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        """logits [n, V] (n <= len(draft) + 1) fp32, row i following prompt + output + draft[:i], and `inputs`'
        arrays on the device -> processed logits (may be the same tensor, changed in place)."""

    def apply(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        arrays = self.inputs(logits, output, draft)
        sent = staging_for(logits.device).send(*arrays) if arrays else ()
        return self.apply_inputs(logits, output, draft, sent)


class GrammarMask(LogitsProcessor):
    """Tokens the grammar does not allow at a row get -inf: the block's masks travel as one packed bitmask
    (`grammar.pack_masks`, int32 words, an unconstrained row all ones) and are unpacked on the device."""

    def __init__(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        n, vocab = logits.shape
        masks = self.grammar.masks(list(draft[: n - 1]))[:n]
        if all(m is None for m in masks):
            return []
        masks = masks + [None] * (n - len(masks))
        return [pack_masks(masks, vocab).view(torch.int64)]

    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        if sent:  # one unpack (shift / and) and one fill for every row of the block
            logits.masked_fill_(~unpack_masks(sent[0], logits.shape[-1]), float("-inf"))
        return logits


class MinTokens(LogitsProcessor):
    """Stop tokens (EOS and stop_token_ids) get -inf while fewer than `min_tokens` tokens were generated, except
    on a row where the request's grammar allows nothing but a stop token: a complete structured output cannot be
    extended validly, so the grammar's end wins (that row is the last of its block: a stop ends the proposal)."""

    def __init__(self, min_tokens: int, stop_ids: Iterable[int], grammar: GrammarState | None = None) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = sorted(stop_ids)
        self.grammar = grammar
        self._rows = 0  # the rows `inputs` banned, for `apply_inputs`

    def _banned_rows(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> int:
        rows = max(0, min(self.min_tokens - len(output), logits.shape[0]))  # row i has len(output) + i tokens
        if rows and self.grammar is not None:
            masks = self.grammar.masks(list(draft[: logits.shape[0] - 1]))  # the grammar mask's own (cached)
            stops = torch.tensor([t for t in self.stop_ids if t < logits.shape[-1]], dtype=torch.long)
            for i, allowed in enumerate(masks[:rows]):
                if allowed is not None and int(allowed.sum()) == int(allowed[stops].sum()):
                    return i  # only the grammar's end is left
        return rows

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        ids = [t for t in self.stop_ids if t < logits.shape[-1]]
        self._rows = self._banned_rows(logits, output, draft) if ids else 0
        return [ids] if self._rows else []

    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        if sent:
            logits[: self._rows].index_fill_(1, sent[0], float("-inf"))
        return logits


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a bias per token id added to the logits (-100 bans a token, +100 forces it)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = list(bias)
        self.values = [float(v) for v in bias.values()]

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        if any(t >= logits.shape[-1] for t in self.ids):
            raise IndexError(f"logit_bias token id {max(self.ids)} is out of the vocabulary ({logits.shape[-1]})")
        return [self.ids, [float_bits(v) for v in self.values]]

    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        ids, bits = sent
        values = bits.view(torch.float64).float()  # the float32 biases, as torch.tensor(values) rounds them
        return logits.index_add_(1, ids, values.expand(logits.shape[0], -1))  # ids are distinct: one add each


class Penalties(LogitsProcessor):
    """vLLM's penalties: repetition over prompt + output (a positive logit divided by it, a negative one
    multiplied), then frequency (times the output count) and presence (once per token in the output) subtracted.
    """

    def __init__(self, presence: float, frequency: float, repetition: float, prompt: Sequence[int],
                 vocab_size: int) -> None:
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.vocab_size = vocab_size
        self.prompt = [t for t in prompt if 0 <= t < vocab_size]
        self._prompt_seen: torch.Tensor | None = None  # bool [V], on the logits' device once seen
        self._counts: torch.Tensor | None = None
        self._counted = 0  # the output grows only: its counts are updated with the new tokens

    def _fresh_counts(self, output: Sequence[int], device: torch.device) -> bool:
        return self._counts is None or self._counts.device != device or len(output) < self._counted

    def _needs_prompt(self, device: torch.device) -> bool:
        return self.repetition != 1.0 and (self._prompt_seen is None or self._prompt_seen.device != device)

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        """[the output tokens not counted yet, the draft tokens of rows 1.., the prompt when not seen yet]."""
        n, device = logits.shape[0], logits.device
        counted = 0 if self._fresh_counts(output, device) else self._counted
        arrays: Arrays = [list(output[counted:]), list(draft[: n - 1]) if n > 1 else []]
        if self._needs_prompt(device):
            arrays.append(self.prompt)
        return arrays

    def output_counts(self, output: Sequence[int], device: torch.device, new: torch.Tensor) -> torch.Tensor:
        """How often each token occurs in `output` (float [V] on `device`), `new` its tokens not counted yet."""
        if self._fresh_counts(output, device):
            self._counts = torch.zeros(self.vocab_size, device=device)  # first use, or a different output
        assert self._counts is not None
        if new.numel():  # index_add, not bincount: bincount on CUDA reads its maximum back to the host
            self._counts.index_add_(0, new, torch.ones(new.shape, device=device))
        self._counted = len(output)
        return self._counts

    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        n, device = logits.shape[0], logits.device
        if self._needs_prompt(device):
            self._prompt_seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device).index_fill_(
                0, sent[2], True)
        counts = self.output_counts(output, device, sent[0]).expand(n, -1)
        if n > 1:  # row i also counts draft[:i]: a one-hot per draft token, summed down the rows
            steps = torch.zeros(n, self.vocab_size, device=device)
            steps[torch.arange(1, n, device=device), sent[1]] = 1.0
            counts = counts + steps.cumsum(dim=0)
        seen = counts > 0
        if self.repetition != 1.0:
            assert self._prompt_seen is not None
            hit = seen | self._prompt_seen
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
        self._split: list[int] = []  # how many of the arrays `inputs` gave are each processor's

    def inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int]) -> Arrays:
        arrays: Arrays = []
        self._split = []
        for processor in self.processors:
            mine = processor.inputs(logits, output, draft)
            self._split.append(len(mine))
            arrays.extend(mine)
        return arrays

    def apply_inputs(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                     sent: Sequence[torch.Tensor]) -> torch.Tensor:
        logits = logits.float().clone()
        at = 0
        for processor, k in zip(self.processors, self._split):
            logits = processor.apply_inputs(logits, output, draft, sent[at : at + k])
            at += k
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
        processors.append(MinTokens(params.min_tokens, stop_ids, grammar))
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        processors.append(Penalties(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                                    prompt, vocab_size))
    return Pipeline(processors) if processors else None
