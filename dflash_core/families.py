"""Which target families our own forwards run, torch-free (the memory estimate reads it without loading a model),
and what no batched runner runs (`rope_reads_the_batch`).

`NATIVE_MODEL_TYPES`: the plain decoders of the native runner (`runners/native.py`); `HYBRID_MODEL_TYPES`: the
Gated DeltaNet hybrids of the hybrid runner (`runners/hybrid.py`). Every other attention-only decoder runs on the
generic runner (`runners/generic.py`).
"""

from typing import Any

NATIVE_MODEL_TYPES = ("qwen3", "llama", "qwen2", "qwen3_moe")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def rope_reads_the_batch(cfg: Any) -> bool:
    """Whether the model's rotary embedding picks its frequencies from the largest position of the whole forward
    (transformers' dynamic NTK and LongRoPE types): a row's output would then depend on the other requests in its
    forward and on how its own tokens are split into forwards."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    kinds = [str(g.get("rope_type", g.get("type", ""))) for g in groups]
    return any("dynamic" in kind or kind == "longrope" for kind in kinds)
