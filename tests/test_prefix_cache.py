"""The paged KV cache through the engine, on the bundled demo pair: prefix caching across the turns of a
conversation, preemption when blocks run out, and many short requests in the block budget of a few slots. Every
output is token-identical to the target alone (greedy) or to an unpreempted, uncached run (seeded sampling).

The engines speculate with the fixed width (`speculation="fixed"`), so what the tests count does not depend on the
machine's load.
"""

from __future__ import annotations

import random

import pytest

from dflash_core.chat import encode_chat
from dflash_core.engine import Engine
from dflash_core.generate import run_to_completion
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.native import NativeTarget
from dflash_core.sampling import SamplingParams
from tests.demo_engines import QUESTIONS, demo

KV_BLOCK = 16
SYSTEM = " ".join(f"Rule {i}: convert units carefully, show the arithmetic, and answer briefly." for i in range(60))


def _engine(num_blocks: int, max_slots: int, prefix: bool = True, draft: bool = True,
            prefill_chunk: int | None = None) -> Engine:
    """An engine over the demo pair's weights with its own block pool of `num_blocks` blocks."""
    models, _ = demo()
    base = models.engine.target
    target = NativeTarget(base.model, base.layer_ids, max_slots=max_slots, max_len=base.max_len,
                          num_blocks=num_blocks, kv_block=KV_BLOCK)
    drafter = None
    if draft:
        drafter = DFlashDrafter(models.engine.drafter.draft, target, max_slots=max_slots, max_len=base.max_len)
    return Engine(target, drafter, eos_token_ids=models.engine.eos_token_ids, speculation="fixed",
                  enable_prefix_caching=prefix, prefill_chunk=prefill_chunk)


def _prompt(messages: list[dict[str, str]]) -> list[int]:
    return encode_chat(demo()[0].tokenizer, messages)


def test_each_turn_prefills_only_its_new_tokens() -> None:
    """Six turns behind a long system prompt: from turn 2 on, the whole previous prompt comes from the cache
    (`cached_tokens`), and the text equals the run with caching off (whose exactness against the target alone the
    backends matrix tests) and, on the first and last turns, the target alone."""
    tok = demo()[0].tokenizer
    cached, uncached, plain = _engine(400, 2), _engine(400, 2, prefix=False), _engine(400, 2, draft=False)
    params = SamplingParams(max_tokens=24)
    messages = [{"role": "system", "content": SYSTEM}]
    previous: list[int] = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"{QUESTIONS[turn % len(QUESTIONS)]} (question {turn + 1})"})
        prompt = _prompt(messages)
        assert len(prompt) > 1000 or turn  # the system prompt alone is over 1,000 tokens
        out = run_to_completion(cached, [prompt], params)[0]
        assert out.token_ids == run_to_completion(uncached, [prompt], params)[0].token_ids
        if turn in (0, 5):
            assert out.token_ids == run_to_completion(plain, [prompt], params)[0].token_ids
        if turn == 0:
            assert out.stats.cached_tokens == 0
        else:
            assert prompt[: len(previous)] == previous  # the template renders earlier turns unchanged
            assert out.stats.cached_tokens >= len(previous) // KV_BLOCK * KV_BLOCK
            assert out.stats.cached_tokens < len(prompt)  # the last prompt token is always computed
        messages.append({"role": "assistant", "content": tok.decode(out.token_ids, skip_special_tokens=True)})
        previous = prompt
    stats = cached.kv_stats()
    assert stats is not None and stats.prefix_hits > 5 * 1000 and stats.prefix_queries > stats.prefix_hits
    assert uncached.kv_stats().prefix_hits == 0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_preemption_loses_nothing(seeded: bool) -> None:
    """A pool far too small for six requests at once: requests are preempted and recomputed, every one completes,
    and each output equals the run with room for all."""
    prompts = [_prompt([{"role": "user", "content": f"{q} Then explain it to a child, step {i}."}])
               for i, q in enumerate(QUESTIONS * 2)]
    params = [SamplingParams(max_tokens=64, ignore_eos=True, **(dict(temperature=0.8, seed=i) if seeded else {}))
              for i in range(len(prompts))]
    roomy, tight = _engine(400, 6), _engine(24, 6)
    ref = run_to_completion(roomy, prompts, params)
    outs = run_to_completion(tight, prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert tight.kv_stats().preemptions > 0 and roomy.kv_stats().preemptions == 0
    assert sum(o.stats.preemptions for o in outs) == tight.kv_stats().preemptions
    assert tight.kv_stats().usage == 0 and tight.kv.slots.num_free() == 6  # every block and slot given back
    if not seeded:
        plain = run_to_completion(_engine(400, 6, draft=False), prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_four_times_the_requests_of_the_slot_layout() -> None:
    """The blocks of 2 slots x 1,024 positions (today's layout would run 2 requests) run 16 short requests at
    once, all exact."""
    slots, max_len = 2, 1024
    budget = slots * (max_len // KV_BLOCK) + 1
    engine = _engine(budget, 16)
    prompts = [_prompt([{"role": "user", "content": f"{QUESTIONS[i % 3]} ({i})"}]) for i in range(16)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    peak, outputs = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        peak = max(peak, engine.scheduler.num_running())
    assert peak >= 4 * slots
    plain = run_to_completion(_engine(budget, 16, draft=False), prompts, params)
    assert [outputs[i] for i in sorted(outputs)] == [o.token_ids for o in plain]


def test_the_newest_holder_gives_its_blocks_back() -> None:
    """An older request decoding while a newer one is still prefilling (in chunks) when blocks run out: the newer
    one is preempted, even mid-prefill, never the older; both outputs equal a roomy run, and the recompute of the
    newer one's own blocks is not counted as prefix-cache hits."""
    r = random.Random(1)
    vocab = demo()[0].engine.target.vocab_size
    first = [r.randrange(5, vocab) for _ in range(300)]
    second = [r.randrange(5, vocab) for _ in range(400)]
    long, short = SamplingParams(max_tokens=200, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)
    tight = _engine(48, 4, prefill_chunk=8)
    a = tight.add_request(first, long)
    while not tight.stats(a).generated_tokens:
        tight.step()
    b = tight.add_request(second, short)
    outs: dict[int, list[int]] = {a: [], b: []}
    while tight.has_unfinished():
        for out in tight.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert tight.stats(a).preemptions == 0 and tight.stats(b).preemptions >= 1
    assert tight.kv_stats().prefix_hits == 0  # the prompts share nothing: the recompute's own hits do not count
    ref = run_to_completion(_engine(400, 4), [first, second], [long, short])
    first_token = tight.stats(a).generated_tokens - len(outs[a])  # the prefill's token came before the loop
    assert outs[a] == ref[0].token_ids[first_token:] and outs[b] == ref[1].token_ids


def test_warm_up_requests_are_not_counted() -> None:
    engine = _engine(64, 2)
    engine.warm_up()
    stats = engine.kv_stats()
    assert (stats.prefix_queries, stats.prefix_hits, stats.preemptions) == (0, 0, 0)


def test_an_engine_without_a_draft_shares_no_prefix_with_one() -> None:
    """The benchmarks' plain twin shares the DFlash engine's pool (`plain_twin`): blocks it caches hold no draft
    rows, so the DFlash engine must not take them as a prefix (its draft would read unwritten context and accept
    less), nor the twin the DFlash engine's. A prompt run on the twin first then drafts exactly as it does alone."""
    from dflash_core.bench.offline import plain_twin

    prompt = _prompt([{"role": "system", "content": SYSTEM[:1500]}, {"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    alone = run_to_completion(_engine(400, 2), [prompt], params)[0]
    dflash = _engine(400, 2)
    twin = plain_twin(dflash)
    first = run_to_completion(twin, [prompt], params)[0]
    after = run_to_completion(dflash, [prompt], params)[0]
    again = run_to_completion(twin, [prompt], params)[0]
    assert first.token_ids == after.token_ids == alone.token_ids == again.token_ids
    assert after.stats.cached_tokens == 0 and again.stats.cached_tokens > 0  # each engine hits only its own blocks
    assert after.stats.acceptance_lengths == alone.stats.acceptance_lengths
    assert run_to_completion(dflash, [prompt], params)[0].stats.cached_tokens > 0
