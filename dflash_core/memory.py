"""Memory arithmetic, in one place: the bytes a slot costs (target KV rows, draft KV rows, a hybrid's recurrent
state), and the start-up budget that sizes slots x length from `--kv-cache-memory` or `--gpu-memory-utilization`.

`dflash-bench memory` (`dflash_core/bench/memory.py`) estimates presets with the same functions; `load_models`
plans the budget from the loaded models (`plan_memory`), logs it, and refuses a setting that cannot fit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GB = 1e9
GIB = 1 << 30
# Activations beside the caches on CUDA (prefill chunks, the MLP of a verify batch, allocator slack), plus the
# float32 logits of a full verify batch (added per setting in `cuda_cache_budget`).
ACTIVATION_RESERVE = 2 * GIB
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
    """Bytes as GB (1e9) with two decimals, or MB below 0.1 GB."""
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


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


def kv_bytes_per_row(m: dict[str, Any], dtype_bytes: int) -> int:
    """Keys + values of one position over the layers that keep them (not Gated DeltaNet layers)."""
    attention = sum(kind != "linear_attention" for kind in layer_types(m))
    return 2 * attention * int(m["num_key_value_heads"]) * int(m["head_dim"]) * dtype_bytes


def state_bytes_per_slot(m: dict[str, Any], dtype_bytes: int) -> int:
    """A slot's fixed-size state in Gated DeltaNet layers: the convolution window (kernel - 1 inputs, model dtype)
    and the recurrent state (value heads x key dim x value dim, float32), each held twice: the live one and the
    copy a verify step records for rollback; 0 without such layers."""
    linear = sum(kind == "linear_attention" for kind in layer_types(m))
    if not linear:
        return 0
    conv, kernel, nv, dk, dv = linear_dims(m)
    return 2 * linear * (conv * (kernel - 1) * dtype_bytes + nv * dk * dv * 4)


def normalize_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """A model's config.json fields (its text_config folded in) with the KV heads and head dim filled in."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    heads = int(cfg["num_attention_heads"])
    return {
        **cfg,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
    }


# ---- per slot ----
@dataclass(frozen=True)
class SlotCosts:
    """What one slot costs: `target_row` / `draft_row` bytes per cached position, `state` fixed bytes (a hybrid's
    windows and recurrent states), and the rows a slot holds beyond `max_model_len` (the verify block, the
    scratch column)."""

    target_row: int
    draft_row: int
    state: int
    target_extra_rows: int
    draft_extra_rows: int

    def target_kv(self, max_model_len: int) -> int:
        return self.target_row * (max_model_len + self.target_extra_rows)

    def draft_kv(self, max_model_len: int) -> int:
        return self.draft_row * (max_model_len + self.draft_extra_rows) if self.draft_row else 0

    def per_slot(self, max_model_len: int) -> int:
        return self.target_kv(max_model_len) + self.draft_kv(max_model_len) + self.state

    def max_len_within(self, per_slot: int) -> int:
        """The longest max_model_len whose slot fits in `per_slot` bytes (0 when none does)."""
        row = self.target_row + self.draft_row
        room = per_slot - self.state - self.target_row * self.target_extra_rows - (
            self.draft_row * self.draft_extra_rows if self.draft_row else 0)
        return max(0, room // row) if row else 0


@dataclass(frozen=True)
class MemoryBudget:
    """The start-up memory plan: weights, and the caches of `slots` slots of `max_model_len` positions."""

    weights: int
    slots: int
    max_model_len: int
    target_kv: int
    draft_kv: int
    state: int
    cache_budget: int | None  # bytes the caches may take (None: not limited)
    source: str  # where the budget came from ("--kv-cache-memory 4GiB", ...), or "no budget set"

    @property
    def caches(self) -> int:
        return self.target_kv + self.draft_kv + self.state

    def summary(self) -> str:
        """One log line: weights, target KV, draft KV, recurrent state, against the budget."""
        parts = [f"weights {format_bytes(self.weights)}",
                 f"target KV {format_bytes(self.target_kv)} ({self.slots} slots x {self.max_model_len:,} tokens)",
                 f"draft KV {format_bytes(self.draft_kv)}"]
        if self.state:
            parts.append(f"recurrent state {format_bytes(self.state)}")
        budget = (f"of a {format_bytes(self.cache_budget)} cache budget ({self.source})"
                  if self.cache_budget is not None else f"({self.source})")
        return f"memory: {', '.join(parts)}; caches {format_bytes(self.caches)} {budget}"


def plan_memory(
    costs: SlotCosts, weights: int, slots: int, max_model_len: int | None, model_max_len: int,
    cache_budget: int | None, source: str,
) -> MemoryBudget:
    """Slots x length within `cache_budget` bytes: a given max_model_len is checked (ValueError saying what would
    fit), an unset one is the longest that fits `slots` slots (at most the model's). No budget: as configured."""
    length = max_model_len or model_max_len
    if cache_budget is not None:
        fit_len = min(model_max_len, costs.max_len_within(cache_budget // slots))
        if max_model_len is None and fit_len >= 2:
            length = fit_len
        elif costs.per_slot(length) * slots > cache_budget:
            slots_fit = cache_budget // costs.per_slot(length)
            plural = "s" if slots > 1 else ""
            options = [f"max_model_len <= {fit_len:,} at {slots} slot{plural}"] if fit_len >= 2 else []
            if slots_fit >= 1:
                options.append(f"max_running_requests <= {slots_fit} at max_model_len {length:,}")
            one = min(model_max_len, costs.max_len_within(cache_budget))
            if slots > 1 and one >= 2 and not slots_fit:
                options.append(f"max_model_len <= {one:,} at 1 slot")
            fits = f"which fits {' or '.join(options)}" if options else "which fits no slot: raise it"
            raise ValueError(
                f"max_model_len {length:,} needs {format_bytes(costs.per_slot(length))} per slot, "
                f"{format_bytes(costs.per_slot(length) * slots)} for {slots} slots; {source} leaves "
                f"{format_bytes(cache_budget)} for caches, {fits}")
    return MemoryBudget(weights, slots, length, costs.target_kv(length) * slots, costs.draft_kv(length) * slots,
                        costs.state * slots, cache_budget, source)


def cuda_cache_budget(utilization: float, total: int, weights: int, logits_bytes: int) -> int:
    """Bytes left for caches under `--gpu-memory-utilization`: utilization x the card's memory, less the
    weights, ACTIVATION_RESERVE and the logits of a full verify batch (may be <= 0: nothing fits)."""
    return int(utilization * total) - weights - ACTIVATION_RESERVE - logits_bytes
