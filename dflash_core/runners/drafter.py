"""The DFlash drafter: a DFlash draft model proposing blocks from the target's features."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash_core.draft import DFlashDraft, DraftKVCache, SlotDraftCache
from dflash_core.runners.base import Drafter, DraftRequest, TargetRunner


@dataclass
class _DFlashState:
    slot: int  # the request's slot: its row of the shared slot cache (batched drafter)
    cache: DraftKVCache | None = None  # per-request cache (unbatched drafter)
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not yet in the draft cache


class DFlashDrafter(Drafter):
    """Drafter backed by a DFlash draft model sharing the target's embeddings and output head.

    With `max_slots` the drafts of all requests run as ONE batched forward over a slot KV cache whose row is the
    request's slot (the engine's SlotPool hands it out with the target's); without it, one forward per request
    over a growing per-request cache. With a `window` N the draft sees only the last N context positions and
    either cache holds at most N of them per request. A draft with a reduced vocabulary proposes target ids.
    """

    def __init__(
        self,
        draft: DFlashDraft,
        target: TargetRunner,
        block_size: int | None = None,
        max_slots: int | None = None,
        max_len: int | None = None,
        window: int | None = None,
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

    def new_state(self, slot: int, prompt_token_ids: list[int]) -> _DFlashState:
        if self.slots is not None:
            if not 0 <= slot < self.slots.max_slots:
                raise ValueError(f"slot {slot} outside the draft cache's {self.slots.max_slots} slots")
            return _DFlashState(slot=slot)
        return _DFlashState(slot=slot, cache=DraftKVCache(len(self.draft.layers), self.window))

    def extend_context(self, state: _DFlashState, features: torch.Tensor) -> None:
        state.pending.append(features)

    @torch.inference_mode()
    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        """Argmax proposals for each (state, last token, its position, how many).

        Nothing is consumed unless the whole call succeeds: the pending context features stay pending and a
        per-request cache keeps its length, so a failed call can be retried (the engine retries one by one).
        """
        device, dtype = self.target.device, self.target.dtype
        if self.slots is None and len(items) > 1:  # per-request caches: one forward each
            return [self.propose_batch([item])[0] for item in items]
        b = len(items)
        width = max(n for *_, n in items) + 1
        pending = [torch.cat(st.pending, dim=0) if st.pending else None for st, *_ in items]
        skipped = 0  # context rows older than the window: never seen, so not computed (one request when per-request)
        if self.window is not None:
            skipped = sum(max(0, f.shape[0] - self.window) for f in pending if f is not None)
            pending = [None if f is None else f[-self.window :] for f in pending]
        n_ctx = max((0 if f is None else f.shape[0]) for f in pending)
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
            best = self.draft.target_ids(logits.argmax(dim=-1)).tolist()
        except BaseException:
            if rollback is not None:
                cache.length = rollback
            raise
        for st, *_ in items:  # only now is the context in the draft cache
            st.pending.clear()
        return [row[:n] for row, (*_, n) in zip(best, items)]
