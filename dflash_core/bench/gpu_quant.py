"""The GPU check's quantized linear layers (`dflash_core/quant/`): one layer of each served kind shaped like
Qwen3-8B's MLP down projection (12288 -> 4096; 256 x 384 on a CPU dry run), with whether each device kernel passes
its probe on this device and why not, and ms per multiply at 1, 16 and 256 rows for bf16 weights, the kernel-free
(dequantizing) forward and the kernel. Kinds: FP8 block-scaled (Qwen's FP8 checkpoints; cuBLAS's block-scaled GEMM),
FP8-dynamic and INT8 W8A8 (compressed-tensors; torch's row-wise FP8 and int8 GEMMs), and GPTQ int4 in groups of 128
(torch's int4 GEMM, tinygemm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ROWS = (1, 16, 256)


def _layers(in_f: int, out_f: int, dtype: Any, device: Any, weight: Any) -> list[tuple[str, Any, Any]]:
    """(name, layer holding `weight` as that kind rounds it (GPTQ: random codes), its kernel)."""
    import torch

    from dflash_core.quant.fp8 import Fp8Linear
    from dflash_core.quant.fp8_channel import Fp8ChannelLinear, RowWiseFp8Kernel
    from dflash_core.quant.fp8_kernels import BlockFp8Kernel
    from dflash_core.quant.gptq_awq import GptqLinear
    from dflash_core.quant.int4_kernel import Int4Kernel
    from dflash_core.quant.int8_channel import Int8ChannelLinear, Int8Kernel

    block = Fp8Linear(in_f, out_f, (128, 128), False, dtype, device)
    dynamic = Fp8ChannelLinear(in_f, out_f, False, True, False, dtype, device)
    int8 = Int8ChannelLinear(in_f, out_f, False, True, False, dtype, device)
    for layer in (block, dynamic):  # unit scales: the values as FP8 rounds them
        layer.weight.data = weight.to(layer.weight.dtype)
    dynamic.weight_scale.data.fill_(1.0)
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    int8.weight.data = torch.round(weight / scale).to(torch.int8)
    int8.weight_scale.data = scale.to(dtype)
    gptq = GptqLinear(in_f, out_f, 4, 128, False, dtype, zero_offset=0, device=device)
    gptq.qweight.data = torch.randint(-2**31, 2**31 - 1, gptq.qweight.shape, dtype=torch.int32, device=device)
    gptq.qzeros.data.fill_(0x88888888 - 2**32)  # every zero point 8
    gptq.scales.data = torch.full_like(gptq.scales, 0.01)
    return [("block", block, BlockFp8Kernel()), ("dynamic", dynamic, RowWiseFp8Kernel()), ("int8", int8, Int8Kernel()),
            ("gptq-int4", gptq, Int4Kernel())]


def quant_check(device: Any, time_ms: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """Each kind's kernel choice and timings on `device` (`time_ms(fn)`: ms per call of fn)."""
    import torch

    from dflash_core.quant.base import choose_kernel

    out_f, in_f = (256, 384) if device.type != "cuda" else (4096, 12288)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(out_f, in_f, device=device, dtype=dtype) * 0.02
    inputs = {rows: torch.randn(rows, in_f, device=device, dtype=dtype) for rows in ROWS}
    result: dict[str, Any] = dict(shape=[out_f, in_f])
    for rows, x in inputs.items():
        result[f"bf16_ms_{rows}"] = time_ms(lambda x=x: torch.nn.functional.linear(x, weight))
    for name, layer, kernel in _layers(in_f, out_f, dtype, device, weight):
        entry: dict[str, Any] = {f"dequant_ms_{rows}": time_ms(lambda x=x, m=layer: m(x)) for rows, x in inputs.items()}
        choice = choose_kernel(torch.nn.Sequential(layer), device, kernel)
        entry.update(kernel=choice.used, reason=choice.reason, probe_error=choice.error)
        for rows, x in inputs.items() if entry["kernel"] else ():
            entry[f"kernel_ms_{rows}"] = time_ms(lambda x=x, m=layer: m(x))
        result[name] = entry
    return result


def format_quant(result: dict[str, Any]) -> list[str]:
    """The report's lines for `quant_check`'s result (none for an empty one)."""
    lines = []
    for name in ("block", "dynamic", "int8", "gptq-int4") if result else ():
        e = result[name]
        times = ", ".join(f"{rows} rows bf16 {result[f'bf16_ms_{rows}']:.3f} / dequant {e[f'dequant_ms_{rows}']:.3f}"
                          + (f" / kernel {e[f'kernel_ms_{rows}']:.3f}" if e["kernel"] else "") for rows in ROWS)
        lines.append(f"{name} {result['shape'][0]}x{result['shape'][1]}: {'kernel' if e['kernel'] else 'no kernel'} "
                     f"({e['reason']}); ms {times}")
    return lines
