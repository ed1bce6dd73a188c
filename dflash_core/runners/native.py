"""The `native` target backend: a lean batched forward over a paged KV cache, written by position.

It reuses the weights of a loaded transformers Qwen3 / Llama / Qwen2 / Qwen3-MoE model, each plain layer packed
(`DenseLayer`, `runners/dense.py`: one QKV and one gate/up matmul, a few tensor ops) and its rotary module, but runs
its own attention over a paged cache (`dflash_core/attention.py`): per layer one key
and one value tensor `[num_blocks * kv_block, kv_heads, head_dim]` of flat rows, block `b` holding rows
`b * kv_block ..`. Each request's cache (`Slot`) carries its block table, the engine's list of block ids (grown by
the engine before each forward); position p lives in row `blocks[p // kv_block] * kv_block + p % kv_block`. Tokens
write their keys/values at their positions' rows, and a query sees its request's keys at positions up to its own.
Rolling back is just setting the cache's length: rows past it are never visible before they are overwritten. Two
requests may share read-only blocks of a common prefix (a prefix-cache hit: `new_cache(slot, blocks, cached)`).
Block 0 is the null block, never a request's: padding writes there. Several requests' verify blocks run as ONE
forward. The cache is a list of per-layer tensors, not one tensor indexed by layer: a compiled step writes each
layer's rows in place into its own graph input (an `index_put_`), where a write into a view of one big cache makes
inductor copy the whole cache in every step.

With `StaticShapes` (`dflash_core/compile.py`) a verify or plain step is padded to a (batch, width) bucket and runs
a fixed-shape step (`native_static.py`). Prefill and shapes beyond the buckets run the eager forward, which
attends by gather + SDPA on every device (no compiler: no prompt shape compiles anything); FlexAttention serves only
the compiled static step (`attention_kernel`: CUDA by default, `DFLASH_ATTENTION` overrides).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_core.attention import PagedAttention, prepare, write_kv
from dflash_core.compat import rotary_positions
from dflash_core.compile import StaticShapes
from dflash_core.cpu_step.fused import FusedCpuStep, fused_cpu_step, lay_out_for_fused_step
from dflash_core.families import NATIVE_MODEL_TYPES, rope_reads_the_batch
from dflash_core.kv.pool import DEFAULT_KV_BLOCK
from dflash_core.layers import apply_rope
from dflash_core.overlap import run_held
from dflash_core.runners.base import TargetOutput
from dflash_core.runners.dense import DenseLayer, dense_layer
from dflash_core.runners.paged import PagedTarget, Rows, Slot
from dflash_core.tree import DraftTree, tree_mask

log = logging.getLogger("dflash.native")

SUPPORTED_MODEL_TYPES = NATIVE_MODEL_TYPES
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [b, n, rotary dim]
LayerStep = Callable[[int, nn.Module, torch.Tensor, "Batch", Rope], torch.Tensor]  # (li, layer, h, batch, rope) -> h


@dataclass
class Batch:
    """The geometry of one batched forward: rows padded to `n` tokens at positions `pos`."""

    rows: Rows
    b: int
    n: int
    lengths: torch.Tensor | None  # [b] real tokens per row
    pos: torch.Tensor  # [b, n]
    slots: torch.Tensor | None  # [b] the rows' slot indices (per-slot states of subclasses)
    table: torch.Tensor  # [b, M] block tables, 0 past a row's blocks
    write: torch.Tensor  # [b, n] cache rows the tokens write (ragged: [T], the real tokens')
    attention: PagedAttention  # the forward's attention, its mask built once for every layer
    static: bool = False  # a padded static step
    # ragged: the rows' real tokens run as ONE sequence [1, T]; each token's (row, column) of the padded [b, n]
    # layout, which only attention uses (projections, norms and MLPs never see padding)
    flat: tuple[torch.Tensor, torch.Tensor] | None = None


def supports(model: nn.Module, model_types: Sequence[str] = SUPPORTED_MODEL_TYPES) -> str | None:
    """None when `model` can run natively, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type == "gpt_oss":
        return "gpt-oss's attention sinks and sliding-window layers"
    if cfg.model_type not in model_types:
        return f"model_type {cfg.model_type!r} (native supports {', '.join(model_types)})"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if rope_reads_the_batch(cfg):  # batched rows would change each other's frequencies
        return "a rotary embedding that picks its frequencies from the largest position of each forward"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class NativeTarget(PagedTarget):
    """Batched target forward over a paged KV cache; same outputs as `HFTarget`, tested logit for logit.

    Subclasses for other layer types override `_allocate` (their caches), `_mix` (a layer's token mixer),
    `new_cache` and `crop`.
    """

    backend = "native"
    model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    ragged = True  # eager rows of different lengths run unpadded (subclasses whose mixers need [b, n]: False)
    verifies_trees = True  # attention alone: a tree's nodes see their ancestors by mask (hybrids: False)
    packs_layers = True  # self-attention layers run as `DenseLayer`s (subclasses with their own mixers: False)
    fuses_cpu_step = True  # float32 on a CPU, forwards run as one C call (`dflash_core/cpu_step/`; subclasses
    # whose layers mix tokens otherwise: False)

    def __init__(
        self, model: nn.Module, layer_ids: list[int] | None, max_slots: int, max_len: int,
        static: StaticShapes | None = None, num_blocks: int | None = None, kv_block: int = DEFAULT_KV_BLOCK,
    ) -> None:
        reason = supports(model, self.model_types)
        if reason is not None:
            raise ValueError(f"the native backend does not support {reason}; use --backend generic or auto")
        self.model = model.eval()
        cfg = model.config
        self.config = cfg
        inner = model.model
        self.embed_tokens, self.layers, self.norm, self.rotary = (
            inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb)
        self.lm_head = model.get_output_embeddings()
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", max_len))
        self.layer_ids = list(layer_ids or [])
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.scaling = self.head_dim**-0.5
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._init_paging(max_slots, max_len, num_blocks, kv_block)
        if self.fuses_cpu_step and static is None:
            lay_out_for_fused_step(model, self.device, self.dtype)  # before packing: the packs keep the layout
        # each plain self-attention layer as packed weights and a few tensor ops (None: the layer's modules run it)
        self.dense: list[DenseLayer | None] = (
            [dense_layer(layer, self.num_heads, self.num_kv_heads, self.head_dim) for layer in self.layers]
            if self.packs_layers else [None] * self.num_layers)
        self.static = static
        prepare(self.device)
        self._allocate()
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_block = 2 * len(self.k_cache) * kv_block * self.num_kv_heads * self.head_dim * elem
        self._static_step: Any = None
        self._fused: FusedCpuStep | None = None
        if static is not None:
            from dflash_core.runners.native_static import StaticStep  # it builds on this module's Batch

            self._static_step = StaticStep(self, static)
        elif self.fuses_cpu_step:
            self._fused = fused_cpu_step(self)

    def _allocate(self) -> None:
        """The KV cache: per layer, one key and one value tensor `[num_blocks * kv_block, kv_heads, head_dim]`."""
        self.k_cache, self.v_cache = self._kv_tensors(self.num_layers)
        self.kv_index = {li: li for li in range(self.num_layers)}  # layer -> its tensor in k_cache / v_cache

    def _kv_tensors(self, layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.kv_rows_total, self.num_kv_heads, self.head_dim)
        def one() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [one() for _ in range(layers)], [one() for _ in range(layers)]

    @property
    def pads_rows(self) -> bool:
        return not self.ragged or self.static is not None

    @property
    def compiled_steps(self) -> bool:
        return self.static is not None

    @property
    def cpu_step(self) -> str:
        return "fused" if self._fused is not None else "torch"

    @property
    def fused_step(self) -> FusedCpuStep | None:
        """The fused CPU step that runs this runner's forwards, or None."""
        return self._fused

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def _batch(self, rows: Rows) -> Batch:
        g = self._geometry(rows)
        return Batch(rows, g.b, g.n, g.lengths, g.pos, g.slots, g.table, g.write, g.attention)

    def layer_kv(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `li`'s key and value cache tensors."""
        return self.k_cache[self.kv_index[li]], self.v_cache[self.kv_index[li]]

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                batch: Batch, scale: float) -> torch.Tensor:
        """Write the rows' keys [b, kv_heads, n, d] and values [b, n, kv_heads, d] at their positions' rows of one
        layer's cache kc / vc, then attend: [b, heads, n, d]. Ragged (`batch.flat`): [1, ..., T, ...] in and out."""
        if batch.flat is not None:
            rows, cols = batch.flat
            write_kv(kc, vc, batch.write, k[0].transpose(0, 1), v[0])
            queries = q.new_zeros(batch.b, q.shape[1], batch.n, q.shape[3])  # padding queries: computed, not read
            queries[rows, :, cols] = q[0].transpose(0, 1)
            return batch.attention(queries, kc, vc, scale)[rows, :, cols].transpose(0, 1)[None]
        write_kv(kc, vc, batch.write, k.transpose(1, 2), v)  # rows [b, n]: no reshape, whose views specialise n
        return batch.attention(q, kc, vc, scale)

    def _mix(self, li: int, layer: nn.Module, x: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        """Layer `li`'s token mixer on its normed input x [b, n, H] (ragged: [1, T, H]): self-attention over the
        paged cache."""
        return self._self_attention(layer, x, *self.layer_kv(li), batch, rope)

    def _self_attention(self, layer: nn.Module, x: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch,
                        rope: Rope) -> torch.Tensor:
        """An attention layer's mixer over its cache tensors kc / vc (no layer index: a compiled layer region
        serves every layer with one graph)."""
        attn = layer.self_attn
        b, n = x.shape[0], x.shape[1]
        q = attn.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 (Llama and Qwen2 have none)
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        out = self._attend(q, k, v, kc, vc, batch, self.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def layer_module(self, li: int) -> nn.Module:
        """What runs layer `li`: its `DenseLayer`, or the transformers layer."""
        dense = self.dense[li]
        return self.layers[li] if dense is None else dense

    def attention_layer(self, layer: nn.Module, h: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch,
                        rope: Rope) -> torch.Tensor:
        """One whole attention layer (`layer_module`), residuals included, over its cache tensors: what every
        forward runs per layer, and a compiled layer region (`native_static.py`)."""
        if isinstance(layer, DenseLayer):
            q, k, v = layer.project(h, *rope)
            return layer.finish(h, self._attend(q, k, v, kc, vc, batch, self.scaling))
        h = h + self._self_attention(layer, layer.input_layernorm(h), kc, vc, batch, rope)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _trunk(
        self, ids: torch.Tensor, batch: Batch, features: bool, run_layer: LayerStep | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over token ids [b, n]: final-normed hidden states, and the draft features when asked.
        `run_layer` (li, layer, h, batch, rope) -> h runs each layer (default: its mixer, then its MLP)."""
        h = self.embed_tokens(ids)
        pos = batch.pos if batch.flat is None else batch.pos[batch.flat][None]
        rope = self.rotary(h, rotary_positions(self.rotary, pos))
        # transformers' numbering: hidden state j is the input of layer j (0: the embeddings) and hidden state
        # num_layers comes after the final norm; the feature of target layer i is hidden state i + 1.
        hidden_ids = [i + 1 for i in self.layer_ids] if features else []
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in hidden_ids:
                hidden[li] = h
            if run_layer is not None:
                h = run_layer(li, layer, h, batch, rope)
                continue
            dense = self.dense[li]
            if dense is not None:
                h = self.attention_layer(dense, h, *self.layer_kv(li), batch, rope)
                continue
            h = h + self._mix(li, layer, layer.input_layernorm(h), batch, rope)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h)
        if self.num_layers in hidden_ids:
            hidden[self.num_layers] = h
        feat = torch.cat([hidden[j] for j in hidden_ids], dim=-1) if hidden_ids else None
        return h, feat

    @torch.inference_mode()
    def forward_batch(self, rows: Rows, features: bool, last_only: bool = False) -> list[TargetOutput]:
        """Several requests in ONE forward; rows shorter than the longest are padded (padding is never visible).
        A decode step that fits a static bucket runs the static (compiled) step. Raises ValueError when a row
        starts past its cache's length or its blocks do not cover its positions."""
        self._check(rows)
        if self._fused is not None and self._fused.serves(rows, last_only):
            return self._fused.forward(rows, features, last_only)
        if self._static_step is not None and not last_only:
            static = self._static_step.run(rows, features)
            if static is not None:
                return static
        return self._eager(rows, self._batch(rows), features, last_only)

    @torch.inference_mode()
    def forward_tree(self, rows: Rows, trees: Sequence[DraftTree], features: bool) -> list[TargetOutput]:
        """Tree rows (`TargetRunner.forward_tree`) through the eager forward: the rows' geometry as for a chain of
        their tokens (keys written at rows start + i, causal by row), the rotary positions start + depth, and the
        mask cut to each node's ancestors (`tree_mask`)."""
        self._check(rows)
        batch = self._batch(rows)
        n = batch.n
        depth = torch.tensor([(tr.depths + [0] * n)[:n] for tr in trees], device=self.device)
        vis = torch.tensor([[(row + [0] * n)[:n] for row in tr.visibility()] + [[0] * n] * (n - tr.size)
                            for tr in trees], dtype=torch.bool, device=self.device)
        assert batch.attention.mask is not None  # a tree row has two tokens at least: the mask is built
        batch.attention.mask = tree_mask(batch.attention.mask, vis, batch.pos[:, 0])
        batch.pos = batch.pos[:, :1] + depth
        return self._eager(rows, batch, features, False)

    def compact(self, cache: Slot, start: int, keep: Sequence[int]) -> None:
        moved = [(start + d, start + a) for d, a in enumerate(keep) if a != d]
        if moved:
            kvb = self.kv_block_size
            rows = torch.tensor([[cache.blocks[p // kvb] * kvb + p % kvb for p in pair] for pair in moved],
                                device=self.device)
            for kc, vc in zip(self.k_cache, self.v_cache):
                kc.index_copy_(0, rows[:, 0], kc.index_select(0, rows[:, 1]))
                vc.index_copy_(0, rows[:, 0], vc.index_select(0, rows[:, 1]))
        cache.length = start + len(keep)

    def _eager(self, rows: Rows, batch: Batch, features: bool, last_only: bool) -> list[TargetOutput]:
        """The eager forward of `rows` with their geometry `batch` (ragged when their lengths differ)."""
        if self.device.type == "cpu":  # PyTorch computes as it is called: work held for a later wait only comes late
            run_held()
        b, n = batch.b, batch.n
        if self.ragged and b > 1 and any(len(t) != n for t, _, _ in rows):
            return self._forward_ragged(rows, batch, features, last_only)
        ids = torch.tensor([t + [t[-1]] * (n - len(t)) for t, _, _ in rows], device=self.device)
        h, feat = self._trunk(ids, batch, features)
        if last_only:
            assert batch.lengths is not None
            h = h[torch.arange(b, device=self.device), batch.lengths - 1][:, None]
        logits = self.lm_head(h).float()
        outs = []
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            row_logits = logits[r] if last_only else logits[r, :m]
            outs.append(TargetOutput(row_logits, feat[r, :m] if feat is not None else None))
        return outs

    def _forward_ragged(self, rows: Rows, batch: Batch, features: bool, last_only: bool) -> list[TargetOutput]:
        """Rows of different lengths as one sequence of their real tokens: a verify step whose rows have different
        widths costs the sum of the widths, not rows x the widest."""
        assert batch.lengths is not None
        row_of, col_of = self._flat(rows, batch)  # type: ignore[arg-type]  # a Batch has a Geometry's fields
        batch.flat = (row_of, col_of)
        batch.write = batch.write[row_of, col_of]  # the real tokens' rows only
        ids = torch.tensor([tok for t, _, _ in rows for tok in t], device=self.device)[None]
        h, feat = self._trunk(ids, batch, features)
        if last_only:
            h = h[:, batch.lengths.cumsum(0) - 1]
        logits = self.lm_head(h[0]).float()
        return self.split_rows(rows, logits, feat[0] if feat is not None else None, last_only)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile every static (batch, width) bucket (on CUDA: record every (batch, width, key bucket) graph),
        padding only, so no request's rows change. Returns the seconds it took."""
        return 0.0 if self._static_step is None else self._static_step.warm_up()
