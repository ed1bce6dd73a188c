"""Load a target with quantized linear layers through transformers' own loader.

transformers builds the model (every family's module layout, key renames, buffers) and reads the checkpoint;
a quantizer it calls while the model is still a skeleton replaces the linear layers the checkpoint holds quantized
with ours (`Fp8Linear`, `PackedIntLinear`, `GptqLinear`, ...), so the checkpoint's tensors land in them as they
are: one byte a weight in FP8, half a byte in int4. transformers' extension point is a quantizer registered under
a method name (`register_quantizer`); ours is "dflash", and the checkpoint's config is handed over with that method
name, so transformers' own quantizers for the format (its "fp8" one dequantizes the whole model to bf16 on a CPU
and needs kernels from the hub on CUDA; its GPTQ, AWQ and compressed-tensors ones need those libraries) stay
untouched for everything else in the process.

`--quantization fp8` (a full-precision checkpoint, quantized while it loads): the same quantizer, not
pre-quantized; transformers' own FP8 quantization op (`Fp8Quantize`) turns each weight into FP8 and its scales as
it is read, so the full-precision model never sits in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import FineGrainedFP8Config

from dflash_core.quant.base import ChannelScaledLinear, QuantizedLinear
from dflash_core.quant.formats import QuantSpec
from dflash_core.quant.fp8 import FP8_DTYPE, Fp8Linear
from dflash_core.quant.fp8_channel import Fp8ChannelLinear
from dflash_core.quant.gptq_awq import AwqLinear, GptqLinear, quantize_int4
from dflash_core.quant.int8_channel import Int8ChannelLinear
from dflash_core.quant.mxfp4 import Mxfp4Experts
from dflash_core.quant.packed_int import PackedIntLinear

METHOD = "dflash"
# the layer kinds whose scales cover groups of inputs (`QuantSpec.block` = (1, group size))
GROUPED = ("packed-int", "gptq", "awq")
# the tensor each layer kind keeps beside a quantized layer's weight: which modules a checkpoint holds quantized
MARKERS = {"fp8-block": ".weight_scale_inv", "packed-int": ".weight_packed", "fp8-channel": ".weight_scale",
           "int8-channel": ".weight_scale",
           "gptq": ".qweight", "awq": ".qweight", "mxfp4-experts": "_blocks"}


class DFlashQuantConfig(FineGrainedFP8Config):
    """transformers' FP8 config (its fields drive `--quantization fp8`'s op) under our method name, so that
    transformers hands loading to our quantizer, with what our quantizer needs of the checkpoint."""

    def __init__(self, compute_dtype: str = "bfloat16", checkpoint_modules: tuple[str, ...] = (),
                 layer: str = "fp8-block", bits: int = 8, group_size: int | None = None, per_tensor: bool = False,
                 dynamic_activations: bool = False, zero_offset: int = 0, **kwargs: Any) -> None:
        kwargs["quant_method"] = METHOD
        super().__init__(**kwargs)
        self.compute_dtype = compute_dtype  # a torch dtype's name: the config stays JSON
        self.checkpoint_modules = tuple(checkpoint_modules)  # the modules the checkpoint holds quantized
        self.layer, self.bits, self.group_size = layer, bits, group_size  # `QuantSpec.layer`
        self.per_tensor, self.dynamic_activations = per_tensor, dynamic_activations
        self.zero_offset = zero_offset  # "gptq"


class DFlashQuantizer(HfQuantizer):
    """Replaces the skeleton's linear layers with our quantized ones before transformers reads the weights."""

    requires_calibration = False
    quantization_config: DFlashQuantConfig

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: the layers run on CPU and CUDA alike (`quant/fp8.py`, `quant/packed_int.py`)."""

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        """A full-precision weight read into an FP8 or int4 layer is quantized on the way (`--quantization`)."""
        if self.pre_quantized:
            return False
        owner, _, name = param_name.rpartition(".")
        return name == "weight" and isinstance(model.get_submodule(owner), (Fp8Linear, GptqLinear))

    def get_quantize_ops(self) -> Any:
        from transformers.integrations.finegrained_fp8 import Fp8Quantize

        return Int4Quantize(self.quantization_config.group_size) if self.quantization_config.layer == "gptq" else (
            Fp8Quantize(self))

    def _layer(self, linear: nn.Linear) -> nn.Module | None:
        """`linear`'s quantized replacement (on the skeleton's device), or None where it stays as it is."""
        qc = self.quantization_config
        dtype, device = getattr(torch, qc.compute_dtype), linear.weight.device
        if qc.layer == "packed-int":
            return PackedIntLinear(linear.in_features, linear.out_features, qc.bits, qc.group_size,
                                   linear.bias is not None, dtype, device)
        if qc.layer == "gptq":
            layer = GptqLinear(linear.in_features, linear.out_features, qc.bits, qc.group_size,
                               linear.bias is not None, dtype, qc.zero_offset, device)
            if not self.pre_quantized:  # --quantization int4: where transformers reads the full-precision weight
                layer.weight = nn.Parameter(torch.empty_like(linear.weight, dtype=dtype), requires_grad=False)
            return layer
        if qc.layer == "awq":
            return AwqLinear(linear.in_features, linear.out_features, qc.bits, qc.group_size, linear.bias is not None,
                             dtype, device)
        if qc.layer in ("fp8-channel", "int8-channel"):
            kind = Fp8ChannelLinear if qc.layer == "fp8-channel" else Int8ChannelLinear
            return kind(linear.in_features, linear.out_features, qc.per_tensor, qc.dynamic_activations,
                        linear.bias is not None, dtype, device)
        block = tuple(qc.weight_block_size) if qc.weight_block_size else None
        if not self.pre_quantized and block and (linear.out_features % block[0] or linear.in_features % block[1]):
            return None  # as transformers' quantization op: a weight that does not tile stays as it is
        layer = Fp8Linear(linear.in_features, linear.out_features, block, linear.bias is not None, dtype, device)
        if not self.pre_quantized:
            # the placeholder in the checkpoint's precision: transformers (5.17) reads a tensor in its
            # placeholder's dtype before the quantization op sees it, and FP8 there would round it twice
            layer.weight.data = torch.empty_like(layer.weight, dtype=dtype)
        return layer

    def _quantized_modules(self, model: nn.Module) -> set[str]:
        """The model's names of the modules the checkpoint holds quantized: each checkpoint name through the model's
        own key renames (transformers' conversion mapping: Qwen3.5's `model.language_model.` prefix and the like).
        A name that lands on a parameter of the model (fused MoE experts) is refused; one that lands nowhere (an
        MTP head, a vision tower the text model does not load) is skipped, as transformers skips its tensors."""
        modules, params = dict(model.named_modules()), dict(model.named_parameters())
        found, refused = set(), []
        for original, key in _model_keys(model, self.quantization_config.checkpoint_modules).items():
            name = key.removesuffix(".weight")  # (a fused MoE parameter has no suffix: it lands in `params`)
            if isinstance(modules.get(name), nn.Linear):
                found.add(name)
            elif name in modules or key in params:
                refused.append(original)
        if refused:
            raise ValueError(
                f"the checkpoint quantizes {len(refused)} weight(s) this server keeps only in full precision (first: "
                f"{sorted(refused)[0]}; the output head, MoE experts and embeddings are not served quantized); serve "
                "the bf16 checkpoint (with --quantization fp8)")
        return found

    def _swap_experts(self, model: nn.Module) -> None:
        """gpt-oss's experts replaced by MXFP4 ones where the checkpoint holds them so (every one of them)."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        keys = _model_keys(model, self.quantization_config.checkpoint_modules).values()
        held = {key.removesuffix(".weight") for key in keys}
        dtype = getattr(torch, self.quantization_config.compute_dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, GptOssExperts) and held & {f"{name}.gate_up_proj", f"{name}.down_proj"}:
                parent, _, child = name.rpartition(".")
                device = module.gate_up_proj.device
                setattr(model.get_submodule(parent), child, Mxfp4Experts(model.config, dtype, device))
                held -= {f"{name}.gate_up_proj", f"{name}.down_proj"}
        if held:
            raise ValueError(f"the checkpoint holds MXFP4 tensors for {len(held)} weight(s) that are not gpt-oss's "
                             f"MoE experts (first: {sorted(held)[0]}); only gpt-oss's experts are served in MXFP4")

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        qc = self.quantization_config
        if qc.layer == "mxfp4-experts":
            return self._swap_experts(model)
        quantized = self._quantized_modules(model) if self.pre_quantized else set()
        # the output head stays in full precision whatever the skip list says: the draft multiplies by it
        skip = list(qc.modules_to_not_convert or []) + get_keys_to_not_convert(model)
        converted = set()
        head = model.get_output_embeddings()
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or module is head:
                continue
            if self.pre_quantized and name not in quantized:
                continue  # the checkpoint left it in full precision
            if not self.pre_quantized and not should_convert_module(name, skip):
                continue
            layer = self._layer(module)
            if layer is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, layer)
                converted.add(name)
        if quantized - converted:
            raise ValueError(
                f"the checkpoint quantizes {len(quantized - converted)} weight(s) this server keeps only in full "
                f"precision (first: {sorted(quantized - converted)[0]}: the output head is not served quantized, the "
                "draft multiplies by it); serve the bf16 checkpoint (with --quantization fp8)")

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for module in model.modules():
            expected = FP8_DTYPE if isinstance(module, Fp8Linear) else (
                module.value_dtype if isinstance(module, ChannelScaledLinear) else None)
            if expected is not None and module.weight.dtype != expected:
                raise RuntimeError(f"transformers loaded {module.weight.dtype} weights into a {expected} layer")
            if isinstance(module, GptqLinear) and "weight" in module._parameters:
                del module._parameters["weight"]  # --quantization int4's placeholder, emptied by `Int4Quantize`
            if isinstance(module, (QuantizedLinear, Mxfp4Experts)):
                module.requires_grad_(False)  # served, never trained (the loader hands back trainable parameters)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


class Int4Quantize(ConversionOps):
    """`--quantization int4`: each full-precision weight, as transformers reads it, into a `GptqLinear`'s tensors
    (`quantize_int4`); other tensors pass through."""

    def __init__(self, group: int) -> None:
        self.group = group

    def convert(self, input_dict: dict[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            if key.endswith(".weight") and value.ndim == 2:
                prefix = key.removesuffix(".weight")
                out.update({f"{prefix}.{k}": v for k, v in quantize_int4(value, self.group).items()})
                out[key] = value.new_empty(0)  # the placeholder the weight was read into, emptied
            else:
                out[key] = value
        return out


def _model_keys(model: nn.Module, checkpoint_modules: tuple[str, ...]) -> dict[str, str]:
    """Each checkpoint module name -> the model's key for its weight, through the model's own key renames
    (transformers' conversion mapping: Qwen3.5's `model.language_model.` prefix, per-expert weights into fused ones,
    and the like)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    renamings, keys = get_model_conversion_mapping(model), {}
    for original in checkpoint_modules:
        key = f"{original}.weight"
        for rename in renamings:
            key, _ = rename.rename_source_key(key)
        keys[original] = key
    return keys


def _register() -> None:
    """Register our config and quantizer with transformers once per process."""
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(DFlashQuantConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(DFlashQuantizer)


def checkpoint_dtypes(folder: Path) -> dict[str, str]:
    """Each tensor of a safetensors checkpoint (all its shards) and its dtype ("F8_E4M3", "BF16", ...), read from
    the files' headers, not their tensors."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    return dtypes


def load_quantized(auto: Any, folder: Path, config: Any, spec: QuantSpec, dtype: torch.dtype) -> nn.Module:
    """`auto.from_pretrained(folder)` with the linear layers `spec` names held quantized."""
    _register()
    marker = MARKERS[spec.layer]
    modules: tuple[str, ...] = ()
    if spec.pre_quantized:
        dtypes = checkpoint_dtypes(folder)
        keys = list(dtypes)
        modules = tuple(k[: -len(marker)] for k in keys if k.endswith(marker))
        other = next((k for k in keys if k.endswith((".weight_scale", ".input_scale"))), None)
        if spec.method == "fp8" and (other is not None or not modules):
            # AutoFP8's layout (per-tensor `weight_scale`, static `input_scale`), or no safetensors at all: the FP8
            # values would land in full-precision layers unscaled
            found = f"its tensors include {other}" if other else f"it has no {marker[1:]} tensors in safetensors"
            raise ValueError(f"the target's FP8 checkpoint is not in the layout served ({found}; served: "
                             f"{marker[1:]} block or per-tensor scales, as Qwen's FP8 checkpoints); serve its bf16 "
                             "checkpoint with --quantization fp8")
        if not modules:
            raise ValueError(f"the target's {spec.method} checkpoint has no {marker[1:]} tensors in safetensors")
        # tensors of a layout other than the config's: they would be dropped (act-order indices, zero points, static
        # input scales) or read into the wrong layer
        foreign = {".weight_g_idx", ".weight_zero_point", ".input_scale", *MARKERS.values()} - {marker}
        if spec.layer == "packed-int":
            foreign.discard(".weight_scale")  # its groups' scales, beside weight_packed
        stray = next((k for k in keys if k.endswith(tuple(foreign))), None)
        if spec.layer != "fp8-block" and stray is not None:  # (FP8 blocks: refused above, by their own names)
            raise ValueError(f"the target's checkpoint holds {stray}, which its {spec.method} config does not "
                             "describe; serve its bf16 checkpoint (with --quantization fp8)")
        # an FP8 weight without its scale would be read into a full-precision layer as it is
        unscaled = sorted(k for k, d in dtypes.items() if d.startswith("F8") and k.endswith(".weight")
                          and k.removesuffix(".weight") not in modules)
        if unscaled:
            raise ValueError(f"the target's checkpoint holds FP8 weights without their {marker[1:]} (first: "
                             f"{unscaled[0]}); it is incomplete or in another layout")
    block_fp8 = spec.layer == "fp8-block"
    qc = DFlashQuantConfig(compute_dtype=str(dtype).removeprefix("torch."), checkpoint_modules=modules,
                           layer=spec.layer, bits=spec.bits, dynamic_activations=spec.dynamic_activations,
                           group_size=spec.block[1] if spec.layer in GROUPED and spec.block else None,
                           per_tensor=spec.per_tensor, zero_offset=spec.zero_offset,
                           weight_block_size=spec.block if block_fp8 else None,
                           modules_to_not_convert=list(spec.skip) or None)
    if spec.pre_quantized:
        config.quantization_config = qc.to_dict()
        kwargs: dict[str, Any] = {}
    else:
        kwargs = dict(quantization_config=qc)
    try:
        model, info = auto.from_pretrained(str(folder), config=config, dtype=dtype, output_loading_info=True,
                                           **kwargs)
    except RuntimeError as exc:  # shapes that do not match: transformers has logged its load report
        reason = "transformers' load report above lists them" if "mismatched" in str(exc) else (
            str(exc).splitlines()[0][:160])
        raise ValueError(f"the quantized checkpoint's tensors do not have the shapes its quantization_config "
                         f"describes ({reason}); check its block or group size and bits") from None
    head = model.get_output_embeddings()  # tied to the embeddings in some checkpoints: not a tensor of its own
    linear = {name for name, m in model.named_modules()
              if isinstance(m, (QuantizedLinear, nn.Linear, Mxfp4Experts)) and m is not head}
    missing = [k for k in info.get("missing_keys", ()) if k.rpartition(".")[0] in linear]
    if missing:  # a layer left with uninitialized tensors (a quantized layer's, or one whose weight was never there)
        raise ValueError(f"the quantized checkpoint lacks {len(missing)} tensor(s) of its linear layers (first: "
                         f"{sorted(missing)[0]})")
    return model


def weights_format(model: nn.Module) -> str | None:
    """How a loaded model's linear weights are held: "fp8", "compressed-tensors int4" (or int8), "gptq int4",
    "awq int4", ..., None in full precision."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            return "fp8"
        if isinstance(module, PackedIntLinear):
            return f"compressed-tensors int{module.bits}"
        if isinstance(module, ChannelScaledLinear):
            return f"compressed-tensors {module.kind}" + (" (W8A8)" if module.dynamic_activations else "")
        if isinstance(module, Mxfp4Experts):
            return "mxfp4 (MoE experts)"
        if isinstance(module, (GptqLinear, AwqLinear)):
            return f"{'gptq' if isinstance(module, GptqLinear) else 'awq'} int{module.bits}"
    return None
