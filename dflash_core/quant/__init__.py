"""Quantized targets: which formats are served (`formats`, torch-free: `dflash-bench memory` reads it), their
layers (`fp8`) and how they load (`loader`)."""

from dflash_core.quant.formats import LOAD_TIME_METHODS, QuantSpec, gguf_refusal, quant_spec

__all__ = ["LOAD_TIME_METHODS", "QuantSpec", "gguf_refusal", "quant_spec"]
