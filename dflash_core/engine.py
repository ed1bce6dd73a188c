"""The DFlash engine: chunked, batched prefill, then draft -> verify -> accept iterations.

`step()` runs what the scheduler planned: the verify rows of the running requests (their drafts first, all in one
batched call each, at the width the policy chose) and the prefill chunks of new requests. A request without a
drafter (block size 1) is plain autoregressive decoding through the same code: the baseline every benchmark
compares against.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from dflash_core.config import SPEC_SAMPLING
from dflash_core.grammar import GrammarBackend, GrammarState
from dflash_core.kv.manager import KVManager
from dflash_core.kv.pool import KVStats
from dflash_core.kv.requests import RequestMemory
from dflash_core.memory import verify_rows
from dflash_core.outputs import FINISH_ABORT, StepOutput, failed_output
from dflash_core.pace import DecodePace
from dflash_core.processors import build_processor
from dflash_core.rejection import draft_sampling, rejects
from dflash_core.request_state import EngineRequest, checked_prompt, commit_tokens
from dflash_core.runners.base import Drafter, DraftRequest, Proposal, TargetOutput, TargetRow, TargetRunner
from dflash_core.sampling import SamplingParams, choose_tokens, resolve_seed
from dflash_core.scheduler import Chunk, Scheduler
from dflash_core.speculation import StepCosts, WidthPolicy
from dflash_core.stats import RequestStats
from dflash_core.timing import StepClock, device_timer
from dflash_core.tree import TREE_TOP_K, DraftTree
from dflash_core.verify import step_choices, tree_budget_for, verify_plans

log = logging.getLogger("dflash.engine")
_KEEP_FINISHED_STATS = 4096


class Engine:
    """Serves many requests, one draft+verify iteration each per `step()`. Not thread-safe.

    Each admitted request holds a slot and, on a paged runner, KV blocks (`self.kv`; `self.memory` runs their life:
    admission, prefix hits, preemption, release). Requests that cannot be admitted wait, in order; a running request
    short of blocks makes the newest running one give its memory back and be recomputed later, with the same output.
    `speculation` is the width policy ("fixed": the full block, the default here; "adaptive", the default of
    `EngineConfig`, see `dflash_core.speculation`); `max_num_batched_tokens` and `prefill_chunk` are the
    scheduler's step budget and prefill chunk size (None: unbounded). `spec_sampling` is how a sampled request
    accepts draft tokens: "keyed" (the target's own position-keyed draw must equal the draft's argmax: seeded text
    independent of speculation) or "rejection" (drawn drafts accepted with probability min(1, p / q):
    `dflash_core.rejection`; structured requests stay keyed).
    """

    def __init__(
        self,
        target: TargetRunner,
        drafter: Drafter | None = None,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
        max_slots: int | None = None,
        kv: KVManager | None = None,
        speculation: str = "fixed",
        max_num_batched_tokens: int | None = None,
        prefill_chunk: int | None = None,
        grammar: GrammarBackend | None = None,
        enable_prefix_caching: bool = True,
        spec_sampling: str = "keyed",
        tree_budget: int = 0,
    ) -> None:
        if spec_sampling not in SPEC_SAMPLING:
            raise ValueError(f"spec_sampling must be one of {', '.join(SPEC_SAMPLING)}, got {spec_sampling!r}")
        self.spec_sampling = spec_sampling
        self.target = target
        self.drafter = drafter
        self.draft_version = 1  # the draft proposing: 1 at start, one more per `swap_draft`
        self.grammar = grammar  # compiles structured outputs (None: requests with `structured` are refused)
        self.block_size = drafter.block_size if drafter is not None else 1
        if kv is None:  # engines that share a runner must share its KV memory: pass `kv`
            kv = KVManager.for_runners(target, drafter, max_slots, enable_prefix_caching)
        self.kv = kv
        tree_budget = tree_budget_for(speculation, tree_budget, target, drafter)
        # a chain writes block_size rows past the position; a tree up to tree_budget + 1, from free blocks only
        self.memory = RequestMemory(kv, target, drafter, self.block_size, tree_budget + 1 if tree_budget else 0)
        # on CUDA a step's tree rows stay within the logits the memory plan reserves (`memory.verify_rows`)
        self._tree_tokens = verify_rows(kv.slots.capacity or 1, self.block_size, tree_budget + 1 if speculation ==
                                        "tree" else 0) if target.device.type == "cuda" else None
        self.eos_token_ids = list(eos_token_ids or [])
        self.max_model_len = int(max_model_len or target.max_position_embeddings)
        self._ids = itertools.count()
        self._active: dict[int, EngineRequest] = {}
        self._finished: OrderedDict[int, RequestStats] = OrderedDict()
        self.scheduler = Scheduler(self.memory.admit, max_num_batched_tokens, prefill_chunk)
        self.policy = WidthPolicy(self.block_size, speculation, padded=target.pads_rows, tree_budget=tree_budget)
        self.pace = DecodePace()  # decode step times, the speedup estimate
        self.clock = StepClock(device_timer(target.device))  # every cost sample: device time, read after a sync

    def kv_stats(self) -> KVStats | None:
        """Block pool usage, prefix-cache queries and hits (tokens) and preemptions; None when not paged."""
        return None if self.kv.pool is None else self.kv.pool.stats(self.memory.preemptions)

    # ---- requests ----
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; raises ValueError on bad input."""
        vocab = self.target.vocab_size
        prompt = checked_prompt(prompt_token_ids, params, vocab, self.max_model_len)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        grammar = self._grammar_state(params, stop)
        processor = build_processor(params, prompt, stop, vocab, grammar)
        rid = next(self._ids)
        req = EngineRequest(
            id=rid,
            prompt=prompt,
            params=params,
            seed=resolve_seed(params.seed),
            stop_ids=frozenset(stop),
            stats=RequestStats(prompt_tokens=len(prompt), block_size=self.block_size),
            processor=processor,
            grammar=grammar,
        )
        self._active[rid] = req
        self.scheduler.add(req)
        return rid

    def _grammar_state(self, params: SamplingParams, stop_ids: set[int]) -> GrammarState | None:
        """A structured request's grammar, ending on its stop tokens (on EOS when it has none)."""
        if params.structured is None:
            return None
        if self.grammar is None:
            raise ValueError("structured output needs a grammar backend (this engine was built without one)")
        ends = stop_ids or set(self.eos_token_ids)
        return GrammarState(self.grammar.matcher(params.structured, ends), params.structured.start_after)

    def abort(self, request_id: int) -> None:
        """The request ends with finish reason "abort" at the next step; unknown ids are ignored."""
        req = self._active.get(request_id)
        if req is not None:
            req.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self._active)

    def num_running(self) -> int:
        """Requests added and not finished (waiting, prefilling or decoding)."""
        return len(self._active)

    def num_waiting(self) -> int:
        """Requests not admitted yet (vLLM's "waiting"): no slot or KV blocks for them now, or preempted."""
        return len(self.scheduler.waiting)

    def warm_up(self) -> None:
        """Before serving, on the thread that will run the steps (recorded CUDA graphs are per thread): the runners'
        compile warm-up (their static shapes; nothing without them), then two short requests through every path
        (prefill, draft, verify): the first forwards of a process are slow (lazy allocations, cold caches), and the
        width policy's cost measurements should not start from them. The first run's measurements are dropped;
        the second's seed the policy."""
        self.target.warm_up()
        if self.drafter is not None:
            self.drafter.warm_up()
        prompt = list(range(min(8, self.target.vocab_size)))
        for run in range(2):
            rid = self.add_request(prompt, SamplingParams(max_tokens=2 * self.block_size, ignore_eos=True))
            for _ in range(4 * self.block_size + 8):  # every step commits a token: a bound, never reached
                if not self.is_running(rid):
                    break
                self._step()
            else:
                raise RuntimeError("the engine's warm-up request did not finish")
            self.release(rid)
            if run == 0:
                self.policy.costs = StepCosts()
        # keep the measured costs, not what the dummy requests (ignore_eos on a made-up prompt) said of the draft
        self.policy = self.policy.fresh()
        self.pace = DecodePace()
        if self.kv.pool is not None:
            self.kv.pool.reset_counters()  # the metrics count clients' requests, not the warm-up's

    def swap_draft(self, draft: Any) -> int:
        """Propose with `draft` from the next step (`Drafter.replace_draft`: ValueError, nothing changed, when it
        cannot; any other error comes after the copy, `draft_version` moved on). Every request holding memory gives
        it back and recomputes its caches, which rebuilds its draft context with the new weights; its output goes on
        unchanged (the target chooses every token). The prefix cache is emptied: its blocks hold the old draft's
        rows. Returns how many requests were restarted."""
        if self.drafter is None:
            raise ValueError("this engine runs without a draft: there is none to replace")
        self.drafter.replace_draft(draft)
        self.draft_version += 1  # the new weights serve from here on, whatever follows
        restarted = self.memory.recompute_all([*self.scheduler.running, *self.scheduler.prefilling],
                                              self.scheduler.preempted)
        for req in self._active.values():
            req.spec = None  # what the old draft's acceptance taught the policy does not hold for the new one
        self.policy = self.policy.fresh()
        log.info("draft replaced: %d request(s) restarted to rebuild their draft context", restarted)
        return restarted

    @property
    def max_verify_width(self) -> int:
        """The most tokens one verify row checks: the draft block, or a tree's nodes and root."""
        return max(self.block_size, self.memory.tree_width)

    def estimated_speedup(self) -> float | None:
        """Committed tokens per second of recent decode steps over what plain steps of the same batch would give,
        from the measured step costs (None until measured; 1.0 without a drafter)."""
        if self.drafter is None:
            return 1.0
        return self.pace.speedup

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
        """Run one scheduled step: aborts, then one draft + verify for every running request, then the prefill
        chunks of new requests (batched; a request's last chunk gives its first token).

        The verify blocks of all decoding requests go to the target as one batch (one forward on the native
        backend). A failure is confined to the request that caused it.
        """
        return self._step()

    def _step(self) -> list[StepOutput]:
        """`step`'s work (`warm_up` runs it directly: a test gate wrapped around `step` must not see it)."""
        sched = self.scheduler  # blocks for the verify rows first (preempting while short); admission gets the rest
        self.memory.make_room([r for r in sched.running if not r.aborted], [*sched.running, *sched.prefilling],
                              self._preempt)
        plan = sched.schedule(self._prefill_room())
        outputs: list[StepOutput] = []
        for req in plan.aborted:
            self._emit(req, StepOutput(req.id, [], finish_reason=FINISH_ABORT), outputs)
        if plan.decode:
            for req, out in self._decode_batch(plan.decode, plan.verify_budget):
                self._emit(req, out, outputs)
        if plan.prefill:
            for req, out in self._prefill_batch(plan.prefill):
                self._emit(req, out, outputs)
        return outputs

    def _prefill_room(self) -> int | None:
        """While streams decode, the prefill tokens of a step (`DecodePace.prefill_room`): the most whose measured
        forward takes at most PREFILL_SHARE of a decode step, so a long prompt delays running streams by a fraction
        of a step at a time. None (the configured chunk) when nothing decodes or nothing is measured."""
        if not self.scheduler.running or not self.scheduler.num_waiting():
            return None
        return self.pace.prefill_room(self.policy.costs, self.scheduler.prefill_chunk)

    def _emit(self, req: EngineRequest, out: StepOutput, outputs: list[StepOutput]) -> None:
        if out.finish_reason is not None:
            self._retire(req)
        outputs.append(out)

    @staticmethod
    def _error(req: EngineRequest, exc: BaseException) -> StepOutput:
        out = failed_output(req.id, exc)  # the request's own fault (its grammar): a warning without a traceback
        log.log(logging.WARNING if out.error_type else logging.ERROR, "request %d failed: %s", req.id, exc,
                exc_info=None if out.error_type else exc)
        return out

    def _guarded(self, req: EngineRequest, fn: Any, *args: Any) -> StepOutput:
        try:
            return fn(req, *args)
        except Exception as exc:  # one request's failure must not take the others down
            return self._error(req, exc)

    def _retire(self, req: EngineRequest) -> None:
        del self._active[req.id]
        self.scheduler.remove(req)
        self.memory.release(req)
        self._finished[req.id] = req.stats
        while len(self._finished) > _KEEP_FINISHED_STATS:
            self._finished.popitem(last=False)

    def _start(self, req: EngineRequest) -> None:
        self.memory.start(req)
        if self.drafter is not None and req.spec is None:  # a resumed request keeps its history
            req.spec = self.policy.new_state()

    def _preempt(self, req: EngineRequest) -> None:
        self.memory.preempt(req)
        self.scheduler.preempted(req)

    def _forward_rows(
        self, rows: list[TargetRow], features: bool, last_only: bool, trees: list[DraftTree] | None = None
    ) -> list[TargetOutput | BaseException]:
        """One batched target forward (`trees`: the rows' trees, `forward_tree`); if it fails, the rows one by one
        so the failure stays with its request."""
        try:
            if trees is not None:
                return list(self.target.forward_tree(rows, trees, features))
            return list(self.target.forward_batch(rows, features=features, last_only=last_only))
        except Exception:
            log.warning("batched target forward failed; retrying request by request", exc_info=True)
        outs: list[TargetOutput | BaseException] = []
        for r, row in enumerate(rows):
            tokens, start, cache = row
            try:
                # Rows that ran before the failure already appended to their cache (hf): back to the start.
                self.target.crop(cache, start)
                outs.append(self.target.forward_tree([row], [trees[r]], features)[0] if trees is not None else
                            self.target.forward(tokens, start, cache, features=features, last_only=last_only))
            except Exception as exc:
                outs.append(exc)
        return outs

    def _forward_tokens(self, rows: list[TargetRow]) -> int:
        """Tokens a target forward of these rows computes: rows x the widest when the runner pads them, else the
        sum of their lengths (the cost model's unit)."""
        if self.target.pads_rows:
            return len(rows) * max(len(r.token_ids) for r in rows)
        return sum(len(r.token_ids) for r in rows)

    def _prefill_batch(self, chunks: list[Chunk]) -> list[tuple[EngineRequest, StepOutput]]:
        """Prefill this step's chunks in one forward; a request whose prompt is now cached gets its first token."""
        t0 = time.perf_counter()
        done: list[tuple[EngineRequest, StepOutput]] = []
        ready: list[Chunk] = []
        for ch in chunks:
            req = ch.req
            if req.cache is None:
                try:
                    self._start(req)
                except Exception as exc:
                    done.append((req, self._error(req, exc)))
                    continue
            ready.append(ch)
        if not ready:
            return done
        rows = [TargetRow(ch.tokens, ch.start, ch.req.cache) for ch in ready]
        mark = self.clock.start()
        outs = self._forward_rows(rows, self.drafter is not None, last_only=True)
        self.clock.stop(mark, functools.partial(self.policy.costs.target.add, self._forward_tokens(rows)))
        for ch, out in zip(ready, outs):
            req = ch.req
            if isinstance(out, BaseException):
                done.append((req, self._error(req, out)))
                continue
            step = self._guarded(req, self._prefilled, ch, out)  # a last chunk's first token: the host syncs
            if step is not None:
                done.append((req, step))
        self.clock.synced()
        for ch in ready:
            ch.req.stats.prefill_time += time.perf_counter() - t0
        return done

    def _prefilled(self, req: EngineRequest, chunk: Chunk, out: TargetOutput) -> StepOutput | None:
        """A chunk is in the cache; after the last one, choose the first token (a resumed request has it: it
        decodes on from where its preemption left it)."""
        if req.draft_state is not None and out.features is not None:
            self.drafter.extend_context(req.draft_state, out.features)
        req.prefilled = chunk.start + len(chunk.tokens)
        if not chunk.last or req.resumed:
            if chunk.last:
                self.scheduler.prefilled(req)
            self.memory.register(req)
            return None
        token = choose_tokens(self._processed(req, out.logits, []), req.params, req.seed, len(req.prompt))
        req.position = len(req.prompt)
        self.scheduler.prefilled(req)
        step = commit_tokens(req, token, out.logits, StepOutput(req.id, [], is_prefill=True))
        self.memory.register(req)
        return step

    def _draft_width(self, req: EngineRequest) -> int:  # draft tokens to propose: B-1, fewer near max_tokens
        return min(self.block_size, req.params.max_tokens - len(req.output)) - 1

    def _propose_all(
        self, reqs: list[EngineRequest]
    ) -> tuple[list[tuple[EngineRequest, Proposal]], list[tuple[EngineRequest, Any]]]:
        """Proposals for every request (one batched draft call; empty for a plain step); failures apart."""
        plans = {req.id: (req, Proposal([], [])) for req in reqs}
        failed: list[tuple[EngineRequest, Any]] = []
        for req in reqs:
            req.drafted = False
        if self.drafter is None:
            return list(plans.values()), failed
        wanted = self.policy.drafting([r.spec for r in reqs], [self._draft_width(r) for r in reqs])
        drafting = [req for req, n in zip(reqs, wanted) if n > 0]
        items = [DraftRequest(r.draft_state, r.output[-1], r.position, n) for r, n in zip(reqs, wanted) if n > 0]
        if not items:
            return list(plans.values()), failed
        sampling = [draft_sampling(self.spec_sampling, r.params, r.seed) for r in drafting]
        # candidates only where a tree may follow (they cost a top-k, and on CUDA the compiled whole-step graph)
        candidates = TREE_TOP_K if self.policy.uses_trees and any(map(self._tree_ok, drafting)) else 0
        try:
            self.drafter.catch_up([it.state for it in items])  # context held back by plain steps: not the draft's cost
            mark = self.clock.start()
            for req, prop in zip(drafting, self.drafter.propose_scored(items, sampling, candidates)):
                plans[req.id] = (req, prop)
                req.drafted = True
            self.clock.stop(mark, functools.partial(self.policy.costs.draft.add,
                                                    len(items) * (max(it.n for it in items) + 1)))
            self.clock.synced()  # the proposals are host lists: the drafter has synced
            return list(plans.values()), failed
        except Exception:  # find out which request it was: one by one
            log.warning("batched draft failed; retrying request by request", exc_info=True)
        for req, item, how in zip(drafting, items, sampling):
            try:
                plans[req.id] = (req, self.drafter.propose_scored([item], [how], candidates)[0])
                req.drafted = True
            except Exception as exc:
                del plans[req.id]
                failed.append((req, exc))
        return list(plans.values()), failed

    def _decode_batch(
        self, reqs: list[EngineRequest], verify_budget: int | None
    ) -> list[tuple[EngineRequest, StepOutput]]:
        t0, whole = time.perf_counter(), self.clock.start()
        proposed, failed = self._propose_all(reqs)
        done = [(req, self._error(req, exc)) for req, exc in failed]
        if not proposed:
            return done
        keep = self.policy.widths([prop.confidence for _, prop in proposed], verify_budget)
        tree_ok = [self._tree_ok(req) for req, _ in proposed]
        room = [self.memory.tree_room(req) for req, _ in proposed]
        caps = [c for c in (verify_budget, self._tree_tokens) if c is not None]
        plans = verify_plans(proposed, keep, self.policy, tree_ok, room, min(caps) if caps else None)
        rows = [TargetRow(tree.tokens, req.position, req.cache) for req, tree in plans]
        mark = self.clock.start()
        trees = [tree for _, tree in plans]
        chains = all(t.is_chain for t in trees)
        outs = self._forward_rows(rows, self.drafter is not None, False, None if chains else trees)
        self.clock.stop(mark, functools.partial(self.policy.costs.verify_table(not chains).add,  # trees: their own
                                                self._forward_tokens(rows)))
        whole = self.clock.stop(whole)
        dists = {req.id: prop.dist for req, prop in proposed}
        choices = step_choices(plans, outs, dists, self.spec_sampling)  # the step's one host sync
        self.clock.synced()
        now = time.perf_counter()
        committed = 0
        confidence = {req.id: prop.confidence for req, prop in proposed}
        for (req, tree), out, chosen in zip(plans, outs, choices):
            if isinstance(out, BaseException) or isinstance(chosen, BaseException):
                done.append((req, self._error(req, out if isinstance(out, BaseException) else chosen)))
                continue
            step = self._guarded(req, self._accept, tree, out, chosen)
            if step.error is None and tree.is_chain:  # a failed step accepted nothing: no calibration
                self.policy.calibrate(confidence[req.id][: tree.size - 1], step.num_accepted_tokens)
            elif step.error is None:
                self.policy.calibrate_tree(tree.expected_accepted(), step.num_accepted_tokens)
            done.append((req, step))
            req.stats.decode_time += now - t0
            committed += step.acceptance_length
        seconds = self.clock.seconds(whole)  # the step's device time (its wall time if not known yet)
        self.pace.observe(self.policy.costs, len(plans), committed, now - t0 if seconds is None else seconds,
                          speculative=self.drafter is not None)
        return done

    def _tree_ok(self, req: EngineRequest) -> bool:
        """A request may verify a tree: no logits processing, and its draws are the target's own (keyed)."""
        return req.processor is None and not rejects(self.spec_sampling, req.params)

    @staticmethod
    def _processed(req: EngineRequest, logits: torch.Tensor, proposals: list[int]) -> torch.Tensor:
        """The request's processed logits (`dflash_core.processors`): row i as plain decoding sees it after the
        output plus proposals[:i]. The raw logits stay for logprobs."""
        return logits if req.processor is None else req.processor.apply(logits, req.output, proposals)

    def _accept(self, req: EngineRequest, tree: DraftTree, out: TargetOutput, chosen: list[int]) -> StepOutput:
        """Keep the longest path of the draft that the target agrees with (a chain: its longest prefix), plus the
        target's own next token.

        Row i of the verify row picks (in `chosen`) the token at position p + 1 + depth(i) (a chain: p + 1 + i) with
        that position's uniform, exactly as plain decoding would, so the committed tokens are the target's own
        choices whatever the draft proposed.
        """
        p = req.position
        path = tree.path(chosen)
        accepted = len(path) - 1
        if tree.is_chain:
            self.target.crop(req.cache, p + accepted + 1)
        else:  # the accepted nodes' keys and values to positions p + 1 ..
            self.target.compact(req.cache, p, path)
        if req.draft_state is not None and out.features is not None:  # plain steps too: the draft's context
            feats = out.features[: accepted + 1] if tree.is_chain else out.features[path]
            self.drafter.extend_context(req.draft_state, feats)
        req.position = p + accepted + 1
        if req.spec is not None:
            self.policy.observe(req.spec, req.drafted, accepted + 1)

        req.stats.record_step(tree.size - 1, accepted)
        step = StepOutput(req.id, [], acceptance_length=accepted + 1, num_draft_tokens=tree.size - 1,
                          num_accepted_tokens=accepted, verify_width=tree.size)
        # The accepted draft tokens (equal to the target's choices), then the target's own token after them.
        logits = out.logits if tree.is_chain else out.logits[path]
        step = commit_tokens(req, [tree.tokens[i] for i in path[1:]] + [chosen[path[-1]]], logits, step)
        self.memory.register(req)
        return step
