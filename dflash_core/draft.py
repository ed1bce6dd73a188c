"""The DFlash draft model: a few Qwen3-style layers whose block queries attend to projected target context.

Weight names follow z-lab checkpoints (`fc`, `hidden_norm`, `norm`, `layers.N.self_attn.*`, `layers.N.mlp.*`,
`layers.N.input_layernorm`, `layers.N.post_attention_layernorm`); `embed_tokens` is the target's, and so is the
output head unless the draft has a reduced vocabulary (`lm_head` and `d2t`, speculators format).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.config import DraftConfig
from dflash_core.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash_core.draft_cache import DraftKVCache, PagedBatch, gather_blocks, write_context_rows
from dflash_core.draft_formats import read_draft_config, read_draft_weights
from dflash_core.draft_sampling import RowSampling, sample_dense
from dflash_core.layers import RMSNorm, RopeFrequencies, apply_rope, pack_linears, rms_norm, rope_inv_freq

# (layer, x, cos_q, sin_q, ctx, cos_c, sin_c, kc, vc, rows, table, mask) -> x: `layer_region`, its kv_block bound
LayerRegion = Callable[..., torch.Tensor]

_FLOAT32_BUFFERS = ("_inv_freq", "_long_inv_freq")


class DraftAttention(nn.Module):
    """Block queries attend to [cached context ++ new context ++ the block] with q/k RMSNorm and RoPE."""

    def __init__(self, cfg: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        layer_type = cfg.attention_layers()[layer_idx]
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.sliding_window = cfg.sliding_window if sliding else None
        # `pack`: q/k/v weights as one tensor (non-persistent: the checkpoint keeps its own names)
        self.qkv: torch.Tensor | None
        self.qkv_bias: torch.Tensor | None
        self.qk_norm: torch.Tensor | None  # [heads + kv_heads, d]: q_norm's weight per query head, then k_norm's
        for name in ("qkv", "qkv_bias", "qk_norm"):
            self.register_buffer(name, None, persistent=False)

    def pack(self) -> None:
        """Serve with one matrix multiply for the queries, keys and values (the projections' weights become views of
        it) and one norm for the queries and keys; idempotent. Training does not pack."""
        if self.qkv is not None:
            return
        weight, bias = pack_linears([self.q_proj, self.k_proj, self.v_proj])
        self.qkv, self.qkv_bias = weight.data, None if bias is None else bias.data
        self.qk_norm = torch.cat([self.q_norm.weight.detach().expand(self.num_heads, self.head_dim),
                                  self.k_norm.weight.detach().expand(self.num_kv_heads, self.head_dim)])

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n_heads, self.head_dim).transpose(1, 2)

    def context_kv(
        self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of projected context rows: [b, kv_heads, n, d]."""
        if self.qkv is not None:  # packed: the key and value rows of the packed weight, one multiply
            q_size = self.num_heads * self.head_dim
            bias = None if self.qkv_bias is None else self.qkv_bias[q_size:]
            k, v = F.linear(ctx, self.qkv[q_size:], bias).split(self.num_kv_heads * self.head_dim, dim=-1)
            return apply_rope(self.k_norm(self._heads(k, self.num_kv_heads)), cos, sin), self._heads(
                v, self.num_kv_heads)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(ctx), self.num_kv_heads)

    def _block_qkv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block rows' queries [b, heads, q, d], keys and values [b, kv_heads, q, d]: normed and rotated."""
        if self.qkv is None:
            q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), cos, sin)
            k = apply_rope(self.k_norm(self._heads(self.k_proj(h), self.num_kv_heads)), cos, sin)
            return q, k, self._heads(self.v_proj(h), self.num_kv_heads)
        assert self.qk_norm is not None
        b, n = h.shape[0], h.shape[1]
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        qk = qkv[..., :qk_size].view(b, n, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(rms_norm(qk, self.qk_norm, self.q_norm.eps).transpose(1, 2), cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], self._heads(qkv[..., qk_size:], self.num_kv_heads)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        q, k_blk, v_blk = self._block_qkv(h, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} in draft config")
        self.gate_up: torch.Tensor | None
        self.register_buffer("gate_up", None, persistent=False)

    def pack(self) -> None:
        """Serve with one matrix multiply for the gate and up projections (theirs become views of it)."""
        if self.gate_up is None:
            self.gate_up = pack_linears([self.gate_proj, self.up_proj])[0].data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).split(self.gate_proj.weight.shape[0], dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash 2: each sublayer's query rows convolved before and after it (`dflash_core.dflash2`)
        self.attention_conv = self.mlp_conv = None
        if cfg.dflash2 is not None:
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):  # noqa: ANN001, ANN201 - hot path, types as in DraftModel
        if self.attention_conv is None or self.mlp_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, ctx_k, ctx_v, mask), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


def layer_region(
    layer: DraftLayer, x: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, ctx: torch.Tensor,
    cos_c: torch.Tensor, sin_c: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
    table: torch.Tensor, mask: torch.Tensor | None, kv_block: int,
) -> torch.Tensor:
    """One draft layer over a paged cache: the new context rows' keys / values written to rows [b, c] of the
    layer's tensors kc / vc, the table's [b, M] blocks of `kv_block` rows gathered, then the layer on the block
    rows x [b, q, H]."""
    new_k, new_v = layer.self_attn.context_kv(ctx, cos_c, sin_c)
    write_context_rows(kc, vc, rows, new_k, new_v)
    ctx_k, ctx_v = gather_blocks(kc, vc, table, kv_block)
    return layer(x, cos_q, sin_q, ctx_k, ctx_v, mask)


def key_visibility(
    ctx_k_pos: torch.Tensor, block_pos: torch.Tensor, base: torch.Tensor | None, ctx_len: torch.Tensor | None,
    ctx_start: torch.Tensor | None, block_len: torch.Tensor | None,
) -> torch.Tensor | None:
    """Which keys [context ++ block] each block query may see, bool [b, 1, q, keys] (None: all): context keys at
    positions ctx_k_pos [b, c] below ctx_len [b] and from ctx_start [b] on, block keys below block_len [b]; and
    `base`, an explicit visibility, when given."""
    b, q = block_pos.shape
    valid = []
    all_ctx = torch.ones_like(ctx_k_pos, dtype=torch.bool)
    all_block = torch.ones_like(block_pos, dtype=torch.bool)
    if ctx_len is not None:
        valid.append(torch.cat([ctx_k_pos < ctx_len[:, None], all_block], 1))
    if ctx_start is not None:
        valid.append(torch.cat([ctx_k_pos >= ctx_start[:, None], all_block], 1))
    if block_len is not None:
        in_block = torch.arange(q, device=block_pos.device)[None] < block_len[:, None]
        valid.append(torch.cat([all_ctx, in_block], 1))
    for v in valid:
        v = v[:, None, None, :].expand(b, 1, q, ctx_k_pos.shape[1] + q)
        base = v if base is None else base & v
    return base


class DFlashDraft(nn.Module):
    """DFlash draft network. `forward` returns final-normed hidden states of the block rows."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # a reduced vocabulary: the draft's own head, and d2t mapping its ids to the target's
        self.lm_head: nn.Linear | None = None
        self.d2t: torch.Tensor | None
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t = None if cfg.draft_vocab_size is None else torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t)
        # DFlash 2: the proposal is a path through each position's candidates (`dflash_core.dflash2`)
        self.candidate_selector = None
        if cfg.dflash2 is not None:
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.dflash2)
        # RoPE frequencies: buffers, so that `.to(device)` moves them (a compiled step must find no CPU tensor);
        # out of the state dict, and kept float32 by `.to(dtype)` (`_apply`).
        rope = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                             cfg.hidden_size, cfg.num_attention_heads)
        self._rope_scaling, self._rope_long_after = rope.attention_scaling, rope.original_max_position_embeddings
        self._inv_freq: torch.Tensor
        self._long_inv_freq: torch.Tensor | None
        self.register_buffer("_inv_freq", rope.inv_freq, persistent=False)
        self.register_buffer("_long_inv_freq", rope.long_inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """As nn.Module's (`.to`, `.cuda`, `.half`, ...), but the RoPE frequencies only change device: float32."""
        kept = {n: b for n in _FLOAT32_BUFFERS if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            self._buffers[name] = before.to(device=self._buffers[name].device, dtype=torch.float32)
        return self

    def pack(self) -> None:
        """Pack every layer's projections for serving (`DraftAttention.pack`, `DraftMLP.pack`); idempotent."""
        for layer in self.layers:
            layer.self_attn.pack()
            layer.mlp.pack()

    @property
    def rope_frequencies(self) -> RopeFrequencies:
        """The draft's RoPE frequencies (on its device) and scaling."""
        return RopeFrequencies(self._inv_freq, self._rope_scaling, self._long_inv_freq, self._rope_long_after)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype, last: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [b, n, rotary_dim] for integer positions [b, n], times the RoPE type's attention scaling.

        `last` [b] is each row's last position in this forward: LongRoPE (and dynamic NTK) switch to their long
        frequencies once the sequence is longer than `original_max_position_embeddings` (for dynamic NTK,
        `max_position_embeddings`), as transformers does per forward.
        """
        inv_freq = self._inv_freq
        if self._long_inv_freq is not None and last is not None:
            long = (last + 1 > int(self._rope_long_after or 0))[:, None, None]
            inv_freq = torch.where(long, self._long_inv_freq, self._inv_freq)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self._rope_scaling != 1.0:
            cos, sin = cos * self._rope_scaling, sin * self._rope_scaling
        return cos.to(dtype), sin.to(dtype)

    def embed(self, token_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Block embeddings through the target's embedding table."""
        emb = F.embedding(token_ids, embed_weight)
        return emb * self.cfg.input_embedding_scale if self.cfg.input_embedding_scale != 1.0 else emb

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits through the target's output head, or the draft's own over its reduced vocabulary (draft ids:
        `target_ids` maps them), with the optional multiplier and soft-cap."""
        logits = F.linear(hidden, lm_head_weight if self.lm_head is None else self.lm_head.weight)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def choose(
        self, hidden: torch.Tensor, first: torch.Tensor, lm_head_weight: torch.Tensor, top_k: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """The proposal at each block row, as target ids [b, w], with the draft's probability of it: the argmax of
        its distribution, or (DFlash 2) its selector's path through the candidates. hidden [b, w, H] (`forward`),
        first [b] the block's first tokens; column 0 (the known token) is no proposal. With `top_k` (DFlash only)
        also each row's top_k candidates, target ids and log-probabilities [b, w, top_k], most likely first: a
        tree's material (`dflash_core.tree`)."""
        b, w = hidden.shape[0], hidden.shape[1]
        # every row of the block, flattened to 2-D (a view): a 3-D matmul, or a reshape of sliced rows, decides its
        # path on whether a dimension is 1
        logits = self.logits(hidden.reshape(b * w, hidden.shape[-1]), lm_head_weight).float()
        if self.candidate_selector is not None:
            return self.candidate_selector.walk(hidden, logits.view(b, w, -1), first)
        probs = torch.softmax(logits, dim=-1)
        prob, best = probs.max(dim=-1)
        if not top_k:
            return self.target_ids(best.view(b, w)), prob.view(b, w)
        top = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
        return (self.target_ids(best.view(b, w)), prob.view(b, w), self.target_ids(top.indices.view(b, w, -1)),
                top.values.log().view(b, w, -1))

    def sample(
        self, hidden: torch.Tensor, first: torch.Tensor, lm_head_weight: torch.Tensor, rows: RowSampling,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`choose` drawing each proposal from the draft's processed distribution (`dflash_core.draft_sampling`):
        rows of the block's requests (`RowSampling`), positions [b, w] of the block's tokens. Returns target ids
        [b, w], confidences [b, w] and the distributions [b, w - 1, V] the proposals (columns 1 ..) were drawn
        from."""
        b, w = hidden.shape[0], hidden.shape[1]
        logits = self.logits(hidden.reshape(b * w, hidden.shape[-1]), lm_head_weight).float().view(b, w, -1)
        if self.candidate_selector is not None:
            return self.candidate_selector.sample_walk(hidden, logits, first, rows, positions)
        return sample_dense(logits, first, rows, positions, lm_head_weight.shape[0],
                            None if self.d2t is None else self.target_ids)

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids of `logits`' vocabulary as target ids: target id = draft id + d2t[draft id]."""
        return ids if self.d2t is None else ids + self.d2t[ids]

    def _mask(self, layer: DraftLayer, q_pos: torch.Tensor, k_pos: torch.Tensor, base: torch.Tensor | None):
        attn = layer.self_attn
        if not attn.is_causal and attn.sliding_window is None:
            return base
        qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
        visible = torch.ones(qp.shape[0], 1, qp.shape[2], kp.shape[3], dtype=torch.bool, device=qp.device)
        if attn.is_causal:
            visible &= kp <= qp
        if attn.sliding_window is not None:
            visible &= (qp - kp) < attn.sliding_window
            if not attn.is_causal:
                visible &= (kp - qp) < attn.sliding_window
        return visible if base is None else visible & base

    def write_context(
        self, ctx_features: torch.Tensor, ctx_pos: torch.Tensor, cache: DraftKVCache | PagedBatch, last: torch.Tensor
    ) -> None:
        """Write the keys/values of context rows [b, c, len(ids)*H] at ctx_pos [b, c] to the cache, with no block:
        exactly the rows `forward` would write for them (`last` [b]: the RoPE type's long switch, as there)."""
        ctx = self.hidden_norm(self.fc(ctx_features))
        cos, sin = self.rope(ctx_pos, ctx.dtype, last if self._long_inv_freq is not None else None)
        for i, layer in enumerate(self.layers):
            cache.update(i, *layer.self_attn.context_kv(ctx, cos, sin))
        cache.commit(ctx.shape[1])

    def forward(
        self,
        block_emb: torch.Tensor,
        block_pos: torch.Tensor,
        ctx_features: torch.Tensor | None,
        ctx_pos: torch.Tensor | None,
        cache: DraftKVCache | PagedBatch | None = None,
        mask: torch.Tensor | None = None,
        ctx_len: torch.Tensor | None = None,
        block_len: torch.Tensor | None = None,
        ctx_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the block; returns final-normed hidden states [b, q, H].

        block_emb [b, q, H] at positions block_pos [b, q]; ctx_features [b, c, len(ids)*H] are new target context
        rows at ctx_pos [b, c]. With a cache they are written to it and the queries see every cached row (at the
        positions the cache reports); without one they see only these rows. `ctx_len` [b] hides cached rows at
        positions >= it, `ctx_start` [b] those at positions < it (a window), `block_len` [b] hides padded block
        rows, and `mask` (bool [b, 1, q, keys]) is an explicit visibility over keys [context ++ block] (training).
        """
        dtype = block_emb.dtype
        b, q = block_pos.shape
        last = block_pos.max(dim=1).values if self._long_inv_freq is not None else None
        cos_q, sin_q = self.rope(block_pos, dtype, last)
        ctx = None
        if ctx_features is not None and ctx_features.shape[1] > 0:
            ctx = self.hidden_norm(self.fc(ctx_features))
            cos_c, sin_c = self.rope(ctx_pos, dtype, last)
        x = block_emb
        base, k_pos = mask, None
        for i, layer in enumerate(self.layers):
            new_k = new_v = None
            if ctx is not None:
                new_k, new_v = layer.self_attn.context_kv(ctx, cos_c, sin_c)
            ctx_k, ctx_v = cache.update(i, new_k, new_v) if cache is not None else (new_k, new_v)
            if ctx_k is None:
                shape = (b, layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim)
                ctx_k = ctx_v = x.new_zeros(shape)
            if k_pos is None:  # same keys for every layer: build positions and validity once
                n_ctx = ctx_k.shape[2]
                if cache is not None:
                    ctx_k_pos = cache.key_positions(b, n_ctx, block_pos.device)
                else:
                    ctx_k_pos = ctx_pos if ctx is not None else block_pos[:, :0]
                k_pos = torch.cat([ctx_k_pos, block_pos], dim=1)
                base = key_visibility(ctx_k_pos, block_pos, base, ctx_len, ctx_start, block_len)
            x = layer(x, cos_q, sin_q, ctx_k, ctx_v, self._mask(layer, block_pos, k_pos, base))
        if cache is not None and ctx is not None:
            cache.commit(ctx.shape[1])
        return self.norm(x)

    def forward_paged_by_layer(
        self, block_emb: torch.Tensor, block_pos: torch.Tensor, ctx_features: torch.Tensor, ctx_pos: torch.Tensor,
        cache: PagedBatch, run_layer: LayerRegion, ctx_len: torch.Tensor, block_len: torch.Tensor,
        ctx_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` over a paged batch with a table and new context rows, each layer through `run_layer` (a
        compiled layer region: `layer_region` with the layer's weights and cache tensors as inputs, one graph for
        every layer). The keys' positions and visibility are known before the first layer: the table's blocks."""
        assert cache.table is not None and cache.rows is not None
        dtype = block_emb.dtype
        b = block_pos.shape[0]
        last = block_pos.max(dim=1).values if self._long_inv_freq is not None else None
        cos_q, sin_q = self.rope(block_pos, dtype, last)
        ctx = self.hidden_norm(self.fc(ctx_features))
        cos_c, sin_c = self.rope(ctx_pos, dtype, last)
        ctx_k_pos = cache.key_positions(b, cache.table.shape[1] * cache.cache.kv_block, block_pos.device)
        k_pos = torch.cat([ctx_k_pos, block_pos], dim=1)
        base = key_visibility(ctx_k_pos, block_pos, None, ctx_len, ctx_start, block_len)
        x = block_emb
        for i, layer in enumerate(self.layers):
            x = run_layer(layer, x, cos_q, sin_q, ctx, cos_c, sin_c, cache.cache.k[i], cache.cache.v[i], cache.rows,
                          cache.table, self._mask(layer, block_pos, k_pos, base))
        return self.norm(x)

    # ---- checkpoint I/O (z-lab layout) ----
    def save(self, folder: str | Path) -> None:
        """Write a z-lab-format draft folder: config.json + model.safetensors."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.cfg.save(folder)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_folder(cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        """Load a draft folder (config.json + *.safetensors) in z-lab or speculators format."""
        cfg = read_draft_config(folder)
        state = read_draft_weights(folder, cfg)
        model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: draft weights do not match config (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        return model.to(device=device, dtype=dtype).eval()
