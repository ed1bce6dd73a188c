"""Every family on every backend that claims it: greedy output equals transformers' own greedy generate.

Qwen3, Llama, Qwen2 and Qwen3-MoE run on `hf` and `native`; gpt-oss (sliding-window layers, attention sinks, MoE)
on `hf` only; the hybrids Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated
DeltaNet layers, whose recurrent state is rolled back exactly) on `native` only. Each runs at block sizes 2, 8 and 16
with a scripted draft right for part of each block (short, full and zero acceptances, the bonus token), four requests of
different lengths at once, and with a real (random) DFlash draft whose every proposal is checked against the
from-scratch draft reference.
"""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.loading import make_target as load_target_runner
from dflash_core.loading import native_runner
from dflash_core.runners.base import TargetRunner
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES
from dflash_core.runners.native import SUPPORTED_MODEL_TYPES
from dflash_core.sampling import SamplingParams
from tests.helpers import RecordingDrafter, make_target
from tests.test_draft_reference import assert_proposals_match_reference
from tests.test_engine import ScriptedDrafter, hf_greedy, run_all, tokens

FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next")
HF_ONLY = ("gpt_oss",)  # the native runner has no attention sinks or sliding windows: loading picks hf for it
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # native only: transformers' cache cannot roll them back
BACKENDS = ("hf", "native")
PROMPT_LENGTHS = (1, 7, 64, 200)
NEW_TOKENS = 40
MAX_LEN = 300


def test_every_native_family_is_in_the_matrix():
    text_types = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # their text-only model types
    native_types = {text_types.get(f, f) for f in FAMILIES if f not in HF_ONLY}
    assert native_types == set(SUPPORTED_MODEL_TYPES) | set(HYBRID_MODEL_TYPES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, torch.nn.Module, dict[tuple[int, ...], list[int]]]:
    """(family, a tiny random model of it, transformers' greedy continuation of each prompt)."""
    model = make_target(None, request.param, seed=3)
    g = torch.Generator().manual_seed(0)
    refs = {}
    for n in PROMPT_LENGTHS:
        prompt = torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist()
        refs[tuple(prompt)] = hf_greedy(model, prompt, NEW_TOKENS)
    return request.param, model, refs


def make_backend(model: torch.nn.Module, backend: str, layer_ids: list[int] | None = None) -> TargetRunner:
    if backend == "hf":
        return HFTarget(model, layer_ids)
    runner, reason = native_runner(model)
    assert runner is not None, reason
    return runner(model, layer_ids, max_slots=len(PROMPT_LENGTHS), max_len=MAX_LEN)


def refused_on_hf(family: tuple, backend: str) -> bool:
    """A backend that does not run the family: loading refuses it with a clear message (a hybrid on `hf`, whose
    cache transformers cannot roll back; gpt-oss on `native`), and `auto` picks the one that runs it."""
    name, model, _ = family
    if (backend, name in HYBRIDS, name in HF_ONLY) not in (("hf", True, False), ("native", False, True)):
        return False
    with pytest.raises(ValueError, match="native backend only" if backend == "hf" else "does not support"):
        load_target_runner(model, None, backend, len(PROMPT_LENGTHS), MAX_LEN, 16)
    auto = load_target_runner(model, None, "auto", len(PROMPT_LENGTHS), MAX_LEN, 16)
    assert auto.backend != backend
    return True


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_identical_with_scripted_draft(family, backend, block_size):
    if refused_on_hf(family, backend):
        return
    _, model, refs = family
    target = make_backend(model, backend)
    assert target.backend == backend
    # at block size 8 the prompts are prefilled in chunks of 3 tokens, several requests per forward
    chunked = dict(prefill_chunk=3, max_num_batched_tokens=40) if block_size == 8 else {}
    engine = Engine(target, ScriptedDrafter(refs, block_size, target.vocab_size), eos_token_ids=[], **chunked)
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): ref for p, ref in refs.items()}
    outs = run_all(engine)
    for rid, ref in ids.items():
        assert tokens(outs[rid]) == ref
        lengths = [s.acceptance_length for s in outs[rid] if not s.is_prefill]
        assert max(lengths) == block_size  # a fully accepted block plus its bonus token
        assert engine.stats(rid).num_accepted_tokens > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_identical_with_real_draft_and_exact_proposals(family, backend):
    """A random DFlash draft (the batched slot drafter on native): output exact, every proposal equal to the
    draft run from scratch on the committed prefix."""
    if refused_on_hf(family, backend):
        return
    _, model, refs = family
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=model.config.vocab_size, num_target_layers=4,
                      block_size=8, mask_token_id=3, max_position_embeddings=1024)
    torch.manual_seed(1)
    draft = DFlashDraft(cfg).eval()
    target = make_backend(model, backend, cfg.target_layer_ids)
    slots = dict(max_slots=len(PROMPT_LENGTHS), max_len=MAX_LEN) if backend == "native" else {}
    recorder = RecordingDrafter(DFlashDrafter(draft, target, 8, **slots))
    engine = Engine(target, recorder, eos_token_ids=[])
    prompts = [p for p in refs if len(p) in (7, 64)]
    n_tokens = 16
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=n_tokens)): p for p in prompts}
    outs = run_all(engine)
    for rid, p in ids.items():
        assert tokens(outs[rid]) == refs[p][:n_tokens]
    assert_proposals_match_reference(model, draft, {p: tokens(outs[rid]) for rid, p in ids.items()},
                                     recorder.proposals)


def test_greedy_identical_with_prefix_cache_and_preemption(family):
    """The native runner of every family with a random DFlash draft, a block pool that one long request nearly
    fills (requests are preempted and recomputed), and the same prompts twice (the second round starts from the
    prefix cache, a hybrid from its state checkpoints): output exact each time."""
    name, model, refs = family
    if name in HF_ONLY:
        return  # the hf backend has no block pool
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=model.config.vocab_size, num_target_layers=4,
                      block_size=8, mask_token_id=3, max_position_embeddings=1024)
    torch.manual_seed(1)
    draft = DFlashDraft(cfg).eval()
    runner, _ = native_runner(model)
    # 20 usable blocks of 16: the 200-token prompt with its 40 tokens and a verify block needs 16 at the end
    target = runner(model, cfg.target_layer_ids, max_slots=4, max_len=MAX_LEN, num_blocks=21)
    engine = Engine(target, DFlashDrafter(draft, target, 8, max_slots=4, max_len=MAX_LEN), eos_token_ids=[])
    for _ in range(2):
        # the longest first: admitted with the room its prompt needs, it grows into what the others hold
        ids = {engine.add_request(list(p), SamplingParams(max_tokens=NEW_TOKENS)): ref
               for p, ref in sorted(refs.items(), key=lambda item: -len(item[0]))}
        outs = run_all(engine)
        for rid, ref in ids.items():
            assert tokens(outs[rid]) == ref
    stats = engine.kv_stats()
    assert stats is not None and stats.preemptions > 0 and stats.usage == 0, stats
    # a hybrid hits only where a state checkpoint survived this tiny pool's evictions (tests/test_hybrid_prefix.py
    # tests its hits); the others' second round starts from cached blocks
    assert stats.prefix_hits > 0 or name in HYBRIDS, stats
