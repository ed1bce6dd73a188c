"""The `native` target backend: a lean batched forward over a slot KV cache, written by position.

It reuses the weights and modules of a loaded transformers Qwen3 / Llama / Qwen2 model (projections, norms, MLP,
rotary embedding), but runs its own attention over a static cache, per layer `[slots, kv_heads, max_len, head_dim]`:
each request owns a slot, tokens write their keys/values at their positions, and a query sees the keys at positions
up to its own. Rolling back is just setting the slot's length: rows past it are never visible before they are
overwritten. Several requests' verify blocks run as ONE forward. The cache is a list of per-layer tensors, not one
tensor indexed by layer: a compiled step writes each layer's rows in place into its own graph input (an
`index_put_`), where a write into a view of one big cache makes inductor copy the whole cache in every step.

With `StaticShapes` (`dflash_core/compile.py`) a verify or plain step is padded to a (batch, width) bucket and runs
a fixed-shape step, compiled once per bucket: attention over the slot cache up to a power-of-two key bucket with a
position mask. Padding (rows beyond the batch, tokens beyond a row) is written to a scratch column past `max_len`,
which no query of a real row sees. Prefill and shapes beyond the buckets run the eager forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.compile import StaticShapes, kv_bucket, timed_warm_up
from dflash_core.layers import apply_rope
from dflash_core.runners.base import TargetOutput, TargetRow, TargetRunner

log = logging.getLogger("dflash.native")

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2", "qwen3_moe")
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [b, n, rotary dim]


@dataclass
class Slot:
    """One request's rows of the slot cache: its slot index (from the engine's SlotPool) and filled length."""

    index: int
    length: int = 0


@dataclass
class Batch:
    """The geometry of one batched forward: rows padded to `n` tokens at positions `pos` of their slots."""

    rows: Sequence[TargetRow | tuple[list[int], int, Any]]
    b: int
    n: int
    lengths: torch.Tensor  # [b] real tokens per row
    pos: torch.Tensor  # [b, n]
    slots: torch.Tensor  # [b]
    kv_len: int  # keys 0 .. kv_len-1 are visible to some query
    mask: torch.Tensor | None  # [b, 1, n, kv_len]: key position <= query position
    static: bool = False  # a padded static step: every row goes through the gather path, whatever b
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
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class NativeTarget(TargetRunner):
    """Batched target forward with a slot KV cache; same outputs as `HFTarget`, tested logit for logit.

    Subclasses for other layer types override `_allocate` (their caches), `_mix` (a layer's token mixer),
    `new_cache` and `crop`.
    """

    backend = "native"
    model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    ragged = True  # eager rows of different lengths run unpadded (subclasses whose mixers need [b, n]: False)

    def __init__(
        self, model: nn.Module, layer_ids: list[int] | None, max_slots: int, max_len: int,
        static: StaticShapes | None = None,
    ) -> None:
        reason = supports(model, self.model_types)
        if reason is not None:
            raise ValueError(f"the native backend does not support {reason}; use --backend hf")
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
        self.max_len = int(max_len)
        self.max_slots = int(max_slots)
        self.static = static
        self._allocate()
        self._step = None
        if static is not None:
            for t in (*self.k_cache, *self.v_cache):
                torch._dynamo.mark_static_address(t)  # mutated in place by a CUDA graph
            # ids, pos [b, n], slots [b], key_pos [L]: one graph over every batch, width and key bucket
            self._step = static.wrap(self._static_forward, self.device,
                                     dynamic={0: (0, 1), 1: (0, 1), 2: (0,), 3: (0,)})

    def _allocate(self) -> None:
        """The KV cache: per layer, one tensor `[slots, kv_heads, columns, head_dim]`, a row per slot and position;
        with static steps, a scratch column (at `max_len`) where their padding is written."""
        columns = self.max_len + (1 if self.static is not None else 0)
        self.k_cache, self.v_cache = self._kv_tensors(self.num_layers, columns)
        self.kv_index = {li: li for li in range(self.num_layers)}  # layer -> its tensor in k_cache / v_cache

    def _kv_tensors(self, layers: int, columns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.max_slots, self.num_kv_heads, columns, self.head_dim)
        def one() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [one() for _ in range(layers)], [one() for _ in range(layers)]

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the attention KV cache (every layer's keys and values)."""
        return sum(t.nbytes for t in (*self.k_cache, *self.v_cache))

    @property
    def pads_rows(self) -> bool:
        return not self.ragged or self.static is not None

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    # ---- slots ----
    def new_cache(self, slot: int) -> Slot:
        """The request's rows of the KV cache: slot `slot`, empty."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside the KV cache's {self.max_slots} slots")
        return Slot(slot)

    def crop(self, cache: Slot, length: int) -> None:
        cache.length = min(cache.length, length)

    # ---- forward ----
    def _batch(self, rows: Sequence[TargetRow | tuple[list[int], int, Any]]) -> Batch:
        b = len(rows)
        n = max(len(t) for t, _, _ in rows)
        last_pos = max(start for _, start, _ in rows) + n
        if last_pos > self.max_len:
            raise ValueError(f"position {last_pos} beyond the KV cache ({self.max_len})")
        if any(start > cache.length for _, start, cache in rows):  # rows never written would be visible
            raise ValueError("a row starts past the end of its slot's cache")
        starts = torch.tensor([s for _, s, _ in rows], device=self.device)
        pos = starts[:, None] + torch.arange(n, device=self.device)[None]  # [b, n]
        kv_len = int(pos.max()) + 1
        key_pos = torch.arange(kv_len, device=self.device)
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # [b, 1, n, kv_len]
        if n == 1 and b == 1:
            mask = None  # one query at the newest position sees every key
        lengths = torch.tensor([len(t) for t, _, _ in rows], device=self.device)
        slots = torch.tensor([c.index for _, _, c in rows], device=self.device)
        return Batch(rows, b, n, lengths, pos, slots, kv_len, mask)

    def _attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Write the rows' keys [b, kv_heads, n, d] and values [b, n, kv_heads, d] at their positions of layer
        `li`'s slot cache, then attend: [b, heads, n, d]. Ragged (`batch.flat`): [1, ..., T, ...] in and out."""
        kc, vc = self.k_cache[self.kv_index[li]], self.v_cache[self.kv_index[li]]
        n, kv_len = batch.n, batch.kv_len
        if batch.flat is not None:
            rows, cols = batch.flat
            slots, pos = batch.slots[rows], batch.pos[rows, cols]
            kc[slots, :, pos] = k[0].transpose(0, 1)
            vc[slots, :, pos] = v[0]
            keys, values = kc[batch.slots, :, :kv_len], vc[batch.slots, :, :kv_len]
            queries = q.new_zeros(batch.b, q.shape[1], n, q.shape[3])  # padding queries: computed, never read
            queries[rows, :, cols] = q[0].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=batch.mask, scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return out[rows, :, cols].transpose(0, 1)[None]
        if batch.b == 1 and not batch.static:  # plain slice writes and views: no gather
            s0, p0 = batch.rows[0][2].index, batch.rows[0][1]
            kc[s0, :, p0 : p0 + n] = k[0]
            vc[s0, :, p0 : p0 + n] = v[0].transpose(0, 1)
            keys, values = kc[s0, :, :kv_len][None], vc[s0, :, :kv_len][None]
        else:  # an index_put_ into the layer's own tensor: in place, also under inductor
            kc[batch.slots[:, None], :, batch.pos] = k.transpose(1, 2)
            vc[batch.slots[:, None], :, batch.pos] = v
            keys, values = kc[batch.slots, :, :kv_len], vc[batch.slots, :, :kv_len]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=batch.mask, scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )

    def _mix(self, li: int, layer: nn.Module, x: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        """Layer `li`'s token mixer on its normed input x [b, n, H] (ragged: [1, T, H]): self-attention over the
        slot cache."""
        attn = layer.self_attn
        b, n = x.shape[0], x.shape[1]
        q = attn.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 (Llama and Qwen2 have none)
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        out = self._attend(li, q, k, v, batch)
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _trunk(self, ids: torch.Tensor, batch: Batch, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over token ids [b, n]: final-normed hidden states, and the draft features when asked."""
        h = self.embed_tokens(ids)
        rope = self.rotary(h, batch.pos if batch.flat is None else batch.pos[batch.flat][None])
        # transformers' numbering: hidden state j is the input of layer j (0: the embeddings) and hidden state
        # num_layers comes after the final norm; the feature of target layer i is hidden state i + 1.
        hidden_ids = [i + 1 for i in self.layer_ids] if features else []
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in hidden_ids:
                hidden[li] = h
            h = h + self._mix(li, layer, layer.input_layernorm(h), batch, rope)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h)
        if self.num_layers in hidden_ids:
            hidden[self.num_layers] = h
        feat = torch.cat([hidden[j] for j in hidden_ids], dim=-1) if hidden_ids else None
        return h, feat

    @torch.inference_mode()
    def forward_batch(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], features: bool, last_only: bool = False
    ) -> list[TargetOutput]:
        """Several requests in ONE forward; rows shorter than the longest are padded (padding is never visible).
        A decode step that fits a static bucket runs the static (compiled) step."""
        static = self._static_rows(rows, features) if self._step is not None and not last_only else None
        if static is not None:
            return static
        batch = self._batch(rows)
        b, n = batch.b, batch.n
        if self.ragged and b > 1 and any(len(t) != n for t, _, _ in rows):
            return self._forward_ragged(rows, batch, features, last_only)
        ids = torch.tensor([t + [t[-1]] * (n - len(t)) for t, _, _ in rows], device=self.device)
        h, feat = self._trunk(ids, batch, features)
        if last_only:
            h = h[torch.arange(b, device=self.device), batch.lengths - 1][:, None]
        logits = self.lm_head(h).float()
        outs = []
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            row_logits = logits[r] if last_only else logits[r, :m]
            outs.append(TargetOutput(row_logits, feat[r, :m] if feat is not None else None))
        return outs

    def _forward_ragged(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], batch: Batch, features: bool, last_only: bool
    ) -> list[TargetOutput]:
        """Rows of different lengths as one sequence of their real tokens: a verify step whose rows have different
        widths costs the sum of the widths, not rows x the widest."""
        lengths = [len(t) for t, _, _ in rows]
        row_of = torch.repeat_interleave(torch.arange(batch.b, device=self.device),
                                         torch.tensor(lengths, device=self.device))
        ends = torch.tensor(lengths, device=self.device).cumsum(0)
        col_of = torch.arange(int(ends[-1]), device=self.device) - (ends - batch.lengths)[row_of]
        batch.flat = (row_of, col_of)
        ids = torch.tensor([tok for t, _, _ in rows for tok in t], device=self.device)[None]
        h, feat = self._trunk(ids, batch, features)
        if last_only:
            h = h[:, ends - 1]
        logits = self.lm_head(h[0]).float()
        outs = []
        start_of = 0
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            row_logits = logits[r : r + 1] if last_only else logits[start_of : start_of + m]
            row_feat = feat[0, start_of : start_of + m] if feat is not None else None
            outs.append(TargetOutput(row_logits, row_feat))
            start_of += m
        return outs

    # ---- the static step ----
    def _static_forward(
        self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, key_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded step: ids, pos [b, n], slots [b], key_pos [L] (the key bucket). Logits [b, n, V] float32 and
        the features [b, n, F] (always computed when the runner has layer ids: one shape per bucket)."""
        b, n = ids.shape
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]
        batch = Batch((), b, n, None, pos, slots, key_pos.shape[0], mask, static=True)  # type: ignore[arg-type]
        h, feat = self._trunk(ids, batch, bool(self.layer_ids))
        return self.lm_head(h).float(), feat

    def _static_rows(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], features: bool
    ) -> list[TargetOutput] | None:
        """The rows through the static step, or None when they fit no bucket (the eager forward runs them)."""
        assert self.static is not None
        bb = self.static.batch_bucket(len(rows))
        nb = self.static.width_bucket(max(len(t) for t, _, _ in rows))
        if bb is None or nb is None or any(s + len(t) > self.max_len or s > c.length for t, s, c in rows):
            return None  # the eager forward runs them (and raises on a bad row)
        scratch = self.max_len
        ids = [[0] * nb for _ in range(bb)]
        pos = [[scratch] * nb for _ in range(bb)]
        slots = [0] * bb  # padding rows write the scratch column of slot 0 only
        for r, (tokens, start, cache) in enumerate(rows):
            ids[r][: len(tokens)] = tokens
            pos[r][: len(tokens)] = range(start, start + len(tokens))
            slots[r] = cache.index
        kv_len = max(s + len(t) for t, s, _ in rows)
        logits, feat = self._run_static(bb, nb, ids, pos, slots, kv_len)
        outs = []
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            outs.append(TargetOutput(logits[r, :m], feat[r, :m] if features and feat is not None else None))
        return outs

    def _run_static(
        self, bb: int, nb: int, ids: list[list[int]], pos: list[list[int]], slots: list[int], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self._step is not None and self.static is not None
        dev = self.device
        # at most max_len keys: a key bucket never spans the cache's columns (the scratch one is past it), or the
        # whole-columns slice, contiguous, would be a graph of its own
        key_pos = torch.arange(kv_bucket(kv_len, self.max_len), device=dev)
        self.static.calls[(bb, nb)] += 1
        return self._step(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                          torch.tensor(slots, device=dev), key_pos)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile every (batch, width) bucket, and on CUDA record the graph of every (batch, width, key bucket)
        shape (`StaticShapes.warm_up_keys`); padding only, so no slot's rows change. Returns the seconds it took."""
        if self.static is None:
            return 0.0
        st, scratch = self.static, self.max_len
        keys, calls = st.warm_up_keys(self.device, self.max_len)
        runs = [
            (lambda bb=bb, nb=nb, kv=kv: self._run_static(bb, nb, [[0] * nb] * bb, [[scratch] * nb] * bb, [0] * bb, kv))
            for bb in st.batch_sizes for nb in st.widths for kv in keys
        ]
        seconds = timed_warm_up("native target", runs, log, calls)
        st.calls.clear()
        return seconds
