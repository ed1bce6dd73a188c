"""The native backend reproduces transformers' logits and hidden-state features, batched or not."""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.runners.hf import HFTarget
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair
from tests.test_engine import ScriptedDrafter, hf_greedy, run_all, tokens

LAYER_IDS = [0, 2, 3]  # includes the last layer, whose feature transformers returns after the final norm


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tmp_path_factory):
    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp(f"native-{request.param}"), arch=request.param)
    return load_models(EngineConfig(str(target_dir), None)).engine.target.model


def full_pass(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and features of the whole sequence in one transformers forward without a cache."""
    hf = HFTarget(model, LAYER_IDS)
    out = hf.forward(seq, 0, hf.new_cache(), features=True)
    return out.logits, out.features


def test_prefill_verify_rollback_match_transformers(model):
    native = NativeTarget(model, LAYER_IDS, max_slots=2, max_len=128)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, 300, (60,), generator=g).tolist()
    ref_logits, ref_feats = full_pass(model, seq)
    slot = native.new_cache(0)
    out = native.forward(seq[:30], 0, slot, features=True)
    torch.testing.assert_close(out.logits, ref_logits[:30], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.features, ref_feats[:30], rtol=1e-4, atol=1e-4)
    # a rejected block: written, then rolled back by length and overwritten
    wrong = native.forward([7] * 16, 30, slot, features=True)
    assert wrong.logits.shape[0] == 16
    native.crop(slot, 30)
    out = native.forward(seq[30:46], 30, slot, features=True)
    torch.testing.assert_close(out.logits, ref_logits[30:46], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.features, ref_feats[30:46], rtol=1e-4, atol=1e-4)


def test_batched_rows_equal_single_rows(model):
    native = NativeTarget(model, LAYER_IDS, max_slots=3, max_len=128)
    seqs = [list(range(5, 25)), list(range(40, 47)), list(range(100, 150))]
    slots = [native.new_cache(i) for i in range(len(seqs))]
    prefix = [11, 5, 33]
    for seq, slot, n in zip(seqs, slots, prefix):
        native.forward(seq[:n], 0, slot, features=False)
    rows = [(seq[n:n + k], n, slot) for seq, slot, n, k in zip(seqs, slots, prefix, (4, 2, 16))]
    batched = native.forward_batch(rows, features=True)
    for (seq, n, k), out in zip([(s, n, k) for s, n, k in zip(seqs, prefix, (4, 2, 16))], batched):
        ref_logits, ref_feats = full_pass(model, seq[: n + k])
        torch.testing.assert_close(out.logits, ref_logits[n:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.features, ref_feats[n:], rtol=1e-4, atol=1e-4)
    assert [s.length for s in slots] == [15, 7, 49]


def test_engine_on_native_backend_is_lossless(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (1, 9, 70, 33)]
    refs = {tuple(p): hf_greedy(model, p, 30) for p in prompts}
    native = NativeTarget(model, None, max_slots=2, max_len=256)  # fewer slots than requests: they wait
    engine = Engine(native, ScriptedDrafter(refs, 8, native.vocab_size), eos_token_ids=[])
    ids = {engine.add_request(p, SamplingParams(max_tokens=30)): refs[tuple(p)] for p in prompts}
    outs = run_all(engine)
    for rid, ref in ids.items():
        assert tokens(outs[rid]) == ref
    assert engine.slots.capacity == 2 and engine.slots.num_free() == 2  # every slot back in the pool


def test_load_models_native_backend(tmp_path):
    target_dir, draft_dir = make_tiny_pair(tmp_path)
    hf = load_models(EngineConfig(str(target_dir), str(draft_dir), backend="hf"))
    nat = load_models(EngineConfig(str(target_dir), str(draft_dir), backend="native", max_running_requests=4))
    assert nat.backend == "native" and hf.backend == "hf"
    outs = []
    for models in (hf, nat):
        ids = [models.engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
               for i in range(3)]
        res = run_all(models.engine)
        outs.append([tokens(res[i]) for i in ids])
    assert outs[0] == outs[1]


def test_batched_slot_drafts_equal_per_request_drafts(tmp_path):
    from dflash_core.draft import DFlashDraft
    from dflash_core.runners.drafter import DFlashDrafter

    target_dir, draft_dir = make_tiny_pair(tmp_path)
    models = load_models(EngineConfig(str(target_dir), str(draft_dir), backend="native"))
    target = models.engine.target
    draft = DFlashDraft.from_folder(draft_dir)
    batched = DFlashDrafter(draft, target, 16, max_slots=3, max_len=256)
    single = DFlashDrafter(draft, target, 16)
    g = torch.Generator().manual_seed(0)
    feat_dim = len(draft.cfg.target_layer_ids) * 64
    lengths, widths = (5, 40, 17), (15, 3, 9)
    states = [(batched.new_state(slot, []), single.new_state(slot, [])) for slot in range(len(lengths))]
    for round_ in range(3):  # context arrives in pieces of different sizes
        items_b, expected = [], []
        for i, ((sb, ss), n, w) in enumerate(zip(states, lengths, widths)):
            pos = n + 4 * round_
            feats = torch.randn(n if round_ == 0 else 4, feat_dim, generator=g)
            batched.extend_context(sb, feats)
            single.extend_context(ss, feats)
            items_b.append((sb, 7 + i, pos, w))
            expected.append(single.propose(ss, 7 + i, pos, w))
        assert batched.propose_batch(items_b) == expected
