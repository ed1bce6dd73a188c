"""gpt-oss targets with MXFP4 experts (dflash_core/quant/mxfp4.py), as OpenAI's checkpoints ship them: the experts
stay in MXFP4 (4.25 bits a weight) and greedy output equals transformers' own forward of the same checkpoint (its
MXFP4 quantizer, which on a CPU dequantizes every expert at load), with and without the draft, on the generic runner
and hf; seeded sampling is equal with and without speculation; the memory estimate counts the experts at their
size; what is not served is refused in one line.

The checkpoint is written here by rounding each expert weight to the nearest MXFP4 value (a power-of-two scale per
32 inputs, the largest magnitude at or under 6 x the scale), in OpenAI's layout (`{proj}_blocks`, `{proj}_scales`);
transformers' decoder reads it back as the reference, so a layout we got wrong would not agree.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core.config import EngineConfig
from dflash_core.loading import load_models, load_target
from dflash_core.quant.mxfp4 import Mxfp4Experts
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair
from tests.test_engine import hf_greedy, run_all, tokens

PROMPTS = ([5], [9, 17, 33, 4, 6, 120, 7], list(range(4, 40)))
NEW_TOKENS = 24
CPU = torch.device("cpu")
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1's magnitudes; code | 8 is the negative


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (blocks [..., out, in / 32, 16] uint8, scales [..., out, in / 32] uint8): each 32 inputs
    scaled by a power of two that puts their largest magnitude in (3, 6], rounded to the nearest e2m1 value."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    code = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1) | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """`src` (a full-precision gpt-oss checkpoint) with its experts in MXFP4, as OpenAI's checkpoints hold them."""
    tensors = load_file(str(src / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers holds [experts, in, out]; the checkpoint [experts, out, in / 32, 16]
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = to_mxfp4(tensors.pop(key).transpose(1, 2))
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def transformers_reference(folder: Path) -> dict[tuple[int, ...], list[int]]:
    """transformers' own greedy continuations from the checkpoint as its MXFP4 quantizer loads it (dequantized)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    # transformers 5.17 leaves the dequantized experts in bf16 whatever the dtype asked (5.24: float32)
    return {tuple(p): hf_greedy(model.float(), p, NEW_TOKENS) for p in PROMPTS}


@functools.cache
def mxfp4_pair(root: Path) -> tuple[Path, Path, dict]:
    target, draft = make_tiny_pair(root, arch="gpt_oss")
    folder = write_mxfp4_checkpoint(target, root / "target-mxfp4")
    refs = transformers_reference(folder)
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    assert refs != {tuple(p): hf_greedy(full, p, NEW_TOKENS) for p in PROMPTS}  # MXFP4 changes the choices
    return folder, draft, refs


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, dict]:
    return mxfp4_pair(tmp_path_factory.mktemp("mxfp4"))


def test_experts_stay_in_mxfp4_and_dequantize_as_transformers_does(pair):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder, _, _ = pair
    model = load_target(folder, CPU, torch.float32)
    ours = [(n, m) for n, m in model.named_modules() if isinstance(m, Mxfp4Experts)]
    assert len(ours) == model.config.num_hidden_layers
    assert all(m.gate_up_proj_blocks.dtype == torch.uint8 and m.down_proj_scales.dtype == torch.uint8 for _, m in ours)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).float()
    for name, experts in ours:
        dense = theirs.get_submodule(name)
        for e in range(experts.num_experts):
            assert torch.equal(experts.expert_weight("gate_up_proj", e), dense.gate_up_proj[e])
            assert torch.equal(experts.expert_weight("down_proj", e), dense.down_proj[e])


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("backend", ["generic", "hf"])
def test_greedy_equals_transformers_forward(pair, backend, speculative):
    folder, draft, refs = pair
    models = load_models(EngineConfig(str(folder), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu", dtype="float32"))
    assert models.backend == backend and models.quantization == "mxfp4 (MoE experts)"
    engine = models.engine
    engine.eos_token_ids = []
    ids = {engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)): tuple(p) for p in PROMPTS}
    assert {ids[rid]: tokens(steps) for rid, steps in run_all(engine).items()} == refs


def test_seeded_sampling_equal_with_and_without_speculation(pair):
    folder, draft, _ = pair
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, stop_token_ids=[])
    outs = []
    for speculative in (True, False):
        engine = load_models(EngineConfig(str(folder), str(draft), speculative=speculative, device="cpu")).engine
        engine.eos_token_ids = []
        rid = engine.add_request([9, 17, 33, 4], params)
        outs.append(tokens(run_all(engine)[rid]))
    assert outs[0] == outs[1]


def test_memory_estimate_counts_the_experts_at_their_size(pair):
    from dflash_core.bench import memory as bench_memory

    folder, draft, _ = pair
    est = bench_memory.memory_estimate(str(folder), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(folder), str(draft), device="cpu", dtype="float32", max_model_len=64,
                                      max_running_requests=2))
    assert est["weights_bytes"] == models.memory.weights
    assert "MoE experts in MXFP4" in bench_memory.format_memory([{**est, "preset": "x"}])


def test_mxfp4_tensors_outside_the_experts_are_refused(pair, tmp_path):
    folder, _, _ = pair
    dst = shutil.copytree(folder, tmp_path / "t")
    tensors = load_file(str(dst / "model.safetensors"))
    weight = tensors.pop("model.layers.0.self_attn.o_proj.weight")
    tensors["model.layers.0.self_attn.o_proj_blocks"], tensors["model.layers.0.self_attn.o_proj_scales"] = (
        to_mxfp4(weight))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_target(dst, CPU, torch.float32)
    assert "\n" not in str(err.value) and "not gpt-oss's MoE experts" in str(err.value)


def test_missing_scales_are_refused(pair, tmp_path):
    folder, _, _ = pair
    dst = shutil.copytree(folder, tmp_path / "t")
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_target(dst, CPU, torch.float32)
    assert "\n" not in str(err.value) and "down_proj_scales" in str(err.value)
