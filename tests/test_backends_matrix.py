"""Every family on every backend that claims it: greedy output equals transformers' own greedy generate.

Qwen3, Llama, Qwen2 and Qwen3-MoE run on `hf`, `native` and `generic`; the families only the generic runner batches
(gpt-oss: sliding-window layers, attention sinks, MoE; Gemma 4: sliding and global layers of different head dims,
per-layer inputs, shared keys, logit softcapping; MiniMax-M2 and GLM-4.5: MoE; DeepSeek-V3 and Kimi K2.5: MLA;
Mistral: sliding window; Phi-3: fused projections; GLM-5: MLA with DeepSeek sparse attention, its latents and indexer
keys in the pages) on `generic` (gpt-oss on `hf` too); the hybrids Qwen3.5,
Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers, whose recurrent state is rolled back exactly) on `native` only.
Each runs at block sizes 2, 8 and 16 with a scripted draft right for part of each block (short, full and zero
acceptances, the bonus token), four requests of different lengths at once, and with a real (random) DFlash draft
whose every proposal is checked against the from-scratch draft reference; every paged family also with a tiny
block pool (preemption) and a second round from the prefix cache.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.loading import make_target as load_target_runner
from dflash_core.runners.base import TargetRunner
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES
from dflash_core.runners.native import SUPPORTED_MODEL_TYPES
from dflash_core.sampling import SamplingParams
from tests.helpers import GENERIC_ARCHS, RecordingDrafter, make_target
from tests.test_draft_reference import assert_proposals_match_reference
from tests.test_engine import ScriptedDrafter, hf_greedy, run_all, tokens

NATIVE = ("qwen3", "llama", "qwen2", "qwen3_moe")
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # native only: transformers' cache cannot roll them back
GENERIC = ("gpt_oss", "gemma4", "minimax_m2", "glm4_moe", "deepseek_v3", "kimi_k25", "mistral", "phi3", "glm_moe_dsa")
BACKENDS = {**{f: ("hf", "native", "generic") for f in NATIVE}, **{f: ("native",) for f in HYBRIDS},
            **{f: ("generic",) for f in GENERIC}, "gpt_oss": ("hf", "generic")}
CASES = [(family, backend) for family, backends in BACKENDS.items() for backend in backends]
PROMPT_LENGTHS = (1, 7, 64, 200)
NEW_TOKENS = 40
MAX_LEN = 300


def test_every_native_and_generic_family_is_in_the_matrix():
    text_types = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # their text-only model types
    native_types = {text_types.get(f, f) for f in (*NATIVE, *HYBRIDS)}
    assert native_types == set(SUPPORTED_MODEL_TYPES) | set(HYBRID_MODEL_TYPES)
    assert set(GENERIC) >= set(GENERIC_ARCHS) - {"phi3_longrope"}


@functools.cache
def family(name: str) -> tuple[torch.nn.Module, dict[tuple[int, ...], list[int]]]:
    """A tiny random model of `name`, and transformers' greedy continuation of each prompt."""
    model = make_target(None, name, seed=3)
    g = torch.Generator().manual_seed(0)
    refs = {}
    for n in PROMPT_LENGTHS:
        prompt = torch.randint(4, model.config.get_text_config().vocab_size, (n,), generator=g).tolist()
        refs[tuple(prompt)] = hf_greedy(model, prompt, NEW_TOKENS)
    return model, refs


def make_backend(model: torch.nn.Module, backend: str, layer_ids: list[int] | None = None,
                 num_blocks: int | None = None) -> TargetRunner:
    """`backend`'s runner for `model`, built as the server builds it."""
    runner = load_target_runner(model, layer_ids, backend, len(PROMPT_LENGTHS), MAX_LEN - 17, 16,
                                num_blocks=num_blocks)
    assert runner.backend == backend
    return runner


@pytest.mark.parametrize("name", [*HYBRIDS, "gpt_oss", "glm_moe_dsa"])
def test_backends_that_cannot_run_a_family_refuse_it_in_one_line(name):
    """A hybrid on hf or generic (transformers' cache cannot roll back its recurrent layers), gpt-oss on native,
    GLM-5 (DeepSeek sparse attention) on native and hf: loading refuses with a clear message; auto picks one that
    runs."""
    model = make_target(None, name, seed=3)
    refused = {"gpt_oss": ("native",), "glm_moe_dsa": ("native", "hf")}.get(name, ("hf", "generic"))
    for backend in refused:
        with pytest.raises(ValueError) as err:
            load_target_runner(model, None, backend, len(PROMPT_LENGTHS), MAX_LEN, 16)
        assert "\n" not in str(err.value) and len(str(err.value)) < 300, err.value
    auto = load_target_runner(model, None, "auto", len(PROMPT_LENGTHS), MAX_LEN, 16)
    assert auto.backend not in refused


@pytest.mark.parametrize("name,backend", [("qwen3", "native"), ("qwen3_5", "native"), ("gpt_oss", "generic"),
                                          ("kimi_k25", "generic")])
def test_auto_picks_native_then_generic(name, backend):
    model, _ = family(name)
    text = model.config.get_text_config()
    before = text._attn_implementation
    runner = load_target_runner(model, [0, 3], "auto", len(PROMPT_LENGTHS), None, 16)
    assert runner.backend == backend
    # a multimodal checkpoint's limits come from its text config (Kimi's top-level config has none)
    assert runner.max_len == text.max_position_embeddings + 16 + 1
    runner.forward(list(range(4, 12)), 0, runner.new_cache(0), features=True)
    assert text._attn_implementation == before  # transformers' own attention is back after the runner's forward


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("name,backend", CASES)
def test_greedy_identical_with_scripted_draft(name, backend, block_size):
    model, refs = family(name)
    target = make_backend(model, backend)
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


def random_draft(vocab_size: int) -> DFlashDraft:
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, num_target_layers=4,
                      block_size=8, mask_token_id=3, max_position_embeddings=1024)
    torch.manual_seed(1)
    return DFlashDraft(cfg).eval()


def drafter(draft: DFlashDraft, target: TargetRunner) -> DFlashDrafter:
    """The DFlash drafter as loading builds it: batched over the target's pages when the target is paged."""
    slots = dict(max_slots=target.max_slots, max_len=target.max_len) if target.max_slots is not None else {}
    return DFlashDrafter(draft, target, 8, **slots)


@pytest.mark.parametrize("name,backend", CASES)
def test_greedy_identical_with_real_draft_and_exact_proposals(name, backend):
    """A random DFlash draft (the batched drafter on the paged runners): output exact, every proposal equal to the
    draft run from scratch on the committed prefix."""
    model, refs = family(name)
    draft = random_draft(model.config.get_text_config().vocab_size)
    target = make_backend(model, backend, draft.cfg.target_layer_ids)
    recorder = RecordingDrafter(drafter(draft, target))
    engine = Engine(target, recorder, eos_token_ids=[])
    prompts = [p for p in refs if len(p) in (7, 64)]
    n_tokens = 16
    ids = {engine.add_request(list(p), SamplingParams(max_tokens=n_tokens)): p for p in prompts}
    outs = run_all(engine)
    for rid, p in ids.items():
        assert tokens(outs[rid]) == refs[p][:n_tokens]
    assert_proposals_match_reference(model, draft, {p: tokens(outs[rid]) for rid, p in ids.items()},
                                     recorder.proposals)


@pytest.mark.parametrize("name,backend", [(f, "native") for f in (*NATIVE, *HYBRIDS)] +
                         [(f, "generic") for f in ("qwen3", *GENERIC)])
def test_greedy_identical_with_prefix_cache_and_preemption(name, backend):
    """Every paged runner with a random DFlash draft, a block pool that one long request nearly fills (requests are
    preempted and recomputed), and the same prompts twice (the second round starts from the prefix cache, a hybrid
    from its state checkpoints): output exact each time."""
    model, refs = family(name)
    draft = random_draft(model.config.get_text_config().vocab_size)
    # 20 usable blocks of 16: the 200-token prompt with its 40 tokens and a verify block needs 16 at the end
    target = make_backend(model, backend, draft.cfg.target_layer_ids, num_blocks=21)
    engine = Engine(target, drafter(draft, target), eos_token_ids=[])
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



def test_rope_that_reads_the_batch_is_refused_by_the_batched_runners():
    """LongRoPE and dynamic NTK pick their frequencies from a forward's largest position, so a request's output
    would depend on what shares its forward: the generic backend refuses them in one line (and native a Llama with
    dynamic NTK), auto falls back to hf."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    dynamic = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    for model, refused in ((make_target(None, "phi3_longrope", seed=3), ("generic",)),
                           (dynamic, ("generic", "native"))):
        for backend in refused:
            with pytest.raises(ValueError, match="largest position"):
                load_target_runner(model, None, backend, len(PROMPT_LENGTHS), MAX_LEN, 16)
        assert load_target_runner(model, None, "auto", len(PROMPT_LENGTHS), MAX_LEN, 16).backend == "hf"


@pytest.mark.parametrize("name", [*NATIVE, "gpt_oss", "gemma4", "deepseek_v3", "kimi_k25", "mistral", "glm_moe_dsa"])
def test_memory_arithmetic_counts_the_caches_the_generic_runner_allocates(name):
    """`dflash-bench memory` and the start-up plan of a folder count KV per position from the config
    (`dflash_core.memory`): Gemma 4's global layers and shared KV, MLA's per-head keys and values, every sliding
    layer at full length, DSA's latents and indexer keys. That count equals what the generic runner allocates."""
    from dflash_core.memory import kv_bytes_per_row, normalize_shape
    from dflash_core.runners.generic import layout_of

    model, _ = family(name)
    assert kv_bytes_per_row(normalize_shape(model.config.to_dict()), 4) == layout_of(model).bytes_per_row(4)
    runner = make_backend(model, "generic")
    assert runner.kv_bytes_per_block == 16 * layout_of(model).bytes_per_row(4)
    assert runner.kv_cache_bytes == runner.num_blocks * runner.kv_bytes_per_block
