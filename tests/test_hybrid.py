"""Hybrid targets (Qwen3.5: Gated DeltaNet layers beside full attention) on the native runner: exact rollback of
the recurrent state, requests isolated from each other, seeded sampling unchanged by speculation, and served by
`dflash-serve` through the native backend."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest
import torch

from dflash_core.engine import Engine
from dflash_core.runners.hybrid import HybridTarget
from dflash_core.sampling import SamplingParams
from tests.helpers import make_target, make_tiny_pair
from tests.server_fixtures import start_server
from tests.test_engine import ScriptedDrafter, hf_greedy, run_all, tokens

LENGTHS = (3, 17, 40, 66)
NEW = 24


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_target(None, "qwen3_5", seed=5)


@pytest.fixture(scope="module")
def refs(model: torch.nn.Module) -> dict[tuple[int, ...], list[int]]:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    return {tuple(p): hf_greedy(model, p, NEW) for p in prompts}


def runner(model: torch.nn.Module, slots: int = 4) -> HybridTarget:
    return HybridTarget(model, None, max_slots=slots, max_len=256)


def test_crop_leaves_the_state_of_the_accepted_prefix_alone(model: torch.nn.Module) -> None:
    """Verify 8 tokens, keep 3: every linear layer's window and state equal those of a slot fed only those 3 (up to
    the float rounding of projecting 8 rows instead of 3; crop itself recomputes in the forward's exact order)."""
    target = runner(model, slots=2)
    prompt, block = list(range(5, 25)), [40, 41, 42, 43, 44, 45, 46, 47]
    a, b = target.new_cache(0), target.new_cache(1)
    for cache in (a, b):
        target.forward(prompt, 0, cache, features=False)
    target.forward(block, len(prompt), a, features=False)
    target.crop(a, len(prompt) + 3)
    target.forward(block[:3], len(prompt), b, features=False)
    assert a.length == b.length == len(prompt) + 3
    torch.testing.assert_close(target.conv_state[:, 0], target.conv_state[:, 1])
    torch.testing.assert_close(target.rec_state[:, 0], target.rec_state[:, 1])
    target.crop(a, len(prompt))  # back to the block's start (a retry): exactly the state before the block
    target.crop(b, len(prompt))
    assert torch.equal(target.rec_state[:, 0], target.rec_state[:, 1])
    assert torch.equal(target.conv_state[:, 0], target.conv_state[:, 1])
    with pytest.raises(RuntimeError, match="before the last forward"):
        target.crop(a, len(prompt) - 1)


def test_concurrent_requests_equal_each_alone_and_an_abort_leaves_the_others_exact(
    model: torch.nn.Module, refs: dict
) -> None:
    target = runner(model)
    engine = Engine(target, ScriptedDrafter(refs, 8, target.vocab_size), eos_token_ids=[])
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW)): ref for p, ref in refs.items()}
    victim = next(iter(ids))
    outs: dict[int, list] = {rid: [] for rid in ids}
    for step in range(100):
        if step == 3:
            engine.abort(victim)
        for out in engine.step():
            outs[out.request_id].append(out)
        if not engine.has_unfinished():
            break
    assert outs[victim][-1].finish_reason == "abort"
    for rid, ref in ids.items():
        if rid != victim:
            assert tokens(outs[rid]) == ref
            assert engine.stats(rid).num_accepted_tokens > 0  # partial and full acceptances did happen


class UnevenDrafter(ScriptedDrafter):
    """Proposes fewer tokens than asked, a different number per call: the verify rows of one batch then have
    different widths, so shorter rows are padded and their states must stop at their last real token."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args, pattern=(15,))  # every proposal right: each row is accepted whole
        self.cuts = itertools.cycle((1, 7, 0, 4, 2))

    def propose(self, state: tuple, last_token: int, position: int, n: int) -> list[int]:
        return super().propose(state, last_token, position, n)[: next(self.cuts)]


def test_rows_of_different_widths_in_one_batch_stay_exact(model: torch.nn.Module, refs: dict) -> None:
    target = runner(model)
    engine = Engine(target, UnevenDrafter(refs, 8, target.vocab_size), eos_token_ids=[])
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW)): ref for p, ref in refs.items()}
    outs = run_all(engine)
    for rid, ref in ids.items():
        assert tokens(outs[rid]) == ref


def test_seeded_sampling_is_the_same_with_and_without_speculation(model: torch.nn.Module, refs: dict) -> None:
    params = [SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=i) for i in range(len(refs))]
    texts = []
    for drafter in (ScriptedDrafter(refs, 8, model.config.vocab_size), None):
        engine = Engine(runner(model), drafter, eos_token_ids=[])
        ids = [engine.add_request(list(p), sp) for p, sp in zip(refs, params)]
        outs = run_all(engine)
        texts.append([tokens(outs[rid]) for rid in ids])
    assert texts[0] == texts[1]


def test_dflash_serve_runs_a_hybrid_target_natively(tmp_path: Path) -> None:
    target_dir, draft_dir = make_tiny_pair(tmp_path, arch="qwen3_5")
    server = start_server(["--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu",
                           "--max-running-requests", "2", "--speculation", "fixed"],  # it must draft
                          tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"model": "target-qwen3_5", "prompt": "hello world", "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert r.json()["dflash"]["num_drafts"] >= 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        info = next(line for line in metrics.splitlines() if line.startswith("dflash_model_info{"))
        assert 'backend="native"' in info
    finally:
        server.terminate()


def test_a_published_multimodal_qwen3_5_checkpoint_loads_as_a_native_hybrid(tmp_path: Path) -> None:
    """Qwen3.5 / Qwen3.6 checkpoints are `Qwen3_5ForConditionalGeneration` (model_type qwen3_5, with a vision
    encoder): the text model loads from them and runs natively, equal to transformers' greedy generate."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from tests.helpers import make_tokenizer

    folder = tmp_path / "qwen3_5-vl"
    tok = make_tokenizer(folder)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, initializer_range=0.2)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    torch.manual_seed(7)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(folder)
    models = load_models(EngineConfig(str(folder), None, device="cpu", dtype="float32"))
    assert models.backend == "native" and isinstance(models.engine.target, HybridTarget)
    prompt = [5, 9, 13, 17, 21]
    rid = models.engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    out = run_all(models.engine)[rid]
    assert tokens(out) == hf_greedy(models.engine.target.model, prompt, 12)


def test_attention_layers_on_shuffled_pages_and_no_prefix_hits(model: torch.nn.Module) -> None:
    """The full-attention layers read their pages through the block table: shuffled block ids give the logits of
    each slot's own run of blocks, rollback included. A hybrid cache cannot start from cached positions."""
    prompt, block = list(range(5, 35)), [40, 41, 42, 43, 44, 45, 46, 47]
    logits = []
    for target, blocks in ((runner(model, slots=2), None), (HybridTarget(model, None, 2, 64, num_blocks=12,
                                                                         kv_block=8), [9, 3, 11, 1, 6])):
        cache = target.new_cache(1, blocks)
        out = [target.forward(prompt, 0, cache, features=False).logits]
        out.append(target.forward(block, len(prompt), cache, features=False).logits)
        target.crop(cache, len(prompt) + 3)
        out.append(target.forward(block[3:], len(prompt) + 3, cache, features=False).logits)
        logits.append(out)
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a, b)
    target = runner(model, slots=2)
    assert target.prefix_cacheable and target.kv_block_size == 16
    with pytest.raises(ValueError, match="cached"):
        target.new_cache(0, None, cached=16)


def test_every_prefill_chunk_takes_the_chunked_rule_and_stays_exact(model: torch.nn.Module, refs: dict) -> None:
    """Prompts prefilled 16 tokens at a time: every chunk after the first runs transformers' chunked delta rule from
    the row's state (not the token-by-token recurrence of verify steps), and the text still equals transformers'
    greedy `generate`."""
    target = runner(model)
    rule, calls = target._chunk_rule, []

    def counted(*args, **kwargs):
        calls.append(kwargs["initial_state"] is not None)
        return rule(*args, **kwargs)

    target._chunk_rule = counted
    engine = Engine(target, None, eos_token_ids=[], prefill_chunk=16)
    for prompt, want in refs.items():
        calls.clear()
        rid = engine.add_request(list(prompt), SamplingParams(max_tokens=NEW))
        assert tokens(run_all(engine)[rid]) == want
        chunks = -(-len(prompt) // 16)
        assert len(calls) == chunks * len(target.linear_index)  # one chunked call per chunk and linear layer
        assert sum(calls) == (chunks - 1) * len(target.linear_index)  # every later chunk from the row's state
