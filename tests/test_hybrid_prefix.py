"""Prefix caching on hybrid targets (Qwen3.5 / Qwen3-Next: Gated DeltaNet beside full attention): a cached prefix
resumes from a recurrent-state checkpoint taken at a block boundary (the prompt's last one once prefilled, the
committed sequence's last one when a request ends or is preempted). Every output equals the run with caching off,
greedy and seeded, with a random DFlash draft, with a scripted draft whose partial acceptances roll back across
block boundaries, and with preemption; a checkpoint whose block left the prefix index is never used; the store of
checkpoints stays within its bounds."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.kv.manager import CheckpointStore, KVManager
from dflash_core.kv.pool import BlockPool
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.hybrid import HybridTarget
from dflash_core.sampling import SamplingParams
from dflash_core.slots import SlotPool
from tests.helpers import make_target
from tests.test_engine import ScriptedDrafter

KV_BLOCK = 16
MAX_LEN = 400
DRAFT_BLOCK = 8


@functools.cache
def model(arch: str) -> torch.nn.Module:
    return make_target(None, arch, seed=5)


@functools.cache
def draft(vocab: int) -> DFlashDraft:
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, num_target_layers=4,
                      block_size=DRAFT_BLOCK, mask_token_id=3, max_position_embeddings=1024)
    torch.manual_seed(1)
    return DFlashDraft(cfg).eval()


class CacheableScripted(ScriptedDrafter):
    """The scripted drafter (true continuation for k tokens of each block, then wrong ones) with nothing of its
    own to cache: the target's blocks may be shared. Its acceptances vary, so verify steps cross block boundaries
    with some of their proposals rejected."""

    prefix_cacheable = True

    def context_written(self, state: Any) -> int:
        return 1 << 30


def engine(arch: str, prefix: bool = True, drafter: str | None = "dflash", num_blocks: int = 200, slots: int = 4,
           refs: dict | None = None, limits: tuple[int, int] | None = None) -> Engine:
    m = model(arch)
    layer_ids = draft(m.config.vocab_size).cfg.target_layer_ids if drafter == "dflash" else None
    target = HybridTarget(m, layer_ids, max_slots=slots, max_len=MAX_LEN, num_blocks=num_blocks, kv_block=KV_BLOCK)
    if limits is not None:
        target.checkpoint_limits = limits
    d: Any = None
    if drafter == "dflash":
        d = DFlashDrafter(draft(m.config.vocab_size), target, DRAFT_BLOCK, max_slots=slots, max_len=MAX_LEN)
    elif drafter == "scripted":
        d = CacheableScripted(refs or {}, DRAFT_BLOCK, target.vocab_size, pattern=(7, 2, 0, 5, 3, 1))
    return Engine(target, d, eos_token_ids=[], speculation="fixed", enable_prefix_caching=prefix)


def ids(n: int, seed: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def conversation(eng: Engine, first: list[int], news: list[list[int]], params: SamplingParams
                 ) -> list[tuple[list[int], list[int], int]]:
    """Turns: each prompt is the previous prompt + its output + new tokens. (prompt, output, cached_tokens)."""
    turns, prompt = [], first
    for i in range(len(news) + 1):
        out = run_to_completion(eng, [prompt], params)[0]
        turns.append((prompt, out.token_ids, out.stats.cached_tokens))
        if i < len(news):
            prompt = prompt + out.token_ids + news[i]
    return turns


def verify_restores(eng: Engine) -> list[int]:
    """From now on, every checkpoint a hit restores is checked against the state a cold forward of the hit's tokens
    leaves (the outputs of these tiny models barely depend on the recurrent state, so their equality alone would not
    catch a wrong one); returns the list the checked hits' lengths go to."""
    target = eng.target
    ref = HybridTarget(target.model, None, max_slots=1, max_len=MAX_LEN)
    start, checked = eng.memory.start, []

    def checked_start(req: Any) -> None:
        kv = req.kv
        if kv.cached:
            conv, rec = kv.state
            ref.forward(req.prefill_tokens[: kv.cached], 0, ref.new_cache(0), features=False)
            torch.testing.assert_close(conv, ref.conv_state[:, 0], rtol=1e-3, atol=2e-4)
            torch.testing.assert_close(rec, ref.rec_state[:, 0], rtol=1e-3, atol=2e-4)
            checked.append(kv.cached)
            start(req)  # the checkpoint is the slot's live state now
            assert torch.equal(target.conv_state[:, kv.slot], conv) and torch.equal(target.rec_state[:, kv.slot], rec)
            return
        start(req)

    eng.memory.start = checked_start
    return checked


def check_store(eng: Engine) -> None:
    """Every checkpoint kept hangs on a block still in the prefix index, and the store is within its bounds."""
    store, pool = eng.kv.checkpoints, eng.kv.pool
    assert store is not None and pool is not None
    assert set(store._entries) <= set(pool._live)
    assert len(store) <= store.max_count and store.nbytes <= store.max_bytes
    assert store.nbytes == sum(size for _, size in store._entries.values())


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("drafter", [None, "dflash", "scripted"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_conversation_turns_hit_and_equal_caching_off(arch: str, drafter: str | None, seeded: bool) -> None:
    """Three turns: turns 2 and 3 resume from the checkpoint at the last block boundary of the previous turn's
    committed sequence (`cached_tokens` is that boundary, or the one before when the draft's context of the last
    block is still pending) and their tokens equal a run with caching off."""
    params = SamplingParams(max_tokens=37, ignore_eos=True, **(dict(temperature=0.9, seed=11) if seeded else {}))
    first, news = ids(45, 1), [ids(13, 2), ids(21, 3)]
    refs: dict = {}
    if drafter == "scripted":  # the scripted draft proposes from the true continuations: take them from a plain run
        for prompt, out, _ in conversation(engine(arch, prefix=False, drafter=None), first, news, params):
            refs[tuple(prompt)] = out
    off = conversation(engine(arch, prefix=False, drafter=drafter, refs=refs), first, news, params)
    cached = engine(arch, drafter=drafter, refs=refs)
    checked = verify_restores(cached)
    on = conversation(cached, first, news, params)
    assert checked == [t[2] for t in on[1:]]
    assert [t[:2] for t in on] == [t[:2] for t in off]
    assert [t[2] for t in off] == [0, 0, 0] and on[0][2] == 0
    for (prompt, out, _), (_, _, hit) in zip(on, on[1:]):
        committed = len(prompt) + len(out) - 1  # the last output token was never fed
        # the hit ends at the last block that entered the index: with the DFlash draft, whose context rows of the
        # last proposal's tokens are still pending when a request ends, possibly the block before
        lag = DRAFT_BLOCK if drafter == "dflash" else 0
        assert (committed - lag) // KV_BLOCK * KV_BLOCK <= hit <= committed // KV_BLOCK * KV_BLOCK
        assert hit >= 64
    stats = cached.kv_stats()
    assert stats is not None and stats.prefix_hits == sum(t[2] for t in on)
    check_store(cached)


def test_a_dflash_request_that_ended_on_plain_steps_leaves_its_blocks_in_the_index() -> None:
    """On a CPU a run of plain steps holds up to four blocks' worth of draft context rows back (`DFlashDrafter`);
    a request that ends so writes them as it is released, so the next turn hits as far as after a drafting run
    (and resumes from the checkpoint there), and its tokens equal caching off."""
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    first, news = ids(45, 1), [ids(13, 2)]
    cached = engine("qwen3_5")
    cached.policy.drafting = lambda states, room: [0] * len(states)  # type: ignore[method-assign]  # all plain
    checked = verify_restores(cached)
    on = conversation(cached, first, news, params)
    (prompt, out, _), (_, _, hit) = on
    committed = len(prompt) + len(out) - 1
    assert (committed - DRAFT_BLOCK) // KV_BLOCK * KV_BLOCK <= hit and checked == [hit]
    off = conversation(engine("qwen3_5", prefix=False), first, news, params)
    assert [t[:2] for t in on] == [t[:2] for t in off]


def test_the_prompt_checkpoint_serves_a_repeated_prompt() -> None:
    """A prompt seen again (another sample of it) hits the checkpoint taken once the first was prefilled: at the
    prompt's last block boundary before its last token, even though the first request ended elsewhere."""
    prompt = ids(70, 4)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=3)
    cached, off = engine("qwen3_5"), engine("qwen3_5", prefix=False)
    checked = verify_restores(cached)
    first = run_to_completion(cached, [prompt], params)[0]
    again = run_to_completion(cached, [prompt], params)[0]
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == 64
    assert first.token_ids == again.token_ids == run_to_completion(off, [prompt], params)[0].token_ids
    assert checked == [64]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_preempted_hybrid_requests_resume_from_their_checkpoints(seeded: bool) -> None:
    """A pool far too small for five requests: preempted ones are recomputed from the checkpoint their preemption
    left (hits), and every output equals the roomy run with caching off."""
    prompts = [ids(30 + 7 * i, 10 + i) for i in range(5)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True, **(dict(temperature=0.8, seed=i) if seeded else {}))
              for i in range(len(prompts))]
    ref = run_to_completion(engine("qwen3_5", prefix=False, slots=5), prompts, params)
    tight = engine("qwen3_5", num_blocks=16, slots=5)
    checked = verify_restores(tight)
    outs = run_to_completion(tight, prompts, params)
    assert checked
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    stats = tight.kv_stats()
    # recomputes resumed from checkpoints (`checked`: restores seen); their own hits are not counted as hits
    assert stats is not None and stats.preemptions > 0 and stats.prefix_hits == 0
    check_store(tight)


def test_checkpoints_of_evicted_blocks_are_never_used() -> None:
    """A tiny pool under many conversations sharing a prefix: blocks are evicted and their ids reused for other
    content all the time; after every step each kept checkpoint hangs on a live registration, every restored
    checkpoint is the one of the block the hit ends on, and the outputs equal caching off."""
    shared = ids(40, 20)
    prompts = [shared + ids(9 + 5 * i, 30 + i) for i in range(8)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = run_to_completion(engine("qwen3_5", prefix=False), prompts, params)
    eng = engine("qwen3_5", num_blocks=14, slots=2)
    store, pool = eng.kv.checkpoints, eng.kv.pool
    assert store is not None and pool is not None
    restored: list[tuple[torch.Tensor, torch.Tensor]] = []
    new_cache = eng.target.new_cache

    def spy(slot: int, blocks: Any = None, cached: int = 0, state: Any = None) -> Any:
        if cached:  # the checkpoint given is the one kept for the hit's last block, which is still cached
            serial = pool.serial(blocks[cached // KV_BLOCK - 1])
            assert serial is not None and store._entries[serial][0] is state
            restored.append(state)
        return new_cache(slot, blocks, cached, state=state)

    eng.target.new_cache = spy
    checked = verify_restores(eng)
    outs: dict[int, list[int]] = {}
    rids = [eng.add_request(p, params) for p in prompts]
    evicted = 0
    drop = store.drop

    def counting_drop(serial: int) -> None:
        nonlocal evicted
        evicted += serial in store
        drop(serial)

    pool.on_uncache = counting_drop
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_store(eng)
    assert [outs[r] for r in rids] == [o.token_ids for o in ref]
    assert restored and evicted > 0  # hits resumed from checkpoints, and evictions took checkpoints with them
    assert len(checked) == len(restored)


def test_a_reused_block_id_does_not_inherit_a_checkpoint() -> None:
    """The store is keyed by registration serial: when a block is evicted and its id registered again for other
    tokens, the old checkpoint is gone and a lookup of the new content misses."""
    pool = BlockPool(4, 4)  # 3 usable blocks of 4 positions
    store = CheckpointStore(8, 1 << 20)
    kv = KVManager(SlotPool(2), pool, reserve=1, checkpoints=store)
    a = kv.admit([1, 2, 3, 4, 5])
    assert a is not None and a.blocks is not None
    kv.register(a, [1, 2, 3, 4], 4)
    assert kv.save_checkpoint(a, 1, "state after 1 2 3 4", 10) and len(store) == 1
    block = a.blocks[0]
    kv.release(a)
    again = kv.admit([1, 2, 3, 4, 9])
    assert again is not None and again.cached == 4 and again.state == "state after 1 2 3 4"
    kv.release(again)
    other = kv.admit([7, 7, 7, 7, 7, 7, 7, 7, 8])  # needs every block: the cached one is evicted and reused
    assert other is not None and block in other.blocks and len(store) == 0
    kv.register(other, [7] * 8, 8)
    kv.release(other)
    miss = kv.admit([1, 2, 3, 4, 9])
    assert miss is not None and miss.cached == 0 and miss.state is None
    kv.release(miss)
    sevens = [7, 7, 7, 7, 7, 7, 7, 7, 1]
    cached = pool.match_prefix(sevens, count=False)
    assert cached  # the sevens' first block is still cached ...
    pool.free(cached)
    hit_without_checkpoint = kv.admit(sevens)  # ... but has no checkpoint: the hit is trimmed to nothing
    assert hit_without_checkpoint is not None and hit_without_checkpoint.cached == 0
    assert hit_without_checkpoint.state is None
    assert all(pool.ref_count(b) == 1 for b in hit_without_checkpoint.blocks)  # trimmed refs were given back


def test_the_checkpoint_store_stays_bounded() -> None:
    """Many distinct requests, a store of at most 3 checkpoints: never more, least recently used dropped first;
    a byte cap below one checkpoint keeps none, and the outputs are the same either way."""
    prompts = [ids(20 + 3 * i, 50 + i) for i in range(7)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = []
    for limits in ((3, 1 << 30), (100, 1)):
        eng = engine("qwen3_5", limits=limits)
        store = eng.kv.checkpoints
        assert store is not None and (store.max_count, store.max_bytes) == limits
        for p in prompts:
            outputs.append(run_to_completion(eng, [p], params)[0].token_ids)
            check_store(eng)
        assert len(store) == (3 if limits[1] > 1 else 0)
    assert outputs[:7] == outputs[7:]
    target = engine("qwen3_5").target
    assert target.checkpoint_limits == (4, 4 * target.checkpoint_bytes)  # default: max(4, slots // 2) states
    layers = len(target.linear_index)
    conv, rec = target.conv_state.shape, target.rec_state.shape
    assert target.checkpoint_bytes == layers * (conv[2] * conv[3] * 4 + rec[2] * rec[3] * rec[4] * 4)


def test_caching_off_keeps_no_checkpoints() -> None:
    eng = engine("qwen3_5", prefix=False)
    assert eng.kv.checkpoints is None and not eng.target.checkpointing
    run_to_completion(eng, [ids(40, 7)], SamplingParams(max_tokens=20, ignore_eos=True))


def held_state_bytes(eng: Engine) -> tuple[int, int]:
    """(all, checkpoint copies): bytes of hybrid state the engine holds now, distinct storages: the runner's live and
    rollback states, each request's rollback records of its last forward, and the checkpoint copies beyond them
    (each admitted request's marks, pending boundary state and deferred checkpoint, and the store's checkpoints)."""
    target, store = eng.target, eng.kv.checkpoints
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in (target.conv_state, target.rec_state, target.conv_backup, target.rec_backup):
        add(t)
    for req in [*eng.scheduler.running, *eng.scheduler.prefilling]:
        for rec in (req.cache.records.values() if req.cache is not None else ()):
            for t in (rec.inputs, rec.key, rec.value, rec.decay, rec.beta):
                if t is not None:
                    add(t)
    allocated = sum(seen.values())
    for req in [*eng.scheduler.running, *eng.scheduler.prefilling]:
        if req.cache is not None:
            for layers in [*req.cache.marks.values(), req.cache.pending]:
                for conv, rec in layers.values():
                    add(conv)
                    add(rec)
        if req.kv is not None and req.kv.deferred is not None:
            for t in req.kv.deferred[1]:
                add(t)
    for checkpoint, _ in (store._entries.values() if store is not None else ()):
        for t in checkpoint:
            add(t)
    total = sum(seen.values())
    return total, total - allocated


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_a_hybrid_engine_holds_no_more_state_than_the_plan(prefix: bool) -> None:
    """Conversations and distinct prompts through a tiny hybrid engine with the DFlash draft: after every step, the
    state it holds (live and rollback states, marks, pending and deferred checkpoints, the store) is within the
    memory plan's figure for its running cap, computed from the config; the checkpoint copies are exercised."""
    from dflash_core.memory import PoolCosts, normalize_shape, plan_memory, pool_state_costs

    slots = 3
    eng = engine("qwen3_5", prefix=prefix, slots=slots)
    shape = normalize_shape(model("qwen3_5").config.to_dict())
    costs = PoolCosts(0, 0, kv_block=KV_BLOCK, extra_len=DRAFT_BLOCK + 1,
                      **pool_state_costs(shape, 4, prefix, verify_tokens=DRAFT_BLOCK))
    plan = plan_memory(costs, 0, slots, 64, MAX_LEN, None, "no budget set")
    assert eng.target.checkpoint_bytes == pool_state_costs(shape, 4, True, DRAFT_BLOCK)["checkpoint"]
    assert plan.slots == slots and plan.checkpoints == (eng.target.checkpoint_limits[1] if prefix else 0)
    budget = plan.state + plan.checkpoints
    shared = ids(37, 60)
    prompts = [shared + ids(5 + 11 * i, 70 + i) for i in range(4)] + [ids(20 + 9 * i, 80 + i) for i in range(5)]
    params = SamplingParams(max_tokens=45, ignore_eos=True)
    peak = copies = 0
    for p in prompts:
        eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
        held, extra = held_state_bytes(eng)
        assert held <= budget, (held, budget)
        peak, copies = max(peak, held), max(copies, extra)
    if prefix:
        store = eng.kv.checkpoints
        assert store is not None and len(store) == store.max_count  # the store filled up
        assert copies > store.max_bytes  # requests' own checkpoint copies beside a full store
    else:
        assert copies == 0 and peak == budget  # just the live and rollback states
