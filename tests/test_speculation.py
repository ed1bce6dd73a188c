"""The width policy (dflash_core/speculation.py) and the scheduler (dflash_core/scheduler.py), through their public
methods, plus engine runs that show a cut proposal, a zero-width (plain) step and budget sharing keep the output
exactly the target's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dflash_core.scheduler import Scheduler
from dflash_core.slots import SlotPool
from dflash_core.speculation import LinearCost, SpecState, WidthPolicy, round_width, width_set


def test_width_set_and_rounding() -> None:
    assert width_set(16) == (1, 2, 4, 8, 16)
    assert width_set(10) == (1, 2, 4, 8, 10)
    assert width_set(1) == (1,)
    assert round_width(7, width_set(16)) == 4 and round_width(16, width_set(16)) == 16 and round_width(0, (1, 2)) == 1


def test_linear_cost_fits_intercept_and_slope() -> None:
    cost = LinearCost()
    assert not cost.ready and cost(10) == 0.0
    for tokens in (1, 4, 16, 64):
        cost.add(tokens, 0.002 + 0.0001 * tokens)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0001)
    one = LinearCost()
    one.add(16, 0.01)  # one token count only: slope unknown, taken as 0
    assert one.coefficients() == (0.01, 0.0)


def measured(intercept: float, per_token: float, draft_intercept: float, draft_per_token: float) -> WidthPolicy:
    """An adaptive policy whose step costs are already measured."""
    policy = WidthPolicy(16, "adaptive")
    for tokens in (1, 8, 16, 64, 256):
        policy.costs.target.add(tokens, intercept + per_token * tokens)
        policy.costs.draft.add(tokens, draft_intercept + draft_per_token * tokens)
    return policy


def test_fixed_policy_drafts_every_request_at_the_full_block() -> None:
    policy = WidthPolicy(16, "fixed")
    states = [policy.new_state() for _ in range(3)]
    assert policy.drafting(states, [15, 15, 4]) == [15, 15, 4]
    assert policy.verify_width([[0.01] * 15, [0.9] * 15, [0.5] * 4]) == 16
    assert policy.verify_width([[0.5] * 4]) == 5  # near max_tokens: the shorter proposal, not rounded


def test_cut_where_the_draft_confidence_falls() -> None:
    """One request, verify cost that grows with tokens: the width stops where the running product of the
    draft's probabilities no longer pays for the extra rows."""
    policy = measured(0.010, 0.001, 0.005, 0.0001)
    sure = [0.99] * 15
    unsure_after_3 = [0.99, 0.99, 0.99] + [0.05] * 12
    assert policy.verify_width([sure]) == 16
    assert policy.verify_width([unsure_after_3]) == 4
    assert policy.verify_width([[0.01] * 15]) == 1  # nothing worth verifying: a plain step's width


def test_free_tokens_take_the_whole_block() -> None:
    """When extra verify rows cost nothing measurable (a launch-bound step), the whole proposal is verified."""
    policy = measured(0.010, 0.0, 0.005, 0.0)
    assert policy.verify_width([[0.3] * 15]) == 16


def test_budget_is_shared_by_the_rows() -> None:
    policy = measured(0.010, 0.0, 0.005, 0.0)
    confident = [[0.99] * 15 for _ in range(4)]
    assert policy.verify_width(confident, budget=1000) == 16
    assert policy.verify_width(confident, budget=32) == 8  # 4 rows x 8 fits 32
    assert policy.verify_width(confident, budget=5) == 1  # below 4 x 2: every row a plain step
    fixed = WidthPolicy(16, "fixed")
    assert fixed.verify_width(confident, budget=20) == 4


def test_requests_whose_drafts_do_not_pay_take_plain_steps_and_are_retried() -> None:
    """Drafting costs a forward; a request committing ~1 token per step is better off plain, a request committing
    many is not. A left-out request is re-tried after its streak, and backs off if it still does not pay."""
    policy = measured(0.010, 0.0002, 0.008, 0.0001)
    good, bad = SpecState(mean_committed=8.0), SpecState(mean_committed=1.05)
    assert policy.drafting([good, bad], [15, 15]) == [15, 0]
    assert policy.drafting([bad], [15]) == [0]  # alone it does not pay either: a zero-width step
    for _ in range(bad.retry_after):
        policy.observe(bad, drafted=False, committed=1)
    assert policy.drafting([good, bad], [15, 15])[1] > 0  # re-tried on a step that drafts anyway
    other = SpecState(mean_committed=1.05)
    assert policy.drafting([bad, other], [15, 0]) == [0, 0]  # with others, a draft forward for it alone waits
    for _ in range(3 * bad.retry_after):
        policy.observe(bad, drafted=False, committed=1)
    assert policy.drafting([bad, other], [15, 0])[0] > 0
    assert policy.drafting([bad], [15])[0] > 0  # alone it is re-tried at once
    policy.observe(bad, drafted=True, committed=1)
    assert bad.plain_streak == 0 and bad.retry_after == 8  # backs off
    assert policy.drafting([good, bad], [0, 15]) == [0, 0]  # a request with no room never drafts


def test_no_retries_where_the_step_costs_alone_rule_drafting_out() -> None:
    """A busy batch on a CPU: verify and draft costs grow with every token and a plain step of 8 is cheap per token,
    so even requests that commit 6 tokens a speculative step are better off plain; re-trying them could only find
    that out again, at every request's expense: nobody drafts, however long the plain streaks. Alone, the same
    request drafts on merit."""
    policy = measured(0.0008, 0.00012, 0.0008, 0.0001)
    states = [SpecState(mean_committed=6.0) for _ in range(8)]
    for state in states:
        for _ in range(1000):
            policy.observe(state, drafted=False, committed=1)
    assert policy.drafting(states, [15] * 8) == [0] * 8
    assert policy.drafting([SpecState(mean_committed=6.0)], [15])[0] > 0


def test_a_draft_that_did_badly_for_a_while_is_still_retried() -> None:
    """After a run of unpredictable text every speculative step committed ~1.5 tokens, which is what new requests
    start from: none drafts on merit. A request's re-try still hopes for half a block (nothing learnt lowers it),
    so once its streak has run it drafts again and can find the text predictable now."""
    policy = measured(0.010, 0.0002, 0.008, 0.0001)
    for _ in range(200):
        policy.observe(SpecState(mean_committed=1.5), drafted=True, committed=1)
    state = policy.new_state()
    assert policy.mean_committed < 1.5 and policy.drafting([state], [15]) == [0]
    for _ in range(state.retry_after):
        policy.observe(state, drafted=False, committed=1)
    assert policy.drafting([state], [15])[0] > 0


def test_draft_width_follows_what_requests_commit() -> None:
    policy = measured(0.010, 0.0, 0.001, 0.0)
    assert policy.drafting([SpecState(mean_committed=1.6)], [15]) == [3]  # twice 1.6, up to a width of 4
    assert policy.drafting([SpecState(mean_committed=9.0)], [15]) == [15]


@dataclass
class Req:
    prompt: list[int]
    prefilled: int = 0
    aborted: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> list[int]:
        return self.prompt


def _admit_by(slots: SlotPool):
    """An admission that takes one slot per request (the engine's KVManager also takes blocks)."""
    def admit(req: Req) -> bool:
        if not slots.has_free():
            return False
        slots.allocate()
        return True
    return admit


def test_scheduler_chunks_prompts_under_the_budget() -> None:
    slots = SlotPool(2)
    sched = Scheduler(_admit_by(slots), max_num_batched_tokens=40, prefill_chunk=16)
    long, short, late = Req(list(range(50))), Req(list(range(5))), Req(list(range(3)))
    for r in (long, short, late):
        sched.add(r)
    plan = sched.schedule()
    # new requests are admitted in arrival order while there is room; together they take one chunk
    assert [c.req for c in plan.prefill] == [long] and plan.prefill[0].tokens == list(range(16))
    assert plan.starting == [long]
    long.prefilled = 16
    plan = sched.schedule()
    assert [(c.req, c.start, len(c.tokens)) for c in plan.prefill] == [(long, 16, 16)]
    long.prefilled = 48
    plan = sched.schedule()  # the long prompt's tail and the short prompt share one chunk, in one forward
    assert [(c.req, c.start, len(c.tokens)) for c in plan.prefill] == [(long, 48, 2), (short, 0, 5)]
    assert plan.prefill[0].last and plan.starting == [short]
    assert list(sched.waiting) == [late]  # not admitted: no slot left
    sched.prefilled(long)
    sched.prefilled(short)
    plan = sched.schedule()
    assert plan.decode == [long, short] and plan.prefill == [] and plan.verify_budget == 40
    assert sched.num_waiting() == 1 and sched.num_running() == 2


def test_scheduler_keeps_one_token_per_running_request() -> None:
    slots = SlotPool(8)
    sched = Scheduler(_admit_by(slots), max_num_batched_tokens=10, prefill_chunk=64)
    running = [Req([1]) for _ in range(6)]
    for r in running:
        sched.add(r)
        sched.started(r)
        slots.allocate()
        sched.prefilled(r)
    new = Req(list(range(30)))
    sched.add(new)
    plan = sched.schedule()
    assert len(plan.prefill[0].tokens) == 4  # 10 - 6 running rows
    assert plan.verify_budget == 6
    running[0].aborted = True
    assert running[0] in sched.schedule().aborted


def test_scheduler_puts_a_preempted_request_first_in_line() -> None:
    slots = SlotPool(1)
    sched = Scheduler(_admit_by(slots), prefill_chunk=64)
    first, second = Req([1, 2]), Req([3, 4])
    sched.add(first)
    sched.add(second)
    assert sched.schedule().starting == [first]
    sched.prefilled(first)
    sched.preempted(first)
    slots.release(0)
    assert sched.schedule().starting == [first]  # ahead of `second`, which arrived before its preemption


# ---- the engine under the policy: output stays the target's ----

CHATS = [
    [{"role": "user", "content": "Convert 5 kilometers to meters."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is 48 plus 27?"}],
    [{"role": "user", "content": "How many minutes are in 3 hours?"}],
]
NEW = 40


@pytest.fixture(scope="module")
def demo():
    from dflash_core import LLM

    spec = LLM(device="cpu", dtype="float32", max_running_requests=4, max_num_batched_tokens=2048)
    plain = LLM(device="cpu", dtype="float32", max_running_requests=4, speculative=False)
    prompts = [spec.encode(c) for c in CHATS]
    from dflash_core import SamplingParams

    ref = [g.token_ids for g in plain.generate(prompts, SamplingParams(max_tokens=NEW))]
    return spec, prompts, ref


def run_steps(engine, prompts):
    """(outputs per prompt, every decode StepOutput) of a batched greedy run."""
    from dflash_core import SamplingParams
    from dflash_core.generate import iter_steps

    outs: dict[int, list[int]] = {}
    steps = []
    for req, step in iter_steps(engine, prompts, SamplingParams(max_tokens=NEW)):
        outs[req.index] = list(req.token_ids)
        if not step.is_prefill and step.finish_reason is None:
            steps.append(step)
    return [outs[i] for i in range(len(prompts))], steps


def seed_costs(engine, target: tuple[float, float], draft: tuple[float, float]) -> None:
    """Fill the policy's cost windows with a cost line (live steps add only a few samples)."""
    engine.policy = WidthPolicy(engine.block_size, "adaptive")
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128) * 16:
        engine.policy.costs.target.add(tokens, target[0] + target[1] * tokens)
        engine.policy.costs.draft.add(tokens, draft[0] + draft[1] * tokens)


def test_engine_cut_proposals_keep_the_output(demo) -> None:
    """Verify rows that cost a lot per token: the policy cuts proposals (narrower than the block) and the output
    is still exactly plain decoding's."""
    llm, prompts, ref = demo
    seed_costs(llm.engine, (0.002, 0.001), (0.0001, 0.0))  # 16 rows cost 3x 4 rows
    outs, steps = run_steps(llm.engine, prompts[:1])
    assert outs == ref[:1]
    widths = {s.verify_width for s in steps}
    assert any(1 < w < 16 for w in widths), widths
    assert all(s.num_draft_tokens == s.verify_width - 1 for s in steps)


def test_engine_zero_width_steps_keep_the_output(demo) -> None:
    """A draft that costs far more than it saves: requests take plain steps (no draft tokens, width 1), are
    re-tried now and then, and the output is still exactly plain decoding's."""
    llm, prompts, ref = demo
    seed_costs(llm.engine, (0.001, 0.0), (10.0, 0.0))
    outs, steps = run_steps(llm.engine, prompts)
    assert outs == ref
    plain_steps = [s for s in steps if s.num_draft_tokens == 0]
    assert plain_steps and all(s.verify_width == 1 and s.acceptance_length == 1 for s in plain_steps)
    assert len(plain_steps) > len(steps) // 2


def test_engine_budget_is_shared_across_requests(demo, monkeypatch) -> None:
    """A step budget of 20 tokens for 4 requests: every verify forward's rows x its width stays within what the
    budget leaves (20 minus the step's prefill tokens, at least a row each), rows are cut to width 4 while four
    run, and the output is still exactly plain decoding's."""
    llm, prompts, ref = demo
    engine = llm.engine
    engine.policy = WidthPolicy(engine.block_size, "fixed")
    engine.scheduler.max_num_batched_tokens = 20
    # the configured chunk, not one sized from measured step times: which requests decode together, and so the
    # widths, must not depend on the machine's load
    monkeypatch.setattr(engine, "_prefill_room", lambda: None)
    verifies: list[tuple[int, int]] = []  # (rows, width) of every verify forward
    forward = engine.target.forward_batch

    def recorded(rows, features, last_only=False):  # noqa: ANN001, ANN202
        if not last_only:  # a verify (prefill chunks ask for the last row only)
            verifies.append((len(rows), max(len(r[0]) for r in rows)))
        return forward(rows, features, last_only)

    monkeypatch.setattr(engine.target, "forward_batch", recorded)
    try:
        outs, steps = run_steps(engine, prompts)
    finally:
        engine.scheduler.max_num_batched_tokens = 2048
    assert outs == ref
    assert verifies and all(rows * width <= 20 for rows, width in verifies), verifies
    assert (4, 4) in verifies  # four rows at once: cut from the block of 16 to 4
    assert all(s.num_draft_tokens == s.verify_width - 1 for s in steps)


def test_token_uniforms_on_the_device_equal_the_host_draws() -> None:
    """Every step draws its noise on the device, in int64 tensors: bit for bit the host's plain-int hash."""
    import random

    import torch

    from dflash_core.sampling import token_uniform, token_uniforms

    rng = random.Random(7)
    seeds = [0, 1, (1 << 63) - 1, (1 << 64) - 1] + [rng.getrandbits(64) for _ in range(20)]
    for first in (0, 17, 1 << 20, 1 << 40):
        positions = [first + i for i in range(len(seeds))]
        signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], dtype=torch.int64)
        got = token_uniforms(signed, torch.tensor(positions), 64).tolist()
        for row, (seed, position) in enumerate(zip(seeds, positions)):
            assert got[row] == [token_uniform(seed, position, t) for t in range(64)], (seed, position)


def test_estimated_speedup_agrees_with_the_benchmark() -> None:
    """The engine's speedup estimate (the `dflash_spec_decode_estimated_speedup` gauge) against what
    `dflash-bench offline` measures on the same run (plain and DFlash interleaved prompt by prompt): within a
    factor of 2 either way. The estimate comes from the engine's own step-cost measurements, the benchmark's
    figure from wall time, and this 2-core machine's timings are noisy, hence the wide tolerance."""
    from dflash_core.bench.offline import run_offline
    from dflash_core.bench.prompts import load_prompts

    result = run_offline(load_prompts("all", 4), max_tokens=48, device="cpu", dtype="float32", progress=False)
    s = result["summary"]
    assert s["identical_outputs"] == 4 and s["estimated_speedup"] is not None
    assert 0.5 <= s["estimated_speedup"] / s["decode_speedup"] <= 2.0, (s["estimated_speedup"], s["decode_speedup"])


def test_settings_reach_the_engine() -> None:
    """EngineConfig's speculation policy, step budget and prefill chunk are the loaded engine's."""
    from dflash_core import LLM

    llm = LLM(device="cpu", dtype="float32", speculation="fixed", max_num_batched_tokens=300, prefill_chunk=64)
    assert llm.engine.policy.policy == "fixed"
    assert llm.engine.scheduler.max_num_batched_tokens == 300 and llm.engine.scheduler.prefill_chunk == 64
    assert LLM(device="cpu", dtype="float32").engine.policy.policy == "adaptive"
    assert LLM(device="cpu", dtype="float32", prefill_chunk=0).engine.scheduler.prefill_chunk is None


def test_calibration_follows_what_the_target_accepts() -> None:
    """A draft that is right more often than its probabilities say gets its gains scaled up (and so wider
    rows); one that is right less often, scaled down."""
    from dflash_core.speculation import expected_accepted

    assert expected_accepted([0.5, 0.5]) == [0.5, 0.75]
    under = measured(0.010, 0.0005, 0.005, 0.0)
    over = measured(0.010, 0.0005, 0.005, 0.0)
    conf = [0.7] * 15
    for _ in range(50):
        under.calibrate(conf[:7], 7)  # the target accepted all 7, the draft expected about 2
        over.calibrate(conf[:7], 0)
    assert under.calibration > 2.0 and over.calibration == 0.25
    assert under.verify_width([conf]) > over.verify_width([conf])


def test_ragged_rows_get_their_own_widths_within_the_budget() -> None:
    """A target that runs each row's own tokens (no padding): a confident proposal is verified far, a doubtful
    one is cut short or not verified at all, and the budget bounds the sum of the rows' tokens."""
    policy = WidthPolicy(16, "adaptive", padded=False)
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        policy.costs.target.add(tokens, 0.010 + 0.0005 * tokens)
        policy.costs.draft.add(tokens, 0.005)
    sure, doubtful = [0.98] * 15, [0.3] * 15
    keep = policy.widths([sure, doubtful, []])
    assert keep[0] == 15 and keep[1] < 3 and keep[2] == 0
    assert all(k + 1 in width_set(16) for k in keep)
    capped = policy.widths([sure, sure], budget=12)  # 2 rows: at most 10 draft tokens between them
    assert sum(capped) + 2 <= 12 and capped[0] > 0
    padded = WidthPolicy(16, "adaptive", padded=True)
    padded.costs = policy.costs
    assert len(set(padded.widths([sure, doubtful]))) == 1  # padded rows share one width


def test_warm_up_measures_costs_and_leaves_nothing_behind(demo) -> None:
    """`Engine.warm_up` (run by the server before serving): the policy has measured costs, the dummy requests
    are gone, their slots free, and the policy's per-request history starts fresh."""
    llm, prompts, ref = demo
    engine = llm.engine
    engine.warm_up()
    assert engine.policy.costs.target.ready and engine.policy.costs.draft.ready
    assert engine.num_running() == 0 and engine.kv.slots.num_free() == engine.kv.slots.capacity
    assert engine.policy.mean_committed == (engine.block_size + 1) / 2 and engine.policy.calibration == 1.0
    outs, _ = run_steps(engine, prompts)
    assert outs == ref
