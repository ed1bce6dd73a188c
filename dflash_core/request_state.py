"""The engine's record of one request (``EngineRequest``): what the scheduler, the step loop and the width policy
read and update while it waits, prefills and decodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_core.chat import as_token_ids
from dflash_core.grammar import GrammarState
from dflash_core.kv.manager import RequestKV
from dflash_core.outputs import FINISH_LENGTH, FINISH_STOP, StepOutput, TokenLogprob
from dflash_core.processors import LogitsProcessor
from dflash_core.sampling import SamplingParams, token_logprobs
from dflash_core.speculation import SpecState
from dflash_core.stats import RequestStats


@dataclass
class EngineRequest:
    """A request inside the engine: its prompt, parameters, slot and caches, output so far, and per-step state."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    stats: RequestStats
    kv: RequestKV | None = None  # its slot and KV blocks, held from admission to the end (or a preemption)
    cache: Any = None
    draft_state: Any = None
    output: list[int] = field(default_factory=list)
    position: int = 0  # position of output[-1], the one generated token not yet in the target cache
    aborted: bool = False
    prefilled: int = 0  # tokens of `prefill_tokens` in the target cache (chunked prefill)
    # what a prefill computes: the prompt; after a preemption, the prompt and the output but its last token
    prefill_tokens: list[int] = field(default_factory=list)
    # digests of its leading full blocks (the prefix-cache lookup's), kept between admission tries: its prefill
    # tokens only ever grow at the end (a preemption's recompute adds output), so they stay valid
    block_digests: list[bytes] = field(default_factory=list)
    spec: SpecState | None = None  # the width policy's history of this request
    drafted: bool = False  # it drafted in the current step
    processor: LogitsProcessor | None = None  # penalties, logit_bias, min_tokens, grammar mask (None: none)
    grammar: GrammarState | None = None  # structured output: the grammar over the committed tokens

    def __post_init__(self) -> None:
        if not self.prefill_tokens:
            self.prefill_tokens = self.prompt

    @property
    def resumed(self) -> bool:
        """It was preempted after generating: its prefill recomputes the cache and chooses no token."""
        return bool(self.output)

    def committed(self) -> int:
        """Positions whose target KV is committed: the prefilled ones, then (decoding) those before output[-1]."""
        return self.prefilled if self.prefilled < len(self.prefill_tokens) else self.position


def checked_prompt(prompt_token_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int) -> list[int]:
    """The prompt as token ids, after checking it and the parameters against the model; ValueError otherwise."""
    params.validate()
    try:
        prompt = as_token_ids(prompt_token_ids)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"prompt must be a list of token ids ({exc})") from None
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab})")
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
            f"context length ({max_model_len})"
        )
    if any(t >= vocab for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    return prompt


def commit_tokens(req: EngineRequest, tokens: list[int], logits: torch.Tensor, step: StepOutput) -> StepOutput:
    """Append the step's tokens to the request's output, cut at the first stop token, at max_tokens or where the
    grammar ends; `step` gets them, its finish reason and their logprobs."""
    stop_at = next((i for i, tok in enumerate(tokens) if tok in req.stop_ids), None)
    if stop_at is not None:
        tokens = tokens[: stop_at + 1]
        step.finish_reason, step.stop_token_id = FINISH_STOP, tokens[-1]
    room = req.params.max_tokens - len(req.output)
    if len(tokens) > room:
        tokens = tokens[:room]
        step.finish_reason, step.stop_token_id = FINISH_LENGTH, None
    elif len(tokens) == room and step.finish_reason is None:
        step.finish_reason = FINISH_LENGTH
    ended = req.grammar.advance(tokens) if req.grammar is not None else None
    if ended is not None:  # the grammar accepted its stop token: nothing may follow, the request ends
        tokens = tokens[:ended]
        step.finish_reason, step.stop_token_id = FINISH_STOP, tokens[-1]
    req.output.extend(tokens)
    req.stats.generated_tokens = len(req.output)
    step.new_token_ids = tokens
    if req.params.logprobs is not None:
        rows = logits[-1:] if step.is_prefill else logits[: len(tokens)]
        step.logprobs = [
            TokenLogprob(tok, lp, top)
            for tok, (lp, top) in zip(tokens, token_logprobs(rows, tokens, req.params.logprobs))
        ]
    return step
