"""Memory arithmetic, in one place: the bytes of a KV block (target and draft pages), a hybrid's recurrent state
(per running request, and its prefix-cache checkpoints: `dflash_core.hybrid_state`, the runner's own figures), and
the start-up plan that sizes the KV pool from `--kv-cache-memory` or
`--gpu-memory-utilization` (by default: 0.9 of a CUDA card, as vLLM; elsewhere a share of the free RAM).

`dflash-bench memory` (`dflash_core/bench/memory.py`) estimates presets with the same functions; `load_models`
plans the budget from the loaded models (`plan_memory`), logs it, and refuses a setting that cannot fit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from dflash_core.hybrid_state import checkpoint_limits, checkpoint_nbytes, record_nbytes, request_state_bytes

GB = 1e9
GIB = 1 << 30
# Activations beside the caches on CUDA (prefill chunks, the MLP of a verify batch, allocator slack), plus the
# float32 logits of a full verify batch (added per setting in `cuda_cache_budget`).
ACTIVATION_RESERVE = 2 * GIB
# The CUDA default when neither budget flag is set (vLLM's default --gpu-memory-utilization).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The default budget off CUDA: a quarter of the available RAM, at most 1 GiB. CPU decoding is compute-bound at a
# few streams, so a bigger pool buys little there, while the pool is zero-filled at start-up (about a second per
# GiB on a small machine) and RAM is shared with the weights and the OS. 1 GiB holds 131k tokens of the demo pair
# (float32) or ~3,200 of Qwen3-8B with its draft in float32; --kv-cache-memory sets more.
RAM_KV_DEFAULT_CAP = 1 * GIB
RAM_KV_FRACTION = 0.25
SHORT_REQUEST = 2048  # the second request length the plan's log line (and `dflash-bench memory`) reports
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: str | int | float) -> int:
    """A size in bytes: an integer, or a number with a unit ("4GiB", "4 GB", "512MiB", "1.5G"; GB = 1e9,
    GiB and G = 2**30). ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 4GiB, 4GB or 4294967296, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size such as 4GiB, 4GB or 4294967296, got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a size must be > 0, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """Bytes as GB (1e9) with two decimals, MB below 0.1 GB, KB below 0.1 MB."""
    if n >= 0.1 * GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


# ---- shapes ----
def layer_types(m: dict[str, Any]) -> list[str]:
    """Each layer's token mixer: the config's `layer_types`, else Gated DeltaNet with every
    `full_attention_interval`-th layer full attention where the config has linear-attention heads, else all
    full attention."""
    n = int(m["num_hidden_layers"])
    if m.get("layer_types"):
        return list(m["layer_types"])
    if m.get("linear_num_value_heads"):
        every = int(m.get("full_attention_interval") or 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def linear_dims(m: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """Gated DeltaNet shape: (convolution channels, kernel, value heads, key head dim, value head dim)."""
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    return 2 * nk * dk + nv * dv, int(m.get("linear_conv_kernel_dim") or 4), nv, dk, dv


def layer_shape(m: dict[str, Any], index: int, kind: str) -> dict[str, Any]:
    """The shape of layer `index`, of `kind`: the model's, with the kind's own fields (`layer_overrides`: Gemma 4's
    full-attention layers have their own head dim and KV heads) and the layer's (`per_layer_config`, as
    transformers writes a heterogeneous config) where it has them."""
    own = (m.get("per_layer_config") or {})
    return {**m, **(m.get("layer_overrides") or {}).get(kind, {}), **own.get(str(index), own.get(index, {}))}


def kv_bytes_per_row(m: dict[str, Any], dtype_bytes: int) -> int:
    """Keys + values of one position over the layers that keep them: not Gated DeltaNet layers, not the last
    `num_kv_shared_layers` (they read an earlier layer's keys), each with its own KV heads and head dim. Values are
    counted where a layer's values equal its keys too (`attention_k_eq_v`): the paged cache stores both."""
    kinds = layer_types(m)
    if m.get("index_head_dim"):  # DeepSeek sparse attention: per layer its latent and rotated key, and its
        # indexer's keys where it has its own indexer (`dflash_core/runners/dsa.py`)
        indexers = sum(kind != "shared" for kind in (m.get("indexer_types") or ["full"] * len(kinds)))
        latent = int(m["kv_lora_rank"]) + int(m["qk_rope_head_dim"])
        return (len(kinds) * latent + indexers * int(m["index_head_dim"])) * dtype_bytes
    kinds = kinds[: len(kinds) - int(m.get("num_kv_shared_layers") or 0)]
    rows = 0
    for index, kind in enumerate(kinds):
        if kind != "linear_attention":
            shape = layer_shape(m, index, kind)
            key_dim = int(shape.get("key_dim") or shape["head_dim"])
            rows += int(shape["num_key_value_heads"]) * (key_dim + int(shape.get("value_dim") or shape["head_dim"]))
    return rows * dtype_bytes


def _linear_layers(m: dict[str, Any]) -> int:
    """Gated DeltaNet layers of the model (0: attention only)."""
    return sum(kind == "linear_attention" for kind in layer_types(m))


def checkpoint_bytes(m: dict[str, Any], dtype_bytes: int) -> int:
    """One copy of a hybrid's state from its config: every Gated DeltaNet layer's convolution window (kernel - 1
    inputs, model dtype) and recurrent state (value heads x key dim x value dim, float32), as the runner's
    `checkpoint_bytes`; 0 without such layers."""
    linear = _linear_layers(m)
    return checkpoint_nbytes(linear, *linear_dims(m), dtype_bytes) if linear else 0


def record_bytes(m: dict[str, Any], dtype_bytes: int, tokens: int) -> int:
    """The rollback records of a verify step of `tokens` tokens (`dflash_core.hybrid_state.record_nbytes`); 0
    without Gated DeltaNet layers."""
    linear = _linear_layers(m)
    if not linear:
        return 0
    conv, _, value_heads, key_dim, value_dim = linear_dims(m)
    return tokens * record_nbytes(linear, conv, value_heads, key_dim, value_dim, dtype_bytes)


def state_bytes_per_slot(m: dict[str, Any], dtype_bytes: int, prefix_caching: bool = False,
                         verify_tokens: int = 1) -> int:
    """A running request's fixed-size state in Gated DeltaNet layers, at most: the live state and the copy a verify
    step records for rollback, with prefix caching the checkpoint copies it holds (marks, a pending boundary
    state, a deferred checkpoint), and the records of a verify step of `verify_tokens` tokens (the DFlash block):
    `dflash_core.hybrid_state.request_state_bytes`; 0 without such layers."""
    return pool_state_costs(m, dtype_bytes, prefix_caching, verify_tokens)["state"]


def normalize_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """A model's config.json fields (its text_config folded in) with the KV heads and head dim filled in."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    shape = {**cfg, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi): the generic runner caches per-head keys and values
        shape.update(num_key_value_heads=heads, key_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
                     value_dim=int(cfg["v_head_dim"]))
    if cfg.get("global_head_dim"):  # Gemma 4: full-attention layers with their own head dim and KV heads
        shape["layer_overrides"] = {"full_attention": {
            "head_dim": int(cfg["global_head_dim"]),
            "num_key_value_heads": int(cfg.get("num_global_key_value_heads") or kv_heads),
            "k_eq_v": bool(cfg.get("attention_k_eq_v"))}}
    return shape


# ---- the KV pool ----
@dataclass(frozen=True)
class PoolCosts:
    """What the KV pool costs: `target_row` / `draft_row` bytes per cached position (the draft's pages share the
    target's block ids, so a block holds both), `state` fixed bytes per running request (a hybrid's convolution
    windows and recurrent states: live, rollback copy and, with prefix caching, its checkpoint copies), the KV block
    of `kv_block` positions, `extra_len`: positions a request may reach beyond max_model_len (its verify block and
    one more, as the runners' `max_len`), and `checkpoint`: bytes of one state checkpoint in the KV manager's
    store (0: no store; a hybrid with prefix caching off, or no linear layers)."""

    target_row: int
    draft_row: int
    state: int
    kv_block: int
    extra_len: int
    checkpoint: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: target and draft pages of `kv_block` positions."""
        return self.kv_block * (self.target_row + self.draft_row)

    def request_blocks(self, tokens: int) -> int:
        """Blocks one request of `tokens` positions (prompt + output) holds at most."""
        return -(-(tokens + self.extra_len) // self.kv_block)

    def min_blocks(self, max_model_len: int) -> int:
        """vLLM's rule: one request of max_model_len must fit (plus block 0, the null block, never handed out)."""
        return self.request_blocks(max_model_len) + 1

    def max_len_within(self, num_blocks: int) -> int:
        """The longest max_model_len whose request fits `num_blocks` blocks (0 when none does)."""
        return max(0, (num_blocks - 1) * self.kv_block - self.extra_len)

    def store_bytes(self, slots: int) -> int:
        """The checkpoint store's limit beside `slots` running requests (`HybridTarget.checkpoint_limits`)."""
        return checkpoint_limits(slots, self.checkpoint)[1] if self.checkpoint else 0

    def states(self, slots: int) -> int:
        """Fixed bytes beside the pool: `slots` running requests' states and the checkpoint store."""
        return slots * self.state + self.store_bytes(slots)


def pool_state_costs(m: dict[str, Any], dtype_bytes: int, prefix_caching: bool, verify_tokens: int) -> dict[str, int]:
    """A target's `state` and `checkpoint` fields of PoolCosts, from its config: the state a running request holds
    at most (its verify step of `verify_tokens` tokens recorded), and with prefix caching on the store's checkpoint
    size (0 off: no store, no checkpoint copies)."""
    one = checkpoint_bytes(m, dtype_bytes)
    records = record_bytes(m, dtype_bytes, verify_tokens)
    return {"state": request_state_bytes(one, prefix_caching, records), "checkpoint": one if prefix_caching else 0}


@dataclass(frozen=True)
class MemoryBudget:
    """The start-up memory plan: weights, and the KV pool of `num_blocks` blocks of `kv_block` positions (block 0
    the null block) beside `slots` running requests' recurrent states (`state`, their checkpoint copies included)
    and a hybrid's checkpoint store (`checkpoints`: its byte limit). `num_blocks` None: no pool (hf backend)."""

    weights: int
    slots: int
    max_model_len: int
    kv_block: int
    num_blocks: int | None
    target_kv: int
    draft_kv: int
    state: int
    cache_budget: int | None  # bytes the caches may take (None: not limited)
    source: str  # where the budget came from ("--kv-cache-memory 4GiB", ...), or "no budget set"
    extra_len: int = 0
    notes: tuple[str, ...] = ()  # what the plan lowered, and why (logged)
    checkpoints: int = 0  # a hybrid's checkpoint store (prefix caching on): at most these bytes

    @property
    def caches(self) -> int:
        return self.target_kv + self.draft_kv + self.state + self.checkpoints

    @property
    def pool_tokens(self) -> int:
        """Positions of KV the pool holds (its usable blocks; 0 without a pool)."""
        return (self.num_blocks - 1) * self.kv_block if self.num_blocks else 0

    def requests_of(self, tokens: int) -> int:
        """Requests of `tokens` positions each that run at once: what the pool holds, at most the running cap."""
        if not self.num_blocks:
            return self.slots
        need = -(-(tokens + self.extra_len) // self.kv_block)
        return min(self.slots, (self.num_blocks - 1) // need)

    def summary(self) -> str:
        """One log line: weights, the pool (blocks, tokens, target and draft KV), recurrent state, the budget."""
        if self.num_blocks is None:
            return (f"memory: weights {format_bytes(self.weights)}; no KV pool (the hf backend's caches grow with "
                    f"each request); max_model_len {self.max_model_len:,}")
        parts = [f"weights {format_bytes(self.weights)}",
                 f"KV pool {self.num_blocks - 1:,} blocks x {self.kv_block} = {self.pool_tokens:,} tokens "
                 f"(target KV {format_bytes(self.target_kv)}, draft KV {format_bytes(self.draft_kv)})"]
        if self.state:
            parts.append(f"recurrent state {format_bytes(self.state)} ({self.slots} running requests)")
        if self.checkpoints:
            parts.append(f"state checkpoints {format_bytes(self.checkpoints)}")
        budget = (f"of a {format_bytes(self.cache_budget)} cache budget ({self.source})"
                  if self.cache_budget is not None else f"({self.source})")
        full = self.requests_of(self.max_model_len)
        fits = f"max_model_len {self.max_model_len:,}: {full:,} request(s) of full length"
        if self.max_model_len > SHORT_REQUEST:
            fits += f", {self.requests_of(SHORT_REQUEST):,} of {SHORT_REQUEST:,} tokens"
        fits += f" at once (running cap {self.slots})"
        return f"memory: {', '.join(parts)}; caches {format_bytes(self.caches)} {budget}; {fits}"


def _raise_hint(source: str) -> str:
    """The setting to raise: the flag the budget came from, else --kv-cache-memory."""
    flag = source.split()[0] if source.startswith("--") else ""
    return f"raise {flag}" if flag else "set --kv-cache-memory"


def plan_memory(
    costs: PoolCosts, weights: int, slots: int, max_model_len: int | None, model_max_len: int,
    cache_budget: int | None, source: str,
) -> MemoryBudget:
    """The KV pool within `cache_budget` bytes. A hybrid's recurrent states come first: each running request's
    (`costs.state`) and the checkpoint store's limit (`costs.store_bytes`), together at most half of the budget
    (the running cap is lowered to fit: memory decides how many run); the rest buys
    `num_blocks = rest // block_bytes`. One request of max_model_len must fit (vLLM's rule): an unset
    max_model_len is the model's, lowered to the longest that fits; a set one that does not fit is a ValueError
    saying what would. No budget: every running request at full length (the runners' default pool)."""
    length = max_model_len or model_max_len
    if cache_budget is None:
        num_blocks = slots * costs.request_blocks(length) + 1
        return _budget(costs, weights, slots, length, num_blocks, None, source, ())
    notes: list[str] = []
    if costs.state:
        half = cache_budget // 2
        fit = min(slots, half // costs.state)
        while fit > 0 and costs.states(fit) > half:  # the store grows with the running cap
            fit -= 1
        if fit < 1:
            store = (f" and the state checkpoints' {format_bytes(costs.store_bytes(1))}"
                     if costs.checkpoint else "")
            off = " or --no-enable-prefix-caching (no checkpoint copies, no store)" if costs.checkpoint else ""
            raise ValueError(
                f"one request's recurrent state takes {format_bytes(costs.state)}{store}, more than half of the "
                f"{format_bytes(cache_budget)} that {source} leaves for caches; {_raise_hint(source)}{off}")
        if fit < slots:
            store = " and the state checkpoints" if costs.checkpoint else ""
            notes.append(f"running requests capped at {fit} (max_num_seqs {slots}): their recurrent states "
                         f"({format_bytes(costs.state)} each){store} take at most half of the cache budget")
            slots = fit
    num_blocks = (cache_budget - costs.states(slots)) // costs.block_bytes
    if num_blocks < costs.min_blocks(length):
        fit_len = min(model_max_len, costs.max_len_within(num_blocks))
        if max_model_len is None and fit_len >= 2:
            notes.append(f"max_model_len {fit_len:,} (the model's {model_max_len:,} does not fit one request in "
                         f"the KV pool)")
            length = fit_len
        else:
            need = costs.min_blocks(length) - 1
            fits = (f"which fits max_model_len <= {fit_len:,}: lower --max-model-len or {_raise_hint(source)}"
                    if fit_len >= 2 else f"which fits no request: {_raise_hint(source)}")
            raise ValueError(
                f"max_model_len {length:,} needs {need:,} KV blocks of {costs.kv_block} tokens "
                f"({format_bytes(need * costs.block_bytes)}) for one request; {source} leaves "
                f"{format_bytes(cache_budget)} for caches: {max(num_blocks - 1, 0):,} blocks, {fits}")
    return _budget(costs, weights, slots, length, num_blocks, cache_budget, source, tuple(notes))


def _budget(
    costs: PoolCosts, weights: int, slots: int, length: int, num_blocks: int, cache_budget: int | None,
    source: str, notes: tuple[str, ...],
) -> MemoryBudget:
    rows = num_blocks * costs.kv_block
    return MemoryBudget(weights, slots, length, costs.kv_block, num_blocks, costs.target_row * rows,
                        costs.draft_row * rows, costs.state * slots, cache_budget, source, costs.extra_len, notes,
                        costs.store_bytes(slots))


def no_pool(weights: int, slots: int, max_model_len: int, kv_block: int) -> MemoryBudget:
    """The plan of a runner without a pool (hf): weights only; its caches grow with each request."""
    return MemoryBudget(weights, slots, max_model_len, kv_block, None, 0, 0, 0, None, "no KV pool")


def cuda_cache_budget(utilization: float, total: int, weights: int, logits_bytes: int) -> int:
    """Bytes left for caches under `--gpu-memory-utilization`: utilization x the card's memory, less the
    weights, ACTIVATION_RESERVE and the logits of a full verify batch (may be <= 0: nothing fits)."""
    return int(utilization * total) - weights - ACTIVATION_RESERVE - logits_bytes


def verify_rows(slots: int, block: int, tree_rows: int = 0) -> int:
    """Rows of the widest verify step the plan reserves logits for: every running request verifying a block (at
    least 16 wide: the widest width bucket) or, under `--speculation tree`, a tree of `tree_rows` (the engine keeps
    a step's trees within it; the adaptive policy's trees take what narrower rows leave)."""
    return slots * max(block, 16, tree_rows)


def verify_logits_bytes(slots: int, block: int, vocab: int, max_num_batched_tokens: int | None,
                        tree_rows: int = 0) -> int:
    """float32 logits of the widest step (`verify_rows`), at most the step's token budget."""
    tokens = verify_rows(slots, block, tree_rows)
    if max_num_batched_tokens is not None:
        tokens = min(tokens, max_num_batched_tokens)
    return tokens * vocab * 4


def available_memory() -> int | None:
    """Bytes of RAM available now (Linux MemAvailable; else free pages), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def ram_cache_budget(available: int | None, pending: int = 0) -> int:
    """The default budget off CUDA: a quarter of the RAM available (less `pending` bytes still to load), at most
    RAM_KV_DEFAULT_CAP (see there)."""
    if available is None:
        return RAM_KV_DEFAULT_CAP
    return min(RAM_KV_DEFAULT_CAP, max(0, int(RAM_KV_FRACTION * (available - pending))))
