"""Run requests on an `Engine` to completion: the one loop behind `LLM`, `dflash-bench offline` and
`dflash-train`'s evaluation (the server runs the engine from its worker thread instead)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from dflash_core.engine import Engine
from dflash_core.outputs import StepOutput, TokenLogprob
from dflash_core.sampling import SamplingParams
from dflash_core.stats import RequestStats


@dataclass
class RequestOutput:
    """One request's output so far; `stats` is set once it has finished."""

    index: int  # position of its prompt in the call
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def params_per_prompt(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One SamplingParams for each of `n` prompts, from one for all or a list of one per prompt."""
    per_prompt = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != n or not all(isinstance(p, SamplingParams) for p in per_prompt):
        raise ValueError(f"params: one SamplingParams, or one per prompt ({n})")
    return per_prompt


def iter_steps(
    engine: Engine, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
) -> Iterator[tuple[RequestOutput, StepOutput]]:
    """Add every prompt, then step until all have finished, yielding each step's output with its request's
    running output. A prompt the engine refuses raises ValueError before anything runs. When the caller stops
    early, the requests still running are aborted so that their slots are free for the next call."""
    per_prompt = params_per_prompt(params, len(prompts))
    running: dict[int, RequestOutput] = {}
    try:
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            rid = engine.add_request(prompt, p)
            running[rid] = RequestOutput(i, rid, list(prompt))
        while running:
            for out in engine.step():
                req = running.get(out.request_id)
                if req is None:  # another caller's request on a shared engine
                    continue
                req.token_ids.extend(out.new_token_ids)
                req.logprobs.extend(out.logprobs or [])
                if out.finish_reason is not None:
                    req.finish_reason, req.error = out.finish_reason, out.error
                    req.stats = engine.stats(req.request_id)
                    engine.release(req.request_id)
                    del running[req.request_id]
                yield req, out
    finally:
        for rid in running:
            engine.abort(rid)
        while any(engine.is_running(rid) for rid in running):
            engine.step()
        for rid in running:
            engine.release(rid)


def run_to_completion(
    engine: Engine, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
) -> list[RequestOutput]:
    """Every prompt's finished output, in prompt order (the requests run batched, as the server runs them)."""
    outputs: dict[int, RequestOutput] = {}
    for req, _ in iter_steps(engine, prompts, params):
        outputs[req.index] = req
    return [outputs[i] for i in range(len(prompts))]
