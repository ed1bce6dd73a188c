"""GPTQ and AWQ checkpoints (dflash_core/quant/gptq_awq.py): they load with their weights kept packed and give
greedy output identical to transformers' own forward of the same checkpoint (GPTQModel's torch kernels), with and
without the draft, on every batched runner and hf; every layer dequantizes bit for bit as GPTQModel does; seeded
sampling is equal with and without speculation; the memory estimate counts them at their size; what is not served
is refused in one line.

The checkpoints are written, and transformers' reference forward of them run, by GPTQModel in a child process
(tests/gptq_awq_reference.py) whose venv holds GPTQModel and borrows this interpreter's torch and transformers
(.ci/gptq_reference_venv.sh builds it once and caches it): GPTQModel stays out of the project's environment (it pulls
torchao, which transformers imports in every process that loads a model, and it pins numpy) and its import's
process-wide settings out of the test process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.exactness import compare_greedy, runner_logits
from dflash_core.loading import load_models, load_target
from dflash_core.quant.gptq_awq import AwqLinear, GptqLinear
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair
from tests.test_engine import run_all, tokens

PROMPTS = ([5], [9, 17, 33, 4, 6, 120, 7])
NEW_TOKENS = 24
CPU = torch.device("cpu")
# what each checkpoint is: GPTQ's original format (zeros stored minus one) in groups of 16, the same under act-order
# (groups of scattered inputs, g_idx), GPTQ v2 8-bit per channel, asymmetric GPTQ in both formats, AWQ in groups of
# 16 (its reference computes in float16, as AWQ's kernels do, so dflash-serve serves it in float16 here)
CHECKPOINTS = {
    "gptq": {"method": "gptq", "bits": 4, "group": 16, "dtype": "float32"},
    "gptq-act": {"method": "gptq", "bits": 4, "group": 16, "act_order": True, "dtype": "float32"},
    "gptq8": {"method": "gptq", "bits": 8, "group": -1, "checkpoint_format": "gptq_v2", "dtype": "float32"},
    # asymmetric (zero points per group): in the original format a zero point of 0 is stored as -1, borrowing from
    # its neighbour in the word
    "gptq-asym": {"method": "gptq", "bits": 4, "group": 16, "sym": False, "dtype": "float32"},
    "gptq-asym-v2": {"method": "gptq", "bits": 4, "group": 16, "sym": False, "checkpoint_format": "gptq_v2",
                     "dtype": "float32"},
    "awq": {"method": "awq", "bits": 4, "group": 16, "dtype": "float16"},
    # groups of 32, as torch's int4 GEMM takes them (the kernel test)
    "gptq-g32": {"method": "gptq", "bits": 4, "group": 32, "sym": False, "dtype": "float32"},
    "awq-g32": {"method": "awq", "bits": 4, "group": 32, "dtype": "float16"},
}


def run_reference(src: Path, root: Path, checkpoints: dict) -> None:
    """tests/gptq_awq_reference.py in GPTQModel's venv: `checkpoints` written from `src` into `root` (or already
    there: "existing"), and transformers' greedy references of each."""
    job = {"prompts": [list(p) for p in PROMPTS], "new_tokens": NEW_TOKENS, "checkpoints": checkpoints}
    script = Path(__file__).with_name("gptq_awq_reference.py")
    run = subprocess.run([reference_python(), str(script), str(src), str(root), json.dumps(job)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (folder of its checkpoints and GPTQModel's references, draft): qwen3, and qwen2 (biased q/k/v)."""
    out = {}
    for arch in ("qwen3", "qwen2"):
        root = tmp_path_factory.mktemp(f"gptq-{arch}")
        target, draft = make_tiny_pair(root, arch=arch)
        run_reference(target, root, CHECKPOINTS)
        out[arch] = (root, draft)
    return out


def reference_python() -> str:
    """The interpreter with GPTQModel (.ci/gptq_reference_venv.sh: built on first use, then cached)."""
    script = Path(__file__).resolve().parents[1] / ".ci" / "gptq_reference_venv.sh"
    run = subprocess.run([str(script), sys.executable], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout.strip().splitlines()[-1]


def reference(root: Path, name: str) -> dict[tuple[int, ...], list[int]]:
    return dict(zip(map(tuple, PROMPTS), json.loads((root / name / "reference.json").read_text())))


def greedy(engine) -> dict[tuple[int, ...], list[int]]:
    engine.eos_token_ids = []
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): tuple(p) for p in PROMPTS}
    return {ids[rid]: tokens(steps) for rid, steps in run_all(engine).items()}


def test_the_references_can_tell(families):
    """The 4-bit codes change the tiny target's choices (a test that ignored the quantization would fail), and the
    two GPTQ groupings differ from each other."""
    root, _ = families["qwen3"]
    refs = {name: reference(root, name) for name in CHECKPOINTS}
    full = load_target(root / "target-qwen3", CPU, torch.float32)
    plain = {tuple(p): tokens_of(full, list(p)) for p in PROMPTS}
    assert refs["gptq"] != plain and refs["awq"] != plain and refs["gptq"] != refs["gptq-act"]


def tokens_of(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_every_layer_dequantizes_as_gptqmodel_does(families, name):
    root, _ = families["qwen3"]
    theirs = load_file(str(root / name / "dequantized.safetensors"))
    model = load_target(root / name, CPU, torch.float16)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (GptqLinear, AwqLinear))}
    assert set(layers) == set(theirs)
    for n, layer in layers.items():
        assert layer.qweight.dtype == torch.int32 and layer.scales.dtype == torch.float16
        assert torch.equal(layer.dequantized(), theirs[n].t()), n
        groups = layer.int_groups()  # what the int4 kernel is given: the same weight, groups in order
        if groups is not None:
            codes, zeros, scales = (t.float() for t in groups)
            g = torch.arange(layer.in_features) // layer.group
            assert torch.equal(((codes - zeros[:, g]) * scales[:, g]).half(), theirs[n].t()), n
        else:
            assert name == "gptq-act"


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("arch,name,backend", [
    ("qwen3", "gptq", "native"), ("qwen3", "gptq", "generic"), ("qwen3", "gptq", "hf"),
    ("qwen3", "gptq-act", "native"), ("qwen3", "gptq8", "native"), ("qwen2", "gptq", "native"),
    ("qwen3", "gptq-asym", "native"), ("qwen3", "gptq-asym-v2", "generic"),
    ("qwen3", "awq", "native"), ("qwen3", "awq", "generic"), ("qwen2", "awq", "native")])
def test_greedy_equals_transformers_forward(families, arch, name, backend, speculative):
    root, draft = families[arch]
    spec = CHECKPOINTS[name]
    models = load_models(EngineConfig(str(root / name), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu", dtype=spec["dtype"]))
    layer = GptqLinear if spec["method"] == "gptq" else AwqLinear
    assert models.backend == backend and models.quantization == f"{spec['method']} int{spec['bits']}"
    assert any(isinstance(m, layer) for m in models.engine.target.model.modules())
    assert greedy(models.engine) == reference(root, name)


def test_weights_stay_packed(families):
    """int4 codes in int32 words: the quantized layers' tensors are a fraction of the full-precision weights."""
    root, _ = families["qwen3"]
    model = load_target(root / "gptq", CPU, torch.float32)
    full = load_target(root / "target-qwen3", CPU, torch.float32)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GptqLinear)]
    packed = sum(p.numel() * p.element_size() for _, m in layers for p in m.parameters())
    dense = sum(full.get_submodule(n).weight.numel() * 4 for n, _ in layers)
    assert packed < 0.25 * dense


def test_seeded_sampling_equal_with_and_without_speculation(families):
    root, draft = families["qwen3"]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, stop_token_ids=[])
    outs = []
    for speculative in (True, False):
        engine = load_models(EngineConfig(str(root / "gptq-act"), str(draft), speculative=speculative,
                                          device="cpu")).engine
        engine.eos_token_ids = []
        rid = engine.add_request([9, 17, 33, 4], params)
        outs.append(tokens(run_all(engine)[rid]))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["gptq", "gptq8", "awq"])
def test_memory_estimate_counts_them_at_their_size(families, name):
    from dflash_core.bench import memory as bench_memory

    root, draft = families["qwen3"]
    est = bench_memory.memory_estimate(str(root / name), str(draft), dtype="float32", max_model_len=64,
                                       max_running_requests=2)
    models = load_models(EngineConfig(str(root / name), str(draft), device="cpu", dtype="float32", max_model_len=64,
                                      max_running_requests=2))
    assert est["weights_bytes"] == models.memory.weights
    note = f"target linear weights int{CHECKPOINTS[name]['bits']} ({name[:4].upper()})"
    assert note in bench_memory.format_memory([{**est, "preset": "x"}])


def _with(src: Path, dst: Path, qcfg: dict | None = None, drop: str | None = None) -> Path:
    """A copy of checkpoint `src` with `qcfg` merged into its quantization_config, or without tensors named `drop`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(qcfg or {})
    (dst / "config.json").write_text(json.dumps(config))
    if drop:
        from safetensors.torch import save_file

        tensors = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if not k.endswith(drop)}
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("name", "qcfg", "drop", "words"), [
    ("gptq", {"bits": 3}, None, ("GPTQ", "3-bit")),
    ("gptq", {"checkpoint_format": "marlin"}, None, ("checkpoint format 'marlin'",)),
    ("gptq", {"dynamic": {"+:.*mlp.*": {"bits": 8}}}, None, ("per-module overrides",)),
    ("gptq", {"rotation": "hadamard"}, None, ("rotated inputs (hadamard)",)),
    ("gptq", {"activation": "w4afp8"}, None, ("quantized activations",)),
    ("gptq", {"group_size": 0}, None, ("group_size is 0",)),
    ("awq", {"version": "exllama"}, None, ("AWQ", "version 'exllama'")),
    ("awq", {"zero_point": False}, None, ("without zero points",)),
    ("gptq", {"bits": 8}, None, ("shapes",)),
    ("gptq", None, ".g_idx", ("lacks", "g_idx")),
    ("awq", None, "q_proj.qzeros", ("lacks", "qzeros")),
], ids=["gptq-3bit", "gptq-marlin", "gptq-dynamic", "gptq-rotation", "gptq-activation", "gptq-group-0",
        "awq-exllama", "awq-no-zeros", "gptq-wrong-bits",
        "gptq-no-g-idx", "awq-no-qzeros"])
def test_what_is_not_served_is_refused_in_one_line(families, tmp_path, name, qcfg, drop, words):
    root, _ = families["qwen3"]
    folder = _with(root / name, tmp_path / "t", qcfg, drop)
    with pytest.raises(ValueError) as err:
        load_target(folder, CPU, torch.float32)
    message = str(err.value)
    assert "\n" not in message and len(message) < 300 and all(w in message for w in words), message


def test_older_config_files_and_exclusions_load(families, tmp_path):
    """An AutoGPTQ-era checkpoint keeps its config in quantize_config.json (config.json has none): read from there,
    not loaded as a full-precision model with random weights; a `dynamic` entry that only excludes modules ("-:")
    loads (the checkpoint's tensors say which layers are quantized)."""
    root, _ = families["qwen3"]
    legacy = shutil.copytree(root / "gptq", tmp_path / "legacy")
    config = json.loads((legacy / "config.json").read_text())
    (legacy / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (legacy / "config.json").write_text(json.dumps(config))
    excluded = _with(root / "gptq", tmp_path / "excluded", {"dynamic": {"-:.*lm_head.*": {}}})
    theirs = load_file(str(root / "gptq" / "dequantized.safetensors"))
    for folder in (legacy, excluded):
        model = load_target(folder, CPU, torch.float16)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, GptqLinear)}
        assert set(layers) == set(theirs)
        assert all(torch.equal(m.dequantized(), theirs[n].t()) for n, m in layers.items())
    # a full-precision folder left with such a file loads as it is; a file that is not JSON is refused in one line
    stale = shutil.copytree(root / "target-qwen3", tmp_path / "stale")
    shutil.copy(legacy / "quantize_config.json", stale / "quantize_config.json")
    assert not any(isinstance(m, GptqLinear) for m in load_target(stale, CPU, torch.float32).modules())
    (legacy / "quantize_config.json").write_text("{bits: 4")
    with pytest.raises(ValueError, match="quantize_config.json is not readable JSON") as err:
        load_target(legacy, CPU, torch.float32)
    assert "\n" not in str(err.value)
    from dflash_core.bench import memory as bench_memory
    from dflash_core.bench.errors import BenchError

    with pytest.raises(BenchError, match="quantize_config.json is not readable JSON"):
        bench_memory.memory_estimate(str(legacy), str(root / "draft-qwen3-b16"), dtype="float32", max_model_len=64)


@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32"])
def test_int4_kernel_agrees_keeps_weights_4bit_and_speculation_exact(families, monkeypatch, name):
    """torch's int4 GEMM (tinygemm; CUDA's, whose arithmetic torch also runs on this CPU) multiplies GPTQ and AWQ
    layers in bf16 once the device check passes: it agrees with the kernel-free product, its packed weight replaces
    the checkpoint's tensors (still half a byte a weight), and DFlash output with it equals plain decoding's or
    leaves it only at a near-tie (bf16). On a CPU by default, and for act-order GPTQ or float32 anywhere, the
    kernel-free forward serves."""
    from dflash_core.quant.int4_kernel import Int4Kernel

    root, draft = families["qwen3"]
    layer_type = GptqLinear if name.startswith("gptq") else AwqLinear

    def layers(folder: Path, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
        model = load_target(folder, CPU, dtype)  # the kernel is chosen as the target loads
        return {n: m for n, m in model.named_modules() if isinstance(m, layer_type)}

    free = layers(root / name, torch.bfloat16)
    assert all(m.kernel is None for m in free.values())  # a CPU: the kernel-free forward
    monkeypatch.setattr(Int4Kernel, "unavailable", lambda self, device: None)
    assert all(m.kernel is None for m in layers(root / name, torch.float32).values())  # bf16 only
    assert all(m.kernel is None for m in layers(root / "gptq-act", torch.bfloat16).values())  # scattered groups
    fast = layers(root / name, torch.bfloat16)
    assert len(fast) == 4 * 7 and all(m.kernel is not None and m.qweight.numel() == 0 for m in fast.values())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for n, m in fast.items():
        rows = x[:, : m.in_features].repeat(1, m.in_features // 64 or 1).to(torch.bfloat16)
        ref = free[n](rows).float()
        assert float((m(rows).float() - ref).norm() / ref.norm()) < Int4Kernel.tolerance, n
    size = {k: sum(p.numel() * p.element_size() for m in v.values() for p in m.parameters())
            for k, v in (("free", free), ("fast", fast))}
    # codes at half a byte, a bf16 scale and zero per group and output: the checkpoint's size, give or take its
    # zero points' and indices' layout
    expected = sum(m.out_features * m.in_features // 2 + m.in_features // 32 * m.out_features * 4
                   for m in fast.values())
    assert size["fast"] == expected and abs(size["fast"] - size["free"]) < 0.1 * size["free"]
    # DFlash with the kernel against plain decoding with it, in bf16: equal, or first apart where the target's top
    # two logits nearly tie (the cross-shape policy of dflash_core/exactness.py: 16-row verify blocks and one-row
    # plain steps round differently in bf16)
    models = load_models(EngineConfig(str(root / name), str(draft), speculation="fixed", device="cpu",
                                      dtype="bfloat16"))
    spec, target = models.engine, models.engine.target
    assert all(m.kernel is not None for m in target.model.modules() if isinstance(m, layer_type))
    plain = Engine(target, None, eos_token_ids=[], kv=spec.kv)
    outs = [greedy(engine) for engine in (spec, plain)]
    for prompt in outs[0]:
        with spec.kv.borrow(len(prompt) + NEW_TOKENS + 1) as blocks:
            d = compare_greedy(outs[1][prompt], outs[0][prompt], runner_logits(target, prompt, blocks=blocks))
        assert d is None or d.near_tie, d


@pytest.fixture(scope="module")
def int4_at_load(families, tmp_path_factory) -> tuple[Path, Path]:
    """(full-precision target, folder of the same quantized by `--quantization int4` and written out in GPTQ's v2
    layout, with transformers' greedy references of that checkpoint through GPTQModel)."""
    from safetensors.torch import save_file

    root, _ = families["qwen3"]
    src, out = root / "target-qwen3", tmp_path_factory.mktemp("int4")
    model = load_target(src, CPU, torch.float32, "int4")
    tensors = load_file(str(src / "model.safetensors"))
    folder = shutil.copytree(src, out / "int4-at-load")
    for name, layer in model.named_modules():
        if isinstance(layer, GptqLinear):
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": getattr(layer, k).detach().contiguous() for k in layer.storage})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                                     "desc_act": False, "checkpoint_format": "gptq_v2"}
    (folder / "config.json").write_text(json.dumps(config))
    run_reference(src, out, {"int4-at-load": {"method": "gptq", "existing": True, "dtype": "float32"}})
    return src, folder


@pytest.mark.parametrize("speculative", [True, False], ids=["dflash", "plain"])
@pytest.mark.parametrize("backend", ["native", "generic"])
def test_quantization_int4_at_load_is_a_gptq_checkpoint(families, int4_at_load, backend, speculative):
    """`--quantization int4` quantizes a full-precision checkpoint while it loads (4-bit codes, a float16 scale and
    a zero point per 128 inputs, GPTQ's v2 layout): the tensors it holds, written out as a GPTQ checkpoint, are one
    transformers' GPTQ loading (GPTQModel) reads, and greedy output with and without the draft equals transformers'
    forward of it. The memory estimate counts them."""
    from dflash_core.bench import memory as bench_memory

    src, folder = int4_at_load
    _, draft = families["qwen3"]
    models = load_models(EngineConfig(str(src), str(draft), backend=backend, speculative=speculative,
                                      speculation="fixed", device="cpu", quantization="int4", max_model_len=64))
    assert models.quantization == "gptq int4"
    assert greedy(models.engine) == reference(folder.parent, folder.name)
    est = bench_memory.memory_estimate(str(src), str(draft) if speculative else None, dtype="float32", max_model_len=64,
                                       max_running_requests=models.engine.target.max_slots, quantization="int4")
    assert est["weights_bytes"] == models.memory.weights
