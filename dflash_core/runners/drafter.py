"""The DFlash drafter: a DFlash draft model proposing blocks from the target's features."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash_core.compile import StaticShapes, kv_bucket, timed_warm_up
from dflash_core.draft import DFlashDraft, DraftKVCache, SlotDraftCache
from dflash_core.runners.base import Drafter, DraftRequest, Proposal, TargetRunner

log = logging.getLogger("dflash.drafter")


@dataclass
class _DFlashState:
    slot: int  # the request's slot: its row of the shared slot cache (batched drafter)
    cache: DraftKVCache | None = None  # per-request cache (unbatched drafter)
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet in the draft cache
    written: int = 0  # positions before the pending ones: in the draft cache (or skipped, older than a window)


class DFlashDrafter(Drafter):
    """Drafter backed by a DFlash draft model sharing the target's embeddings and output head.

    With `max_slots` the drafts of all requests run as ONE batched forward over a slot KV cache whose row is the
    request's slot (the engine's SlotPool hands it out with the target's); without it, one forward per request
    over a growing per-request cache. With a `window` N the draft sees only the last N context positions and
    either cache holds at most N of them per request. A draft with a reduced vocabulary proposes target ids.

    Context features wait for the next proposal's forward, at most `block_size` rows of them (a verify commits no
    more): beyond that (a prefill chunk, a long run of plain steps) `extend_context` writes the older rows to the
    cache at once, one request and one chunk at a time, so a proposal never pads its batch to a long prompt.

    With `static` (a batched drafter without a window) a proposal whose batch, block width and new context rows
    fit the buckets runs a fixed-shape step (compiled: `dflash_core/compile.py`); shapes beyond the buckets run
    eagerly.
    """

    def __init__(
        self,
        draft: DFlashDraft,
        target: TargetRunner,
        block_size: int | None = None,
        max_slots: int | None = None,
        max_len: int | None = None,
        window: int | None = None,
        static: StaticShapes | None = None,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"draft window must be >= 1, got {window}")
        self.draft = draft
        self.target = target
        self.block_size = int(block_size or draft.block_size)
        self.mask_token_id = draft.mask_token_id
        self.slots: SlotDraftCache | None = None
        self.max_slots = max_slots or None
        self.window = window
        if max_slots:
            self.slots = SlotDraftCache(draft.cfg, max_slots, int(max_len), target.device, target.dtype, window)
        # the static step needs the slot cache's fixed columns (a window's ring runs eagerly)
        self.static = static if self.slots is not None and self.slots.window is None else None
        self._step = None
        if self.static is not None:
            assert self.slots is not None
            for t in (*self.slots.k, *self.slots.v):
                torch._dynamo.mark_static_address(t)  # mutated in place by a CUDA graph
            dims = {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0,), 5: (0,), 6: (0,), 7: (0,)}
            self._step = self.static.wrap(self._static_forward, target.device, dynamic=dims)

    def new_state(self, slot: int, prompt_token_ids: list[int]) -> _DFlashState:
        if self.slots is not None:
            if not 0 <= slot < self.slots.max_slots:
                raise ValueError(f"slot {slot} outside the draft cache's {self.slots.max_slots} slots")
            return _DFlashState(slot=slot)
        return _DFlashState(slot=slot, cache=DraftKVCache(len(self.draft.layers), self.window))

    def extend_context(self, state: _DFlashState, features: torch.Tensor) -> None:
        state.pending.append(features)
        rows = sum(f.shape[0] for f in state.pending)
        if rows > self.block_size:
            # the next proposal keeps 1..block_size rows (its context bucket); the older ones are written now
            self._write_context(state, rows - (rows - 1) // self.block_size * self.block_size)

    @torch.inference_mode()
    def _write_context(self, state: _DFlashState, keep: int) -> None:
        """Write all but the last `keep` pending rows to the request's draft cache (their own forward, bounded by
        the chunk that brought them); on failure nothing is consumed, as for a proposal."""
        device, dtype = self.target.device, self.target.dtype
        feats = torch.cat(state.pending, dim=0)
        n, start = feats.shape[0] - keep, state.written
        skip = 0  # rows older than the window as of the last pending one: no query will see them
        if self.window is not None:
            skip = n - min(n, max(0, self.window - keep))
        ctx_pos = torch.arange(start + skip, start + n, device=device)[None]
        # the long-RoPE switch as for a proposal at the next position (the smallest block that will see them)
        last = torch.tensor([start + feats.shape[0]], device=device)
        if self.slots is not None:
            cache, before = self.slots.batch([state.slot], ctx_pos, 0), None
        else:
            cache = state.cache
            before = cache.length
        try:
            if before is not None and skip:
                cache.skip(skip)
            if n > skip:
                self.draft.write_context(feats[None, skip:n].to(dtype), ctx_pos, cache, last)
        except BaseException:
            if before is not None:
                cache.length = before
            raise
        state.pending = [feats[n:].clone()]
        state.written = start + n

    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        return [p.tokens for p in self.propose_scored(items)]

    @torch.inference_mode()
    def propose_scored(self, items: Sequence[DraftRequest]) -> list[Proposal]:
        """Argmax proposals for each (state, last token, its position, how many), with their draft probabilities.

        Nothing is consumed unless the whole call succeeds: the pending context features stay pending and a
        per-request cache keeps its length, so a failed call can be retried (the engine retries one by one).
        """
        device, dtype = self.target.device, self.target.dtype
        if self.slots is None and len(items) > 1:  # per-request caches: one forward each
            return [self.propose_scored([item])[0] for item in items]
        b = len(items)
        width = max(n for *_, n in items) + 1
        pending = [torch.cat(st.pending, dim=0) if st.pending else None for st, *_ in items]
        skipped = 0  # context rows older than the window: never seen, so not computed (one request when per-request)
        if self.window is not None:
            skipped = sum(max(0, f.shape[0] - self.window) for f in pending if f is not None)
            pending = [None if f is None else f[-self.window :] for f in pending]
        n_ctx = max((0 if f is None else f.shape[0]) for f in pending)
        if self._step is not None and n_ctx:
            proposals = self._propose_static(items, pending, n_ctx)
            if proposals is not None:
                for st, _, p, _ in items:
                    st.pending.clear()
                    st.written = p
                return proposals
        ctx = ctx_pos = None
        positions = torch.tensor([p for _, _, p, _ in items], device=device)
        if n_ctx:
            feat_dim = next(f for f in pending if f is not None).shape[1]
            ctx = torch.zeros(b, n_ctx, feat_dim, device=device, dtype=dtype)
            # padding rows go to the slot cache's scratch column, which no query sees
            scratch = self.slots.pad_position if self.slots is not None else 0
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
            if self.window is not None:
                lens["ctx_start"] = positions - self.window
        else:
            cache, lens = items[0][0].cache, {}
        # The slot cache is written by position (a retry rewrites the same rows); a per-request cache appends.
        rollback = cache.length if self.slots is None else None
        try:
            if rollback is not None and skipped:
                cache.skip(skipped)
            emb = self.draft.embed(block, self.target.embed_weight)
            hidden = self.draft(emb, block_pos, ctx, ctx_pos, cache, **lens)
            logits = self.draft.logits(hidden[:, 1:], self.target.lm_head_weight)
            prob, best_ids = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            # one transfer for tokens and probabilities together
            both = torch.stack([self.draft.target_ids(best_ids).to(torch.float64), prob.to(torch.float64)]).tolist()
            best, probs = [[int(t) for t in row] for row in both[0]], both[1]
        except BaseException:
            if rollback is not None:
                cache.length = rollback
            raise
        for st, _, p, _ in items:  # only now is the context in the draft cache
            st.pending.clear()
            st.written = p
        return [Proposal(row[:n], pr[:n]) for row, pr, (*_, n) in zip(best, probs, items)]

    # ---- the static step ----
    def _static_forward(
        self, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
        slots: torch.Tensor, ctx_len: torch.Tensor, block_len: torch.Tensor, key_pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded proposal: block ids / positions [b, w], new context features [b, c, F] at ctx_pos [b, c],
        slots, ctx_len, block_len [b], key_pos [L] (the key bucket). Target ids and probabilities [b, w - 1]."""
        assert self.slots is not None
        cache = self.slots.batch(slots, ctx_pos, key_pos.shape[0])
        emb = self.draft.embed(block, self.target.embed_weight)
        hidden = self.draft(emb, block_pos, ctx, ctx_pos, cache, ctx_len=ctx_len, block_len=block_len)
        logits = self.draft.logits(hidden[:, 1:], self.target.lm_head_weight)
        prob, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return self.draft.target_ids(best), prob

    def _propose_static(
        self, items: Sequence[DraftRequest], pending: list[torch.Tensor | None], n_ctx: int
    ) -> list[Proposal] | None:
        """The items through the static step, or None when they fit no bucket (the eager forward runs them)."""
        assert self.static is not None and self.slots is not None
        bb = self.static.batch_bucket(len(items))
        wb = self.static.width_bucket(max(n for *_, n in items) + 1)
        cb = self.static.width_bucket(n_ctx)
        if bb is None or wb is None or cb is None:
            return None
        device, dtype = self.target.device, self.target.dtype
        feat_dim = next(f for f in pending if f is not None).shape[1]
        ctx = torch.zeros(bb, cb, feat_dim, device=device, dtype=dtype)
        pad = self.slots.pad_position  # padding context rows go to the scratch column, which no query sees
        ctx_pos = [[pad] * cb for _ in range(bb)]
        block = [[self.mask_token_id] * wb for _ in range(bb)]
        block_pos = [list(range(wb)) for _ in range(bb)]
        slots = [items[0][0].slot] * bb  # padding rows write only the scratch column of the first row's slot
        ctx_len, block_len = [0] * bb, [1] * bb
        for r, ((st, last, p, n), f) in enumerate(zip(items, pending)):
            if f is not None:
                c = f.shape[0]
                ctx[r, :c] = f.to(dtype)
                ctx_pos[r][:c] = range(p - c, p)
            block[r][0] = last
            block_pos[r] = list(range(p, p + wb))
            slots[r], ctx_len[r], block_len[r] = st.slot, p, n + 1
        top = max(p for _, _, p, _ in items)
        self.static.calls[(bb, wb)] += 1
        best, prob = self._run_static(block, block_pos, ctx, ctx_pos, slots, ctx_len, block_len, top)
        both = torch.stack([best.to(torch.float64), prob.to(torch.float64)]).tolist()  # one transfer
        return [Proposal([int(t) for t in both[0][r][:n]], both[1][r][:n]) for r, (*_, n) in enumerate(items)]

    def _run_static(
        self, block: list[list[int]], block_pos: list[list[int]], ctx: torch.Tensor, ctx_pos: list[list[int]],
        slots: list[int], ctx_len: list[int], block_len: list[int], top: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._step is not None and self.slots is not None
        dev = self.target.device
        # context keys are at positions < top <= max_len: a key bucket never spans the scratch column, so never the
        # cache's columns (a whole-columns slice, contiguous, would be a graph of its own)
        key_pos = torch.arange(kv_bucket(top, self.slots.scratch), device=dev)
        t = [torch.tensor(x, device=dev) for x in (block, block_pos)]
        rest = [torch.tensor(x, device=dev) for x in (ctx_pos, slots, ctx_len, block_len)]
        return self._step(t[0], t[1], ctx, *rest, key_pos)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile every (batch, width, context width) bucket, and on CUDA record the graph of each at every key
        bucket (`StaticShapes.warm_up_keys`); padding only (the scratch column), so no slot's context changes.
        Returns the seconds it took."""
        if self.static is None or self.slots is None:
            return 0.0
        st, pad = self.static, self.slots.pad_position
        feat_dim = len(self.draft.cfg.target_layer_ids) * self.draft.cfg.hidden_size
        dev, dtype = self.target.device, self.target.dtype

        keys, calls = st.warm_up_keys(dev, self.slots.scratch)

        def run(bb: int, wb: int, cb: int, kv: int) -> None:
            ctx = torch.zeros(bb, cb, feat_dim, device=dev, dtype=dtype)
            self._run_static([[self.mask_token_id] * wb] * bb, [list(range(wb))] * bb, ctx, [[pad] * cb] * bb,
                             [0] * bb, [0] * bb, [1] * bb, kv)

        widths = [w for w in st.widths if w >= 2]  # a block is the last token and at least one proposal
        runs = [(lambda bb=bb, wb=wb, cb=cb, kv=kv: run(bb, wb, cb, kv)) for bb in st.batch_sizes for wb in widths
                for cb in st.widths for kv in keys]
        seconds = timed_warm_up("draft", runs, log, calls)
        st.calls.clear()
        return seconds
