"""The DFlash drafter: a DFlash draft model proposing blocks from the target's features."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_core.compile import StaticShapes, kv_bucket, timed_warm_up
from dflash_core.cpu_step.fused import FUSED_PREFILL_TOKENS, lay_out_for_fused_step
from dflash_core.cpu_step.fused_draft import FusedDraftStep, fused_draft_step
from dflash_core.draft import DFlashDraft, layer_region
from dflash_core.draft_cache import DraftKVCache, PagedBatch, PagedDraftCache
from dflash_core.draft_sampling import RowSampling
from dflash_core.kv.pool import blocks_for
from dflash_core.runners.base import Drafter, DraftRequest, DraftSampling, Proposal, TargetRunner
from dflash_core.runners.draft_state import DFlashState, paged_layout, table_blocks, table_rows
from dflash_core.transfer import HostToDevice, to_host

log = logging.getLogger("dflash.drafter")
CPU_PENDING_BLOCKS = 4  # on a CPU, blocks' worth of context rows a run of plain steps holds back before writing


@dataclass(frozen=True)
class Asked:
    """What a proposal call asks beyond the argmax tokens: rows drawn instead (`DraftSampling` per item, None for an
    argmax row) and `candidates`, each position's top candidates with their log-probabilities (a tree's material,
    `dflash_core.tree`). A whole compiled step answers only the argmax: other asks run the eager step."""

    sampling: Sequence[DraftSampling | None] = ()
    candidates: int = 0

    @property
    def argmax_only(self) -> bool:
        return not self.candidates and not any(self.sampling)


ARGMAX = Asked()


class DFlashDrafter(Drafter):
    """Drafter backed by a DFlash draft model sharing the target's embeddings and output head.

    With `max_slots` the drafts of all requests run as ONE batched forward over a paged context cache in the
    target's block-id space (`PagedDraftCache`): a request's draft rows live in the blocks of its block table, the
    same list as its target cache's (block i has storage in both models' tensors), so a prefix-cache hit holds the
    draft's rows too. Without it, one forward per request over a growing per-request cache. With a `window` N the
    draft sees only the context positions >= p - N (paged: by visibility, gathering only the blocks the window
    covers; per-request: a ring of N rows). A draft with a reduced vocabulary proposes target ids.

    Context features wait for the next proposal's forward, at most `block_size` rows of them (a verify commits no
    more): beyond that (a prefill chunk, a long run of plain steps) `extend_context` writes the older rows to the
    cache at once, one request and one chunk at a time, so a proposal never pads its batch to a long prompt. On a
    CPU a run of plain steps holds back up to `CPU_PENDING_BLOCKS` blocks' worth before writing (a write of a few
    rows costs mostly its per-call overhead there: a plain streak writes a quarter as often), and a proposal
    first writes what it holds beyond a block.

    With `static` (a batched drafter) a proposal whose batch, block width and new context rows fit the buckets
    runs a fixed-shape step (compiled: `dflash_core/compile.py`) over block tables padded to a key bucket (with a
    window: to the window's blocks, one key shape); shapes beyond the buckets run eagerly.
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
        pending_blocks: int | None = None,
    ) -> None:
        """`pending_blocks`: blocks' worth of context rows a request holds back before writing them on their own
        (the class docstring; None: `CPU_PENDING_BLOCKS` for a batched drafter on a CPU, else 1)."""
        if window is not None and window < 1:
            raise ValueError(f"draft window must be >= 1, got {window}")
        lay_out_for_fused_step(draft, target.device, target.dtype)  # before packing: the packs keep the layout
        draft.pack()  # one multiply for q/k/v and for gate/up (the projections' weights become views)
        self.draft = draft
        self.target = target
        self.block_size = int(block_size or draft.block_size)
        if pending_blocks is None:
            pending_blocks = CPU_PENDING_BLOCKS if torch.device(target.device).type == "cpu" and max_slots else 1
        self.pending_limit = self.block_size * pending_blocks  # context rows a request may hold back
        self.mask_token_id = draft.mask_token_id
        self.pages: PagedDraftCache | None = None
        self.max_slots = max_slots or None
        self.window = window
        self.kv_block = self.num_blocks = self.blocks_per_request = 0
        self.draft_bytes_per_block = 0
        self._h2d = HostToDevice(target.device)
        if max_slots:
            self.max_len = int(max_len)  # type: ignore[arg-type]
            self.kv_block, self.num_blocks = paged_layout(target, max_slots, self.max_len)
            self.blocks_per_request = blocks_for(self.max_len, self.kv_block)
            self.pages = PagedDraftCache(draft.cfg, self.num_blocks, self.kv_block, target.device, target.dtype)
            self.draft_bytes_per_block = self.pages.bytes_per_block
        self.prefix_cacheable = self.pages is not None  # a hit's draft rows are in its blocks
        self.static = static if self.pages is not None else None
        self._step: Any = None
        self._region: Any = None  # the compiled layer region (a static step compiled by layer)
        if self.static is not None:
            assert self.pages is not None
            for t in (*self.pages.k, *self.pages.v):
                torch._dynamo.mark_static_address(t)  # mutated in place by a CUDA graph
            # a DFlash 2 selector walks the block's positions in Python: it runs eagerly, around the layer region
            if self.static.by_layer(target.device) or draft.candidate_selector is not None:
                # the step runs eagerly around ONE compiled layer region that every layer calls with its own
                # weights and cache tensors: (layer, x, cos_q, sin_q, ctx, cos_c, sin_c, kc, vc, rows, table, mask)
                dims = {1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0, 1), 5: (0, 1), 6: (0, 1), 9: (0, 1), 10: (0, 1),
                        11: (0, 2, 3)}
                self._region = self.static.wrap(self._layer_region, target.device, dynamic=dims)
                self._step = self._static_forward
            else:
                dims = {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0, 1), 5: (0,), 6: (0,), 7: (0, 1)}
                self._step = self.static.wrap(self._static_forward, target.device, dynamic=dims)

        # float32 on a CPU: the eager batched proposal's forward as one C call (`dflash_core/cpu_step/`)
        self._fused = fused_draft_step(self) if self.pages is not None else None

    @property
    def fused_step(self) -> FusedDraftStep | None:
        """The fused CPU step that runs this drafter's proposals, or None."""
        return self._fused

    @property
    def compiled_whole_step(self) -> bool:
        return self._step is not None and self._region is None

    def replace_draft(self, draft: DFlashDraft) -> None:
        """Copy `draft`'s weights into the serving draft's tensors, in place: the compiled steps and recorded CUDA
        graphs read those tensors, so they serve the new weights unchanged. Only a draft of the same config (shapes,
        block size, target layers, mask token, RoPE) can be copied in; another one needs a restart."""
        why = self.draft.cfg.first_difference(draft.cfg)
        if why is not None:
            raise ValueError(f"the new draft differs from the serving one in {why}: a draft of another shape needs "
                             f"a restart")
        draft.pack()  # the same tensors as the serving draft's (packed projections included)
        # buffers first: the packed projections, whose views the projections' weights are, are copied once
        old = {**dict(self.draft.named_buffers()), **dict(self.draft.named_parameters())}
        new = {**dict(draft.named_buffers()), **dict(draft.named_parameters())}
        if old.keys() != new.keys() or any(old[k].shape != new[k].shape for k in old):
            raise ValueError("the new draft's tensors do not match the serving draft's")
        copied: set[int] = set()
        with torch.no_grad():
            for name, tensor in old.items():
                storage = tensor.untyped_storage().data_ptr()
                if storage in copied:
                    continue  # a view of a packed tensor copied already
                tensor.copy_(new[name])
                copied.add(storage)

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> DFlashState:
        if self.pages is None:  # a block table is the target's business here; a cached prefix cannot be had
            if cached:
                raise ValueError("the per-request draft cache is not paged: it cannot start from cached positions")
            return DFlashState(slot=slot, cache=DraftKVCache(len(self.draft.layers), self.window))
        if not 0 <= slot < int(self.max_slots or 0):
            raise ValueError(f"slot {slot} outside the drafter's {self.max_slots} slots")
        if blocks is None:
            per = self.blocks_per_request
            first = 1 + slot * per
            if first + per > self.num_blocks:
                raise ValueError(f"slot {slot}'s own blocks {first}..{first + per - 1} lie outside the "
                                 f"{self.num_blocks} blocks: give the request's block table")
            blocks = list(range(first, first + per))
        if not 0 <= cached <= len(blocks) * self.kv_block:
            raise ValueError(f"cached {cached} positions outside the block table's {len(blocks)} blocks")
        return DFlashState(slot=slot, blocks=blocks, written=cached)

    def context_written(self, state: DFlashState) -> int:
        """Positions whose context rows are in the paged cache (0 for a per-request cache: never shared)."""
        return state.written if self.pages is not None else 0

    def extend_context(self, state: DFlashState, features: torch.Tensor) -> None:
        state.pending.append(features)
        state.pending_rows += features.shape[0]
        self._write_beyond(state, self.pending_limit)

    def catch_up(self, states: Sequence[DFlashState]) -> None:
        if self.pages is not None:
            for st in states:
                self._write_beyond(st, self.block_size)

    def _write_beyond(self, state: DFlashState, limit: int) -> None:
        """Past `limit` pending rows, write the older ones: the next proposal keeps 1..block_size rows (its context
        bucket)."""
        rows = state.pending_rows
        if rows > limit:
            self._write_context(state, rows - (rows - 1) // self.block_size * self.block_size)

    @torch.inference_mode()
    def _write_context(self, state: DFlashState, keep: int) -> None:
        """Write all but the last `keep` pending rows to the request's draft cache (their own forward, bounded by
        the chunk that brought them); on failure nothing is consumed, as for a proposal."""
        device, dtype = self.target.device, self.target.dtype
        feats = torch.cat(state.pending, dim=0)
        n, start = feats.shape[0] - keep, state.written
        # the long-RoPE switch as for a proposal at the next position (the smallest block that will see them)
        last = start + feats.shape[0]
        if self.pages is not None:  # every row: the pages hold them all, and a prefix hit may need them
            rows = table_rows(state.blocks, self.kv_block, start, start + n)
            if self._fused is not None and n <= FUSED_PREFILL_TOKENS:  # one C call (a long chunk: MKL's products)
                self._fused.write_context(feats[:n], range(start, start + n), rows)
            else:
                rows_t, ctx_pos, last_t = self._h2d.send([rows], [list(range(start, start + n))], [last])
                self.draft.write_context(feats[None, :n].to(dtype), ctx_pos, self.pages.batch(rows_t, None),
                                         last_t)
        else:
            cache = state.cache
            assert cache is not None
            before = cache.length
            # rows older than the window as of the last pending one: no query will see them
            skip = 0 if self.window is None else n - min(n, max(0, self.window - keep))
            try:
                cache.skip(skip)
                if n > skip:
                    pos = torch.arange(start + skip, start + n, device=device)[None]
                    self.draft.write_context(feats[None, skip:n].to(dtype), pos, cache,
                                             torch.tensor([last], device=device))
            except BaseException:
                cache.length = before
                raise
        state.pending, state.pending_rows = [feats[n:].clone()], keep
        state.written = start + n

    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        return [p.tokens for p in self.propose_scored(items)]

    @torch.inference_mode()
    def propose_scored(
        self, items: Sequence[DraftRequest], sampling: Sequence[DraftSampling | None] | None = None,
        candidates: int = 0,
    ) -> list[Proposal]:
        """Argmax proposals for each (state, last token, its position, how many), with their draft probabilities;
        an item with a `DraftSampling` gets its tokens drawn (`DFlashDraft.sample`); `candidates`: each position's
        top candidates too (a DFlash draft's; a DFlash 2 draft reports none).

        Nothing is consumed unless the whole call succeeds: the pending context features stay pending and a
        per-request cache keeps its length, so a failed call can be retried (the engine retries one by one; the
        paged cache is written by position, so a retry rewrites the same rows).
        """
        asked = Asked(list(sampling or [None] * len(items)), candidates)
        if self.pages is None:  # per-request caches: one forward each
            return [self._propose_single(item, Asked([how], candidates)) for item, how in zip(items, asked.sampling)]
        self.catch_up([st for st, *_ in items])  # (the engine has, untimed: then nothing is left to write here)
        pending = [torch.cat(st.pending, dim=0) if st.pending else None for st, *_ in items]
        n_ctx = max((0 if f is None else f.shape[0]) for f in pending)
        proposals = None
        # a whole compiled step chooses inside its graph: sampled rows draft through the eager step
        if self._step is not None and n_ctx and (self._region is not None or asked.argmax_only):
            proposals = self._propose_static(items, pending, n_ctx, asked)
        if proposals is None:
            proposals = self._propose_paged(items, pending, n_ctx, asked)
        for st, _, p, _ in items:  # only now is the context in the draft cache
            st.pending.clear()
            st.pending_rows, st.written = 0, p
        return proposals

    def _draft_argmax(
        self, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor | None, ctx_pos: torch.Tensor | None,
        cache: DraftKVCache | PagedBatch, lens: dict[str, torch.Tensor], by_layer: bool = False,
        asked: Asked = ARGMAX,
    ) -> tuple[Any, ...]:
        """Target ids and probabilities [b, w] of the draft's argmax at each position of the block; column 0 (the
        block's first token, already known) is not a proposal and `_read_back` skips it: a [b, w - 1] output of
        a compiled step would specialise w = 2 (dimensions of size 1 are), a graph of its own. `by_layer`: each
        layer through the compiled layer region (a static step's paged batch). What else is `asked` comes as a
        third output, a dict: the rows with a `sampling[r]` get drawn tokens instead, and "dist" holds the
        distributions [drawn rows, w - 1, V] their proposals were drawn from, in row order; "top_ids" / "top_logp"
        [b, w, candidates] each position's candidates."""
        emb = self.draft.embed(block, self.target.embed_weight)
        if by_layer:
            assert isinstance(cache, PagedBatch) and ctx is not None and ctx_pos is not None
            hidden = self.draft.forward_paged_by_layer(emb, block_pos, ctx, ctx_pos, cache, self._region, **lens)
        else:
            hidden = self.draft(emb, block_pos, ctx, ctx_pos, cache, **lens)
        return self._choose(hidden, block, block_pos, asked)

    def _choose(self, hidden: torch.Tensor, block: torch.Tensor, block_pos: torch.Tensor,
                asked: Asked) -> tuple[Any, ...]:
        """`_draft_argmax`'s outputs from the block rows' final-normed hidden states [b, w, H]."""
        best, prob, *top = self.draft.choose(hidden, block[:, 0], self.target.lm_head_weight, asked.candidates)
        if asked.argmax_only:
            return best, prob
        extras = dict(zip(("top_ids", "top_logp"), top))
        drawn = [r for r, how in enumerate(asked.sampling) if how is not None]
        if drawn:
            at = torch.tensor(drawn, device=best.device)
            rows = RowSampling([asked.sampling[r] for r in drawn], best.device)  # type: ignore[misc]
            tokens, conf, extras["dist"] = self.draft.sample(hidden[at], block[at, 0], self.target.lm_head_weight,
                                                             rows, block_pos[at])
            best, prob = best.index_copy(0, at, tokens.to(best.dtype)), prob.index_copy(0, at, conf.to(prob.dtype))
        return best, prob, extras

    @staticmethod
    def _read_back(best: torch.Tensor, prob: torch.Tensor, extras: dict[str, torch.Tensor] | None = None, *,
                   items: Sequence[DraftRequest], asked: Asked = ARGMAX) -> list[Proposal]:
        """The proposals on the host (one transfer); a sampled row's distributions stay on the device."""
        extras = extras or {}
        parts = [best.to(torch.float64), prob.to(torch.float64)]
        if "top_ids" in extras:  # the candidates ride in the same transfer: [b, w] columns after the two
            parts = [p[:, :, None] for p in parts] + [extras["top_ids"].to(torch.float64), extras["top_logp"].double()]
        host = to_host(torch.cat(parts, dim=-1) if "top_ids" in extras else torch.stack(parts))  # one transfer
        drawn = {r: j for j, r in enumerate(r for r, how in enumerate(asked.sampling) if how is not None)}
        out = []
        for r, (*_, n) in enumerate(items):
            dist = extras["dist"][drawn[r], :n] if r in drawn else None
            if "top_ids" not in extras:
                out.append(Proposal([int(t) for t in host[0][r][1 : n + 1]], host[1][r][1 : n + 1], dist))
                continue
            rows, k = host[r][1 : n + 1], extras["top_ids"].shape[-1]  # fewer than asked in a tiny vocabulary
            out.append(Proposal([int(x[0]) for x in rows], [x[1] for x in rows], dist,
                                ([[int(t) for t in x[2 : 2 + k]] for x in rows], [x[2 + k :] for x in rows])))
        return out

    def _propose_single(self, item: DraftRequest, asked: Asked = ARGMAX) -> Proposal:
        """One request over its per-request cache (appended; rolled back on failure)."""
        st, last, p, n = item
        device, dtype = self.target.device, self.target.dtype
        cache = st.cache
        assert cache is not None
        f = torch.cat(st.pending, dim=0) if st.pending else None
        skipped = 0  # context rows older than the window: never seen, so not computed
        if self.window is not None and f is not None:
            skipped, f = max(0, f.shape[0] - self.window), f[-self.window :]
        ctx = ctx_pos = None
        if f is not None and f.shape[0]:
            ctx, ctx_pos = f[None].to(dtype), torch.arange(p - f.shape[0], p, device=device)[None]
        block = torch.full((1, n + 1), self.mask_token_id, device=device, dtype=torch.long)
        block[0, 0] = last
        block_pos = torch.arange(p, p + n + 1, device=device)[None]
        rollback = cache.length
        try:
            cache.skip(skipped)
            chosen = self._draft_argmax(block, block_pos, ctx, ctx_pos, cache, {}, asked=asked)
            proposal = self._read_back(*chosen, items=[item], asked=asked)[0]
        except BaseException:
            cache.length = rollback
            raise
        st.pending.clear()
        st.pending_rows, st.written = 0, p
        return proposal

    def _padded_inputs(
        self, items: Sequence[DraftRequest], pending: list[torch.Tensor | None], bb: int, wb: int, cb: int
    ) -> tuple[torch.Tensor, list[list[Any]]]:
        """Context features [bb, cb, F] and the integer inputs (block, block_pos, ctx_pos, ctx_rows, block_len) of
        the items padded to bb rows, blocks of wb and cb context rows: padding rows write the null block's row 0
        and see only their block."""
        feat_dim = next(f for f in pending if f is not None).shape[1] if cb else 0
        ctx = torch.zeros(bb, cb, feat_dim, device=self.target.device, dtype=self.target.dtype)
        ctx_pos, rows = [[0] * cb for _ in range(bb)], [[0] * cb for _ in range(bb)]
        block = [[self.mask_token_id] * wb for _ in range(bb)]
        block_pos, block_len = [list(range(wb)) for _ in range(bb)], [1] * bb
        for r, ((st, last, p, n), f) in enumerate(zip(items, pending)):
            if f is not None and f.shape[0]:
                c = f.shape[0]
                ctx[r, :c] = f.to(ctx.dtype)
                ctx_pos[r][:c] = range(p - c, p)
                rows[r][:c] = table_rows(st.blocks, self.kv_block, p - c, p)
            block[r][0] = last
            block_pos[r] = list(range(p, p + wb))
            block_len[r] = n + 1
        return ctx, [block, block_pos, ctx_pos, rows, block_len]

    def _propose_paged(
        self, items: Sequence[DraftRequest], pending: list[torch.Tensor | None], n_ctx: int,
        asked: Asked = ARGMAX,
    ) -> list[Proposal]:
        """The eager batched proposal: each row gathers the blocks its keys (its window's) lie in."""
        if self._fused is not None:
            hidden, block, block_pos = self._fused.hidden(items, pending)
            return self._read_back(*self._choose(hidden, block, block_pos, asked), items=items, asked=asked)
        kb, b = self.kv_block, len(items)
        ctx, ints = self._padded_inputs(items, pending, b, max(n for *_, n in items) + 1, n_ctx)
        first = [0] * b  # each row's first gathered block
        if self.window is not None:
            first = [max(0, p - self.window) // kb for _, _, p, _ in items]
        m = max(1, max(blocks_for(p, kb) - f for (_, _, p, _), f in zip(items, first)))
        tables = [table_blocks(st.blocks, f, m) for (st, *_), f in zip(items, first)]
        block, block_pos, ctx_pos, rows, block_len, table, base = self._h2d.send(*ints, tables, first)
        lens = dict(ctx_len=block_pos[:, 0], block_len=block_len)
        if self.window is not None:
            lens["ctx_start"] = block_pos[:, 0] - self.window
        cache = self.pages.batch(rows if n_ctx else None, table, base if self.window is not None else None)
        chosen = self._draft_argmax(block, block_pos, ctx if n_ctx else None, ctx_pos if n_ctx else None, cache, lens,
                                    asked=asked)
        return self._read_back(*chosen, items=items, asked=asked)

    # ---- the static step ----
    def _static_forward(
        self, block: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
        ctx_rows: torch.Tensor, block_len: torch.Tensor, base: torch.Tensor, table: torch.Tensor,
        asked: Asked = ARGMAX,
    ) -> tuple[torch.Tensor, ...]:
        """The padded proposal: block ids / positions [b, w], new context features [b, c, F] at ctx_pos [b, c]
        written to ctx_rows [b, c], block_len [b], block tables [b, M] (M blocks: the key bucket, or the window's)
        whose first column is block `base` [b] of the request. Target ids and probabilities [b, w] (column 0: no
        proposal). A row's context length is its block's first position. `asked`: only when the step runs eagerly
        around a compiled layer region (a whole compiled step chooses inside its graph)."""
        assert self.pages is not None
        lens = dict(ctx_len=block_pos[:, 0], block_len=block_len)
        if self.window is not None:
            lens["ctx_start"] = block_pos[:, 0] - self.window
        cache = self.pages.batch(ctx_rows, table, base if self.window is not None else None)
        return self._draft_argmax(block, block_pos, ctx, ctx_pos, cache, lens, by_layer=self._region is not None,
                                  asked=asked)

    def _layer_region(
        self, layer: torch.nn.Module, x: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, ctx: torch.Tensor,
        cos_c: torch.Tensor, sin_c: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
        table: torch.Tensor, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One draft layer of the padded proposal (`layer_region`): no layer index, no Python ints of the step's
        shape, so one graph serves every layer, batch, width and key bucket."""
        return layer_region(layer, x, cos_q, sin_q, ctx, cos_c, sin_c, kc, vc, rows, table, mask, self.kv_block)

    def _propose_static(
        self, items: Sequence[DraftRequest], pending: list[torch.Tensor | None], n_ctx: int,
        asked: Asked = ARGMAX,
    ) -> list[Proposal] | None:
        """The items through the static step, or None when they fit no bucket (the eager forward runs them)."""
        assert self.static is not None
        bb = self.static.batch_bucket(len(items))
        wb = self.static.width_bucket(max(n for *_, n in items) + 1)
        cb = self.static.width_bucket(n_ctx)
        if bb is None or wb is None or cb is None:
            return None
        ctx, ints = self._padded_inputs(items, pending, bb, wb, cb)
        first = [0] * bb  # each row's first gathered block (padding rows: 0)
        if self.window is None:
            m = self._key_blocks(max(p for _, _, p, _ in items))
        else:
            m = self._key_blocks(0)
            first[: len(items)] = [max(0, p - self.window) // self.kv_block for _, _, p, _ in items]
        tables = [table_blocks(st.blocks, f, m) for (st, *_), f in zip(items, first)] + [[0] * m] * (bb - len(items))
        self.static.calls[(bb, wb)] += 1
        return self._read_back(*self._run_static(ctx, [*ints, first], tables, asked), items=items, asked=asked)

    def _key_blocks(self, top: int) -> int:
        """Blocks a static step gathers per row: those of the key bucket for context lengths up to `top`, or with
        a window N, (N - 1) // kv_block + 2 whatever `top` (positions p - N .. p - 1 span no more blocks)."""
        if self.window is not None:
            return (self.window - 1) // self.kv_block + 2
        return blocks_for(kv_bucket(top, self.blocks_per_request * self.kv_block), self.kv_block)

    def _run_static(
        self, ctx: torch.Tensor, ints: list[list[Any]], tables: list[list[int]],
        asked: Asked = ARGMAX,
    ) -> tuple[torch.Tensor, ...]:
        assert self._step is not None
        # one host-to-device copy; the tables last, so that no other input's offset in it depends on the key bucket
        block, block_pos, ctx_pos, rows, block_len, base, table = self._h2d.send(*ints, tables)
        if not asked.argmax_only:  # only around a layer region (`propose_scored`): the step is not one graph
            return self._step(block, block_pos, ctx, ctx_pos, rows, block_len, base, table, asked)
        return self._step(block, block_pos, ctx, ctx_pos, rows, block_len, base, table)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile the proposal step, and on CUDA record the graph of every (batch, width, context width) bucket at
        every key bucket (`StaticShapes.warm_up_plan`); padding only (the null block), so no request's context
        changes.
        Returns the seconds it took."""
        if self.static is None:
            return 0.0
        st = self.static
        feat_dim = len(self.draft.cfg.target_layer_ids) * self.draft.cfg.hidden_size
        dev, dtype = self.target.device, self.target.dtype
        plan = st.warm_up_plan(dev, self.blocks_per_request * self.kv_block)
        key_blocks = sorted({self._key_blocks(kv) for kv in plan.keys})  # a window: one

        def run(bb: int, wb: int, cb: int, m: int) -> None:
            ctx = torch.zeros(bb, cb, feat_dim, device=dev, dtype=dtype)
            ints = [[[self.mask_token_id] * wb] * bb, [list(range(wb))] * bb, [[0] * cb] * bb, [[0] * cb] * bb,
                    [1] * bb, [0] * bb]
            self._run_static(ctx, ints, [[0] * m] * bb)

        widths = [w for w in plan.widths if w >= 2]  # a block is the last token and at least one proposal
        runs = [(lambda bb=bb, wb=wb, cb=cb, m=m: run(bb, wb, cb, m)) for bb in plan.batch_sizes for wb in widths
                for cb in plan.widths for m in key_blocks]
        seconds = timed_warm_up("draft", runs, log, plan.calls)
        st.calls.clear()
        return seconds
