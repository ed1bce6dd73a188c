"""GPTQ and AWQ checkpoints of a tiny target written by GPTQModel, and transformers' own forward of them (the
reference tests/test_quant_gptq_awq.py compares dflash-serve with).

Run as a script in a child process (`python tests/gptq_awq_reference.py SRC OUT SPEC_JSON`): importing GPTQModel
sets process-wide environment and logging, so it never enters the test process. For each requested checkpoint it
quantizes every linear layer of the blocks (min-max rounding to the nearest code: the format does not depend on how
the codes were found), packs it with GPTQModel's own layer (`TorchLinear.pack` for GPTQ, `AwqTorchLinear.pack` for
AWQ), writes the checkpoint as GPTQModel lays it out, loads it with transformers (which hands GPTQ and AWQ layers to
GPTQModel's kernels: its torch ones, which dequantize and multiply), and writes `OUT/NAME/reference.json` (greedy
continuations of the prompts) and `OUT/NAME/dequantized.safetensors` (every layer's weight as GPTQModel dequantizes
it, [in, out], in float16).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def quantize(weight: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool, seed: int,
             zero_rows: bool = False):
    """(scales, zeros, g_idx) of `weight` [out, in] by min-max rounding per group: scales [out, groups] (float16
    values), zeros [out, groups] (codes), g_idx [in] (each input's group; permuted under act-order). `zero_rows`:
    every fifth row's zero points are 0 (its negative weights clip), which GPTQ's original format stores as -1."""
    out, inputs = weight.shape
    group = group if group > 0 else inputs
    g_idx = torch.arange(inputs) // group
    if act_order:  # GPTQ's act-order visits the inputs in another order: groups of scattered inputs
        perm = torch.randperm(inputs, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.argsort(perm) // group
    groups = -(-inputs // group)
    top = (1 << bits) - 1
    scales, zeros = torch.zeros(out, groups), torch.zeros(out, groups)
    for g in range(groups):
        w = weight[:, g_idx == g].float()
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        if sym:
            s, z = (torch.maximum(-lo, hi) / (top // 2)).clamp(min=1e-6), torch.full((out,), float((top + 1) // 2))
        else:
            if zero_rows:
                lo[::5] = 0
            s = ((hi - lo) / top).clamp(min=1e-6)
            z = torch.round(-lo / s.half().float()).clamp(0, top)
        scales[:, g], zeros[:, g] = s.half().float(), z
    return scales, zeros, g_idx.int()


def write(src: Path, dst: Path, spec: dict) -> None:
    """`src` quantized as `spec` says (method, bits, group, act_order, checkpoint_format) into `dst`."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    head = model.get_output_embeddings()
    tensors = load_file(str(src / "model.safetensors"))
    awq, bits, group = spec["method"] == "awq", spec["bits"], spec["group"]
    for i, (name, module) in enumerate(model.named_modules()):
        if not isinstance(module, nn.Linear) or module is head or ".layers." not in f".{name}":
            continue
        key = f"{name}.weight"  # the tiny targets' checkpoints use the model's own names
        sym = not awq and spec.get("sym", True)
        scales, zeros, g_idx = quantize(module.weight.detach(), bits, group, sym=sym,
                                        act_order=spec.get("act_order", False), seed=i, zero_rows=not awq)
        kind = AwqTorchLinear if awq else TorchLinear
        layer = kind(bits=bits, group_size=group, sym=sym, desc_act=spec.get("act_order", False),
                     in_features=module.in_features, out_features=module.out_features, bias=module.bias is not None)
        layer.pack(module, scales, zeros, None if awq else g_idx)
        if not awq and spec.get("checkpoint_format", "gptq") == "gptq":  # GPTQ's original format: zeros minus one
            from gptqmodel import QuantizeConfig
            from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

            convert_gptq_v2_to_v1_format_module(layer, QuantizeConfig(bits=bits, group_size=group))
        del tensors[key]
        prefix = key.removesuffix(".weight")
        for part, value in layer.state_dict().items():
            if part in ("qweight", "qzeros", "scales", "g_idx", "bias"):
                tensors[f"{prefix}.{part}"] = value.contiguous()
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if awq:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": spec.get("sym", True),
              "desc_act": spec.get("act_order", False), "checkpoint_format": spec.get("checkpoint_format", "gptq")}
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))


def reference(folder: Path, spec: dict, prompts: list[list[int]], new_tokens: int) -> None:
    """transformers' greedy continuations of `prompts` from `folder` (GPTQModel's torch kernels), and every quantized
    layer's weight as GPTQModel dequantizes it."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    if spec["method"] == "awq":
        config = AwqConfig(bits=qc["bits"], group_size=qc["group_size"], version="gemm", backend="torch_awq")
    else:
        config = GPTQConfig(bits=qc["bits"], group_size=qc["group_size"], desc_act=qc["desc_act"], backend="torch",
                            checkpoint_format=qc["checkpoint_format"], sym=qc["sym"])
    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, quantization_config=config).eval()
    weights = {}
    for name, module in model.named_modules():
        if hasattr(module, "qweight"):
            w = (dequantize_gemm(module.qweight, module.qzeros, module.scales, qc["bits"], qc["group_size"])
                 if spec["method"] == "awq" else module.dequantize_weight())
            weights[name] = w.to(torch.float16).contiguous()
    assert weights, "transformers loaded no quantized layer"
    save_file(weights, str(folder / "dequantized.safetensors"))
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):  # the whole sequence each step: no cache to differ from
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            refs.append(ids[len(prompt):])
    (folder / "reference.json").write_text(json.dumps(refs))


def main() -> None:
    src, out, job = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.manual_seed(0)
    for name, spec in job["checkpoints"].items():
        if not spec.get("existing"):  # else a checkpoint the test wrote (`--quantization int4`'s tensors)
            write(src, out / name, spec)
        reference(out / name, spec, job["prompts"], job["new_tokens"])


if __name__ == "__main__":
    main()
