"""The fused CPU step (`dflash_core/cpu_step/`): the native target's forward as one C call reproduces the PyTorch
forward's logits and features on every family it serves, computes each token alike whatever runs beside it, keeps
greedy output token-identical, and steps aside (or refuses, when asked for) where it cannot run."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from dflash_core.cpu_step import build
from dflash_core.cpu_step.fused import CPU_STEP_ENV, FUSED_PREFILL_TOKENS, FusedCpuStep
from dflash_core.llm import LLM
from dflash_core.runners.base import TargetRow
from dflash_core.runners.drafter import Asked
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from tests.helpers import make_target

LAYER_IDS = [0, 2, 3]  # the last layer too: its feature comes after the final norm


def _odd_qwen3() -> torch.nn.Module:
    """A Qwen3 whose every size leaves a remainder in the C kernels' tiles: hidden 48, MLP 100, heads of 12,
    a vocabulary of 389."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=389, hidden_size=48, intermediate_size=100, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _llama_biased() -> torch.nn.Module:
    """Llama with attention biases (query / key / value and output) and llama3 RoPE scaling."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.2, attention_bias=True,
                      rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=64))
    return AutoModelForCausalLM.from_config(cfg).eval()


MODELS = {
    "qwen3": lambda: make_target(None, "qwen3"),
    "qwen2": lambda: make_target(None, "qwen2"),  # query / key / value biases
    "llama-biased": _llama_biased,
    "qwen3-odd-sizes": _odd_qwen3,
}


def _runner(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str, slots: int = 2) -> NativeTarget:
    monkeypatch.setenv(CPU_STEP_ENV, mode)
    target = NativeTarget(model, LAYER_IDS, max_slots=slots, max_len=256)
    monkeypatch.delenv(CPU_STEP_ENV)
    return target


def _outputs(target: NativeTarget, rows: list[TargetRow], last_only: bool = False) -> list[tuple[torch.Tensor, ...]]:
    outs = target.forward_batch(rows, features=True, last_only=last_only)
    return [(o.logits, o.features) for o in outs]


def _close(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> None:
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", MODELS)
def test_fused_forward_matches_the_pytorch_forward(family, monkeypatch):
    model = MODELS[family]()
    fused = _runner(model, monkeypatch, "fused")
    eager = _runner(model, monkeypatch, "torch")
    assert (fused.cpu_step, eager.cpu_step) == ("fused", "torch")
    vocab = fused.vocab_size
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(4, vocab, (n,), generator=g).tolist() for n in (60, 25))
    caches = {t: (t.new_cache(0), t.new_cache(1)) for t in (fused, eager)}

    def both(rows: list[tuple[list[int], int, int]], last_only: bool = False) -> None:
        outs = [_outputs(t, [TargetRow(toks, start, caches[t][i]) for toks, start, i in rows], last_only)
                for t in (fused, eager)]
        _close(*outs)

    both([(a[:30], 0, 0), (b[:7], 0, 1)])  # a ragged prefill of two requests
    both([(a[30:46], 30, 0), (b[7:8], 7, 1)])  # a verify block beside a plain step
    fused.crop(caches[fused][0], 33)  # a rejected tail rolled back, then overwritten
    eager.crop(caches[eager][0], 33)
    both([(a[33:50], 33, 0)])
    both([(a[50:60], 50, 0), (b[8:25], 8, 1)], last_only=True)


def test_a_token_computes_alike_whatever_runs_beside_it(monkeypatch):
    """A 16-token verify block, the same tokens one plain step at a time, and the block beside another request's
    rows: bit for bit the same logits and features (every product one chain of multiply-adds in order)."""
    target = _runner(make_target(None, "qwen3"), monkeypatch, "fused", slots=3)
    seq, other = list(range(10, 50)), list(range(60, 90))
    block_cache, step_cache, mixed_cache, other_cache = (target.new_cache(i % 3) for i in range(4))
    for cache in (block_cache, step_cache, mixed_cache):
        target.forward_batch([TargetRow(seq[:24], 0, cache)], features=True)
    block = _outputs(target, [TargetRow(seq[24:40], 24, block_cache)])[0]
    steps = [_outputs(target, [TargetRow([tok], 24 + i, step_cache)])[0] for i, tok in enumerate(seq[24:40])]
    target.forward_batch([TargetRow(other[:20], 0, other_cache)], features=False)
    mixed = _outputs(target, [TargetRow(other[20:23], 20, other_cache), TargetRow(seq[24:40], 24, mixed_cache)])[1]
    assert torch.equal(block[0], torch.cat([s[0] for s in steps]))
    assert torch.equal(block[1], torch.cat([s[1] for s in steps]))
    assert torch.equal(block[0], mixed[0]) and torch.equal(block[1], mixed[1])


def test_greedy_output_is_token_identical(monkeypatch):
    """The demo pair: DFlash on the fused step equals plain decoding on it and plain decoding on the PyTorch
    forward, token for token."""
    prompts = ["Write a short story about a robot.", "What is 12 * 7?", "def add(a, b):"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode, speculative in (("fused", True), ("fused", False), ("torch", False)):
        monkeypatch.setenv(CPU_STEP_ENV, mode)
        llm = LLM(device="cpu", speculative=speculative, speculation="fixed")
        assert llm.engine.target.cpu_step == mode
        runs[mode, speculative] = [g.token_ids for g in llm.generate(prompts, params)]
    assert runs["fused", True] == runs["fused", False] == runs["torch", False]
    assert all(len(ids) == 48 for ids in runs["fused", True])


def test_long_prefills_run_the_pytorch_forward():
    rows = [TargetRow([1] * FUSED_PREFILL_TOKENS, 0, None), TargetRow([1], 0, None)]
    assert not FusedCpuStep.serves(rows, last_only=True)
    assert FusedCpuStep.serves(rows[:1], last_only=True)
    assert FusedCpuStep.serves(rows, last_only=False)  # a verify step always runs fused


def test_modes_and_refusals(monkeypatch, caplog):
    model = make_target(None, "qwen3")
    assert _runner(model, monkeypatch, "torch").cpu_step == "torch"
    monkeypatch.setenv(CPU_STEP_ENV, "fast")
    with pytest.raises(ValueError, match="DFLASH_CPU_STEP='fast'"):
        NativeTarget(model, LAYER_IDS, max_slots=1, max_len=64)
    bf16 = make_target(None, "qwen3").to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on a CPU"):
        _runner(bf16, monkeypatch, "fused")
    with caplog.at_level(logging.INFO, logger="dflash.cpu_step"):
        assert _runner(bf16, monkeypatch, "auto").cpu_step == "torch"
    assert "fused CPU step off" in caplog.text


def test_without_a_compiler_the_pytorch_forward_runs(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    model = make_target(None, "qwen3")
    assert _runner(model, monkeypatch, "auto").cpu_step == "torch"
    with pytest.raises(ValueError, match="no-such-cc"):
        _runner(model, monkeypatch, "fused")


def test_more_torch_threads_keep_the_pytorch_forward(monkeypatch):
    """The C runs on one thread: where torch was given more, `auto` leaves them the forward; `fused` forces it."""
    model = make_target(None, "qwen3")
    torch.set_num_threads(2)
    try:
        assert _runner(model, monkeypatch, "auto").cpu_step == "torch"
        assert _runner(model, monkeypatch, "fused").cpu_step == "fused"
    finally:
        torch.set_num_threads(1)


def test_an_unwritable_cache_folder_leaves_the_pytorch_forward(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(build.CACHE_ENV, str(blocker / "cpu_step"))  # under a file: no folder can be made there
    model = make_target(None, "qwen3")
    assert _runner(model, monkeypatch, "auto").cpu_step == "torch"
    with pytest.raises(ValueError, match="cannot write the library"):
        _runner(model, monkeypatch, "fused")


def test_the_library_is_built_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", f"env {shutil.which('cc') or shutil.which('gcc')}")  # a compiler command with arguments
    lib = build.load_library()
    built = list(tmp_path.glob("fused_step-*.so"))
    assert len(built) == 1
    assert build.load_library() is lib
    assert list(tmp_path.glob("fused_step-*.so")) == built


def test_fused_draft_proposes_as_the_pytorch_draft():
    """The demo pair's drafter: proposals of two requests (different block widths and pending context, some of it
    written before on its own) from the fused draft equal the PyTorch draft's, tokens and confidences, and so do
    the top candidates a tree asks for."""
    llm = LLM(device="cpu", speculative=True)
    target, drafter = llm.engine.target, llm.engine.drafter
    assert target.cpu_step == "fused" and drafter.fused_step is not None
    prompts = [llm.encode("Write a poem about the sea."), llm.encode([{"role": "user", "content": "Hi! 2+2?"}])]
    items, pending = [], []
    for slot, (prompt, n) in enumerate(zip(prompts, (15, 6))):
        blocks = list(range(1 + 20 * slot, 21 + 20 * slot))
        out = target.forward_batch([TargetRow(prompt, 0, target.new_cache(slot, blocks))], features=True)[0]
        state = drafter.new_state(slot, prompt, blocks=blocks)
        drafter.extend_context(state, out.features)  # rows beyond the held-back ones are written now (fused)
        items.append((state, int(out.logits[-1].argmax()), len(prompt), n))
        pending.append(torch.cat(state.pending))
    n_ctx = max(p.shape[0] for p in pending)
    fused_step = drafter.fused_step
    fused = drafter._propose_paged(items, pending, n_ctx, Asked(candidates=3))
    drafter._fused = None  # the same proposal through the PyTorch draft (it rewrites the same context rows)
    try:
        eager = drafter._propose_paged(items, pending, n_ctx, Asked(candidates=3))
    finally:
        drafter._fused = fused_step
    for f, e in zip(fused, eager, strict=True):
        assert f.tokens == e.tokens and len(f.tokens) > 0
        torch.testing.assert_close(torch.tensor(f.confidence), torch.tensor(e.confidence), rtol=1e-4, atol=1e-5)
        assert f.candidates is not None and e.candidates is not None and f.candidates[0] == e.candidates[0]


def test_fused_context_write_matches_the_pytorch_write():
    """Held-back context rows written on their own (`FusedDraftStep.write_context`, one C call) land in the same
    draft cache rows with the same keys and values as the PyTorch write, and touch no other row."""
    llm = LLM(device="cpu", speculative=True)
    target, drafter = llm.engine.target, llm.engine.drafter
    fused_step = drafter.fused_step
    assert fused_step is not None and drafter.pages is not None
    prompt = llm.encode("Write a poem about the sea, then another about the mountains and the rivers between them.")
    blocks = list(range(3, 23))
    out = target.forward_batch([TargetRow(prompt, 0, target.new_cache(0, blocks))], features=True)[0]
    pages = drafter.pages
    written = {}
    for name, step in (("fused", fused_step), ("pytorch", None)):
        for t in (*pages.k, *pages.v):
            t.zero_()
        drafter._fused = step
        try:
            state = drafter.new_state(0, prompt, blocks=blocks)
            drafter.extend_context(state, out.features)
            drafter.catch_up([state])  # all but the last block's worth of rows
        finally:
            drafter._fused = fused_step
        assert 0 < state.written < len(prompt)
        written[name] = ([t.clone() for t in (*pages.k, *pages.v)], state.written)
    (fused, n_fused), (eager, n_eager) = written["fused"], written["pytorch"]
    assert n_fused == n_eager
    rows = [blocks[p // drafter.kv_block] * drafter.kv_block + p % drafter.kv_block for p in range(n_fused)]
    for f, e in zip(fused, eager, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-4, atol=1e-5)
        assert f[rows].abs().sum() > 0
        others = torch.ones(f.shape[0], dtype=torch.bool)
        others[rows] = False
        assert f[others].abs().sum() == 0
