"""`dflash-bench memory`: what a preset's KV pool holds on a card, in tokens, computed from the models' shapes
(nothing is loaded or downloaded): the weights, then the pool that `--gpu-memory-utilization` (the preset's, else
0.9) leaves beside them, as positions of KV and as requests of the preset's max_model_len (and of 2,048 tokens)
that run at once. Dense, MoE (experts counted in full: every expert is resident) and hybrid Gated DeltaNet targets
(KV for the full-attention layers only, plus each running request's convolution windows and recurrent states, as
`dflash_core.runners.hybrid` allocates them: live and rollback copies, and with prefix caching the checkpoint copies
a request holds and the KV manager's checkpoint store, `dflash_core.hybrid_state`). The arithmetic is
`dflash_core.memory`'s, which the start-up plan uses too (`plan_memory`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.families import HYBRID_MODEL_TYPES, NATIVE_MODEL_TYPES
from dflash_core.hybrid_state import REQUEST_CHECKPOINTS, checkpoint_limits
from dflash_core.memory import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GB,
    GIB,
    SHORT_REQUEST,
    MemoryBudget,
    PoolCosts,
    checkpoint_bytes,
    cuda_cache_budget,
    kv_bytes_per_row,
    layer_shape,
    layer_types,
    linear_dims,
    normalize_shape,
    plan_memory,
    pool_state_costs,
    record_bytes,
    state_bytes_per_slot,
    verify_logits_bytes,
)
from dflash_core.quant.formats import LOAD_TIME_BLOCK, checkpoint_quant_config, quant_spec, quantized_bytes

__all__ = ["GB", "CARDS", "kv_bytes_per_row", "layer_types", "state_bytes_per_slot", "memory_estimate",
           "format_memory", "memory_from_preset", "target_params", "draft_params"]

# The cards of the table: (label, bytes torch reports as the card's total memory)
CARDS: tuple[tuple[str, int], ...] = (("24 GB", 24 * GIB), ("48 GB", 48 * GIB), ("80 GB", 80 * GIB),
                                      ("H200 141 GB", 139 * GIB))


# Qwen3.5 / Qwen3.6 dense text configs: Gated DeltaNet layers, every fourth layer full attention (with an output
# gate), vocabulary 248320, untied head
_QWEN35 = dict(vocab_size=248320, tie_word_embeddings=False, max_position_embeddings=262144, qk_norm=True,
               model_type="qwen3_5_text", full_attention_interval=4, attn_output_gate=True, head_dim=256,
               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
# Gemma 4 text configs: five sliding-window layers (window 1024, head dim 256) then one global layer (head dim 512,
# its own KV heads, values equal to the keys), vocabulary 262144, tied embeddings, q/k norms
_GEMMA4 = dict(model_type="gemma4_text", vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=262144,
               head_dim=256, sliding_window=1024, qk_norm=True,
               layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10)


def _gemma4_global(num_key_value_heads: int) -> dict[str, dict[str, Any]]:
    return {"full_attention": dict(head_dim=512, num_key_value_heads=num_key_value_heads, k_eq_v=True)}


# z-lab drafts: Qwen3-style layers (full attention, 32 heads x 128, 8 KV heads), 5 of them, block size 16
_DRAFT = dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
              qk_norm=True)

# config.json fields of the preset models. Targets: their published configs. Drafts (they share the target's
# embeddings and head): assumed, not read from the hub: 5 layers with the target's layer shapes (z-lab's
# Qwen3-8B-DFlash-b16 reads 5 target layers, [1, 9, 17, 25, 33], one per draft layer). A local folder's
# config.json replaces these (memory_estimate with a path).
#
# Qwen/Qwen3.5-9B, Qwen/Qwen3.5-27B: the text_config of their published config.json (as quoted by third-party
# tests and model cards: 9B 32 layers x 4096, FFN 12288, 16 heads / 4 KV heads x 256, linear heads 16 key / 32
# value x 128; 27B 64 layers x 5120, FFN 17408, 24 / 4 heads x 256, linear heads 16 / 48 x 128). Their counts
# here, 8.95 B and 26.90 B, equal transformers' own (text model, without the vision tower and MTP layer).
# Qwen/Qwen3.6-27B: not read from its config.json; taken to be Qwen3.5-27B's shape (the same qwen3_5 classes and
# layer layout, per third-party notes). openai/gpt-oss-20b: its config.json (24 layers x 2880, 64 / 8 heads x 64,
# 32 experts x 2880, top 4, vocabulary 201088, untied), 20.91 B parameters as transformers counts them (the hub
# stores the experts in MXFP4, and they load so: `_MXFP4`). openai/gpt-oss-120b: its config.json as
# published (36 layers x 2880, 64 / 8 heads x 64, 128 experts x 2880, top 4, the same vocabulary and attention
# pattern), about 117 B parameters as transformers counts them. Their drafts are assumed (`_DRAFT`, not
# read from the hub): 5 Qwen3-style layers of 32 heads x 128 at the target's width and MLP width, target layer ids
# by z-lab's rule (Qwen3.5-9B-DFlash's [1, 8, 15, 22, 29] and its 32 heads are also on a third-party card); the
# hub lists z-lab's Qwen3.5-9B-DFlash at 1 B and Qwen3.6-27B-DFlash at 2 B parameters, as these shapes give.
# gpt-oss's checkpoints as the hub holds them: the experts in MXFP4 (`quant/mxfp4.py`), the rest in bfloat16
_MXFP4 = dict(quantization="mxfp4", quantization_layer="mxfp4-experts", quantization_bits=4)
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
    "Qwen/Qwen3.5-9B": dict(_QWEN35, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                            num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
    "Qwen/Qwen3.5-27B": dict(_QWEN35, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
    "Qwen/Qwen3.6-27B": dict(_QWEN35, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
    "openai/gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                               num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                               tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=True,
                               num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                               layer_types=["sliding_attention", "full_attention"] * 12, **_MXFP4),
    "openai/gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=True,
                                num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                                layer_types=["sliding_attention", "full_attention"] * 18, **_MXFP4),
    "z-lab/gpt-oss-120b-DFlash": dict(_DRAFT, hidden_size=2880, intermediate_size=2880,
                                      target_layer_ids=[1, 9, 17, 25, 33]),
    "google/gemma-4-31B-it": dict(_GEMMA4, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                                  num_attention_heads=32, num_key_value_heads=16,
                                  layer_overrides=_gemma4_global(num_key_value_heads=4)),
    "google/gemma-4-26B-A4B-it": dict(_GEMMA4, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                                      num_attention_heads=16, num_key_value_heads=8, enable_moe_block=True,
                                      num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                                      layer_overrides=_gemma4_global(num_key_value_heads=2)),
    "z-lab/gemma-4-31B-it-DFlash": dict(_DRAFT, hidden_size=5376, intermediate_size=21504,
                                        target_layer_ids=[1, 15, 29, 43, 57]),
    "z-lab/gemma-4-26B-A4B-it-DFlash": dict(_DRAFT, hidden_size=2816, intermediate_size=2112,
                                            target_layer_ids=[1, 8, 14, 20, 27]),
    "z-lab/Qwen3.5-9B-DFlash": dict(_DRAFT, hidden_size=4096, intermediate_size=12288,
                                    target_layer_ids=[1, 8, 15, 22, 29]),
    "z-lab/Qwen3.5-27B-DFlash": dict(_DRAFT, hidden_size=5120, intermediate_size=17408,
                                     target_layer_ids=[1, 16, 31, 46, 61]),
    "z-lab/Qwen3.6-27B-DFlash": dict(_DRAFT, hidden_size=5120, intermediate_size=17408,
                                     target_layer_ids=[1, 16, 31, 46, 61]),
    "z-lab/gpt-oss-20b-DFlash": dict(_DRAFT, hidden_size=2880, intermediate_size=2880,
                                     target_layer_ids=[1, 6, 11, 16, 21]),
}
# Qwen's official FP8 checkpoints: the same shapes, linear weights in FP8 e4m3 with 128 x 128 block scales (their
# config.json's quantization_config); the embeddings, the head and the norms stay in bf16
for _name in ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B", "Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-27B", "Qwen/Qwen3.6-27B"):
    MODEL_SHAPES[f"{_name}-FP8"] = dict(MODEL_SHAPES[_name], quantization="fp8", quantization_block=(128, 128))
GATED_ATTENTION_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def _model_shape(name: str) -> dict[str, Any]:
    """config.json fields of a preset model, or of a local folder's config.json."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        raise BenchError(f"unknown model {name!r}: pass a local folder with a config.json, or one of "
                         f"{', '.join(MODEL_SHAPES)}")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg = normalize_shape(cfg)
    dflash = cfg.get("dflash_config") or {}
    return {
        **cfg,
        "qk_norm": str(cfg.get("model_type") or "qwen3").startswith("qwen3")
        or "DFlashDraftModel" in cfg.get("architectures", []),
        # transformers' Qwen3.5 and Qwen3-Next attention always has the output gate (its config has no field for it)
        "attn_output_gate": cfg.get("attn_output_gate", cfg.get("model_type") in GATED_ATTENTION_TYPES),
        "target_layer_ids": dflash.get("target_layer_ids") or cfg.get("target_layer_ids") or [],
        "block_size": cfg.get("block_size") or dflash.get("block_size"),
        **_quantization_of(path.parent, cfg),
    }


def _quantization_of(folder: Path | None, cfg: dict[str, Any], load_time: str | None = None) -> dict[str, Any]:
    """A checkpoint's quantization (or `--quantization load_time`'s) as the estimate counts it; a format the server
    does not serve is refused."""
    try:
        spec = quant_spec(checkpoint_quant_config(folder, cfg) if folder else None, load_time)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if spec is None:
        return {}
    return {"quantization": spec.method, "quantization_block": spec.block, "quantization_bits": spec.bits,
            "quantization_layer": spec.layer}


def _attention_matrices(m: dict[str, Any]) -> list[tuple[int, int]]:
    """Attention's projections [out, in]: q (doubled by an output gate), k, v (none where values are the keys,
    Gemma 4's global layers), o."""
    h, hd = int(m["hidden_size"]), int(m["head_dim"])
    q, kv = int(m["num_attention_heads"]) * hd, int(m["num_key_value_heads"]) * hd
    return [(2 * q if m.get("attn_output_gate") else q, h), (kv, h), *([] if m.get("k_eq_v") else [(kv, h)]), (h, q)]


def _linear_attention_matrices(m: dict[str, Any]) -> list[tuple[int, int]]:
    """Gated DeltaNet's projections [out, in]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj."""
    h = int(m["hidden_size"])
    conv, _, nv, _, dv = linear_dims(m)
    return [(conv, h), (nv * dv, h), (nv, h), (nv, h), (h, nv * dv)]


def _attention_params(m: dict[str, Any]) -> int:
    """Attention (its projections; q/k norms for Qwen3 and Gemma; biases and sinks for gpt-oss)."""
    hd, heads = int(m["head_dim"]), int(m["num_attention_heads"])
    mats = _attention_matrices(m)
    params = sum(o * i for o, i in mats) + (2 * hd if m.get("qk_norm") else 0)
    if m.get("attention_bias"):  # q's, k's and v's, o's
        (q_out, _), (kv, _) = mats[:2]
        params += q_out + 2 * kv + int(m["hidden_size"])
    return params + (heads if m.get("model_type") == "gpt_oss" else 0)


def _linear_attention_params(m: dict[str, Any]) -> int:
    """Gated DeltaNet: its projections, the depthwise convolution, dt_bias, A_log, the gated norm."""
    conv, kernel, nv, _, dv = linear_dims(m)
    return sum(o * i for o, i in _linear_attention_matrices(m)) + conv * kernel + 2 * nv + dv


def _mlp_params(m: dict[str, Any]) -> int:
    """A gated MLP, or a mixture of experts: every expert (`moe_intermediate_size`, else `intermediate_size` wide),
    the router, a shared expert with its gate (Qwen3.5-MoE, Qwen3-Next), biases for gpt-oss."""
    h = int(m["hidden_size"])
    experts = int(m.get("num_experts") or m.get("num_local_experts") or 0)
    dense = 3 * h * int(m["intermediate_size"])
    if not experts:
        return dense
    if m.get("enable_moe_block"):  # Gemma 4's MoE layers: a dense MLP beside the experts
        return dense + experts * 3 * h * int(m["moe_intermediate_size"]) + h * experts
    width = int(m.get("moe_intermediate_size") or m["intermediate_size"])
    params = experts * 3 * h * width + h * experts
    if m.get("model_type") == "gpt_oss":
        params += experts * (2 * width + h) + experts
    shared = int(m.get("shared_expert_intermediate_size") or 0)
    return params + (3 * h * shared + h if shared else 0)


def _layer_params(m: dict[str, Any], index: int = 0, kind: str = "full_attention") -> int:
    """Decoder layer `index`: its token mixer, its MLP, two RMSNorms."""
    mixer = (_linear_attention_params(m) if kind == "linear_attention"
             else _attention_params(layer_shape(m, index, kind)))
    return mixer + _mlp_params(m) + 2 * int(m["hidden_size"])


def _experts(m: dict[str, Any]) -> list[tuple[int, int]]:
    """A layer's MoE expert weights [out, in] (gate and up fused, then down, for each expert)."""
    h, width = int(m["hidden_size"]), int(m.get("moe_intermediate_size") or m["intermediate_size"])
    return [(2 * width, h), (h, width)] * int(m.get("num_experts") or m.get("num_local_experts") or 0)


def _quantizable(m: dict[str, Any], index: int, kind: str) -> list[tuple[int, int]]:
    """Layer `index`'s linear weights [out, in] that FP8 holds (`dflash_core/quant/`): the attention or Gated
    DeltaNet projections and a dense MLP's (or a shared expert's); experts, norms, biases, the embeddings and the
    head stay in the compute dtype."""
    h = int(m["hidden_size"])
    mats = (_linear_attention_matrices(m) if kind == "linear_attention"
            else _attention_matrices(layer_shape(m, index, kind)))
    experts = int(m.get("num_experts") or m.get("num_local_experts") or 0)
    dense = int(m["intermediate_size"]) if not experts or m.get("enable_moe_block") else 0
    shared = int(m.get("shared_expert_intermediate_size") or 0) if experts else 0
    for width in (dense, shared):
        if width:
            mats += [(width, h), (width, h), (h, width)]
    return mats


def target_weight_bytes(m: dict[str, Any], nbytes: int, quantization: str | None) -> int:
    """The target's weights in bytes: every parameter in the compute dtype; with `quantization` "fp8" the linear
    weights that tile by its block (`quantization_block`, 128 x 128 by default, as transformers' op and Qwen's
    checkpoints quantize) at one byte each plus a float32 scale per block; with the other formats every linear weight
    at the size its layer holds it (`quant.formats.quantized_bytes`)."""
    total = target_params(m) * nbytes
    if quantization is None:
        return total
    layer = m.get("quantization_layer") or "fp8-block"
    block = m.get("quantization_block") or (LOAD_TIME_BLOCK if layer == "fp8-block" else None)
    bits = int(m.get("quantization_bits") or 8)
    for i, kind in enumerate(layer_types(m)):
        for out, inp in _experts(m) if layer == "mxfp4-experts" else _quantizable(m, i, kind):
            size = quantized_bytes(layer, out, inp, bits, block, nbytes)
            total += 0 if size is None else size - out * inp * nbytes
    return total


def target_params(m: dict[str, Any]) -> int:
    """Parameters of a decoder LM: embeddings (+ an untied head), layers, final norm."""
    h, v = int(m["hidden_size"]), int(m["vocab_size"])
    heads = v * h * (1 if m.get("tie_word_embeddings") else 2)
    return heads + sum(_layer_params(m, i, kind) for i, kind in enumerate(layer_types(m))) + h


def draft_params(m: dict[str, Any]) -> int:
    """A DFlash draft's own parameters: fc (features of len(ids) target layers -> hidden), hidden_norm, layers,
    norm (it uses the target's embeddings and head)."""
    h = int(m["hidden_size"])
    return len(m["target_layer_ids"]) * h * h + h + int(m["num_hidden_layers"]) * _layer_params(m) + h


def _card(costs: PoolCosts, weights: int, slots: int, length: int, model_max: int, utilization: float,
          total: int, logits: int) -> dict[str, Any]:
    """The start-up plan on one card (dflash_core.memory.plan_memory), or why nothing fits."""
    budget = cuda_cache_budget(utilization, total, weights, logits)
    row: dict[str, Any] = {"card_bytes": total, "cache_budget": budget}
    if budget <= 0:
        return {**row, "fits": False, "why": "weights"}
    try:
        plan = plan_memory(costs, weights, slots, length, model_max, budget, "card")
    except ValueError:  # not one request of max_model_len: the pool as it is, for the table
        try:
            short = plan_memory(costs, weights, slots, None, length, budget, "card")
        except ValueError:
            return {**row, "fits": False, "why": "weights"}
        return {**row, "fits": False, "why": "max_model_len", "pool_tokens": short.pool_tokens}
    return {**row, **_plan_dict(plan), "fits": True}


def _plan_dict(plan: MemoryBudget) -> dict[str, Any]:
    return {
        "num_blocks": plan.num_blocks,
        "pool_tokens": plan.pool_tokens,
        "running": plan.slots,
        "requests_full": plan.requests_of(plan.max_model_len),
        "requests_short": plan.requests_of(min(SHORT_REQUEST, plan.max_model_len)),
        "target_kv_bytes": plan.target_kv,
        "draft_kv_bytes": plan.draft_kv,
        "target_state_bytes": plan.state,
        "checkpoint_store_count": checkpoint_limits(plan.slots, 1)[0] if plan.checkpoints else 0,
        "checkpoint_store_bytes": plan.checkpoints,
    }


def memory_estimate(
    target: str,
    draft: str | None,
    *,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    max_running_requests: int = 256,
    block_size: int | None = None,
    kv_block_size: int = 16,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float | None = None,
    max_num_batched_tokens: int | None = 2048,
    enable_prefix_caching: bool = True,
    quantization: str | None = None,
) -> dict[str, Any]:
    """Memory of the native backend, in bytes: the weights; the KV pool per position (target attention layers'
    K and V, the draft's in the same blocks) and a hybrid's recurrent state: `state_bytes_per_request` (live and
    rollback copies, plus `request_checkpoints` copies of `checkpoint_bytes` with `enable_prefix_caching`, plus
    `record_bytes_per_request`: a block-wide verify's rollback records) for each
    running request (`target_state_bytes` in all) and the checkpoint store's limit (`checkpoint_store_count`
    checkpoints, `checkpoint_store_bytes`; 0 with prefix caching off); the pool of `kv_cache_memory` bytes (None:
    every running request at full length, the runners' default pool) with its totals; and, per card of `CARDS`, the
    pool `gpu_memory_utilization` (default 0.9) leaves beside the weights, in tokens and in requests (`cards`).
    Activations, the CUDA context and allocator slack come on top of the totals. A target the native backend does
    not run (gpt-oss: sliding-window attention) runs on the generic backend, whose pool keeps every attention
    layer's keys at every position (a sliding-window layer's too): the figures count them all."""
    t = _model_shape(target)
    d = _model_shape(draft) if draft else None
    if quantization is not None:  # --quantization: a full-precision checkpoint quantized while it loads
        load_time = _quantization_of(None, {}, quantization)
        t = t if t.get("quantization") else {**t, **load_time}
    quantization = t.get("quantization")
    nbytes = DTYPE_BYTES.get(dtype)
    if nbytes is None:
        raise BenchError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_BYTES)}")
    block = int(block_size or (d or {}).get("block_size") or 1) if d else 1
    model_max = int(t["max_position_embeddings"])
    length = int(max_model_len or model_max)
    costs = PoolCosts(kv_bytes_per_row(t, nbytes), kv_bytes_per_row(d, nbytes) if d else 0,
                      kv_block=kv_block_size, extra_len=block + 1,
                      **pool_state_costs(t, nbytes, enable_prefix_caching, verify_tokens=block))
    one = checkpoint_bytes(t, nbytes)
    out: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "dtype": dtype,
        "max_model_len": length,
        "max_running_requests": max_running_requests,
        "block_size": block,
        "kv_block_size": kv_block_size,
        "target_params": target_params(t),
        "draft_params": draft_params(d) if d else 0,
        "target_kv_bytes_per_token": costs.target_row,
        "draft_kv_bytes_per_token": costs.draft_row,
        "enable_prefix_caching": enable_prefix_caching,
        "state_bytes_per_request": costs.state,
        "checkpoint_bytes": one,
        "request_checkpoints": REQUEST_CHECKPOINTS if enable_prefix_caching and one else 0,
        "record_bytes_per_request": record_bytes(t, nbytes, block),
    }
    out["quantization"] = quantization
    out["quantization_bits"] = int(t.get("quantization_bits") or 8) if quantization else None
    out["quantization_layer"] = (t.get("quantization_layer") or "fp8-block") if quantization else None
    out["weights_bytes"] = weights = target_weight_bytes(t, nbytes, quantization) + out["draft_params"] * nbytes
    # what backend auto picks: native for its families (without sliding windows), else generic
    native = t.get("model_type", "qwen3") in (*NATIVE_MODEL_TYPES, *HYBRID_MODEL_TYPES)
    out["backend"] = "native" if native and "sliding_attention" not in layer_types(t) else "generic"
    try:
        plan = plan_memory(costs, weights, max_running_requests, length, model_max, kv_cache_memory,
                           "--kv-cache-memory")
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    out.update(_plan_dict(plan))
    out["total_bytes"] = weights + plan.caches
    utilization = gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    out["gpu_memory_utilization"] = utilization
    logits = verify_logits_bytes(max_running_requests, block, int(t["vocab_size"]), max_num_batched_tokens)
    out["cards"] = {label: _card(costs, weights, max_running_requests, length, model_max, utilization, total, logits)
                    for label, total in CARDS}
    return out


def memory_from_preset(path: Path) -> dict[str, Any]:
    """memory_estimate for a configs/*.yaml preset (its running cap, lengths and budget settings)."""
    import yaml

    from dflash_core.memory import parse_bytes

    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BenchError(f"cannot read preset {path}: {exc}") from None
    if not cfg.get("target"):
        raise BenchError(f"{path}: no target (the bundled demo pair is a few MB)")
    kv = cfg.get("kv_cache_memory")
    est = memory_estimate(
        cfg["target"],
        cfg.get("draft") if cfg.get("speculative", True) else None,
        dtype=cfg.get("dtype") or "auto",
        max_model_len=cfg.get("max_model_len"),
        max_running_requests=int(cfg.get("max_running_requests") or 256),
        block_size=cfg.get("block_size"),
        kv_block_size=int(cfg.get("kv_block_size") or 16),
        kv_cache_memory=parse_bytes(kv) if kv else None,
        gpu_memory_utilization=cfg.get("gpu_memory_utilization"),
        max_num_batched_tokens=cfg.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=bool(cfg.get("enable_prefix_caching", True)),
        quantization=cfg.get("quantization"),
    )
    return {"preset": str(path), **est}


def _cell(card: dict[str, Any], length: int, cap: int, backend: str) -> str:
    """One card's figures: pool tokens, then requests of max_model_len and of 2,048 tokens that run at once."""
    if not card["fits"] and card["why"] == "weights":
        return "- (weights)"
    if not card["fits"]:
        return f"{card['pool_tokens']:,} tokens: < 1 x {length:,}"
    text = f"{card['pool_tokens']:,} tokens: {card['requests_full']:,} x {length:,}"
    if length > SHORT_REQUEST:
        text += f", {card['requests_short']:,} x {SHORT_REQUEST:,}"
    if card["running"] < cap:
        text += f" ({card['running']} running: recurrent state)"
    return text


def _weights_note(row: dict[str, Any]) -> str:
    if row.get("quantization") == "mxfp4":
        return ", target MoE experts in MXFP4"
    if row.get("quantization") in ("compressed-tensors", "gptq", "awq", "int4"):
        kind = "FP8" if row.get("quantization_layer") == "fp8-channel" else f"int{row['quantization_bits']}"
        fmt = {"compressed-tensors": "compressed-tensors", "int4": "quantized at load"}.get(
            row["quantization"], row["quantization"].upper())
        return f", target linear weights {kind} ({fmt})"
    return ", target linear weights in FP8" if row.get("quantization") == "fp8" else ""


def format_memory(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: weights, KV per token, and per card the pool in tokens and in requests that run at once
    (GB = 1e9 bytes; KB = 1e3)."""
    labels = [label for label, _ in CARDS]
    head = ("| preset | target + draft | weights GB | KV per token | "
            + " | ".join(f"{label} card" for label in labels) + " |\n|" + "---|" * (4 + len(labels)))
    lines = [head]
    for r in rows:
        per_token = (r["target_kv_bytes_per_token"] + r["draft_kv_bytes_per_token"]) / 1e3
        state = r.get("state_bytes_per_request") or 0
        kv = f"{per_token:.0f} KB" + (f" + {state / 1e6:.0f} MB state per request" if state else "")
        if state:  # the state copies (with prefix caching: the checkpoints, and the store's limit) and records
            one, rec = r["checkpoint_bytes"] / 1e6, r.get("record_bytes_per_request", 0) / 1e6
            kv += f" ({2 + r.get('request_checkpoints', 0)} x {one:.0f} MB + {rec:.0f} MB verify records)"
            if r.get("request_checkpoints"):
                kv += f" + {one:.0f} MB x max(4, running / 2) checkpoints"
        cells = " | ".join(_cell(r["cards"][label], r["max_model_len"], r["max_running_requests"], r["backend"])
                           for label in labels)
        lines.append(
            f"| `{Path(r['preset']).name}` | {r['target']} ({r['target_params'] / 1e9:.2f} B params) + "
            f"{r['draft'] or 'no draft'} ({r['draft_params'] / 1e9:.2f} B), {r['dtype']}"
            f"{_weights_note(r)} | "
            f"{r['weights_bytes'] / GB:.1f} | {kv} | {cells} |"
        )
    return "\n".join(lines)
