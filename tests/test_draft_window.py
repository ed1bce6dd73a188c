"""`--draft-window N`: the draft sees only the last N context positions.

Outputs stay exactly plain decoding's (the target verifies); every proposal equals the draft run from scratch on
only the last N context rows of the committed prefix, on both caches: the per-request ring of N rows (hf) and the
paged cache (native: every row kept, the window a visibility that gathers only the blocks it covers), with requests
of different lengths side by side and blocks reused by shorter requests (stale rows must stay hidden), and with
sliding-window causal draft layers (the gathered keys' positions feed their masks).
"""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.draft_cache import DraftKVCache
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from tests.helpers import Proposal, RecordingDrafter, make_target, make_tiny_pair
from tests.test_draft_reference import BLOCK, demo, demo_prompts  # noqa: F401 - demo: the fixture
from tests.test_engine import hf_greedy, run_all, tokens

WINDOW = 12
MAX_LEN = 300


@torch.inference_mode()
def windowed_reference_logits(
    model: torch.nn.Module, draft: DFlashDraft, prefix: list[int], last_token: int, n: int, window: int
) -> torch.Tensor:
    """Draft logits [n, V] after `last_token` at position len(prefix), from scratch: the target's hidden states of
    the whole prefix, of which the draft sees only the last `window` rows."""
    out = model(input_ids=torch.tensor([prefix]), use_cache=False, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in draft.cfg.target_layer_ids], dim=-1)
    position = len(prefix)
    start = max(0, position - window)
    block = torch.full((1, n + 1), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = last_token
    emb = draft.embed(block, model.get_input_embeddings().weight)
    hidden = draft(emb, torch.arange(position, position + n + 1)[None], feats[None, start:],
                   torch.arange(start, position)[None])
    return draft.logits(hidden[0, 1:], model.get_output_embeddings().weight).float()


def assert_windowed_proposals(model: torch.nn.Module, draft: DFlashDraft, sequences: dict, proposals: list[Proposal],
                              window: int) -> None:
    """Every proposal is the windowed from-scratch draft's argmax (ties within 1e-3 tolerated)."""
    assert proposals
    for prop in proposals:
        seq = list(prop.prompt) + sequences[prop.prompt]
        assert seq[prop.position] == prop.last_token
        logits = windowed_reference_logits(model, draft, seq[: prop.position], prop.last_token, len(prop.tokens),
                                           window)
        for k, tok in enumerate(prop.tokens):
            assert float(logits[k, tok]) >= float(logits[k].max()) - 1e-3, (prop.position, k)


def test_ring_cache_equals_last_rows_of_a_full_pass() -> None:
    """Context arriving in pieces longer and shorter than the window, sliding-window causal layers included."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, num_target_layers=6, block_size=4, mask_token_id=1,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    draft = DFlashDraft(cfg).eval()
    feats = torch.randn(1, 30, len(cfg.target_layer_ids) * 32)
    block = torch.randn(1, 4, 32)
    block_pos = torch.arange(30, 34)[None]
    windowed = draft(block, block_pos, feats[:, 22:], torch.arange(22, 30)[None])
    cache = DraftKVCache(2, window=8)
    for lo, hi in ((0, 11), (11, 12), (12, 30)):
        part = draft(block, block_pos, feats[:, lo:hi], torch.arange(lo, hi)[None], cache)
    assert cache.length == 30 and cache.k[0].shape[2] == 8
    torch.testing.assert_close(part, windowed, rtol=1e-5, atol=1e-5)
    full = draft(block, block_pos, feats, torch.arange(30)[None])
    assert not torch.allclose(part, full, atol=1e-4)  # the window really hides the older rows


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return make_target(None, "qwen3", seed=3)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_window_exact_with_windowed_proposals(tiny, backend: str) -> None:
    """Two waves of requests (long prompts, then short ones in the same slots); sliding-window causal layers."""
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=tiny.config.vocab_size, num_target_layers=4,
                      block_size=8, mask_token_id=3, max_position_embeddings=1024,
                      layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    torch.manual_seed(1)
    draft = DFlashDraft(cfg).eval()
    if backend == "hf":
        target, slots = HFTarget(tiny, cfg.target_layer_ids), {}
    else:
        target = NativeTarget(tiny, cfg.target_layer_ids, max_slots=2, max_len=MAX_LEN)
        slots = dict(max_slots=2, max_len=MAX_LEN)
    drafter = DFlashDrafter(draft, target, 8, window=WINDOW, **slots)
    if backend == "native":
        # paged: the window does not size the cache; the blocks are the target's (one id space)
        assert len(drafter.pages.k) == 2 and tuple(drafter.pages.k[0].shape) == (drafter.num_blocks * 16, 2, 16)
    recorder = RecordingDrafter(drafter)
    engine = Engine(target, recorder, eos_token_ids=[], max_slots=2)
    g = torch.Generator().manual_seed(0)
    sequences = {}
    for lengths in ((40, 23), (5, 9)):
        prompts = [tuple(torch.randint(4, tiny.config.vocab_size, (n,), generator=g).tolist()) for n in lengths]
        ids = {engine.add_request(list(p), SamplingParams(max_tokens=20)): p for p in prompts}
        outs = run_all(engine)
        for rid, p in ids.items():
            sequences[p] = tokens(outs[rid])
            assert sequences[p] == hf_greedy(tiny, list(p), 20)
    assert_windowed_proposals(tiny, draft, sequences, recorder.proposals, WINDOW)


def test_demo_proposals_equal_windowed_reference(demo) -> None:  # noqa: F811 - the fixture
    """The trained demo draft (really accepted), window shorter than its prompts, on both backends."""
    window = 16
    target = demo.engine.target
    slots = dict(max_slots=4, max_len=target.max_len) if demo.backend == "native" else {}
    drafter = DFlashDrafter(demo.engine.drafter.draft, target, BLOCK, window=window, **slots)
    recorder = RecordingDrafter(drafter)
    engine = Engine(target, recorder, eos_token_ids=[], max_model_len=demo.engine.max_model_len)
    prompts = demo_prompts(demo, 3)
    assert min(len(p) for p in prompts) > window
    ids = {engine.add_request(p, SamplingParams(max_tokens=30)): tuple(p) for p in prompts}
    outs = run_all(engine)
    sequences = {p: tokens(outs[rid]) for rid, p in ids.items()}
    assert sum(engine.stats(rid).num_accepted_tokens for rid in ids) > 0
    assert_windowed_proposals(target.model, drafter.draft, sequences, recorder.proposals, window)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple:
    return make_tiny_pair(tmp_path_factory.mktemp("window"))


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_draft_window_setting_loads_and_stays_exact(pair, backend: str) -> None:
    """`draft_window` reaches the drafter through load_models; a window shorter than the prompt stays exact."""
    prompt = list(range(5, 45))
    outs = []
    # fixed widths: the random draft is never right, and the test asserts that it drafted
    for config in (dict(draft_window=8, speculation="fixed"), dict(speculative=False)):
        models = load_models(EngineConfig(str(pair[0]), str(pair[1]), backend=backend, max_running_requests=2,
                                          **config))
        rid = models.engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        outs.append(tokens(run_all(models.engine)[rid]))
        if config.get("draft_window"):
            drafter = models.engine.drafter
            assert drafter.window == 8
            if backend == "native":
                assert drafter.pages is not None and drafter.static is None  # a window runs eagerly
            assert models.engine.stats(rid).num_drafts > 0
    assert outs[0] == outs[1]


def test_draft_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="draft_window"):
        EngineConfig(draft_window=0)
