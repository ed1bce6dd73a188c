"""The `native` target backend: a lean batched forward over a slot KV cache, written by position.

It reuses the weights and modules of a loaded transformers Qwen3 / Llama / Qwen2 model (projections, norms, MLP,
rotary embedding), but runs its own attention over a static cache `[layers, slots, kv_heads, max_len, head_dim]`:
each request owns a slot, tokens write their keys/values at their positions, and a query sees the keys at positions
up to its own. Rolling back is just setting the slot's length: rows past it are never visible before they are
overwritten. Several requests' verify blocks run as ONE forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.layers import apply_rope
from dflash_core.runners.base import TargetOutput, TargetRow, TargetRunner

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2")


@dataclass
class Slot:
    """One request's rows of the slot cache: its slot index (from the engine's SlotPool) and filled length."""

    index: int
    length: int = 0


def supports(model: nn.Module) -> str | None:
    """None when `model` can run natively, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (native supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class NativeTarget(TargetRunner):
    """Batched target forward with a slot KV cache; same outputs as `HFTarget`, tested logit for logit."""

    backend = "native"

    def __init__(self, model: nn.Module, layer_ids: list[int] | None, max_slots: int, max_len: int) -> None:
        reason = supports(model)
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
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.scaling = float(attn.scaling)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = int(max_len)
        shape = (self.num_layers, max_slots, self.num_kv_heads, self.max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.max_slots = int(max_slots)

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
    @torch.inference_mode()
    def forward_batch(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], features: bool, last_only: bool = False
    ) -> list[TargetOutput]:
        """Several requests in ONE forward; rows shorter than the longest are padded (padding is never visible)."""
        b = len(rows)
        n = max(len(t) for t, _, _ in rows)
        last_pos = max(start for _, start, _ in rows) + n
        if last_pos > self.max_len:
            raise ValueError(f"position {last_pos} beyond the KV cache ({self.max_len})")
        if any(start > cache.length for _, start, cache in rows):  # rows never written would be visible
            raise ValueError("a row starts past the end of its slot's cache")
        ids = torch.tensor([t + [t[-1]] * (n - len(t)) for t, _, _ in rows], device=self.device)
        starts = torch.tensor([s for _, s, _ in rows], device=self.device)
        pos = starts[:, None] + torch.arange(n, device=self.device)[None]  # [b, n]
        slots = torch.tensor([c.index for _, _, c in rows], device=self.device)
        kv_len = int(pos.max()) + 1
        key_pos = torch.arange(kv_len, device=self.device)
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # [b, 1, n, kv_len]
        if n == 1 and b == 1:
            mask = None  # one query at the newest position sees every key
        one_slot = b == 1

        h = self.embed_tokens(ids)
        cos, sin = self.rotary(h, pos)
        # transformers' numbering: hidden state j is the input of layer j (0: the embeddings) and hidden state
        # num_layers comes after the final norm; the feature of target layer i is hidden state i + 1.
        hidden_ids = [i + 1 for i in self.layer_ids] if features else []
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in hidden_ids:
                hidden[li] = h
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, n, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            if one_slot:  # plain slice writes and views: no gather
                s0, p0 = rows[0][2].index, rows[0][1]
                kc[s0, :, p0 : p0 + n] = k[0]
                vc[s0, :, p0 : p0 + n] = v[0].transpose(0, 1)
                keys, values = kc[s0, :, :kv_len][None], vc[s0, :, :kv_len][None]
            else:
                kc[slots[:, None], :, pos] = k.transpose(1, 2)
                vc[slots[:, None], :, pos] = v
                keys, values = kc[slots, :, :kv_len], vc[slots, :, :kv_len]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h)
        if self.num_layers in hidden_ids:
            hidden[self.num_layers] = h
        if last_only:
            last = torch.tensor([len(t) - 1 for t, _, _ in rows], device=self.device)
            h = h[torch.arange(b, device=self.device), last][:, None]
        logits = self.lm_head(h).float()
        feat = torch.cat([hidden[j] for j in hidden_ids], dim=-1) if hidden_ids else None
        outs = []
        for r, (tokens, start, cache) in enumerate(rows):
            m = len(tokens)
            cache.length = start + m
            row_logits = logits[r] if last_only else logits[r, :m]
            outs.append(TargetOutput(row_logits, feat[r, :m] if feat is not None else None))
        return outs

