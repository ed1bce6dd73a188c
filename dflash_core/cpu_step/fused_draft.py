"""The DFlash draft's forward on a CPU as ONE call into `fused_step.c`: `FusedDraftStep`.

Serves the batched drafter's eager proposal (`DFlashDrafter`, paged context cache, no compiled step, no window)
where the draft runs float32 on a CPU and is a DFlash draft (not DFlash 2) whose layers attend bidirectionally
with no sliding window and whose RoPE has no long-context switch. One call writes the requests' new context rows
(the target's features: `fc`, its norm, each layer's keys and values) into the drafter's own paged cache and runs
the blocks over their context and themselves, returning the final-normed hidden states; the drafter's head and
choice (argmax, sampled rows, a tree's candidates) run on them as before; `write_context` writes context rows
alone, as the same call with no block (the rows a run of plain steps held back, a prefill chunk's up to
`FUSED_PREFILL_TOKENS`). `DFLASH_CPU_STEP` picks it as it picks the target's (`dflash_core/cpu_step/fused.py`).
"""

from __future__ import annotations

import ctypes
import logging
from array import array
from collections.abc import Sequence
from typing import Protocol

import torch

from dflash_core.cpu_step.abi import DraftBatch, LayerTensors, ModelView, Scratch, float_ptr, int_ptr
from dflash_core.cpu_step.fused import cpu_step_mode, fused_or_none, threads_reason
from dflash_core.draft import DFlashDraft
from dflash_core.draft_cache import PagedDraftCache
from dflash_core.kv.pool import blocks_for
from dflash_core.overlap import run_held
from dflash_core.runners.base import DraftRequest, TargetRunner
from dflash_core.runners.draft_state import table_rows
from dflash_core.weight_layout import is_input_major

__all__ = ["FusedDraftStep", "FusedDrafter", "fused_draft_step", "unsupported_draft"]

log = logging.getLogger("dflash.cpu_step")


class FusedDrafter(Protocol):
    """What the fused draft step reads from a drafter (`DFlashDrafter` is one)."""

    draft: DFlashDraft
    target: TargetRunner  # its embedding table, device and dtype
    pages: PagedDraftCache | None  # the paged context cache (None: per-request caches)
    static: object | None  # compiled static shapes, or None
    window: int | None
    max_len: int
    block_size: int
    kv_block: int
    mask_token_id: int


def unsupported_draft(drafter: FusedDrafter) -> str | None:
    """Why the fused draft step cannot run `drafter`'s proposals, or None when it can."""
    draft, device, dtype = drafter.draft, drafter.target.device, drafter.target.dtype
    if device.type != "cpu" or dtype != torch.float32:
        return f"it runs float32 on a CPU (the draft is {dtype} on {device.type})"
    if drafter.pages is None or drafter.static is not None or drafter.window is not None:
        return "a per-request, compiled or windowed drafter"
    if type(draft) is not DFlashDraft:  # a subclass or a wrapper may forward otherwise than the C does
        return f"a draft of type {type(draft).__name__}"
    if draft.cfg.dflash2 is not None or draft.rope_frequencies.long_inv_freq is not None:
        return "a DFlash 2 draft or a long-context RoPE switch"
    for layer in draft.layers:
        attn = layer.self_attn
        if attn.is_causal or attn.sliding_window is not None or attn.qkv is None:
            return "causal, sliding-window or unpacked draft layers"
        weights = (attn.qkv, attn.o_proj.weight, layer.mlp.gate_up, layer.mlp.down_proj.weight)
        if not all(w is not None and is_input_major(w) for w in weights):
            return "draft weights not stored input-major"
    if not is_input_major(draft.fc.weight) or draft.fc.bias is not None:
        return "a context projection not stored input-major"
    return None  # every norm of a DFlashDraft has cfg.rms_norm_eps, what C is given


def draft_view(drafter: FusedDrafter) -> ModelView:
    """The draft's tensors and its paged context cache described to C."""
    draft, pages = drafter.draft, drafter.pages
    assert pages is not None
    cfg = draft.cfg
    layers = [LayerTensors(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.self_attn.qkv,
                           layer.self_attn.qkv_bias, layer.self_attn.qk_norm, layer.self_attn.o_proj.weight,
                           layer.self_attn.o_proj.bias, layer.mlp.gate_up, layer.mlp.down_proj.weight, pages.k[i],
                           pages.v[i])
              for i, layer in enumerate(draft.layers)]
    return ModelView(layers, lambda pos: draft.rope(pos, torch.float32), drafter.max_len + drafter.block_size,
                     embed=drafter.target.embed_weight, final_norm=draft.norm.weight, fc=draft.fc.weight,
                     hidden_norm=draft.hidden_norm.weight, embed_scale=cfg.input_embedding_scale,
                     hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, inter=cfg.intermediate_size, vocab=0, kv_block=drafter.kv_block,
                     eps=cfg.rms_norm_eps, qk_eps=cfg.rms_norm_eps, scale=cfg.head_dim**-0.5,
                     feat=draft.fc.weight.shape[1])


class FusedDraftStep:
    """A drafter's batched proposal forward (one `unsupported_draft` accepts) as one C call."""

    def __init__(self, drafter: FusedDrafter, lib: ctypes.CDLL) -> None:
        self.drafter = drafter
        self._lib = lib
        self.view = draft_view(drafter)
        self._scratch = Scratch()

    def hidden(self, items: Sequence[DraftRequest], pending: Sequence[torch.Tensor | None]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks' final-normed hidden states [b, w, H] (w: the longest block + 1), their tokens and their
        positions [b, w], each item's pending context rows written to the cache first."""
        d = self.drafter
        kvb = d.kv_block
        w = max(n for *_, n in items) + 1
        ids: list[int] = []
        ctx_pos: list[int] = []
        ctx_rows: list[int] = []
        starts = [p for _, _, p, _ in items]
        for (st, last, p, _n), f in zip(items, pending):
            ids += [last] + [d.mask_token_id] * (w - 1)
            c = 0 if f is None else f.shape[0]
            ctx_pos += range(p - c, p)
            ctx_rows += table_rows(st.blocks, kvb, p - c, p)
        context = max(starts)
        width = max(1, blocks_for(context, d.kv_block))
        tables = [b for st, *_ in items for b in (list(st.blocks[:width]) + [0] * width)[:width]]
        lens = [n + 1 for *_, n in items]
        feats = [f for f in pending if f is not None and f.shape[0]]
        ctx = torch.cat(feats).float().contiguous() if feats else None
        block_pos = [p + i for p in starts for i in range(w)]
        hidden = self._run(len(items), w, ids, starts, lens, ctx, ctx_pos, ctx_rows, tables, width, block_pos,
                           context)
        return hidden, torch.tensor(ids).view(len(items), w), torch.tensor(block_pos).view(len(items), w)

    def write_context(self, features: torch.Tensor, positions: Sequence[int], rows: Sequence[int]) -> None:
        """Context rows alone, no block: `features` [n, F] (the target's, at `positions`) written to draft cache
        `rows` exactly as a proposal writes its pending rows (one call, none of PyTorch's per-operator cost)."""
        if not features.shape[0] == len(positions) == len(rows):  # the C reads as many feature rows as positions
            raise ValueError(f"{features.shape[0]} context rows for {len(positions)} positions and {len(rows)} rows")
        if features.shape[0]:
            self._run(0, 0, [], [], [], features.float().contiguous(), list(positions), list(rows), [], 0, [], 0)

    def _run(self, b: int, w: int, ids: list[int], starts: list[int], lens: list[int], ctx: torch.Tensor | None,
             ctx_pos: list[int], ctx_rows: list[int], tables: list[int], width: int, block_pos: list[int],
             context: int) -> torch.Tensor:
        """One `dflash_draft_forward` call: b blocks of w tokens (none: context rows only); their hidden states
        [b, w, H]."""
        ints = array("q", ids + starts + lens + ctx_pos + ctx_rows + tables + block_pos)
        base, size = ints.buffer_info()[0], ints.itemsize
        offsets = [0, len(ids), len(ids) + b, len(ids) + 2 * b]
        offsets += [offsets[-1] + len(ctx_pos), offsets[-1] + 2 * len(ctx_pos)]
        offsets.append(offsets[-1] + len(tables))
        ptr = [int_ptr(base + o * size) for o in offsets]
        H = self.view.model.hidden
        hidden = torch.empty(b * w, H, dtype=torch.float32)
        scratch = self._scratch.at_least(self._lib.dflash_draft_scratch_floats(
            ctypes.byref(self.view.model), b, w, len(ctx_pos), context))
        batch = DraftBatch(b, w, ptr[0], ptr[1], ptr[2], len(ctx_pos), float_ptr(ctx), ptr[3], ptr[4], ptr[5],
                           width, ptr[6], context, float_ptr(hidden), float_ptr(scratch))
        self.run_kernel(batch)
        return hidden.view(b, w, H)

    def run_kernel(self, batch: DraftBatch) -> None:
        """The C call itself (`dflash-bench profile` times it apart from the Python around it); what this thread
        holds runs first (`dflash_core/overlap.py`)."""
        run_held()
        if self._lib.dflash_draft_forward(ctypes.byref(self.view.model), ctypes.byref(batch)) != 0:
            raise ValueError(f"a draft position beyond the rotary table ({self.view.model.max_pos})")



def fused_draft_step(drafter: FusedDrafter) -> FusedDraftStep | None:
    """The fused draft step for `drafter` as `DFLASH_CPU_STEP` asks (as `fused_cpu_step`: None where off or where
    it does not apply; `fused` raises where it does not apply to a CPU float32 drafter)."""
    mode = cpu_step_mode()
    if mode == "torch":
        return None
    device, dtype = drafter.target.device, drafter.target.dtype
    refuse = mode == "fused" and device.type == "cpu" and dtype == torch.float32 and drafter.static is None
    return fused_or_none("draft", unsupported_draft(drafter) or threads_reason(mode),
                         lambda lib: FusedDraftStep(drafter, lib), refuse, device.type == "cpu")
