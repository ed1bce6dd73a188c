"""The Python API: `LLM(target, draft, **config)` with `.generate()` and `.stream()`, no HTTP.

    from dflash_core import LLM, SamplingParams

    llm = LLM()  # the bundled demo pair; or LLM("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", dtype="bfloat16")
    out = llm.generate([{"role": "user", "content": "Convert 5 kilometers to meters."}],
                       SamplingParams(max_tokens=64))[0]
    print(out.text, out.spec.mean_acceptance_length)

A prompt is a conversation (a list of `{"role", "content"}` messages, rendered with the chat template), a raw
text (tokenized as a completion prompt), or token ids (a list of ints, or what `apply_chat_template(...,
tokenize=True)` returns, or a 1-D tensor). Several prompts run batched, as concurrent requests do on the
server. `SamplingParams(stop=[...])` strings end a text before them; its penalties, `logit_bias`, `min_p`,
`min_tokens` and `structured` (a `dflash_core.grammar.StructuredOutput`) pass to the engine unchanged.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from dflash_core.chat import as_token_ids, encode_chat, encode_text
from dflash_core.config import EngineConfig
from dflash_core.detokenize import OutputText
from dflash_core.generate import RequestOutput, iter_steps, params_per_prompt
from dflash_core.loading import LoadedModels, load_models
from dflash_core.outputs import FINISH_ABORT, FINISH_ERROR, TokenLogprob
from dflash_core.sampling import SamplingParams
from dflash_core.stats import SpecSummary

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int] | Mapping[str, Any] | torch.Tensor | np.ndarray


@dataclass
class Generation:
    """One prompt's finished output."""

    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort or error
    spec: SpecSummary = field(default_factory=SpecSummary)  # drafts, accepted tokens, mean acceptance length
    logprobs: list[TokenLogprob] | None = None  # text tokens only: an ending EOS / stop token has none
    error: str | None = None


@dataclass
class StreamChunk:
    """What one engine step added to one prompt's output: an accepted draft prefix plus the target's token."""

    index: int  # which prompt
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    spec: SpecSummary | None = None  # set on the last chunk


def _is_conversation(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(
        isinstance(m, Mapping) for m in value)


def _one_prompt(value: Any) -> bool:
    """A single prompt (rather than a list of prompts)."""
    if isinstance(value, (str, Mapping)) or _is_conversation(value):
        return True
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 1
    return isinstance(value, Sequence) and bool(value) and all(isinstance(t, numbers.Integral) for t in value)


class LLM:
    """Target + DFlash draft loaded once; generates for lists of prompts.

    Keyword arguments are `EngineConfig` fields: tokenizer, device, dtype, backend, block_size, speculative,
    max_running_requests (requests decoded at once; more wait for a slot), max_model_len, draft_window.
    Conversations are rendered as `apply_chat_template` renders them: special-token text inside message content
    becomes special tokens (the caller is trusted; the server keeps client text plain instead). One call runs at a
    time: while a `stream` is open (not exhausted or closed), another call raises RuntimeError. Not thread-safe.
    """

    def __init__(self, target: str | None = None, draft: str | None = None, **config: Any) -> None:
        unknown = sorted(set(config) - {f.name for f in fields(EngineConfig)})
        if unknown:
            known = ", ".join(f.name for f in fields(EngineConfig) if f.name not in ("target", "draft"))
            raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(unknown)}; settings: {known}")
        self.config = EngineConfig(target=target, draft=draft, **config)
        self.models: LoadedModels = load_models(self.config)
        self.engine = self.models.engine
        self.tokenizer = self.models.tokenizer
        self._busy = False

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: conversations through the chat template, text as a completion prompt."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        if _is_conversation(prompt):
            return encode_chat(self.tokenizer, [dict(m) for m in prompt])
        if isinstance(prompt, Mapping) and "input_ids" not in prompt:
            raise ValueError("a prompt is a text, a conversation (a LIST of {'role', 'content'} messages) or "
                             "token ids; got a single message dict")
        return as_token_ids(prompt)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Generation]:
        """Every prompt's output, in prompt order (an empty list for no prompts); `params` is one SamplingParams
        for all or one per prompt. A request the engine fails ends with finish_reason "error" and its message in
        `error`; it does not raise."""
        batch = self._batch(prompts)
        outs = [Generation(ids) for ids in batch]
        for _ in self._chunks(batch, params, outs):
            pass  # _chunks fills `outs`
        return outs

    def stream(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StreamChunk]:
        """Each step's new text per prompt as it is accepted; the last chunk of a prompt has its finish reason.
        Closing the iterator early (`break` in a `with contextlib.closing(...)`, or `.close()`) aborts what still
        runs."""
        batch = self._batch(prompts)
        return self._chunks(batch, params, [Generation(ids) for ids in batch])

    def _batch(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        items = [prompts] if _one_prompt(prompts) else list(prompts)  # type: ignore[arg-type]
        return [self.encode(p) for p in items]

    def _chunks(
        self, batch: list[list[int]], params: SamplingParams | Sequence[SamplingParams] | None, outs: list[Generation]
    ) -> Iterator[StreamChunk]:
        if self._busy:  # its steps would advance (and swallow) the open stream's requests
            raise RuntimeError("this LLM still has an open stream: exhaust it or close() it first")
        self._busy = True
        try:
            per_prompt = params_per_prompt(params or SamplingParams(), len(batch))
            for p in per_prompt:
                p.validate()  # before anything reads them (the engine validates again when it adds them)
            yield from self._steps(batch, per_prompt, outs)
        finally:
            self._busy = False

    def _steps(
        self, batch: list[list[int]], params: list[SamplingParams], outs: list[Generation]
    ) -> Iterator[StreamChunk]:
        texts = [OutputText(self.tokenizer, ids, list(p.stop)) for ids, p in zip(batch, params)]
        for req, out in iter_steps(self.engine, batch, params):
            gen = outs[req.index]
            if gen.finish_reason is not None:  # already ended by a stop string; this is the engine's abort
                continue
            if out.finish_reason in (FINISH_ERROR, FINISH_ABORT):  # no tokens: the request ended without output
                gen.finish_reason, gen.error, gen.spec = out.finish_reason, out.error, self._summary(req)
                yield StreamChunk(req.index, "", [], gen.finish_reason, gen.spec)
                continue
            step = texts[req.index].step(out)
            gen.text += step.text
            gen.token_ids.extend(step.token_ids)
            if out.logprobs is not None:
                gen.logprobs = (gen.logprobs or []) + list(out.logprobs[: step.num_text_tokens])
            if step.finish_reason is not None:
                gen.finish_reason = step.finish_reason
                if step.stopped_early:
                    self.engine.abort(req.request_id)
                gen.spec = self._summary(req)
            yield StreamChunk(req.index, step.text, step.token_ids, step.finish_reason,
                              gen.spec if step.finish_reason is not None else None)

    def _summary(self, req: RequestOutput) -> SpecSummary:
        stats = req.stats if req.stats is not None else self.engine.stats(req.request_id)
        return stats.summary()
