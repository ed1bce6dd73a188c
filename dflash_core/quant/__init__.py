"""Quantized targets: which formats are served (`formats`, torch-free: `dflash-bench memory` reads it), their
layers (`fp8`, `fp8_channel`, `int8_channel`, `packed_int`, `gptq_awq`, `mxfp4`) and how they load (`loader`)."""

from dflash_core.quant.formats import LOAD_TIME_METHODS, QuantSpec, checkpoint_quant_config, gguf_refusal, quant_spec

__all__ = ["LOAD_TIME_METHODS", "QuantSpec", "checkpoint_quant_config", "gguf_refusal", "quant_spec"]
