"""The native backend (and the generic one, on the same families) reproduces transformers' logits and hidden-state
features, batched or not."""

from __future__ import annotations

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.runners.generic import GenericTarget
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


PAGED_RUNNERS = pytest.mark.parametrize("runner", [NativeTarget, GenericTarget], ids=["native", "generic"])


@PAGED_RUNNERS
def test_prefill_verify_rollback_match_transformers(model, runner):
    native = runner(model, LAYER_IDS, max_slots=2, max_len=128)
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


@PAGED_RUNNERS
def test_batched_rows_equal_single_rows(model, runner):
    native = runner(model, LAYER_IDS, max_slots=3, max_len=128)
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
    assert engine.kv.slots.capacity == 2 and engine.kv.slots.num_free() == 2  # every slot back in the pool


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


def test_shuffled_block_tables_equal_contiguous_ones(model):
    """The same requests on contiguous block runs and on shuffled, interleaved block ids: the same logits (the
    pages only move rows), through prefill, a rolled-back verify, and a batched verify of different widths."""
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (45, 30, 19)]
    ids = (torch.randperm(39, generator=g) + 1).tolist()
    runs = []
    for tables in ([list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)], [ids[i::3][:12] for i in range(3)]):
        native = NativeTarget(model, LAYER_IDS, max_slots=3, max_len=48, num_blocks=40, kv_block=4)
        caches = [native.new_cache(i, blocks) for i, blocks in enumerate(tables)]
        outs = [native.forward(s[:20], 0, c, features=True).logits for s, c in zip(seqs, caches)]
        native.forward([7] * 8, 20, caches[0], features=False)  # rejected: rolled back
        native.crop(caches[0], 20)
        rows = [(s[20:20 + k], 20, c) for s, c, k in zip(seqs, caches, (16, 2, 7)) if len(s) > 20]
        outs += [o.logits for o in native.forward_batch(rows, features=True)]
        runs.append(outs)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    ref, _ = full_pass(model, seqs[0][:36])
    torch.testing.assert_close(runs[1][3], ref[20:36], rtol=1e-4, atol=1e-4)


def test_rows_their_blocks_do_not_cover_are_refused(model):
    native = NativeTarget(model, None, max_slots=2, max_len=64, num_blocks=10, kv_block=4)
    cache = native.new_cache(0, [3, 5])
    with pytest.raises(ValueError, match="do not cover"):
        native.forward(list(range(5, 14)), 0, cache, features=False)  # 9 positions, 8 in two blocks
    assert cache.length == 0
    native.forward(list(range(5, 13)), 0, cache, features=False)
    with pytest.raises(ValueError, match="do not cover"):
        native.forward([9], 8, cache, features=False)
    cache.blocks.append(7)  # the engine grows the table in place before the forward
    native.forward([9], 8, cache, features=False)
    with pytest.raises(ValueError, match="past the end"):
        native.forward([9], 10, cache, features=False)
    with pytest.raises(ValueError, match="default num_blocks"):
        native.new_cache(1)  # no fixed run per slot when the engine sizes the pool
    with pytest.raises(ValueError, match="null block"):
        native.new_cache(1, [0, 2])
    with pytest.raises(ValueError, match="cached"):
        native.new_cache(1, [2], cached=5)
    assert native.prefix_cacheable and native.kv_block_size == 4 and native.num_blocks == 10
    per_layer = 4 * native.num_kv_heads * native.head_dim * 4  # float32 rows of one block
    assert native.kv_bytes_per_block == 2 * native.num_layers * per_layer
    assert native.kv_cache_bytes == 10 * native.kv_bytes_per_block


def test_requests_sharing_a_prefix_block_equal_each_alone(model):
    """B starts from A's first two full blocks (a prefix-cache hit: `cached=8`); both, batched, give the logits each
    gives alone, and A's shared blocks are never written by B."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(4, 300, (8,), generator=g).tolist()
    a_seq = prefix + torch.randint(4, 300, (14,), generator=g).tolist()
    b_seq = prefix + torch.randint(4, 300, (11,), generator=g).tolist()
    native = NativeTarget(model, LAYER_IDS, max_slots=2, max_len=32, num_blocks=20, kv_block=4)
    a = native.new_cache(0, [6, 2, 11, 4, 15, 1])
    native.forward(a_seq[:13], 0, a, features=False)
    shared = [k.clone() for k in native.k_cache]
    b = native.new_cache(1, [6, 2, 17, 9], cached=8)
    assert b.length == 8
    outs = native.forward_batch([(a_seq[13:], 13, a), (b_seq[8:16], 8, b)], features=True)
    b.blocks.append(13)
    last = native.forward(b_seq[16:], 16, b, features=True)
    rows = [r for blk in (6, 2) for r in range(4 * blk, 4 * blk + 4)]
    for before, after in zip(shared, native.k_cache):
        assert torch.equal(before[rows], after[rows])  # the shared blocks untouched
    for seq, out in ((a_seq[:22], outs[0].logits), (b_seq[:16], outs[1].logits), (b_seq, last.logits)):
        alone = NativeTarget(model, LAYER_IDS, max_slots=1, max_len=32)
        ref = alone.forward(seq, 0, alone.new_cache(0), features=False).logits[-out.shape[0]:]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, full_pass(model, seq)[0][-out.shape[0]:], rtol=1e-4, atol=1e-4)
