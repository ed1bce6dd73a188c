"""The `generic` target backend: any attention-only transformers decoder, batched over the paged KV cache through
transformers' attention interface.

The model runs its own forward (embeddings, norms, rotary, MoE routing, MLA projections, logit softcapping, its
layers' sliding windows and attention sinks) over the rows' real tokens as ONE sequence [1, T], each token at its
own position. Only attention is ours: transformers calls `paged_attention_forward` (registered in its
`AttentionInterface` as "dflash_paged", with no mask function, so transformers builds no mask) with a layer's new
queries, keys and values. It writes the keys and values at the tokens' rows of that layer's paged cache and
attends each query over its own request's keys up to its position (`PagedAttention`, gather + SDPA; explicit
matmuls where the layer has sinks or a softcap), through the forward's block tables. Layers that reuse another
layer's keys (Gemma's KV sharing: the very same tensor object) read that layer's cache and write nothing.

The runner swaps the model's attention implementation to "dflash_paged" for its own forwards only, so the same
model object still runs transformers' own attention elsewhere (a reference `generate`, the `hf` runner).

Which layers keep which cache is found at start-up by one probe forward of one token (`probe_layout`): each
attention module's key heads and dims, and which reuse another's keys. A model whose probe shows layers that are
not attention (a recurrent mixer keeps state this cache cannot roll back), or attention this function does not
compute (its own mask, bidirectional, extra tensor arguments), is refused with its reason. DeepSeek sparse
attention (GLM-5) reads its history compressed from the cache it is given: its pages and that cache are
`runners/dsa.py`'s (`layout_of`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.attention import PagedAttention, prepare, write_kv
from dflash_core.families import rope_reads_the_batch
from dflash_core.kv.pool import DEFAULT_KV_BLOCK
from dflash_core.runners.base import TargetOutput
from dflash_core.runners.dsa import DSALayout, PagedLatents, dsa_layout, history_mask, sparse_attention
from dflash_core.runners.paged import Geometry, PagedTarget, Rows

log = logging.getLogger("dflash.generic")

ATTENTION_NAME = "dflash_paged"
# the attention kinds of `config.layer_types` this runner serves: full, a sliding window, and DeepSeek sparse
# attention ("indexed_attention", GLM-5: its latents and indexer keys in the pages, `runners/dsa.py`)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention")


@dataclass(frozen=True)
class LayerKV:
    """One cache the model keeps: its key heads, key and value dims."""

    kv_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_row(self, dtype_bytes: int) -> int:
        return self.kv_heads * (self.key_dim + self.value_dim) * dtype_bytes


@dataclass
class KVLayout:
    """Which caches a model keeps and which attention module uses which (a module that reuses another's keys
    shares its cache and writes nothing)."""

    caches: list[LayerKV] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)  # id(attention module) -> its cache's index in `caches`
    writes: dict[int, bool] = field(default_factory=dict)  # id(attention module) -> whether it writes its cache
    calls: int = 0  # attention calls of one forward

    def bytes_per_row(self, dtype_bytes: int) -> int:
        """Keys and values of one position over every cache."""
        return sum(c.bytes_per_row(dtype_bytes) for c in self.caches)


@dataclass
class _Forward:
    """What the attention function needs of the forward in flight (held in `_ACTIVE` while it runs)."""

    runner: GenericTarget
    geometry: Geometry
    write: torch.Tensor  # [T] cache rows of the real tokens
    flat: tuple[torch.Tensor, torch.Tensor] | None  # each token's (row, column) in [b, n]; None: one row, unpadded
    windows: dict[int, PagedAttention] = field(default_factory=dict)
    # a DSA model's forward: its layers read their history from `PagedLatents` and pass the forward's history mask
    # and their top-k indices; attention is over what they pass (`dsa.sparse_attention`)
    sparse: bool = False

    def attention(self, window: int | None) -> PagedAttention:
        if window is None:
            return self.geometry.attention
        if window not in self.windows:
            self.windows[window] = self.geometry.attention.windowed(window)
        return self.windows[window]


class _Probe:
    """The probe forward's attention: records each module's keys and runs plain attention over the token."""

    def __init__(self) -> None:
        self.layout = KVLayout()
        self.keys: dict[int, tuple[torch.Tensor, int]] = {}  # id(key tensor) -> (the tensor, its cache)


_ACTIVE: contextvars.ContextVar[_Forward | _Probe | None] = contextvars.ContextVar("dflash_paged", default=None)


def paged_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
    softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: query [1, heads, T, d], key [1, kv_heads, T, d] and value
    [1, kv_heads, T, dv] of the forward's new tokens -> [1, T, heads, dv]. In a DSA model's forward the keys and
    values are the rows' whole histories, with the forward's history mask and each query's top-k `indices`
    (`dsa.sparse_attention`). Other keyword arguments (the positions, flash-attention's) are not used."""
    active = _ACTIVE.get()
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(active, _Probe):
        _refuse_what_is_not_ours(module, attention_mask, kwargs)
        return _probe_attention(active, module, query, key, value, scale, sliding_window), None
    if active is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention runs only inside the generic runner's forward")
    if active.sparse:
        return sparse_attention(query, key, value, attention_mask, kwargs.get("indices"), scale), None
    runner = active.runner
    mid = id(module)
    index = runner.layout.owner[mid]
    kc, vc = runner.k_cache[index], runner.v_cache[index]
    if runner.layout.writes[mid]:
        write_kv(kc, vc, active.write, key[0].transpose(0, 1), value[0].transpose(0, 1))
    attention = active.attention(sliding_window)
    if active.flat is None:  # one row: its tokens are already the [1, heads, n, d] layout
        out = attention(query, kc, vc, scale, softcap, s_aux)
        return out.transpose(1, 2), None
    rows, cols = active.flat
    g = active.geometry
    queries = query.new_zeros(g.b, query.shape[1], g.n, query.shape[3])  # padding queries: computed, not read
    queries[rows, :, cols] = query[0].transpose(0, 1)
    out = attention(queries, kc, vc, scale, softcap, s_aux)[rows, :, cols]  # [T, heads, dv]
    return out[None], None


# tensors transformers hands every attention function that this one may ignore (the positions are in the geometry)
_IGNORED_TENSORS = ("position_ids", "cache_position")


def _refuse_what_is_not_ours(module: nn.Module, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """ValueError where a layer asks for attention this function does not compute: a mask the model made itself
    (transformers builds none for a registered attention without a mask function), non-causal attention, or a
    tensor argument it would ignore (a sparse layer's indices, a position bias, sinks under another name)."""
    if attention_mask is not None:
        raise ValueError("a layer passes its own attention mask")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError("a layer attends bidirectionally")
    extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _IGNORED_TENSORS)
    if extra:
        raise ValueError(f"a layer passes attention arguments this runner does not apply ({', '.join(extra)})")


def _probe_attention(probe: _Probe, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    layout = probe.layout
    mid = id(module)
    if mid in layout.owner:
        raise ValueError("an attention module that runs twice in one forward")
    layout.calls += 1
    shared = probe.keys.get(id(key))
    if shared is not None and shared[0] is key:  # the very tensor another layer made: it reads that cache
        layout.owner[mid], layout.writes[mid] = shared[1], False
    else:
        layout.caches.append(LayerKV(int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1])))
        index = len(layout.caches) - 1
        layout.owner[mid], layout.writes[mid] = index, True
        probe.keys[id(key)] = (key, index)
    out = F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def text_config(model: nn.Module) -> Any:
    """The config of the model's text decoder (the model's own for a text-only model)."""
    return model.config.get_text_config()


def _configs(cfg: Any) -> list[Any]:
    """`cfg` and every sub-config under it (the attention implementation is set on each)."""
    found = [cfg]
    for key in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found += _configs(sub)
    return found


@contextlib.contextmanager
def using_paged_attention(model: nn.Module, active: _Forward | _Probe) -> Iterator[None]:
    """The model's attention is `paged_attention_forward` over `active` for the block; after it each config has its
    own implementation back. The swap is on the model's configs, so no other thread may run the same model
    meanwhile (the engine's forwards all run on its one worker thread)."""
    _register()
    configs = _configs(model.config)
    before = [c._attn_implementation_internal for c in configs]
    token = _ACTIVE.set(active)
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        for c, implementation in zip(configs, before):
            c._attn_implementation_internal = implementation
        _ACTIVE.reset(token)


def unsupported(model: nn.Module) -> str | None:
    """Why the generic runner cannot run `model`, from its config alone; None when it may (the probe decides)."""
    cfg = text_config(model)
    kinds = sorted({kind for kind in (getattr(cfg, "layer_types", None) or []) if kind not in ATTENTION_LAYER_TYPES})
    if kinds:
        return (f"layers of kind {', '.join(kinds)} (the generic runner runs full, sliding-window and DeepSeek sparse "
                f"attention only)")
    if model.get_output_embeddings() is None:
        return "a model without an output head"
    if rope_reads_the_batch(cfg):
        return ("a rotary embedding that picks its frequencies from the largest position of each forward (dynamic "
                "NTK or LongRoPE), so one request's output would depend on the others batched with it")
    return None


@torch.inference_mode()
def probe_layout(model: nn.Module) -> KVLayout:
    """The caches `model` keeps, from one forward of one token with the probe's attention. ValueError (the reason)
    where the generic runner cannot run it."""
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    probe = _Probe()
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with using_paged_attention(model, probe):
            model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False, logits_to_keep=1)
    except ValueError:  # a refusal of ours (`_refuse_what_is_not_ours`, `_probe_attention`)
        raise
    except Exception as exc:  # a family whose forward needs what this runner does not give it (its own cache...)
        raise ValueError(f"its forward fails without transformers' cache ({type(exc).__name__}: {exc})") from exc
    layout = probe.layout
    layers = int(text_config(model).num_hidden_layers)
    if layout.calls != layers:
        raise ValueError(f"{layout.calls} attention calls in a forward of {layers} layers (a layer that is not "
                         f"attention keeps state the paged cache cannot roll back)")
    return layout


def layout_of(model: nn.Module) -> KVLayout | DSALayout:
    """The pages the generic runner keeps for `model`: a DSA model's latents and indexer keys (from its config),
    else each attention layer's keys and values (`probe_layout`). ValueError where it cannot run the model."""
    cfg = text_config(model)
    if "indexed_attention" not in (getattr(cfg, "layer_types", None) or []):
        return probe_layout(model)
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    return dsa_layout(cfg)


class GenericTarget(PagedTarget):
    """Batched target forward of any attention-only transformers decoder over the paged KV cache; same outputs as
    transformers' own forward."""

    backend = "generic"

    def __init__(
        self, model: nn.Module, layer_ids: list[int] | None, max_slots: int, max_len: int,
        num_blocks: int | None = None, kv_block: int = DEFAULT_KV_BLOCK, layout: KVLayout | DSALayout | None = None,
    ) -> None:
        self.model = model.eval()
        self.layout = layout if layout is not None else layout_of(model)
        cfg = text_config(model)
        self.config = cfg
        self.lm_head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", max_len))
        self.layer_ids = list(layer_ids or [])
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._init_paging(max_slots, max_len, num_blocks, kv_block)
        prepare(self.device)
        rows = self.kv_rows_total
        def pages(*shape: int) -> torch.Tensor:
            return torch.zeros(rows, *shape, dtype=self.dtype, device=self.device)
        if isinstance(self.layout, DSALayout):  # k_cache: each layer's latents; v_cache: its indexer's keys
            self.k_cache = [pages(d) for d in self.layout.latent_dims]
            self.index_keys = {li: pages(d) for li, d in self.layout.index_dims.items()}
            self.v_cache = list(self.index_keys.values())
            self.latent_rank = int(cfg.kv_lora_rank)
        else:
            self.k_cache = [pages(c.kv_heads, c.key_dim) for c in self.layout.caches]
            self.v_cache = [pages(c.kv_heads, c.value_dim) for c in self.layout.caches]
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_block = kv_block * self.layout.bytes_per_row(elem)

    @property
    def pads_rows(self) -> bool:
        return False  # the rows' real tokens run as one sequence

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.embed.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @torch.inference_mode()
    def forward_batch(self, rows: Rows, features: bool, last_only: bool = False) -> list[TargetOutput]:
        """Several requests in ONE forward of their real tokens. Raises ValueError when a row starts past its
        cache's length or its blocks do not cover its positions."""
        self._check(rows)
        g = self._geometry(rows)
        lengths = [len(t) for t, _, _ in rows]
        if g.b == 1:
            flat, write, pos = None, g.write[0], g.pos
        else:
            row_of, col_of = self._flat(rows, g)
            flat, write, pos = (row_of, col_of), g.write[row_of, col_of], g.pos[row_of, col_of][None]
        ids = torch.tensor([[tok for t, _, _ in rows for tok in t]], device=self.device)
        keep: int | torch.Tensor = 0
        if last_only:
            keep = g.lengths.cumsum(0) - 1  # each row's last token
        want_hidden = features and bool(self.layer_ids)
        extra: dict[str, Any] = {}
        if isinstance(self.layout, DSALayout):  # its layers read their history from the pages themselves
            history, mask = history_mask(g.table, [s for _, s, _ in rows], lengths, self.kv_block_size, self.device)
            latents = PagedLatents(self.k_cache, self.index_keys, self.latent_rank, write, history)
            extra = dict(cache=latents, attention_mask={"indexed_attention": mask})
        active = _Forward(self, g, write, flat, sparse=bool(extra))
        with using_paged_attention(self.model, active):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=want_hidden,
                             logits_to_keep=keep, **extra)
        logits = out.logits[0].float()
        feat = None
        if want_hidden:  # transformers' hidden state i + 1 is target layer i's output (the last: after the norm)
            feat = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return self.split_rows(rows, logits, feat, last_only)
