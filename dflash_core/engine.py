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

from dflash_core.draft import DFlashDraft, DraftKVCache, SlotDraftCache
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
    """Proposes draft tokens for a request; the engine verifies them with the target.

    Optional: `propose_batch(items) -> list[list[int]]` (one call for all requests, items being
    `(state, last_token, position, n)`) and `release(state)` (frees what a finished request held).
    """

    block_size: int

    def new_state(self, prompt_token_ids: list[int]) -> Any: ...

    def extend_context(self, state: Any, features: torch.Tensor) -> None: ...

    def propose(self, state: Any, last_token: int, position: int, n: int) -> list[int]: ...


@dataclass
class _DFlashState:
    cache: DraftKVCache | None = None  # per-request cache (unbatched drafter)
    slot: int | None = None  # row of the shared slot cache (batched drafter)
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet in the draft cache


class DFlashDrafter:
    """Drafter backed by a DFlash draft model sharing the target's embeddings and output head.

    With `max_slots` the drafts of all requests run as ONE batched forward over a slot KV cache; without it,
    one forward per request over a growing per-request cache.
    """

    def __init__(
        self,
        draft: DFlashDraft,
        target: Any,
        block_size: int | None = None,
        max_slots: int | None = None,
        max_len: int | None = None,
    ) -> None:
        self.draft = draft
        self.target = target
        self.block_size = int(block_size or draft.block_size)
        self.mask_token_id = draft.mask_token_id
        self.slots = None
        if max_slots:
            self.slots = SlotDraftCache(draft.cfg, max_slots, int(max_len), target.device, target.dtype)

    def new_state(self, prompt_token_ids: list[int]) -> _DFlashState:
        if self.slots is not None:
            return _DFlashState(slot=self.slots.allocate())
        return _DFlashState(cache=DraftKVCache(len(self.draft.layers)))

    def release(self, state: _DFlashState | None) -> None:
        if state is not None and state.slot is not None and self.slots is not None:
            self.slots.release(state.slot)
            state.slot = None

    def extend_context(self, state: _DFlashState, features: torch.Tensor) -> None:
        state.pending.append(features)

    def propose(self, state: _DFlashState, last_token: int, position: int, n: int) -> list[int]:
        return self.propose_batch([(state, last_token, position, n)])[0]

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[_DFlashState, int, int, int]]) -> list[list[int]]:
        """Argmax proposals for each (state, last token, its position, how many).

        Nothing is consumed unless the whole call succeeds: the pending context features stay pending and a
        per-request cache keeps its length, so a failed call can be retried (the engine retries one by one).
        """
        device, dtype = self.target.device, self.target.dtype
        if self.slots is None and len(items) > 1:
            return [self.propose(*item) for item in items]
        b = len(items)
        width = max(n for *_, n in items) + 1
        pending = [torch.cat(st.pending, dim=0) if st.pending else None for st, *_ in items]
        n_ctx = max((0 if f is None else f.shape[0]) for f in pending)
        ctx = ctx_pos = None
        positions = torch.tensor([p for _, _, p, _ in items], device=device)
        if n_ctx:
            feat_dim = next(f for f in pending if f is not None).shape[1]
            ctx = torch.zeros(b, n_ctx, feat_dim, device=device, dtype=dtype)
            # padding rows go to the slot cache's scratch column, which no query sees
            scratch = self.slots.scratch if self.slots is not None else 0
            ctx_pos = torch.full((b, n_ctx), scratch, device=device, dtype=torch.long)
            for r, f in enumerate(pending):
                if f is not None:
                    c = f.shape[0]
                    ctx[r, :c] = f.to(dtype)
                    ctx_pos[r, :c] = torch.arange(items[r][2] - c, items[r][2], device=device)
        block = torch.full((b, width), self.mask_token_id, device=device, dtype=torch.long)
        block[:, 0] = torch.tensor([last for _, last, _, _ in items], device=device)
        block_pos = positions[:, None] + torch.arange(width, device=device)[None]
        if self.slots is not None:
            cache = self.slots.batch([st.slot for st, *_ in items], ctx_pos, int(positions.max()))
            lens = dict(ctx_len=positions, block_len=torch.tensor([n + 1 for *_, n in items], device=device))
        else:
            cache, lens = items[0][0].cache, {}
        # The slot cache is written by position (a retry rewrites the same rows); a per-request cache appends.
        rollback = cache.length if self.slots is None else None
        try:
            emb = self.draft.embed(block, self.target.embed_weight)
            hidden = self.draft(emb, block_pos, ctx, ctx_pos, cache, **lens)
            best = self.draft.logits(hidden[:, 1:], self.target.lm_head_weight).argmax(dim=-1).tolist()
        except BaseException:
            if rollback is not None:
                cache.length = rollback
            raise
        for st, *_ in items:  # only now is the context in the draft cache
            st.pending.clear()
        return [row[:n] for row, (*_, n) in zip(best, items)]


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
        if req.draft_state is not None and hasattr(self.drafter, "release"):
            self.drafter.release(req.draft_state)
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

    def _draft_width(self, req: _Request) -> int:
        """Draft tokens to propose: B-1, fewer when max_tokens is closer."""
        return min(self.block_size, req.params.max_tokens - len(req.output)) - 1

    def _propose_all(self, reqs: list[_Request]) -> tuple[list[tuple[_Request, list[int]]], list[tuple[_Request, Any]]]:
        """Proposals for every request (one batched draft call when the drafter has one); failures apart."""
        plans = {req.id: (req, []) for req in reqs}
        drafting = [req for req in reqs if self.drafter is not None and self._draft_width(req) > 0]
        failed: list[tuple[_Request, Any]] = []
        batch = getattr(self.drafter, "propose_batch", None)
        if drafting and batch is not None:
            try:
                items = [(r.draft_state, r.output[-1], r.position, self._draft_width(r)) for r in drafting]
                for req, props in zip(drafting, batch(items)):
                    plans[req.id] = (req, props)
                drafting = []
            except Exception:  # find out which request it was: one by one
                log.warning("batched draft failed; retrying request by request", exc_info=True)
        for req in drafting:
            try:
                props = self.drafter.propose(req.draft_state, req.output[-1], req.position, self._draft_width(req))
                plans[req.id] = (req, props)
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
        rows = [([req.output[-1], *props], req.position, req.cache) for req, props in plans]
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
