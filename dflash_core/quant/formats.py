"""Which quantized checkpoints and load-time quantizations dflash-serve serves, and the one-line refusals of the rest.

A checkpoint says how it is quantized in its config's `quantization_config` (transformers' convention). Served:

- `fp8`: FP8 e4m3 weights with block-wise (Qwen's official FP8 checkpoints: 128 x 128 blocks) or per-tensor
  scales, as transformers' `FineGrainedFP8Config` writes them (`quant/fp8.py`).
- `compressed-tensors` in its `pack-quantized` format, weight-only (W4A16, W8A16: GPTQ- and AWQ-style schemes as
  llm-compressor writes them): symmetric 4- or 8-bit integers with a scale per group of inputs or per channel
  (`quant/packed_int.py`); and in its `float-quantized` format: FP8 weights with a scale per channel (or tensor),
  weight-only or with activations quantized to FP8 per token in each forward (FP8-dynamic, W8A8)
  (`quant/fp8_channel.py`); and in its `int-quantized` format: int8 weights with a scale per channel, weight-only or
  with activations quantized to int8 per token (W8A8 INT8) (`quant/int8_channel.py`).
- `mxfp4`: gpt-oss's MoE experts in MXFP4 (FP4 e2m1 codes, a power-of-two scale per 32 inputs), as OpenAI's
  checkpoints ship them (`quant/mxfp4.py`).
- `gptq` (GPTQModel / AutoGPTQ, original or v2 format) and `awq` (AutoAWQ's "gemm" version): 4-bit (GPTQ: or
  8-bit) integer codes with a scale and a zero point per group of inputs, act-order included (`quant/gptq_awq.py`).

`--quantization fp8` quantizes a full-precision checkpoint's linear layers to that format while it loads (128 x 128
blocks, as Qwen's). Everything else is refused at start-up with one line naming the format and what to use instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --quantization values: what a full-precision checkpoint can be quantized to while it loads
LOAD_TIME_METHODS = ("fp8", "int4")
# the group of --quantization int4 (the usual GPTQ / AWQ group; torch's int4 GEMM takes it)
LOAD_TIME_INT4_GROUP = 128
# the block of --quantization fp8 (Qwen's FP8 checkpoints use 128 x 128)
LOAD_TIME_BLOCK = (128, 128)

_INSTEAD = "serve its bf16 checkpoint (with --quantization fp8 to keep the weights in 8 bits) or an FP8 checkpoint"
# formats transformers knows that this server does not serve yet, and why
_NOT_YET = {
    "bitsandbytes": "bitsandbytes checkpoints are not served: their kernels are bitsandbytes' own CUDA code, not "
    "a format other servers load",
    "gguf": "GGUF is llama.cpp's format",
}


@dataclass(frozen=True)
class QuantSpec:
    """How the target's linear weights are held: `method` ("fp8" or "compressed-tensors"), the scale `block` (None:
    one scale per tensor, or per channel), whether the checkpoint is already quantized, the module names it leaves in
    full precision, and the weights' `bits`."""

    method: str
    block: tuple[int, int] | None  # compressed-tensors: (1, group size), None per channel (or tensor)
    pre_quantized: bool
    skip: tuple[str, ...] = ()
    bits: int = 8
    # the layer that holds the weights: "fp8-block" (`Fp8Linear`), "packed-int" (`PackedIntLinear`), "fp8-channel"
    # (`Fp8ChannelLinear`), "int8-channel" (`Int8ChannelLinear`), "gptq" (`GptqLinear`), "awq" (`AwqLinear`) or
    # "mxfp4-experts" (`Mxfp4Experts`)
    layer: str = "fp8-block"
    dynamic_activations: bool = False  # activations quantized to FP8 per token in each forward (W8A8)
    per_tensor: bool = False  # "fp8-channel", "int8-channel": one weight scale per tensor, not per output channel
    zero_offset: int = 0  # "gptq": what its checkpoint format subtracted from each zero point (1 in the original)

    def describe(self) -> str:
        source = "checkpoint" if self.pre_quantized else "quantized at load"
        if self.layer == "mxfp4-experts":
            return f"mxfp4 (MoE experts, {source})"
        if self.layer in ("gptq", "awq"):
            group = f"groups of {self.block[1]}" if self.block else "per-channel scales"
            name = "int4" if self.method == "int4" else f"{self.method} int{self.bits}"
            return f"{name} ({group}, {source})"
        if self.layer == "packed-int":
            group = f"groups of {self.block[1]}" if self.block else "per-channel scales"
            return f"compressed-tensors int{self.bits} ({group}, {source})"
        if self.layer in ("fp8-channel", "int8-channel"):
            kind = "fp8" if self.layer == "fp8-channel" else "int8"
            acts = f"{kind.upper()} activations per token" if self.dynamic_activations else "weight-only"
            return f"compressed-tensors {kind} (per-channel scales, {acts}, {source})"
        block = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-tensor scales"
        return f"{self.method} ({block}, {source})"


def quantized_bytes(layer: str, out: int, inp: int, bits: int, block: tuple[int, int] | None,
                    nbytes: int) -> int | None:
    """Bytes a `QuantSpec.layer` kind holds a linear weight [out, inp] in (scales, zero points and indices included;
    `nbytes`: the compute dtype's size), or None where the weight stays in the compute dtype (an FP8 block layer
    whose sides do not divide by its block)."""
    words = -(-inp * bits // 32) * 4  # a row of `inp` codes in int32 words
    groups = -(-inp // (block[1] if block else inp))
    if layer == "fp8-block":
        if out % block[0] or inp % block[1]:
            return None
        return out * inp + (out // block[0]) * (inp // block[1]) * 4
    if layer == "mxfp4-experts":  # two FP4 codes a byte, a one-byte scale per 32 inputs
        return out * inp // 2 + out * (inp // 32)
    if layer in ("fp8-channel", "int8-channel"):  # a byte a value, a scale per row in the compute dtype
        return out * inp + out * nbytes
    if layer == "packed-int":  # codes, a scale per group (or row) in the compute dtype, the two-element shape
        return out * words + out * groups * nbytes + 16
    # GPTQ / AWQ: codes, float16 scales and packed zero points per group; GPTQ's group index of each input
    return out * words + groups * (out * 2 + -(-out * bits // 32) * 4) + (inp * 4 if layer == "gptq" else 0)


def gguf_refusal(path: str | Path) -> str | None:
    """The start-up line for a GGUF file, a folder of them (no transformers config beside) or a hub repository
    named as one ("org/name-GGUF", "org/name-GGUF:Q4_K_M"; not downloaded), else None."""
    p = Path(path).expanduser()
    is_gguf = p.suffix.lower() == ".gguf" or (
        p.is_dir() and any(p.glob("*.gguf")) and not (p / "config.json").exists()) or (
        not p.exists() and "gguf" in str(path).lower().split("/")[-1])
    return f"{path}: {_NOT_YET['gguf']}; {_INSTEAD}" if is_gguf else None


def method_of(qcfg: dict[str, Any]) -> str:
    """The quantization method a `quantization_config` dict names (bitsandbytes' flags included)."""
    if qcfg.get("load_in_4bit") or qcfg.get("load_in_8bit"):
        return "bitsandbytes"
    return str(qcfg.get("quant_method") or "unknown").lower()


def quant_spec(qcfg: dict[str, Any] | None, load_time: str | None) -> QuantSpec | None:
    """What to load for a checkpoint whose config has `qcfg` (None: full precision) under `--quantization
    load_time` (None: none); raises ValueError with the one-line reason when it cannot be served."""
    if qcfg is not None and not isinstance(qcfg, dict):
        raise ValueError(f"the target's quantization_config is a {type(qcfg).__name__}, not an object")
    try:
        return _spec(qcfg, load_time)
    except (AttributeError, TypeError, KeyError) as exc:  # a field of the wrong type, or missing
        raise ValueError(f"the target's quantization_config is malformed ({type(exc).__name__}: {exc})") from None


def _spec(qcfg: dict[str, Any] | None, load_time: str | None) -> QuantSpec | None:
    if load_time is not None and load_time not in LOAD_TIME_METHODS:
        raise ValueError(f"--quantization {load_time!r} is not supported (choose {', '.join(LOAD_TIME_METHODS)})")
    if qcfg is None and load_time == "int4":  # held as GPTQ's v2 layout, zero points per group
        return QuantSpec("int4", (1, LOAD_TIME_INT4_GROUP), pre_quantized=False, bits=4, layer="gptq")
    if qcfg is None:
        return QuantSpec(load_time, LOAD_TIME_BLOCK, pre_quantized=False) if load_time else None
    method = method_of(qcfg)
    if load_time is not None and method in ("compressed-tensors", "gptq", "awq", "mxfp4"):
        raise ValueError(f"the target is already quantized with {method}; drop --quantization {load_time}")
    if method == "compressed-tensors":
        return _compressed_tensors_spec(qcfg)
    if method in ("gptq", "awq"):
        return _gptq_spec(qcfg) if method == "gptq" else _awq_spec(qcfg)
    if method == "mxfp4":  # gpt-oss: only its experts are quantized (the loader checks that they are gpt-oss's)
        return QuantSpec("mxfp4", None, pre_quantized=True, skip=tuple(qcfg.get("modules_to_not_convert") or ()),
                         bits=4, layer="mxfp4-experts")
    if method != "fp8":
        reason = _NOT_YET.get(method, f"quantization method {method!r} is not supported")
        raise ValueError(f"the target is quantized with {method}: {reason}; {_INSTEAD}")
    if load_time is not None and load_time != method:
        raise ValueError(f"the target is already quantized with {method}; drop --quantization {load_time}")
    if str(qcfg.get("scale_fmt") or "float") != "float":
        raise ValueError(f"the target's FP8 scales are {qcfg['scale_fmt']} (only float32 scales are served); "
                         f"{_INSTEAD}")
    if str(qcfg.get("fmt") or "e4m3").lower() != "e4m3":
        raise ValueError(f"the target's FP8 weights are {qcfg['fmt']} (only e4m3 is served); {_INSTEAD}")
    block = qcfg.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"the target's FP8 weight_block_size is {block!r}, not two positive integers")
    skip = qcfg.get("modules_to_not_convert") or qcfg.get("ignored_layers") or ()
    return QuantSpec("fp8", tuple(int(b) for b in block) if block else None, pre_quantized=True, skip=tuple(skip))


def _compressed_tensors_spec(qcfg: dict[str, Any]) -> QuantSpec:
    """A compressed-tensors config served as packed integer weights (pack-quantized, weight-only) or FP8 weights
    (float-quantized, weight-only or with dynamic per-token FP8 activations), or ValueError naming what is not
    served."""

    def refuse(what: str) -> ValueError:
        return ValueError(f"the target is quantized with compressed-tensors {what}, not served yet (served: "
                          f"W4A16, W8A16, INT8 W8A8, FP8 W8A16 / W8A8-dynamic); {_INSTEAD}")

    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        value = qcfg.get(key)
        if value and not (key == "sparsity_config" and isinstance(value, dict) and value.get("format") == "dense"):
            raise refuse(f"with a {key}")
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise refuse(f"status {qcfg.get('quantization_status')!r} (full-precision weights beside their scales)")
    schemes = set()
    groups = qcfg.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise refuse("config_groups that are not an object of schemes")
    for group in groups.values():
        fmt, weights = group.get("format") or qcfg.get("format"), group.get("weights") or {}
        acts = group.get("input_activations")
        if group.get("output_activations"):
            raise refuse("output activation quantization")
        if not weights.get("symmetric", True):
            raise refuse("asymmetric weights (zero points)")
        if str(weights.get("actorder")).lower() not in ("none", "false", "weight", "static"):
            raise refuse(f"act-order {weights.get('actorder')!r} (g_idx)")
        if weights.get("dynamic") or weights.get("scale_dtype") or (acts or {}).get("scale_dtype"):
            raise refuse("dynamic weight scales or scales rounded to another dtype")
        if fmt == "pack-quantized":
            if acts:
                raise refuse("integer activation quantization (W8A8 int8)")
            if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
                raise refuse(f"{weights.get('type')} {weights.get('num_bits')}-bit weights")
            if weights.get("strategy") not in ("group", "channel"):
                raise refuse(f"strategy {weights.get('strategy')!r}")
            if weights["strategy"] == "group" and not isinstance(weights.get("group_size"), int):
                raise refuse("group strategy without a group size")
            group_size = int(weights["group_size"]) if weights["strategy"] == "group" else None
            schemes.add(("packed-int", int(weights["num_bits"]), group_size, False))  # (layer, bits, group, acts)
        elif fmt == "int-quantized":  # int8 values, one per byte (W8A8 INT8, W8A16)
            if weights.get("type") != "int" or weights.get("num_bits") != 8:
                raise refuse(f"int-quantized {weights.get('type')} {weights.get('num_bits')}-bit weights")
            if weights.get("strategy") not in ("channel", "tensor"):
                raise refuse(f"int8 weights with strategy {weights.get('strategy')!r}")
            if acts and not (acts.get("type") == "int" and acts.get("num_bits") == 8 and acts.get("dynamic") is True
                             and acts.get("strategy") == "token" and acts.get("symmetric", True)):
                raise refuse("activation quantization other than dynamic symmetric int8 per token")
            schemes.add(("int8-channel", 8, weights["strategy"] == "tensor", bool(acts)))
        elif fmt == "float-quantized":
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise refuse(f"{weights.get('type')} {weights.get('num_bits')}-bit weights")
            if weights.get("strategy") not in ("channel", "tensor"):
                raise refuse(f"FP8 weights with strategy {weights.get('strategy')!r}")
            if acts and not (acts.get("type") == "float" and acts.get("num_bits") == 8 and acts.get("dynamic") is True
                             and acts.get("strategy") == "token" and acts.get("symmetric", True)):
                raise refuse("activation quantization other than dynamic FP8 per token")
            schemes.add(("fp8-channel", 8, weights["strategy"] == "tensor", bool(acts)))
        else:
            raise refuse(f"format {fmt!r}")
    if len(schemes) != 1:
        raise refuse("schemes that differ between layers" if schemes else "without weight schemes")
    ((layer, bits, detail, dynamic),) = schemes  # detail: the group size (packed-int), per tensor (the others)
    group_size = detail if layer == "packed-int" else None
    return QuantSpec("compressed-tensors", (1, group_size) if group_size else None, pre_quantized=True,
                     skip=tuple(qcfg.get("ignore") or ()), bits=bits, layer=layer, dynamic_activations=dynamic,
                     per_tensor=layer != "packed-int" and bool(detail))


def _group(qcfg: dict[str, Any], method: str) -> tuple[int, int] | None:
    """The (1, group size) of a GPTQ or AWQ config, None for one group per row (-1)."""
    group = qcfg.get("group_size", 128 if method == "awq" else -1)
    if not isinstance(group, int) or isinstance(group, bool) or not (group > 0 or group == -1):
        raise ValueError(f"the target's {method} group_size is {group!r}, not a positive integer or -1")
    return (1, group) if group > 0 else None


def checkpoint_quant_config(folder: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's quantization config: config.json's `quantization_config`, else the file older GPTQ and AWQ
    checkpoints keep it in (AutoGPTQ's `quantize_config.json`, AutoAWQ's `quant_config.json`) when the checkpoint
    holds packed weights (a full-precision folder left with one of those files loads as it is), else None."""
    if config.get("quantization_config") is not None:
        return config["quantization_config"]
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if (folder / name).is_file() and _holds_packed_weights(folder):
            try:
                legacy = json.loads((folder / name).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"the target's {name} is not readable JSON ({exc})") from None
            return {"quant_method": method, **legacy} if isinstance(legacy, dict) else legacy
    return None


def _holds_packed_weights(folder: Path) -> bool:
    """Whether the folder's safetensors name GPTQ / AWQ packed weights (`*.qweight`), read from the index or the
    files' JSON headers (no tensor is read)."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return any(k.endswith(".qweight") for k in json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        for file in folder.glob("*.safetensors"):
            with file.open("rb") as f:
                header = f.read(int.from_bytes(f.read(8), "little"))
            if any(k.endswith(".qweight") for k in json.loads(header)):
                return True
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: transformers' load says why
    return False


def _gptq_spec(qcfg: dict[str, Any]) -> QuantSpec:
    """A GPTQ config (GPTQModel's or AutoGPTQ's), or ValueError naming what is not served."""
    bits, fmt = qcfg.get("bits"), str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
    dynamic = qcfg.get("dynamic") or {}
    why = (f"{bits}-bit weights (4 and 8 are served)" if bits not in (4, 8) else
           f"checkpoint format {fmt!r} (served: gptq, gptq_v2)" if fmt not in ("gptq", "gptq_v2") else
           # "-:pattern" only leaves modules unquantized (the checkpoint's tensors say which); others change them
           "per-module overrides (dynamic)" if any(not str(k).startswith("-:") for k in dynamic) else
           f"rotated inputs ({qcfg['rotation']})" if qcfg.get("rotation") else
           f"quantized activations ({qcfg['activation']})" if qcfg.get("activation") else
           f"{qcfg['pack_dtype']} packing" if str(qcfg.get("pack_dtype") or "int32").removeprefix("torch.") != "int32"
           else None)
    if why:
        raise ValueError(f"the target is quantized with GPTQ in {why}, not served; {_INSTEAD}")
    return QuantSpec("gptq", _group(qcfg, "gptq"), pre_quantized=True, bits=int(bits), layer="gptq",
                     zero_offset=1 if fmt == "gptq" else 0)


def _awq_spec(qcfg: dict[str, Any]) -> QuantSpec:
    """An AWQ config (AutoAWQ's "gemm" version), or ValueError naming what is not served."""
    bits, version = qcfg.get("bits", qcfg.get("w_bit")), str(qcfg.get("version") or "gemm").lower()
    why = (f"{bits}-bit weights (4 is served)" if bits != 4 else
           f"version {version!r} (gemm is served)" if version != "gemm" else
           "without zero points" if qcfg.get("zero_point") is False else None)
    if why:
        raise ValueError(f"the target is quantized with AWQ {why}, not served; {_INSTEAD}")
    skip = qcfg.get("modules_to_not_convert") or ()
    return QuantSpec("awq", _group({"group_size": qcfg.get("group_size", qcfg.get("q_group_size", 128))}, "awq"),
                     pre_quantized=True, skip=tuple(skip), bits=4, layer="awq")
