"""The DFlash engine: per-request prefill, then draft -> verify -> accept iterations.

`step()` advances every active request by one iteration. A request without a drafter (block size 1) is plain
autoregressive decoding through the same code: the baseline every benchmark compares against.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_core.chat import as_token_ids
from dflash_core.runners.base import Drafter, DraftRequest, TargetOutput, TargetRow, TargetRunner
from dflash_core.sampling import SamplingParams, choose_tokens, resolve_seed, token_logprobs
from dflash_core.slots import SlotPool
from dflash_core.stats import RequestStats

log = logging.getLogger("dflash.engine")

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"
_KEEP_FINISHED_STATS = 4096


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What one `step()` did for one request."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    acceptance_length: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    is_prefill: bool = False
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    stats: RequestStats
    slot: int | None = None  # from the engine's SlotPool, held from prefill to the end
    cache: Any = None
    draft_state: Any = None
    output: list[int] = field(default_factory=list)
    position: int = 0  # position of output[-1], the one generated token not yet in the target cache
    aborted: bool = False


class Engine:
    """Serves many requests, one draft+verify iteration each per `step()`. Not thread-safe.

    Each running request holds one slot of `self.slots` (its target cache and draft state are created for that
    slot); requests beyond the free slots wait, in order, for one to be released.
    """

    def __init__(
        self,
        target: TargetRunner,
        drafter: Drafter | None = None,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
        max_slots: int | None = None,
        slots: SlotPool | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        if slots is None:  # engines that share a runner must share its pool: pass `slots`
            limits = [n for n in (max_slots, target.max_slots, drafter and drafter.max_slots) if n is not None]
            slots = SlotPool(min(limits) if limits else None)
        self.slots = slots
        self.block_size = drafter.block_size if drafter is not None else 1
        self.eos_token_ids = list(eos_token_ids or [])
        self.max_model_len = int(max_model_len or target.max_position_embeddings)
        self._ids = itertools.count()
        self._active: dict[int, _Request] = {}
        self._finished: OrderedDict[int, RequestStats] = OrderedDict()

    # ---- requests ----
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; raises ValueError on bad input."""
        params.validate()
        try:
            prompt = as_token_ids(prompt_token_ids)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"prompt must be a list of token ids ({exc})") from None
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.target.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context length ({self.max_model_len})"
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        rid = next(self._ids)
        self._active[rid] = _Request(
            id=rid,
            prompt=prompt,
            params=params,
            seed=resolve_seed(params.seed),
            stop_ids=frozenset(stop),
            stats=RequestStats(prompt_tokens=len(prompt), block_size=self.block_size),
        )
        return rid

    def abort(self, request_id: int) -> None:
        """The request ends with finish reason "abort" at the next step; unknown ids are ignored."""
        req = self._active.get(request_id)
        if req is not None:
            req.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self._active)

    def num_running(self) -> int:
        return len(self._active)

    def is_running(self, request_id: int) -> bool:
        """The request was added and has not finished yet."""
        return request_id in self._active

    def stats(self, request_id: int) -> RequestStats:
        req = self._active.get(request_id)
        return req.stats if req is not None else self._finished[request_id]

    def release(self, request_id: int) -> None:
        self._finished.pop(request_id, None)

    # ---- the loop ----
    def step(self) -> list[StepOutput]:
        """Advance every active request by one iteration: its prefill, or one draft + verify.

        The verify blocks of all decoding requests go to the target as one batch (one forward on the native
        backend). A failure is confined to the request that caused it.
        """
        outputs: list[StepOutput] = []
        decoding: list[_Request] = []
        for req in list(self._active.values()):
            if req.aborted:
                self._emit(req, StepOutput(req.id, [], finish_reason=FINISH_ABORT), outputs)
            elif req.cache is None:
                if self.slots.has_free():  # else it waits for a request to finish
                    self._emit(req, self._guarded(req, self._prefill), outputs)
            else:
                decoding.append(req)
        if decoding:
            for req, out in self._decode_batch(decoding):
                self._emit(req, out, outputs)
        return outputs

    def _emit(self, req: _Request, out: StepOutput, outputs: list[StepOutput]) -> None:
        if out.finish_reason is not None:
            self._retire(req)
        outputs.append(out)

    @staticmethod
    def _error(req: _Request, exc: BaseException) -> StepOutput:
        log.error("request %d failed: %s", req.id, exc, exc_info=exc)
        return StepOutput(req.id, [], finish_reason=FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")

    def _guarded(self, req: _Request, fn: Any, *args: Any) -> StepOutput:
        try:
            return fn(req, *args)
        except Exception as exc:  # one request's failure must not take the others down
            return self._error(req, exc)

    def _retire(self, req: _Request) -> None:
        del self._active[req.id]
        req.cache = req.draft_state = None  # both caches dropped before their slot is free again
        if req.slot is not None:
            self.slots.release(req.slot)
            req.slot = None
        self._finished[req.id] = req.stats
        while len(self._finished) > _KEEP_FINISHED_STATS:
            self._finished.popitem(last=False)

    def _prefill(self, req: _Request) -> StepOutput:
        t0 = time.perf_counter()
        req.slot = self.slots.allocate()
        req.cache = self.target.new_cache(req.slot)
        use_draft = self.drafter is not None
        out = self.target.forward(req.prompt, 0, req.cache, features=use_draft, last_only=True)
        token = choose_tokens(out.logits, req.params, req.seed, len(req.prompt))
        if use_draft:
            req.draft_state = self.drafter.new_state(req.slot, req.prompt)
            if out.features is not None:
                self.drafter.extend_context(req.draft_state, out.features)
        req.position = len(req.prompt)
        step = self._commit(req, token, out.logits, StepOutput(req.id, [], is_prefill=True))
        req.stats.prefill_time += time.perf_counter() - t0
        return step

    def _draft_width(self, req: _Request) -> int:
        """Draft tokens to propose: B-1, fewer when max_tokens is closer."""
        return min(self.block_size, req.params.max_tokens - len(req.output)) - 1

    def _propose_all(self, reqs: list[_Request]) -> tuple[list[tuple[_Request, list[int]]], list[tuple[_Request, Any]]]:
        """Proposals for every request (one batched draft call); failures apart."""
        plans = {req.id: (req, []) for req in reqs}
        failed: list[tuple[_Request, Any]] = []
        if self.drafter is None:
            return list(plans.values()), failed
        drafting = [req for req in reqs if self._draft_width(req) > 0]
        items = [DraftRequest(r.draft_state, r.output[-1], r.position, self._draft_width(r)) for r in drafting]
        if items:
            try:
                for req, props in zip(drafting, self.drafter.propose_batch(items)):
                    plans[req.id] = (req, props)
                return list(plans.values()), failed
            except Exception:  # find out which request it was: one by one
                log.warning("batched draft failed; retrying request by request", exc_info=True)
        for req, item in zip(drafting, items):
            try:
                plans[req.id] = (req, self.drafter.propose_batch([item])[0])
            except Exception as exc:
                del plans[req.id]
                failed.append((req, exc))
        return list(plans.values()), failed

    def _decode_batch(self, reqs: list[_Request]) -> list[tuple[_Request, StepOutput]]:
        t0 = time.perf_counter()
        plans, failed = self._propose_all(reqs)
        done = [(req, self._error(req, exc)) for req, exc in failed]
        if not plans:
            return done
        rows = [TargetRow([req.output[-1], *props], req.position, req.cache) for req, props in plans]
        want = any(props for _, props in plans)
        try:
            outs: list[Any] = self.target.forward_batch(rows, features=want)
        except Exception:  # find out which request it was: run them one by one
            log.warning("batched verify failed; retrying request by request", exc_info=True)
            outs = []
            for tokens, start, cache in rows:
                try:
                    # Rows that ran before the failure already appended to their cache (hf): back to the start.
                    self.target.crop(cache, start)
                    outs.append(self.target.forward(tokens, start, cache, features=want))
                except Exception as exc:
                    outs.append(exc)
        elapsed = time.perf_counter() - t0
        for (req, props), out in zip(plans, outs):
            if isinstance(out, BaseException):
                done.append((req, self._error(req, out)))
                continue
            done.append((req, self._guarded(req, self._accept, props, out)))
            req.stats.decode_time += elapsed
        return done

    def _accept(self, req: _Request, proposals: list[int], out: TargetOutput) -> StepOutput:
        """Keep the longest prefix of the draft that the target agrees with, plus the target's own next token.

        Row i of the verify block picks the token at position p + 1 + i with that position's uniform, exactly as
        plain decoding would, so the committed tokens are the target's own choices whatever the draft proposed.
        """
        p = req.position
        chosen = choose_tokens(out.logits, req.params, req.seed, p + 1)
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == chosen[accepted]:
            accepted += 1
        self.target.crop(req.cache, p + accepted + 1)
        if proposals and out.features is not None:
            self.drafter.extend_context(req.draft_state, out.features[: accepted + 1])
        req.position = p + accepted + 1

        req.stats.record_step(len(proposals), accepted)
        step = StepOutput(
            req.id,
            [],
            acceptance_length=accepted + 1,
            num_draft_tokens=len(proposals),
            num_accepted_tokens=accepted,
        )
        # The accepted draft tokens (equal to the target's choices), then the target's own token after them.
        return self._commit(req, proposals[:accepted] + chosen[accepted : accepted + 1], out.logits, step)

    def _commit(self, req: _Request, tokens: list[int], logits: torch.Tensor, step: StepOutput) -> StepOutput:
        """Append tokens, cutting at the first stop token or at max_tokens; fill in logprobs."""
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
