"""The native runner for hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated DeltaNet beside full attention.

Three of every four layers are Gated DeltaNet (linear attention): a short causal convolution over the projected
q/k/v channels, then a gated delta-rule recurrence whose state is a `[heads, d_k, d_v]` matrix per request. Each
slot holds, per linear layer, the convolution window (the last `kernel - 1` inputs) and the recurrent state; the
full-attention layers use the paged KV cache of `NativeTarget` (per layer `[num_blocks * kv_block, kv_heads, d]`,
through each request's block table).

Prefix caching. The attention layers' pages are shared like any runner's; the linear layers' state after a prefix
is a checkpoint (every linear layer's window and state, `checkpoint_bytes`), taken sparsely: with `checkpointing`
on (the engine's KV manager turns it on when prefix caching is), every forward keeps, per row, the state at the
LAST KV-block boundary inside it (captured in the recurrence's own loop, or by splitting a prefill's chunked rule
at that boundary: no extra pass); once the tokens before it are committed (a crop keeps it only if it lies within
the accepted prefix) it becomes one of the request's marks, the states at the last two block boundaries it passed.
`checkpoint(cache, position)` hands a mark (or the live state, when it is exactly there) to the KV manager,
which keeps a few such checkpoints per cached block (`dflash_core.kv.manager.CheckpointStore`); a prefix hit ends
at a checkpointed block and `new_cache(slot, blocks, cached, state=...)` restores it into the slot.

Rollback. A recurrent state cannot be cropped by length. While a forward runs, each linear layer records per row
the state and window it started from and the per-token inputs of the recurrence (keys, values, decays, betas
after normalisation: `hybrid_state.record_nbytes` per token, about 1.2 MB for Qwen3.5-9B). `crop(cache, length)`
recomputes the state from that record over the first `length - start` tokens only, with the same operations in
the same order, so the state is exactly what feeding the accepted prefix alone would have left; no second target
forward runs. A prefill records only its starting point: it can be rolled back to it (a retry), not into its
middle.

Prefill uses transformers' chunked delta-rule function (as transformers' own prefill does), from the row's state
for a later chunk of a long prompt or the suffix after a prefix-cache hit (a forward read at its last row only:
nothing rolls it back into its middle); verify and decode steps use the token-by-token recurrence in torch (as
transformers' own decode does without the fla / causal-conv1d kernels), so outputs match `generate` run with
transformers' torch implementations.

Memory (`dflash_core.hybrid_state`, which the memory plan and `dflash-bench memory` count with too): each running
request holds its state twice (live, and the copy its last forward recorded for rollback). With checkpointing, it
also holds up to `REQUEST_CHECKPOINTS` = 4 more copies: its marks (MARKS = 2), the pending boundary state of a
forward not yet accepted (held beside both marks until the next forward settles it), and the checkpoint the engine
keeps until its block enters the prefix index (`RequestKV.deferred`); the KV manager's checkpoints take at most
`checkpoint_limits` (one state per two slots, at least 4). And each holds the records of its last verify step
(`record_nbytes` per token, at most a DFlash block of tokens; a prefill records none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.compat import chunk_gated_delta_rule
from dflash_core.families import HYBRID_MODEL_TYPES
from dflash_core.hybrid_state import MARKS, checkpoint_limits, checkpoint_nbytes
from dflash_core.kv.pool import DEFAULT_KV_BLOCK
from dflash_core.layers import apply_rope
from dflash_core.runners.native import Batch, NativeTarget, Rope, supports
from dflash_core.runners.paged import Slot

_L2_EPS = 1e-6


def hybrid_unsupported(model: nn.Module) -> str | None:
    """None when the hybrid runner can run `model`, else why not."""
    cfg = model.config
    layout = supports(model, HYBRID_MODEL_TYPES)
    if layout is not None:
        return layout
    if cfg.hidden_act not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} in the linear-attention convolution"
    return None


@dataclass
class _LayerRecord:
    """What one linear layer needs to roll one row back into the last forward."""

    window: torch.Tensor  # [C, K-1] convolution window before the forward (a view of the slot's backup row)
    state: torch.Tensor  # [Hv, dk, dv] recurrent state before the forward (float32; likewise)
    inputs: torch.Tensor | None = None  # [C, m] convolution inputs of the forward's tokens
    key: torch.Tensor | None = None  # [Hv, m, dk] (normalised, float32)
    value: torch.Tensor | None = None  # [Hv, m, dv]
    decay: torch.Tensor | None = None  # [Hv, m] (log decay g)
    beta: torch.Tensor | None = None  # [Hv, m]


@dataclass
class HybridSlot(Slot):
    """A request's slot, and what its last forward recorded for rollback."""

    start: int = 0  # position of the last forward's first token
    state_end: int = 0  # the position the linear layers' windows and states have reached
    records: dict[int, _LayerRecord] = field(default_factory=dict)
    # checkpointing: the windows and states (per linear layer) at the last block boundary inside the last forward,
    # not committed yet (`pending`), and at the last MARKS committed block boundaries the request passed (`marks`,
    # by position, oldest first; two: when a request ends, the draft's context rows may lag the committed tokens by
    # up to a draft block (those a CPU's plain steps held back are written then: `RequestMemory.release`), so the
    # last boundary's block may never enter the prefix index, the one before it does)
    pending_pos: int | None = None
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    marks: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def _delta_step(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One token of the gated delta rule: state [..., dk, dv]; k [..., dk]; v [..., dv]; g, beta [...]."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


class HybridTarget(NativeTarget):
    """Batched forward of a hybrid target: full-attention layers over the paged KV cache, Gated DeltaNet layers over
    slot-indexed convolution windows and recurrent states, with exact rollback (see the module docstring)."""

    ragged = False  # the Gated DeltaNet mixers run per row over [b, n]
    verifies_trees = False  # a recurrent state follows one sequence, not a node's ancestors
    packs_layers = False  # its own mixers (`_mix`) run every layer
    fuses_cpu_step = False
    prefix_cacheable = True  # a hit resumes from a state checkpoint at its last block (see the module docstring)
    checkpointing = False  # keep each request's state at its last block boundary (the KV manager turns it on)
    _chunked = False  # the running forward is a prefill (logits of its last row only): the chunked rule

    model_types = HYBRID_MODEL_TYPES

    def __init__(
        self, model: nn.Module, layer_ids: list[int] | None, max_slots: int, max_len: int,
        num_blocks: int | None = None, kv_block: int = DEFAULT_KV_BLOCK,
    ) -> None:
        reason = hybrid_unsupported(model)
        if reason is not None:
            raise ValueError(f"the native backend does not support {reason}")
        super().__init__(model, layer_ids, max_slots, max_len, num_blocks=num_blocks, kv_block=kv_block)
        # one checkpoint: every linear layer's convolution window and recurrent state (the plan's own arithmetic)
        self.checkpoint_bytes = checkpoint_nbytes(*self.linear_shape, self.dtype.itemsize)
        # the KV manager's checkpoint store (see `dflash_core.hybrid_state.checkpoint_limits`)
        self.checkpoint_limits = checkpoint_limits(self.max_slots, self.checkpoint_bytes)

    def _allocate(self) -> None:
        types = list(self.config.layer_types)
        attn = [li for li, t in enumerate(types) if t == "full_attention"]
        linear = [li for li, t in enumerate(types) if t == "linear_attention"]
        self.kv_index = {li: j for j, li in enumerate(attn)}
        self.linear_index = {li: j for j, li in enumerate(linear)}
        self.k_cache, self.v_cache = self._kv_tensors(len(attn))  # per full-attention layer
        la = self.layers[linear[0]].linear_attn if linear else None
        conv_dim, kernel = (la.conv_dim, la.conv_kernel_size) if la is not None else (0, 1)
        hv, dk, dv = (la.num_v_heads, la.head_k_dim, la.head_v_dim) if la is not None else (0, 0, 0)
        # (linear layers, conv channels, kernel, value heads, key dim, value dim): what `checkpoint_nbytes` takes
        self.linear_shape = (len(linear), conv_dim, kernel, hv, dk, dv)
        self.conv_state = torch.zeros(len(linear), self.max_slots, conv_dim, kernel - 1, dtype=self.dtype,
                                      device=self.device)
        self.rec_state = torch.zeros(len(linear), self.max_slots, hv, dk, dv, dtype=torch.float32, device=self.device)
        # where a forward keeps each row's starting window and state for rollback: allocated once, like the caches
        self.conv_backup = torch.zeros_like(self.conv_state)
        self.rec_backup = torch.zeros_like(self.rec_state)
        # transformers' chunked delta rule (its prefill): taken from the layer's own modeling module
        self._chunk_rule: Callable[..., Any] | None = (
            chunk_gated_delta_rule(la) if la is not None else None)

    # ---- slots ----
    def new_cache(
        self, slot: int, blocks: list[int] | None = None, cached: int = 0,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> HybridSlot:
        """The request's cache: block table `blocks` (as `NativeTarget.new_cache`); zero convolution windows and
        recurrent states, or with `cached` positions from the prefix cache, `state`: the checkpoint (from
        `checkpoint`) at position `cached`, which a hit needs."""
        if cached and state is None:
            raise ValueError(f"a hybrid cache starting at cached={cached} needs the state checkpoint there")
        cached, table = self._paging(slot, blocks, cached)
        if state is None:
            self.conv_state[:, slot] = 0
            self.rec_state[:, slot] = 0
        else:
            conv, rec = state
            self.conv_state[:, slot] = conv
            self.rec_state[:, slot] = rec
        return HybridSlot(slot, length=cached, blocks=table, start=cached, state_end=cached)

    def checkpoint(self, cache: HybridSlot, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every linear layer's window and state after the first `position` tokens (`[L, C, K-1]`, `[L, Hv, dk,
        dv]`, copies), for `new_cache(..., state=)`; None unless the cache holds them: `position` is one of the
        last two committed block boundaries the request passed (its marks) or exactly where its live state is."""
        self._settle(cache)
        layers = len(self.linear_index)
        mark = cache.marks.get(position)
        if mark is not None:
            return (torch.stack([mark[j][0] for j in range(layers)]),
                    torch.stack([mark[j][1] for j in range(layers)]))
        if position == cache.length == cache.state_end:
            return self.conv_state[:, cache.index].clone(), self.rec_state[:, cache.index].clone()
        return None

    def _settle(self, cache: HybridSlot) -> None:
        """The pending boundary state becomes a mark once the tokens before it are committed (the oldest of more
        than MARKS is dropped)."""
        if cache.pending_pos is None or cache.pending_pos > min(cache.length, cache.state_end):
            return
        if len(cache.pending) == len(self.linear_index):
            cache.marks[cache.pending_pos] = cache.pending
            while len(cache.marks) > MARKS:
                del cache.marks[next(iter(cache.marks))]
        cache.pending_pos, cache.pending = None, {}

    @torch.inference_mode()
    def crop(self, cache: HybridSlot, length: int) -> None:
        """Back to the first `length` positions: attention by length, linear layers recomputed from the record."""
        if length >= cache.state_end:  # the states are not past it: attention rows are hidden by length
            cache.length = min(cache.length, length)
            return
        if length < cache.start:
            raise RuntimeError(f"cannot roll a recurrent state back to {length}, before the last forward "
                               f"(which started at {cache.start})")
        keep = length - cache.start
        for j, rec in cache.records.items():
            self._restore(j, cache.index, rec, keep)
        cache.length = cache.state_end = length
        if cache.pending_pos is not None and cache.pending_pos > length:  # a rejected proposal's boundary
            cache.pending_pos, cache.pending = None, {}
        for pos in [p for p in cache.marks if p > length]:
            del cache.marks[pos]

    def _restore(self, j: int, slot: int, rec: _LayerRecord, keep: int) -> None:
        """Layer j's window and state after the first `keep` tokens of the recorded forward."""
        if keep == 0:
            self.conv_state[j, slot] = rec.window
            self.rec_state[j, slot] = rec.state
            return
        if rec.inputs is None or rec.key is None or rec.value is None or rec.decay is None or rec.beta is None:
            raise RuntimeError("this forward was too long to record for rollback into its middle")
        width = rec.window.shape[-1]
        self.conv_state[j, slot] = torch.cat([rec.window, rec.inputs[:, :keep]], dim=-1)[:, -width:] if width else (
            rec.window)
        state = rec.state[None]
        for i in range(keep):  # the forward's operations, in its order, on this row alone
            state = _delta_step(state, rec.key[None, :, i], rec.value[None, :, i], rec.decay[None, :, i],
                                rec.beta[None, :, i])
        self.rec_state[j, slot] = state[0]

    # ---- forward ----
    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[Any], features: bool, last_only: bool = False) -> list[Any]:
        kvb = self.kv_block_size
        for tokens, start, cache in rows:  # a new forward: new records
            self._settle(cache)
            cache.start, cache.records = start, {}
            cache.pending, cache.pending_pos = {}, None
            if self.checkpointing and (start + len(tokens)) // kvb * kvb > start:  # it passes a block boundary
                cache.pending_pos = (start + len(tokens)) // kvb * kvb
        # logits read at the last row only: a prefill (or a chunk of one), never rolled back into its middle, since
        # no row's choice is checked against a draft; a single row then takes the chunked rule from its state
        self._chunked = last_only
        return super().forward_batch(rows, features, last_only)

    def _mix(self, li: int, layer: nn.Module, x: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        if li in self.linear_index:
            return self._linear(self.linear_index[li], layer.linear_attn, x, batch)
        return self._gated_attention(li, layer.self_attn, x, batch, rope)

    def _gated_attention(self, li: int, attn: nn.Module, x: torch.Tensor, batch: Batch, rope: Rope) -> torch.Tensor:
        """Full attention whose query projection also yields an output gate (Qwen3.5)."""
        b, n = batch.b, batch.n
        q, gate = torch.chunk(attn.q_proj(x).view(b, n, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(b, n, -1)
        q = attn.q_norm(q.reshape(b, n, -1, self.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, -1, self.head_dim)
        cos, sin = rope
        out = self._attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, *self.layer_kv(li), batch, self.scaling)
        out = out.transpose(1, 2).reshape(b, n, -1) * torch.sigmoid(gate)
        return attn.o_proj(out)

    def _linear(self, j: int, la: nn.Module, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """A Gated DeltaNet layer over the rows' windows and states; records each row for rollback."""
        b, n = batch.b, batch.n
        mixed, z, b_proj, a_proj = self._project(la, x)  # [b, C, n], [b, n, Hv, dv], [b, n, Hv], [b, n, Hv]
        beta = b_proj.sigmoid()
        g = -la.A_log.float().exp() * F.softplus(a_proj.float() + la.dt_bias)
        window = self.conv_state[j, batch.slots]  # [b, C, K-1]
        full = torch.cat([window, mixed.to(window.dtype)], dim=-1)
        weight = la.conv1d.weight
        conv = F.conv1d(full.to(weight.dtype), weight, la.conv1d.bias, padding=0, groups=la.conv_dim)[:, :, -n:]
        conv = F.silu(conv).to(x.dtype).transpose(1, 2)
        q, k, v = torch.split(conv, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(b, n, -1, la.head_k_dim)
        k = k.reshape(b, n, -1, la.head_k_dim)
        v = v.reshape(b, n, -1, la.head_v_dim)
        state0 = self.rec_state[j, batch.slots]  # [b, Hv, dk, dv]
        # checkpointing: the token count after which each row passes its last block boundary (None: it does not)
        cuts = [None if c.pending_pos is None else c.pending_pos - s for _, s, c in batch.rows]
        marks: dict[int, torch.Tensor] = {}
        if self._chunked or (b == 1 and int(batch.rows[0][1]) == 0):  # a prefill: the chunked rule, row by row
            outs, states = [], []
            for r, (tokens, start, _) in enumerate(batch.rows):
                m = len(tokens)
                # from the row's state: a later chunk of a long prompt, or the suffix after a prefix-cache hit
                out, last, mark = self._chunked_row(q[r : r + 1, :m], k[r : r + 1, :m], v[r : r + 1, :m],
                                                    g[r : r + 1, :m], beta[r : r + 1, :m],
                                                    None if start == 0 else state0[r : r + 1], cuts[r])
                outs.append(out[0])
                states.append(last[0])
                if mark is not None:
                    marks[r] = mark
            core = outs[0].new_zeros(b, n, *outs[0].shape[1:])  # padding columns: zeros, never read
            for r, out in enumerate(outs):
                core[r, : out.shape[0]] = out
            state = torch.stack(states)
            kf = vf = gf = bf = None
        else:
            core, state, (kf, vf, gf, bf) = self._recurrent(q, k, v, g, beta, state0, batch, cuts, marks)
        # the new window of each row: the last K-1 of [window ++ its real tokens' inputs]
        width = window.shape[-1]
        for r, (tokens, _, cache) in enumerate(batch.rows):
            m = len(tokens)
            self.conv_backup[j, cache.index] = window[r]
            self.rec_backup[j, cache.index] = state0[r]
            rec = _LayerRecord(self.conv_backup[j, cache.index], self.rec_backup[j, cache.index])
            if kf is not None:  # copies of the row's tokens only, so the batch's tensors are not kept alive
                rec.inputs = mixed[r, :, :m].to(window.dtype, copy=True)
                rec.key, rec.value = kf[r, :, :m].clone(), vf[r, :, :m].clone()
                rec.decay, rec.beta = gf[r, :, :m].clone(), bf[r, :, :m].clone()
            cache.records[j] = rec
            if r in marks:  # the window and state at the row's last block boundary (copies)
                cut = cuts[r]
                cache.pending[j] = (full[r, :, cut : cut + width].clone(), marks[r])
            self.conv_state[j, cache.index] = full[r, :, m : m + width]
            self.rec_state[j, cache.index] = state[r]
            cache.state_end = cache.start + m
        core = la.norm(core.reshape(-1, la.head_v_dim), z.reshape(-1, la.head_v_dim)).reshape(b, n, -1)
        return la.out_proj(core)

    def _chunked_row(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        init: torch.Tensor | None, cut: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One row's tokens [1, m, ...] through transformers' chunked rule (as its own prefill) from state `init`
        [1, Hv, dk, dv] (None: zeros): its output [1, m, Hv, dv], its last state [1, ...] and, when it passes its
        last block boundary `cut` tokens in, the state there (split there: it comes out of the first part)."""
        m = q.shape[1]
        rule = functools.partial(self._chunk_rule, output_final_state=True, use_qk_l2norm_in_kernel=True)
        if cut is not None and cut < m:
            head, mid = rule(q[:, :cut], k[:, :cut], v[:, :cut], g=g[:, :cut], beta=beta[:, :cut], initial_state=init)
            tail, state = rule(q[:, cut:], k[:, cut:], v[:, cut:], g=g[:, cut:], beta=beta[:, cut:],
                               initial_state=mid)
            return torch.cat([head, tail], dim=1), state, mid[0]
        core, state = rule(q, k, v, g=g, beta=beta, initial_state=init)
        return core, state, None if cut is None else state[0]

    def _project(self, la: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's convolution input [b, C, n] (q, k, v channels), output gate z and the b / a projections."""
        b, n = x.shape[:2]
        if self.config.model_type == "qwen3_next":  # fused projections with per-key-head grouping
            q, k, v, z, b_proj, a_proj = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
            mixed = torch.cat([t.reshape(b, n, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
            return mixed, z, b_proj, a_proj
        z = la.in_proj_z(x).reshape(b, n, -1, la.head_v_dim)
        return la.in_proj_qkv(x).transpose(1, 2), z, la.in_proj_b(x), la.in_proj_a(x)

    def _recurrent(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, batch: Batch, cuts: Sequence[int | None] = (),
        marks: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The token-by-token delta rule (transformers' decode path) over padded rows: a row's state stops at its
        last real token. Returns the output [b, n, Hv, dv], the final states and the normalised inputs; row r's
        state after its first `cuts[r]` tokens goes to `marks[r]` (a copy)."""
        at: dict[int, list[int]] = {}
        for r, cut in enumerate(cuts):
            if cut is not None and marks is not None:
                at.setdefault(cut - 1, []).append(r)
        dtype, hk, hv = v.dtype, k.shape[2], v.shape[2]
        if hk != hv:  # each q/k head serves hv // hk consecutive value heads
            q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32) for t in (q, k, v, beta, g))
        q, k = _l2norm(q), _l2norm(k)
        q = q / (q.shape[-1] ** 0.5)
        out = torch.zeros_like(v)
        active = torch.arange(batch.n, device=self.device)[None] < batch.lengths[:, None]  # [b, n]
        for i in range(batch.n):
            new = _delta_step(state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
            out[:, :, i] = (new * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
            state = torch.where(active[:, i, None, None, None], new, state)
            for r in at.get(i, ()):
                marks[r] = state[r].clone()
        return out.transpose(1, 2).to(dtype), state, (k, v, g, beta)
