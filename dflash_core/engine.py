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
from typing import Any, Protocol

import torch

from dflash_core.draft import DFlashDraft, DraftKVCache
from dflash_core.sampling import SamplingParams, choose_tokens, resolve_seed, token_logprobs
from dflash_core.target import HFTarget, TargetOutput

log = logging.getLogger("dflash.engine")

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"
_KEEP_FINISHED_STATS = 4096


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestStats:
    """What one request did: speculation counters and timings."""

    prompt_tokens: int
    block_size: int
    generated_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    decode_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * max(self.block_size - 1, 0)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition); 1.0 when nothing was drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


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


class Drafter(Protocol):
    """Proposes draft tokens for a request; the engine verifies them with the target."""

    block_size: int

    def new_state(self, prompt_token_ids: list[int]) -> Any: ...

    def extend_context(self, state: Any, features: torch.Tensor) -> None: ...

    def propose(self, state: Any, last_token: int, position: int, n: int) -> list[int]: ...


@dataclass
class _DFlashState:
    cache: DraftKVCache
    pending: list[torch.Tensor] = field(default_factory=list)


class DFlashDrafter:
    """Drafter backed by a DFlash draft model sharing the target's embeddings and output head."""

    def __init__(self, draft: DFlashDraft, target: HFTarget, block_size: int | None = None) -> None:
        self.draft = draft
        self.target = target
        self.block_size = int(block_size or draft.block_size)
        self.mask_token_id = draft.mask_token_id

    def new_state(self, prompt_token_ids: list[int]) -> _DFlashState:
        return _DFlashState(cache=DraftKVCache(len(self.draft.layers)))

    def extend_context(self, state: _DFlashState, features: torch.Tensor) -> None:
        state.pending.append(features)

    @torch.inference_mode()
    def propose(self, state: _DFlashState, last_token: int, position: int, n: int) -> list[int]:
        device = self.target.device
        ctx = None
        ctx_pos = None
        if state.pending:
            ctx = torch.cat(state.pending, dim=0)[None].to(self.target.dtype)
            start = state.cache.length
            ctx_pos = torch.arange(start, start + ctx.shape[1], device=device)[None]
            state.pending.clear()
        block = torch.tensor([[last_token] + [self.mask_token_id] * n], device=device)
        block_pos = torch.arange(position, position + n + 1, device=device)[None]
        hidden = self.draft(self.draft.embed(block, self.target.embed_weight), block_pos, ctx, ctx_pos, state.cache)
        logits = self.draft.logits(hidden[0, 1:], self.target.lm_head_weight)
        return logits.argmax(dim=-1).tolist()


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    stats: RequestStats
    cache: Any = None
    draft_state: Any = None
    output: list[int] = field(default_factory=list)
    position: int = 0  # position of output[-1], the one generated token not yet in the target cache
    aborted: bool = False


class Engine:
    """Serves many requests, one draft+verify iteration each per `step()`. Not thread-safe."""

    def __init__(
        self,
        target: HFTarget,
        drafter: Drafter | None = None,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
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
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.target.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
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
                if self.target.has_free_cache():  # else it waits for a request to finish
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
        self.target.release(req.cache)
        req.cache = req.draft_state = None
        self._finished[req.id] = req.stats
        while len(self._finished) > _KEEP_FINISHED_STATS:
            self._finished.popitem(last=False)

    def _prefill(self, req: _Request) -> StepOutput:
        t0 = time.perf_counter()
        req.cache = self.target.new_cache()
        use_draft = self.drafter is not None
        out = self.target.forward(req.prompt, 0, req.cache, features=use_draft, last_only=True)
        token = choose_tokens(out.logits, req.params, req.seed, len(req.prompt))
        if use_draft:
            req.draft_state = self.drafter.new_state(req.prompt)
            if out.features is not None:
                self.drafter.extend_context(req.draft_state, out.features)
        req.position = len(req.prompt)
        step = self._commit(req, token, out.logits, StepOutput(req.id, [], is_prefill=True))
        req.stats.prefill_time += time.perf_counter() - t0
        return step

    def _propose(self, req: _Request) -> list[int]:
        verify_size = min(self.block_size, req.params.max_tokens - len(req.output))
        if verify_size < 2:
            return []
        return self.drafter.propose(req.draft_state, req.output[-1], req.position, verify_size - 1)

    def _decode_batch(self, reqs: list[_Request]) -> list[tuple[_Request, StepOutput]]:
        t0 = time.perf_counter()
        done: list[tuple[_Request, StepOutput]] = []
        plans: list[tuple[_Request, list[int]]] = []
        for req in reqs:
            try:
                plans.append((req, self._propose(req)))
            except Exception as exc:
                done.append((req, self._error(req, exc)))
        if not plans:
            return done
        rows = [([req.output[-1], *props], req.position, req.cache) for req, props in plans]
        want = any(props for _, props in plans)
        try:
            outs: list[Any] = self.target.forward_batch(rows, features=want)
        except Exception:  # find out which request it was: run them one by one
            outs = []
            for row in rows:
                try:
                    outs.append(self.target.forward(*row, features=want))
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
        """Keep the longest prefix of the draft that the target agrees with, plus the target's own next token."""
        p = req.position
        chosen = choose_tokens(out.logits, req.params, req.seed, p + 1)
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == chosen[accepted]:
            accepted += 1
        self.target.crop(req.cache, p + accepted + 1)
        if proposals and out.features is not None:
            self.drafter.extend_context(req.draft_state, out.features[: accepted + 1])
        req.position = p + accepted + 1

        st = req.stats
        st.acceptance_lengths.append(accepted + 1)
        if proposals:
            st.num_drafts += 1
            st.num_draft_tokens += len(proposals)
            st.num_accepted_tokens += accepted
            for k in range(accepted):
                st.accepted_per_position[k] += 1
        step = StepOutput(
            req.id,
            [],
            acceptance_length=accepted + 1,
            num_draft_tokens=len(proposals),
            num_accepted_tokens=accepted,
        )
        return self._commit(req, chosen[: accepted + 1], out.logits, step)

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
