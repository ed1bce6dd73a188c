"""Quantized targets (dflash_core/quant/): FP8 checkpoints load with their weights kept in FP8 and give greedy output
identical to transformers' own forward of the same checkpoint, with and without the draft, on every batched runner
(and hf); seeded sampling is equal with and without speculation; `--quantization fp8` quantizes a full-precision
checkpoint while it loads, equal to the checkpoint transformers' own FP8 quantization op writes; formats not served
are refused in one line.

The FP8 checkpoints are written by transformers' own FP8 quantization op (`Fp8Quantize`, the one its
`FineGrainedFP8Config` quantizes with), in Qwen's FP8 layout; transformers reads them back on a CPU by dequantizing
every weight (its reference forward here).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_core.config import DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.loading import load_models, load_target
from dflash_core.quant import quant_spec
from dflash_core.quant.fp8 import FP8_DTYPE, Fp8Linear, dequantize_blocks
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair
from tests.test_engine import hf_greedy, run_all, tokens

PROMPTS = ([5], [9, 17, 33, 4, 6, 120, 7], list(range(4, 70)))
NEW_TOKENS = 24
CPU = torch.device("cpu")


def _fp8_op(block: tuple[int, int] | None):
    """transformers' own FP8 quantization op, configured as its FineGrainedFP8Config would."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Holder:
        quantization_config = FineGrainedFP8Config(weight_block_size=block)

    return Fp8Quantize(Holder())


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None, also: tuple[str, ...] = ()) -> Path:
    """`src` (a full-precision checkpoint) in Qwen's FP8 layout: every linear weight but the output head, quantized
    by transformers' op (weights that do not tile by `block` stay as they are, as its op leaves them); `also`: more
    weight names to quantize (the refusal tests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    head = model.get_output_embeddings()
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    op = _fp8_op(block)
    tensors = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        tensors.update(op._quantize_one(key, value) if key in linears or key in also else {key: value})
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if block else {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def transformers_reference(folder: Path) -> dict[tuple[int, ...], list[int]]:
    """transformers' own greedy continuation of each prompt, from the checkpoint as transformers loads it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    refs = {tuple(p): hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS}
    # on a CPU transformers multiplies by dequantized weights (FP8: from the start; compressed-tensors: from the
    # first forward on)
    assert not any(p.dtype in (FP8_DTYPE, torch.int32) for p in model.parameters())
    return refs


def greedy(engine) -> dict[tuple[int, ...], list[int]]:
    engine.eos_token_ids = []
    ids = {engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)): tuple(p) for p in PROMPTS}
    outs = run_all(engine)
    return {ids[rid]: tokens(steps) for rid, steps in outs.items()}


@functools.cache
def fp8_family(arch: str, root: Path) -> tuple[Path, Path, dict]:
    """(FP8 target, draft, transformers' greedy references): the tiny pair of `arch`, its target in FP8 with
    16 x 16 blocks (the tiny layers are 16 to 128 wide; Qwen's checkpoints use 128 x 128)."""
    tmp = root / arch
    target, draft = make_tiny_pair(tmp, arch=arch)
    fp8 = write_fp8_checkpoint(target, tmp / "target-fp8", (16, 16))
    refs = transformers_reference(fp8)
    assert refs != transformers_reference(target)  # FP8 changes the tiny target's choices: the test can tell
    return fp8, draft, refs


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def fp8_pair(root) -> tuple[Path, Path, dict]:
    return fp8_family("qwen3", root)


def test_dequantization_is_transformers_own_bit_for_bit():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight = torch.randn(96, 160) * torch.logspace(-3, 1, 160)
    out = _fp8_op((32, 32))._quantize_one("w.weight", weight)
    q, scale = out["w.weight"], out["w.weight_scale_inv"]
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 5)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = Fp8Dequantize(None)._dequantize_one(q, scale, dtype)
        assert torch.equal(dequantize_blocks(q, scale, (32, 32), dtype), theirs)
    assert (dequantize_blocks(q, scale, (32, 32), torch.float32) - weight).abs().max() < 0.07 * weight.abs().max()


def test_partial_blocks_and_per_tensor_scales():
    """A weight whose sides do not divide by the block: the last row and column blocks are partial (scales
    ceil(out / b0) x ceil(in / b1)); a per-tensor scale is one scalar."""
    q = torch.randn(40, 72).to(FP8_DTYPE)
    scale = torch.rand(3, 3) + 0.5
    full = scale.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :72]
    assert torch.equal(dequantize_blocks(q, scale, (16, 32), torch.float32), q.float() * full)
    assert torch.equal(dequantize_blocks(q, torch.tensor(0.25), None, torch.float32), q.float() * 0.25)
    layer = Fp8Linear(72, 40, (16, 32), bias=True, dtype=torch.float32)
    layer.weight.data, layer.weight_scale_inv.data, layer.bias.data = q, scale, torch.randn(40)
    x = torch.randn(3, 72)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, q.float() * full, layer.bias))


def test_fp8_checkpoint_keeps_its_weights_in_fp8(fp8_pair):
    fp8, _, _ = fp8_pair
    model = load_target(fp8, CPU, torch.float32)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 7  # q, k, v, o, gate, up, down of each of the 4 layers
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale_inv.dtype == torch.float32 for m in layers)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    # the start-up memory plan counts the weights at their real size
    models = load_models(EngineConfig(str(fp8), speculative=False, device="cpu"))
    real = sum(p.numel() * p.element_size() for p in models.engine.target.model.parameters())
    assert models.memory.weights == real
    full = sum(p.numel() * 4 for p in load_target(fp8.parent / "target-qwen3", CPU, torch.float32).parameters())
    assert real < 0.6 * full


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("arch,backend", [("qwen3", "native"), ("qwen3", "generic"), ("qwen3", "hf"),
                                          ("qwen3_5", "native"), ("gemma4", "generic"), ("qwen3_moe", "native")])
def test_fp8_greedy_equals_transformers_forward(root, arch, backend, speculative):
    """Every batched runner (native: dense and hybrid layers, generic) and hf; Qwen3-MoE's experts stay in full
    precision (its attention is FP8)."""
    fp8, draft, refs = fp8_family(arch, root)
    models = load_models(EngineConfig(str(fp8), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu"))
    assert models.backend == backend
    assert models.quantization == "fp8" and any(isinstance(m, Fp8Linear) for m in models.engine.target.model.modules())
    assert greedy(models.engine) == refs


def test_fp8_per_tensor_scales(fp8_pair, tmp_path):
    """A checkpoint with one scale per tensor ([1, 1], as transformers' op writes it)."""
    fp8, draft, _ = fp8_pair
    per_tensor = write_fp8_checkpoint(fp8.parent / "target-qwen3", tmp_path / "pt", None)
    models = load_models(EngineConfig(str(per_tensor), str(draft), speculation="fixed", device="cpu"))
    layers = [m for m in models.engine.target.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 7 and all(m.block is None and m.weight_scale_inv.shape == (1, 1) for m in layers)
    assert greedy(models.engine) == transformers_reference(per_tensor)


def test_fp8_checkpoint_with_hub_key_names(root, tmp_path):
    """Qwen3.5's hub checkpoints name their tensors `model.language_model.*` (transformers renames them while
    loading) and carry tensors the text model does not load (an MTP head): the renamed layers load in FP8, the rest
    is skipped as transformers skips it."""
    from safetensors.torch import load_file, save_file

    src, draft, _ = fp8_family("qwen3_5", root)
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    tensors = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors.update(_fp8_op((16, 16))._quantize_one("mtp.fc.weight", torch.randn(64, 128)))
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    models = load_models(EngineConfig(str(hub), str(draft), speculation="fixed", device="cpu"))
    assert sum(isinstance(m, Fp8Linear) for m in models.engine.target.model.modules()) == 25
    assert greedy(models.engine) == transformers_reference(hub) == fp8_family("qwen3_5", root)[2]


def test_fp8_checkpoint_in_another_layout_is_refused(fp8_pair, tmp_path):
    """AutoFP8's layout (a per-tensor `weight_scale`, a static `input_scale`) would load unscaled: refused."""
    from safetensors.torch import load_file, save_file

    src = fp8_pair[0].parent / "target-qwen3"
    folder = _with_config(src, tmp_path / "autofp8", quantization_config={"quant_method": "fp8",
                                                                          "activation_scheme": "static"})
    tensors = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if key.endswith("proj.weight"):
            scale = value.abs().max() / 448
            tensors[key] = (value / scale).to(FP8_DTYPE)
            module = key.removesuffix(".weight")
            tensors[f"{module}.weight_scale"], tensors[f"{module}.input_scale"] = scale.float(), torch.tensor(1.0)
        else:
            tensors[key] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_target(folder, CPU, torch.float32)
    assert "\n" not in str(err.value) and "input_scale" in str(err.value) and "--quantization fp8" in str(err.value)


def test_fp8_seeded_sampling_equal_with_and_without_speculation(fp8_pair):
    fp8, draft, _ = fp8_pair
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, stop_token_ids=[])
    outs = []
    for speculative in (True, False):
        engine = load_models(EngineConfig(str(fp8), str(draft), speculative=speculative, device="cpu")).engine
        engine.eos_token_ids = []
        rid = engine.add_request([9, 17, 33, 4], params)
        outs.append(tokens(run_all(engine)[rid]))
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A full-precision qwen3 target whose layers tile by 128 x 128 (the blocks of --quantization fp8), and a
    random draft for it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tmp = tmp_path_factory.mktemp("wide")
    target, _ = make_tiny_pair(tmp)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(target))
    draft = tmp / "draft-wide"
    DFlashDraft(DraftConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=vocab, num_target_layers=3, block_size=8,
                            mask_token_id=3, max_position_embeddings=1024)).save(draft)
    return target, draft


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
def test_quantization_fp8_at_load_equals_the_fp8_checkpoint(wide_pair, tmp_path, speculative):
    """--quantization fp8: the weights quantized while loading are the ones transformers' op writes into an FP8
    checkpoint (128 x 128 blocks), and greedy output equals transformers' forward of that checkpoint."""
    target, draft = wide_pair
    refs = transformers_reference(write_fp8_checkpoint(target, tmp_path / "fp8", (128, 128)))
    models = load_models(EngineConfig(str(target), str(draft), quantization="fp8", speculative=speculative,
                                      speculation="fixed", device="cpu"))
    layers = [m for m in models.engine.target.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 3 * 7 and all(m.block == (128, 128) for m in layers)
    assert greedy(models.engine) == refs


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("qcfg", "words"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ("bitsandbytes", "--quantization fp8")),
        ({"load_in_8bit": True}, ("bitsandbytes",)),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ("AWQ", "version 'gemv'")),
        ({"quant_method": "gptq", "bits": 3}, ("GPTQ", "3-bit")),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
            "type": "float", "num_bits": 8, "strategy": "block"}}}}, ("FP8 weights with strategy 'block'",)),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": False}}}},
         ("asymmetric weights",)),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
            "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
            "input_activations": {"type": "int", "num_bits": 8, "dynamic": True}}}},
         ("integer activation quantization",)),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 4, "strategy": "group", "group_size": 16, "actorder": "group"}}}},
         ("act-order 'group'",)),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 4, "strategy": "group", "group_size": 16, "actorder": True}}}},
         ("act-order True",)),
        ({"quant_method": "compressed-tensors", "quantization_status": "frozen", "format": "pack-quantized",
          "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 16}}}},
         ("status 'frozen'",)),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 4, "strategy": "group", "group_size": None}}}}, ("without a group size",)),
        ({"quant_method": "mxfp4"}, ("mxfp4", "no blocks tensors")),
        ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 8, "strategy": "group", "group_size": 16}}}}, ("int8 weights with strategy",)),
        ({"quant_method": "exotic"}, ("'exotic' is not supported",)),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, ("ue8m0",)),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, ("weight_block_size is [128, 0]",)),
        ({"quant_method": "compressed-tensors", "config_groups": [{"weights": {}}]},
         ("config_groups that are not an object",)),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": "int4"}}}, ("malformed",)),
    ],
    ids=["bnb4", "bnb8", "awq", "gptq", "ct-fp8-block", "ct-asymmetric", "ct-w8a8", "ct-actorder", "ct-actorder-true",
         "ct-frozen", "ct-no-group-size", "mxfp4", "ct-int8-group", "exotic", "fp8-ue8m0", "fp8-block-0",
         "ct-groups-list", "ct-weights-str"],
)
def test_formats_not_served_are_refused_in_one_line(fp8_pair, tmp_path, qcfg, words):
    folder = _with_config(fp8_pair[0], tmp_path / "t", quantization_config=qcfg)
    with pytest.raises(ValueError) as err:
        load_target(folder, CPU, torch.float32)
    message = str(err.value)
    assert "\n" not in message and len(message) < 300 and all(w in message for w in words), message


def test_other_refusals_are_one_line(fp8_pair, tmp_path):
    fp8, _, _ = fp8_pair
    gguf = tmp_path / "model-f16.gguf"
    gguf.write_bytes(b"GGUF")
    for path in (gguf, tmp_path):  # a GGUF file, a folder of them
        with pytest.raises(ValueError, match="GGUF is llama.cpp's format; serve its bf16 checkpoint"):
            load_target(path, CPU, torch.float32)
    with pytest.raises(ValueError, match="^Qwen/Qwen3-8B-GGUF: GGUF is llama.cpp's format"):
        load_target("Qwen/Qwen3-8B-GGUF", CPU, torch.float32)  # refused before any download
    with pytest.raises(ValueError, match="quantization must be one of fp8, int4, got 'int8'"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="--quantization 'nf4' is not supported"):
        quant_spec(None, "nf4")
    with pytest.raises(ValueError, match="already quantized with gptq; drop --quantization int4"):
        quant_spec({"quant_method": "gptq", "bits": 4}, "int4")
    assert quant_spec({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8").pre_quantized
    with pytest.raises(ValueError, match="already quantized with compressed-tensors; drop --quantization fp8"):
        quant_spec({"quant_method": "compressed-tensors"}, "fp8")
    # an FP8 output head: the draft multiplies by the target's head, which stays in full precision
    src = fp8_pair[0].parent / "target-qwen3"
    head = write_fp8_checkpoint(src, tmp_path / "head", (16, 16), also=("lm_head.weight",))
    with pytest.raises(ValueError) as err:
        load_target(head, CPU, torch.float32)
    assert "\n" not in str(err.value) and "lm_head" in str(err.value) and "--quantization fp8" in str(err.value)


def test_fp8_moe_experts_are_refused_in_one_line(root, tmp_path):
    """A checkpoint with FP8 experts (Qwen3-MoE's FP8 checkpoints): refused, naming an expert weight; the server
    keeps MoE experts in full precision (--quantization fp8 quantizes the rest)."""
    src = fp8_family("qwen3_moe", root)[0].parent / "target-qwen3_moe"
    experts = write_fp8_checkpoint(src, tmp_path / "experts", (16, 16),
                                   also=("model.layers.0.mlp.experts.0.gate_proj.weight",))
    with pytest.raises(ValueError) as err:
        load_target(experts, CPU, torch.float32)
    assert "\n" not in str(err.value) and "model.layers.0.mlp.experts.0.gate_proj" in str(err.value), err.value


def test_server_refuses_a_gguf_target_before_loading(tmp_path):
    from server.__main__ import preflight
    from server.settings import Settings

    gguf = tmp_path / "model-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    problem = preflight(Settings(target=str(gguf), device="cpu"))
    assert problem == (f"--target {gguf}: GGUF is llama.cpp's format; serve its bf16 checkpoint (with --quantization "
                       "fp8 to keep the weights in 8 bits) or an FP8 checkpoint")


def test_memory_estimate_counts_fp8_weights_at_their_size(fp8_pair):
    """`dflash-bench memory` of a local FP8 checkpoint: the weights the start-up plan counts from the loaded
    model (FP8 weights, float32 block scales, the rest in the compute dtype)."""
    from dflash_core.bench import memory as bench_memory

    fp8, draft, _ = fp8_pair
    est = bench_memory.memory_estimate(str(fp8), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(fp8), str(draft), device="cpu", max_model_len=64, max_running_requests=2))
    assert est["quantization"] == "fp8" and est["weights_bytes"] == models.memory.weights
    full = bench_memory.memory_estimate(str(fp8.parent / "target-qwen3"), str(draft), dtype="float32",
                                        max_model_len=64, max_running_requests=2)
    assert full["quantization"] is None and full["weights_bytes"] > est["weights_bytes"]
    # --quantization fp8 on the full-precision folder: its 16-wide layers do not tile by 128, nothing is quantized
    at_load = bench_memory.memory_estimate(str(fp8.parent / "target-qwen3"), str(draft), dtype="float32",
                                           max_model_len=64, max_running_requests=2, quantization="fp8")
    assert at_load["weights_bytes"] == full["weights_bytes"]


def test_memory_estimate_counts_packed_int_weights_at_their_size(root):
    from dflash_core.bench import memory as bench_memory

    packed, draft, _ = int_family("qwen3", 4, 16, root)
    est = bench_memory.memory_estimate(str(packed), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(packed), str(draft), device="cpu", max_model_len=64, max_running_requests=2))
    assert est["quantization"] == "compressed-tensors" and est["quantization_bits"] == 4
    assert est["weights_bytes"] == models.memory.weights
    assert "target linear weights int4 (compressed-tensors)" in bench_memory.format_memory([{**est, "preset": "x"}])
    fp8, draft, _ = float_family("qwen3", True, root)
    est = bench_memory.memory_estimate(str(fp8), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(fp8), str(draft), device="cpu", max_model_len=64, max_running_requests=2))
    assert est["weights_bytes"] == models.memory.weights
    assert "target linear weights FP8 (compressed-tensors)" in bench_memory.format_memory([{**est, "preset": "x"}])


def test_fp8_presets_fit_the_cards_bf16_does_not():
    """The 24 GB preset (Qwen3-8B FP8 with its draft) holds 8,192-token requests on a 24 GB card, and the 48 GB one
    (Qwen3.5-27B FP8) on a 48 GB card; their bf16 presets hold none there."""
    from dflash_core.bench import memory as bench_memory

    configs = Path(__file__).resolve().parent.parent / "configs"
    for preset, bf16, card in (("qwen3-8b-fp8-24gb.yaml", "qwen3-8b.yaml", "24 GB"),
                               ("qwen3.5-27b-fp8-48gb.yaml", "qwen3.5-27b.yaml", "48 GB")):
        fp8, full = (bench_memory.memory_from_preset(configs / name) for name in (preset, bf16))
        assert fp8["quantization"] == "fp8" and fp8["target_params"] == full["target_params"]
        # linear weights at one byte (plus a float32 scale per 128 x 128 block), the rest in bf16
        assert 0.55 * full["weights_bytes"] < fp8["weights_bytes"] < 0.65 * full["weights_bytes"]
        assert fp8["cards"][card]["fits"] and fp8["cards"][card]["requests_full"] >= 4
        assert not full["cards"][card]["fits"]


def emulated_block_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    """cuBLAS's block-scaled FP8 GEMM as torch documents it, in float32 on a CPU (which has no such kernel), with
    the layout cuBLAS demands checked: the stand-in for the GPU in the kernel's plumbing tests."""
    assert recipe_a == torch.nn.functional.ScalingType.BlockWise1x128
    assert recipe_b == torch.nn.functional.ScalingType.BlockWise128x128
    (m, k), n = a.shape, b.shape[1]
    assert a.dtype == b.dtype == FP8_DTYPE and m % 4 == 0 and b.stride(0) == 1  # b: a column-major view
    assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1  # outer-dimension-major
    # the weight's scales: [K / 128 rounded up to 4, N / 128], a transposed view (K blocks contiguous)
    assert scale_b.shape == (-(-k // 128 // 4) * 4, n // 128) and scale_b.stride() == (1, scale_b.shape[0])
    a_full = a.float() * scale_a.repeat_interleave(128, 1)
    b_full = b.float() * scale_b[: k // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (a_full @ b_full).to(output_dtype)


def test_block_fp8_kernel_plumbing(wide_pair, monkeypatch):
    """On a CPU the kernel is never chosen; with cuBLAS's GEMM emulated and the device check passed, the FP8 layers
    multiply through `dflash::fp8_block_linear` (activations in FP8, 1 x 128 groups), close to the dequantized
    product, inside the engine (DFlash output equal to plain decoding's with the same kernel) and in a compiled graph
    as one opaque call."""
    from dflash_core.quant import fp8_kernels
    from dflash_core.quant.base import choose_kernel

    kernel = fp8_kernels.BlockFp8Kernel()
    target, draft = wide_pair
    model = load_target(target, CPU, torch.float32, "fp8")
    choice = choose_kernel(model, CPU, kernel)
    assert not choice.used and choice.reason == "cpu: the kernel is CUDA's"
    assert all(m.kernel is None for m in model.modules() if isinstance(m, Fp8Linear))

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", emulated_block_scaled_mm)
    monkeypatch.setattr(fp8_kernels.BlockFp8Kernel, "unavailable", lambda self, device: None)
    layer = model.model.layers[0].mlp.down_proj  # [128, 256]: two K blocks, padded to four
    x = torch.randn(3, 5, 256)
    exact = torch.nn.functional.linear(x, layer.dequantized())
    choice = choose_kernel(model, CPU, kernel)
    assert choice.used and choice.layers == 3 * 7 and choice.error < fp8_kernels.TOLERANCE
    out = layer(x)
    assert out.shape == exact.shape and 0 < (out - exact).norm() / exact.norm() < fp8_kernels.TOLERANCE
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), out)

    outs = []
    for speculative in (True, False):
        models = load_models(EngineConfig(str(target), str(draft), quantization="fp8", speculative=speculative,
                                          speculation="fixed", device="cpu"))
        assert all(m.kernel is not None for m in models.engine.target.model.modules()
                   if isinstance(m, Fp8Linear))
        outs.append(greedy(models.engine))
    assert outs[0] == outs[1]

    # a kernel that errs or disagrees is not used
    for broken in (lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")),
                   lambda *a, **k: 2 * emulated_block_scaled_mm(*a, **k)):
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", broken)
        fresh = load_target(target, CPU, torch.float32, "fp8")
        assert all(m.kernel is None for m in fresh.modules() if isinstance(m, Fp8Linear))
    assert "disagreed" in choose_kernel(fresh, CPU, kernel).reason



def write_compressed_checkpoint(src: Path, dst: Path, bits: int, group_size: int | None,
                                kind: str = "int", dynamic_activations: bool = False) -> Path:
    """`src` in compressed-tensors' format, by compressed-tensors itself: its scheme applied to every linear layer but
    the head, min-max scales from its own `calculate_qparams`, compressed by its compressor: `kind` "int" packs
    symmetric `bits`-bit integers per group (or per channel) (pack-quantized); "float" writes FP8 weights per channel
    (float-quantized), with `dynamic_activations` FP8 per token in each forward (FP8-dynamic, W8A8); "int8" writes
    int8 weights per channel (int-quantized), with `dynamic_activations` int8 per token (W8A8 INT8)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    qtype = "float" if kind == "float" else "int"
    args = QuantizationArgs(num_bits=bits, type=qtype, symmetric=True, strategy="group" if group_size else "channel",
                            group_size=group_size)
    acts = QuantizationArgs(num_bits=8, type=qtype, symmetric=True, strategy="token", dynamic=True) if (
        dynamic_activations) else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            w = module.weight.detach()
            groups = w.view(w.shape[0], -1, group_size or w.shape[1])
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).view_as(module.weight_scale)
    fmt = {"int": "pack-quantized", "float": "float-quantized", "int8": "int-quantized"}[kind]
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


@functools.cache
def int_family(arch: str, bits: int, group_size: int | None, root: Path) -> tuple[Path, Path, dict]:
    """(compressed-tensors target, draft, transformers' greedy references) for the tiny pair of `arch`."""
    tmp = root / f"{arch}-int{bits}-{group_size}"
    target, draft = make_tiny_pair(tmp, arch=arch)
    packed = write_compressed_checkpoint(target, tmp / "target-packed", bits, group_size)
    refs = transformers_reference(packed)
    assert refs != transformers_reference(target)  # the quantization changes the tiny target's choices
    return packed, draft, refs


def test_packed_int_unpacking_is_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from dflash_core.quant.packed_int import dequantize_groups, unpack_int32

    for bits, cols in ((4, 72), (4, 64), (8, 40)):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, cols), dtype=torch.int8)
        packed = pack_to_int32(values, bits)
        assert torch.equal(unpack_int32(packed, bits, cols), values)
        assert torch.equal(unpack_from_int32(packed, bits, torch.Size((6, cols))), values)
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize

    values = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    for dtype in (torch.float32, torch.bfloat16):  # compressed-tensors' arithmetic: in the scale's dtype, then cast
        scale = torch.rand(6, 4).to(dtype)
        theirs = _dequantize(values, scale.repeat_interleave(16, 1), dtype=dtype)
        assert torch.equal(dequantize_groups(values, scale, 16, dtype), theirs)
    # a last group shorter than the others (2880 inputs in groups of 128: 22 full groups and one of 64)
    values, scale = torch.randint(-8, 8, (3, 72), dtype=torch.int8), torch.rand(3, 3)
    assert torch.equal(dequantize_groups(values, scale, 32, torch.float32),
                       values.float() * scale.repeat_interleave(32, 1)[:, :72])


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("arch,backend,bits,group_size", [
    ("qwen3", "native", 4, 16), ("qwen3", "generic", 4, 16), ("qwen3", "hf", 4, 16), ("qwen3", "native", 8, None),
    ("qwen3_5", "native", 4, 16)], ids=["w4-native", "w4-generic", "w4-hf", "w8-channel-native", "w4-hybrid"])
def test_compressed_tensors_greedy_equals_transformers_forward(root, arch, backend, bits, group_size, speculative):
    """W4A16 (groups of 16) and W8A16 (per channel) checkpoints written by compressed-tensors: weights kept packed
    (int32 words, half a byte a weight in int4), greedy output equal to transformers' forward of the checkpoint."""
    from dflash_core.quant.packed_int import PackedIntLinear

    packed, draft, refs = int_family(arch, bits, group_size, root)
    models = load_models(EngineConfig(str(packed), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu"))
    layers = [m for m in models.engine.target.model.modules() if isinstance(m, PackedIntLinear)]
    assert layers and all(m.bits == bits and m.weight_packed.dtype == torch.int32 for m in layers)
    for m in layers[:3]:  # what the int4 kernel is given: codes, zero points and scales of the same weight
        codes, zeros, scales = (t.float() for t in m.int_groups())
        g = torch.arange(m.in_features) // m.group
        assert torch.equal((codes - zeros[:, g]) * scales[:, g], m.dequantized().float())
    assert models.quantization == f"compressed-tensors int{bits}"
    assert greedy(models.engine) == refs



@functools.cache
def float_family(arch: str, dynamic_activations: bool, root: Path) -> tuple[Path, Path, dict]:
    """(compressed-tensors FP8 target, draft, transformers' greedy references) for the tiny pair of `arch`."""
    tmp = root / f"{arch}-fp8-channel-{dynamic_activations}"
    target, draft = make_tiny_pair(tmp, arch=arch)
    fp8 = write_compressed_checkpoint(target, tmp / "target-fp8", 8, None, "float", dynamic_activations)
    refs = transformers_reference(fp8)
    assert refs != transformers_reference(target)
    return fp8, draft, refs


def test_fp8_token_quantization_is_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from dflash_core.quant.fp8_channel import fake_quantize_tokens

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 5, 96) * torch.logspace(-2, 1, 96)).to(dtype)
        x[0, 1] = 0  # a token of zeros
        scale, zero = compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
        assert torch.equal(fake_quantize_tokens(x), fake_quantize(x, scale, zero, args))


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("arch,backend,dynamic", [("qwen3", "native", True), ("qwen3", "generic", True),
                                                  ("qwen3", "native", False), ("qwen3_5", "native", True)],
                         ids=["w8a8-native", "w8a8-generic", "w8a16-native", "w8a8-hybrid"])
def test_compressed_tensors_fp8_greedy_equals_transformers_forward(root, arch, backend, dynamic, speculative):
    """FP8 weights per channel (float-quantized), weight-only or FP8-dynamic (inputs quantized per token in each
    forward), written by compressed-tensors: greedy output equal to transformers' forward of the checkpoint."""
    from dflash_core.quant.fp8_channel import Fp8ChannelLinear

    fp8, draft, refs = float_family(arch, dynamic, root)
    models = load_models(EngineConfig(str(fp8), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu"))
    layers = [m for m in models.engine.target.model.modules() if isinstance(m, Fp8ChannelLinear)]
    assert layers and all(m.weight.dtype == FP8_DTYPE and m.dynamic_activations == dynamic for m in layers)
    assert greedy(models.engine) == refs


@functools.cache
def int8_family(arch: str, dynamic_activations: bool, root: Path) -> tuple[Path, Path, dict]:
    """(compressed-tensors INT8 target, draft, transformers' greedy references) for the tiny pair of `arch`."""
    tmp = root / f"{arch}-int8-channel-{dynamic_activations}"
    target, draft = make_tiny_pair(tmp, arch=arch)
    int8 = write_compressed_checkpoint(target, tmp / "target-int8", 8, None, "int8", dynamic_activations)
    refs = transformers_reference(int8)
    assert refs != transformers_reference(target)
    return int8, draft, refs


def test_int8_token_quantization_is_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from dflash_core.quant.int8_channel import fake_quantize_int8_tokens

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 5, 96) * torch.logspace(-2, 1, 96)).to(dtype)
        x[0, 1] = 0  # a token of zeros
        scale, zero = compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
        assert torch.equal(fake_quantize_int8_tokens(x), fake_quantize(x, scale, zero, args))


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("arch,backend,dynamic", [("qwen3", "native", True), ("qwen3", "generic", True),
                                                  ("qwen3", "native", False), ("qwen3_5", "native", False)],
                         ids=["w8a8-native", "w8a8-generic", "w8a16-native", "w8a16-hybrid"])
def test_compressed_tensors_int8_greedy_equals_transformers_forward(root, arch, backend, dynamic, speculative):
    """INT8 weights per channel (int-quantized), weight-only or W8A8 (inputs quantized to int8 per token in each
    forward), written by compressed-tensors: greedy output equal to transformers' forward of the checkpoint. (The
    tiny hybrid in W8A8 has a near-tie, logits 2e-4 apart, at its second token: per-token int8 inputs turn the last
    bits of a sum into a different code there, as FP8-dynamic's do (docs/serving.md); its weight-only form runs.)"""
    from dflash_core.quant.int8_channel import Int8ChannelLinear

    int8, draft, refs = int8_family(arch, dynamic, root)
    models = load_models(EngineConfig(str(int8), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu"))
    layers = [m for m in models.engine.target.model.modules() if isinstance(m, Int8ChannelLinear)]
    assert layers and all(m.weight.dtype == torch.int8 and m.dynamic_activations == dynamic for m in layers)
    assert models.quantization == "compressed-tensors int8" + (" (W8A8)" if dynamic else "")
    assert greedy(models.engine) == refs


def test_int8_kernel_agrees_and_keeps_speculation_exact(root, monkeypatch):
    """torch's int8 GEMM (`_int_mm`, which runs on this CPU too) multiplies W8A8 layers once the device check passes:
    it agrees with the fake-quantized product (padding one row to the 17 CUDA's kernel takes), and DFlash output
    equals plain decoding's with the same kernel. On a CPU by default the layers keep the kernel-free forward."""
    from dflash_core.quant.base import choose_kernel
    from dflash_core.quant.int8_channel import Int8ChannelLinear, Int8Kernel

    int8, draft, _ = int8_family("qwen3", True, root)
    model = load_target(int8, CPU, torch.float32)
    assert not choose_kernel(model, CPU, Int8Kernel()).used
    monkeypatch.setattr(Int8Kernel, "unavailable", lambda self, device: None)
    choice = choose_kernel(model, CPU, Int8Kernel())
    assert choice.used and choice.layers == 4 * 7 and choice.error < 1e-5  # float32: exact sums, rounded once
    assert choose_kernel(load_target(int8, CPU, torch.bfloat16), CPU, Int8Kernel()).used
    outs = []
    for speculative in (True, False):
        models = load_models(EngineConfig(str(int8), str(draft), speculative=speculative, speculation="fixed",
                                          device="cpu"))
        target = models.engine.target.model
        assert all(m.kernel is not None for m in target.modules() if isinstance(m, Int8ChannelLinear))
        outs.append(greedy(models.engine))
    assert outs[0] == outs[1]


def test_memory_estimate_counts_int8_weights_at_their_size(root):
    from dflash_core.bench import memory as bench_memory

    int8, draft, _ = int8_family("qwen3", True, root)
    est = bench_memory.memory_estimate(str(int8), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(int8), str(draft), device="cpu", max_model_len=64, max_running_requests=2))
    assert est["quantization_layer"] == "int8-channel" and est["weights_bytes"] == models.memory.weights
    assert "target linear weights int8 (compressed-tensors)" in bench_memory.format_memory([{**est, "preset": "x"}])


def test_row_wise_fp8_kernel_runs_where_torch_has_it(root, monkeypatch):
    """torch's row-wise FP8 GEMM (`_scaled_mm`, which runs on this CPU too) multiplies FP8-dynamic layers once the
    device check passes: it agrees with the fake-quantized product, and DFlash output equals plain decoding's with
    the same kernel. On a CPU by default the layers keep the kernel-free forward."""
    from dflash_core.quant.base import choose_kernel
    from dflash_core.quant.fp8_channel import Fp8ChannelLinear, RowWiseFp8Kernel

    fp8, draft, _ = float_family("qwen3", True, root)
    model = load_target(fp8, CPU, torch.float32)
    assert not choose_kernel(model, CPU, RowWiseFp8Kernel()).used
    monkeypatch.setattr(RowWiseFp8Kernel, "unavailable", lambda self, device: None)
    choice = choose_kernel(model, CPU, RowWiseFp8Kernel())
    one = torch.ones(4, 16).to(FP8_DTYPE)
    try:  # torch 2.13's CPU _scaled_mm scales rows; 2.11's only whole tensors
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(4, 1), scale_b=torch.ones(1, 4), out_dtype=torch.float32)
    except RuntimeError:
        # where torch refuses the call, the probe catches it and every layer keeps the kernel-free forward
        assert not choice.used and "failed its probe" in choice.reason
        assert all(m.kernel is None for m in model.modules() if isinstance(m, Fp8ChannelLinear))
        return
    assert choice.used and choice.layers == 4 * 7 and choice.error < 1e-4  # float32: only the sums' order differs
    bf16 = choose_kernel(load_target(fp8, CPU, torch.bfloat16), CPU, RowWiseFp8Kernel())  # as a GPU serves
    assert bf16.used and bf16.error < RowWiseFp8Kernel.tolerance
    outs = []
    for speculative in (True, False):
        models = load_models(EngineConfig(str(fp8), str(draft), speculative=speculative, speculation="fixed",
                                          device="cpu"))
        target = models.engine.target.model
        choose_kernel(target, CPU, RowWiseFp8Kernel())
        assert all(m.kernel is not None for m in target.modules() if isinstance(m, Fp8ChannelLinear))
        outs.append(greedy(models.engine))
    assert outs[0] == outs[1]



def test_incomplete_checkpoints_are_refused(root, tmp_path):
    """One layer's scale (FP8) or packed weight (int4) missing: refused in one line, not served unscaled or with a
    random layer."""
    from safetensors.torch import load_file, save_file

    fp8 = fp8_family("qwen3", root)[0]
    packed = int_family("qwen3", 4, 16, root)[0]
    for src, key, words in ((fp8, "model.layers.0.self_attn.q_proj.weight_scale_inv", "FP8 weights without"),
                            (packed, "model.layers.0.self_attn.q_proj.weight_packed", "lacks 1 tensor")):
        broken = tmp_path / src.name
        shutil.copytree(src, broken)
        tensors = load_file(str(src / "model.safetensors"))
        del tensors[key]
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError) as err:
            load_target(broken, CPU, torch.float32)
        message = str(err.value)
        assert "\n" not in message and words in message and "model.layers.0.self_attn.q_proj" in message, message


def test_quantization_that_quantizes_nothing_says_so(fp8_pair, caplog):
    """--quantization fp8 on a model none of whose layers tile by 128 x 128: a warning, full-precision weights."""
    from dflash_core.quant.loader import weights_format

    with caplog.at_level("WARNING", logger="dflash.loading"):
        model = load_target(fp8_pair[0].parent / "target-qwen3", CPU, torch.float32, "fp8")
    assert weights_format(model) is None
    assert "no linear layer's sides divide by its 128x128 blocks; the weights stay in full precision" in caplog.text


def test_malformed_or_misplaced_inputs_are_refused_in_one_line(fp8_pair, tmp_path):
    from server.__main__ import preflight
    from server.settings import Settings

    fp8, draft, _ = fp8_pair
    folder = _with_config(fp8.parent / "target-qwen3", tmp_path / "str", quantization_config="fp8")
    with pytest.raises(ValueError, match="^the target's quantization_config is a str, not an object$"):
        load_target(folder, CPU, torch.float32)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="GGUF is llama.cpp's format"):  # before its tokenizer is looked for
        load_models(EngineConfig(str(gguf), device="cpu"))
    problem = preflight(Settings(target="unsloth/Qwen3-8B-GGUF:Q4_K_M", device="cpu"))
    assert problem is not None and problem.startswith("--target unsloth/Qwen3-8B-GGUF:Q4_K_M: GGUF is llama.cpp's")
    quantized_draft = _with_config(draft, tmp_path / "draft", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="the draft is quantized; drafts run in the target's compute dtype"):
        load_models(EngineConfig(str(fp8), str(quantized_draft), device="cpu"))
