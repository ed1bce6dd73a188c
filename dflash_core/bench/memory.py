"""`dflash-bench memory`: the GPU memory the native backend allocates at start-up for a preset, computed from the
models' shapes (nothing is loaded or downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError

# config.json fields of the preset models. Targets: their published configs. Drafts (they share the target's
# embeddings and head): assumed, not read from the hub: 5 layers with the target's layer shapes (z-lab's
# Qwen3-8B-DFlash-b16 reads 5 target layers, [1, 9, 17, 25, 33], one per draft layer). A local folder's
# config.json replaces these (memory_estimate with a path).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960, qk_norm=True),
    "Qwen/Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=40960, qk_norm=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                             vocab_size=128256, tie_word_embeddings=False,
                                             max_position_embeddings=131072, qk_norm=False),
    "z-lab/Qwen3-8B-DFlash-b16": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                                      target_layer_ids=[1, 9, 17, 25, 33], qk_norm=True),
    "z-lab/Qwen3-4B-DFlash-b16": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                                      target_layer_ids=[1, 9, 17, 25, 33], qk_norm=True),
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": dict(hidden_size=4096, intermediate_size=14336,
                                                        num_hidden_layers=5, num_attention_heads=32,
                                                        num_key_value_heads=8, head_dim=128, block_size=16,
                                                        target_layer_ids=[1, 8, 15, 22, 29], qk_norm=True),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
GB = 1e9


def _model_shape(name: str) -> dict[str, Any]:
    """config.json fields of a preset model, or of a local folder's config.json."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        raise BenchError(f"unknown model {name!r}: pass a local folder with a config.json, or one of "
                         f"{', '.join(MODEL_SHAPES)}")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg = {**cfg, **cfg.get("text_config", {})}
    dflash = cfg.get("dflash_config") or {}
    heads = int(cfg["num_attention_heads"])
    return {
        **cfg,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "qk_norm": cfg.get("model_type") in ("qwen3", None) or "DFlashDraftModel" in cfg.get("architectures", []),
        "target_layer_ids": dflash.get("target_layer_ids") or cfg.get("target_layer_ids") or [],
        "block_size": cfg.get("block_size") or dflash.get("block_size"),
    }


def _layer_params(m: dict[str, Any]) -> int:
    """One decoder layer: attention (q, k, v, o; q/k norms for Qwen3), gated MLP, two RMSNorms."""
    h, hd = int(m["hidden_size"]), int(m["head_dim"])
    q, kv = int(m["num_attention_heads"]) * hd, int(m["num_key_value_heads"]) * hd
    attn = h * q + 2 * h * kv + q * h + (2 * hd if m.get("qk_norm") else 0)
    return attn + 3 * h * int(m["intermediate_size"]) + 2 * h


def target_params(m: dict[str, Any]) -> int:
    """Parameters of a dense decoder LM: embeddings (+ an untied head), layers, final norm."""
    h, v = int(m["hidden_size"]), int(m["vocab_size"])
    heads = v * h * (1 if m.get("tie_word_embeddings") else 2)
    return heads + int(m["num_hidden_layers"]) * _layer_params(m) + h


def draft_params(m: dict[str, Any]) -> int:
    """A DFlash draft's own parameters: fc (features of len(ids) target layers -> hidden), hidden_norm, layers,
    norm (it uses the target's embeddings and head)."""
    h = int(m["hidden_size"])
    return len(m["target_layer_ids"]) * h * h + h + int(m["num_hidden_layers"]) * _layer_params(m) + h


def kv_bytes_per_row(m: dict[str, Any], dtype_bytes: int) -> int:
    """Keys + values of one position over all layers."""
    return 2 * int(m["num_hidden_layers"]) * int(m["num_key_value_heads"]) * int(m["head_dim"]) * dtype_bytes


def memory_estimate(
    target: str,
    draft: str | None,
    *,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    max_running_requests: int = 8,
    block_size: int | None = None,
) -> dict[str, Any]:
    """GPU memory the native backend allocates up front, in bytes: weights, and the slot KV caches it
    preallocates (dflash_core.loading): the target's `max_running_requests x (max_model_len + B + 1)` rows and
    the draft's one row more per slot. Activations, the CUDA context and allocator slack come on top."""
    t = _model_shape(target)
    d = _model_shape(draft) if draft else None
    nbytes = DTYPE_BYTES.get(dtype)
    if nbytes is None:
        raise BenchError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_BYTES)}")
    block = int(block_size or (d or {}).get("block_size") or 1) if d else 1
    length = int(max_model_len or t["max_position_embeddings"])
    rows = length + block + 1
    out: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "dtype": dtype,
        "max_model_len": length,
        "max_running_requests": max_running_requests,
        "block_size": block,
        "target_params": target_params(t),
        "draft_params": draft_params(d) if d else 0,
        "target_kv_rows": rows,
        "draft_kv_rows": rows + 1 if d else 0,
    }
    out["weights_bytes"] = (out["target_params"] + out["draft_params"]) * nbytes
    out["target_kv_bytes"] = kv_bytes_per_row(t, nbytes) * rows * max_running_requests
    out["draft_kv_bytes"] = kv_bytes_per_row(d, nbytes) * (rows + 1) * max_running_requests if d else 0
    out["total_bytes"] = out["weights_bytes"] + out["target_kv_bytes"] + out["draft_kv_bytes"]
    return out


def memory_from_preset(path: Path) -> dict[str, Any]:
    """memory_estimate for a configs/*.yaml preset."""
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BenchError(f"cannot read preset {path}: {exc}") from None
    if not cfg.get("target"):
        raise BenchError(f"{path}: no target (the bundled demo pair is a few MB)")
    est = memory_estimate(
        cfg["target"],
        cfg.get("draft") if cfg.get("speculative", True) else None,
        dtype=cfg.get("dtype") or "auto",
        max_model_len=cfg.get("max_model_len"),
        max_running_requests=int(cfg.get("max_running_requests") or 8),
        block_size=cfg.get("block_size"),
    )
    return {"preset": str(path), **est}


def format_memory(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of memory estimates (GB = 1e9 bytes)."""
    head = ("| preset | target + draft | weights GB | target KV GB | draft KV GB | total GB |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        slots = f"{r['max_running_requests']} x {r['target_kv_rows']:,} rows"
        lines.append(
            f"| `{Path(r['preset']).name}` | {r['target']} ({r['target_params'] / 1e9:.2f} B params) + "
            f"{r['draft'] or 'no draft'} ({r['draft_params'] / 1e9:.2f} B), {r['dtype']} | "
            f"{r['weights_bytes'] / GB:.1f} | {r['target_kv_bytes'] / GB:.1f} ({slots}) | "
            f"{r['draft_kv_bytes'] / GB:.1f} | **{r['total_bytes'] / GB:.1f}** |"
        )
    return "\n".join(lines)
