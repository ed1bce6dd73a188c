"""Which target families our own forwards run, torch-free (the memory estimate reads it without loading a model).

`NATIVE_MODEL_TYPES`: the plain decoders of the native runner (`runners/native.py`); `HYBRID_MODEL_TYPES`: the
Gated DeltaNet hybrids of the hybrid runner (`runners/hybrid.py`). Every other attention-only decoder runs on the
generic runner (`runners/generic.py`).
"""

NATIVE_MODEL_TYPES = ("qwen3", "llama", "qwen2", "qwen3_moe")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
