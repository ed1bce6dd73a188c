"""The static, compiled decode step (inductor on CPU) gives the eager forward's outputs: the native target's verify
step (with either attention kernel: gather + SDPA, and FlexAttention forced by DFLASH_ATTENTION=flex) and the
batched drafter's proposal, at two batch buckets and two widths, over every key bucket.

What inductor made of it is checked too: its generated code allocates no buffer the size of a cache layer (cache
writes are in place: one tensor per layer, written by `index_put_`), and after warm-up no step compiles anything
(batch, width and key length are dynamic dimensions), while the contexts grow across every key bucket.

Kept small for the suite's time: a 2-layer target and draft. Batch, width and key length are dynamic dimensions
and a bucket of 1 is padded to 2, so inductor compiles ONE graph per step function for every bucket (each bucket is
still its own shape, and on CUDA its own CUDA graph): the tests count it, with steps of one row and one token. On
CPU that graph is one layer (`--compile-scope layer`, the default there), which both layers call with their own
weights and caches: still one graph. The whole-step graph (`step`, CUDA's default: one CUDA graph a step) is
checked on CPU too.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from dflash_core.compile import StaticShapes, default_batch_sizes, key_buckets, kv_bucket, parse_sizes
from dflash_core.config import DFlash2Config, DraftConfig
from dflash_core.cpu_step.fused import CPU_STEP_ENV
from dflash_core.draft import DFlashDraft
from dflash_core.runners.base import DraftRequest
from dflash_core.runners.drafter import DFlashDrafter
from dflash_core.runners.native import NativeTarget
from dflash_core.transfer import count_transfers
from tests.helpers import make_target

BUCKETS = dict(batch_sizes=(1, 2, 4), widths=(1, 2, 4))
ALL_BUCKETS = {(2, 2), (2, 4), (4, 2), (4, 4)}  # batch 1 and width 1 run in the buckets of 2
MAX_LEN = 600  # key buckets 256, 512 and 600 (the cap: max_len)


@pytest.fixture(scope="module")
def model():
    return make_target(None, layers=2, seed=3)


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(4)
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=384, num_target_layers=2, block_size=4,
                      mask_token_id=3, max_position_embeddings=1024, target_layer_ids=[0])
    return DFlashDraft(cfg).eval()


def _graphs() -> int:
    """Graphs dynamo has compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


def _cache_sized(code: list[str], layer: torch.Tensor) -> list[str]:
    """The shapes of the buffers inductor's generated code allocates with as many elements as a cache layer or
    more (a copy of the cache; step-sized buffers have symbolic dimensions or fewer elements)."""
    big = []
    for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", "\n".join(code)):
        dims = [d.strip() for d in shape.split(",") if d.strip()]
        if all(d.isdigit() for d in dims) and math.prod(int(d) for d in dims) >= layer.numel():
            big.append(shape)
    return big


def _warm_up(runner: NativeTarget | DFlashDrafter, layer: torch.Tensor) -> None:
    """Warm-up compiles the step: ONE graph for every bucket, whose generated code copies no cache layer."""
    graphs = _graphs()
    _, code = run_and_get_code(runner.warm_up)
    assert code, "warm-up compiled nothing"
    assert _graphs() == graphs + 1, "warm-up compiled more than one graph"
    assert _cache_sized(code, layer) == [], "the compiled step copies a cache-sized buffer"


KV_BLOCK = 16
TARGET_BLOCKS = 3 * math.ceil(MAX_LEN / KV_BLOCK) + 5  # the null block, three requests' tables, four spare


def _target(model, static: StaticShapes | None = None) -> NativeTarget:
    """The target on pages sized as an engine would (not a fixed run per slot)."""
    return NativeTarget(model, [0], max_slots=4, max_len=MAX_LEN, static=static, num_blocks=TARGET_BLOCKS,
                        kv_block=KV_BLOCK)


def _verify_steps(runner: NativeTarget) -> list:
    """Prefill three requests, then verify steps of 2 and 3 rows (buckets 2 and 4) at widths 2 and 3 (2 and 4),
    and a plain step and a 2-wide verify of one row (batch 1, widths 1 and 2), each followed by a rollback, as the
    engine does; twice more after a prefill takes the contexts past 256 keys,
    then past 512 (every key bucket, up to 608: a request's whole table). The requests' blocks are shuffled ids."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.randperm(TARGET_BLOCKS - 1, generator=g) + 1).tolist()
    per = math.ceil(MAX_LEN / KV_BLOCK)
    caches = [runner.new_cache(i, ids[i * per : (i + 1) * per]) for i in range(3)]
    outs = []
    for extend in ((20, 7, 33), (250, 270, 240), (260, 240, 290)):
        for c, n in zip(caches, extend):
            runner.forward(torch.randint(4, 380, (n,), generator=g).tolist(), c.length, c, features=True,
                           last_only=True)
        for rows_n, width in [(2, 2), (3, 3), (1, 1), (2, 3), (3, 2), (1, 2), (3, 3)]:
            rows = [(torch.randint(4, 380, (width,), generator=g).tolist(), c.length, c) for c in caches[:rows_n]]
            outs.append(runner.forward_batch(rows, features=True))
            for c in caches[:rows_n]:
                runner.crop(c, c.length - 1)  # the last token rejected
    assert max(c.length for c in caches) > 512
    return outs


@pytest.mark.parametrize("scope", ["layer", "step"])
def test_verify_compiled_equals_eager(model, scope):
    eager = _verify_steps(_target(model))
    shapes = StaticShapes(**BUCKETS, compiled=True, scope=scope)
    runner = _target(model, shapes)
    _warm_up(runner, runner.k_cache[0])
    assert not runner.k_cache[0][KV_BLOCK:].any()  # warm-up wrote the null block only
    graphs = _graphs()
    with count_transfers() as counts:
        compiled = _verify_steps(runner)
    assert _graphs() == graphs  # nothing compiled after warm-up, at any key bucket
    assert counts.h2d == 21  # a static step's inputs go to the device in one copy (prefills are eager)
    assert set(shapes.calls) == ALL_BUCKETS and sum(shapes.calls.values()) == 21  # every step ran the static step
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            assert c.logits.shape == e.logits.shape and c.features.shape == e.features.shape
            assert torch.equal(c.logits.argmax(-1), e.logits.argmax(-1))
            torch.testing.assert_close(c.logits, e.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.features, e.features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton flex kernel under CUDA graphs: run on a GPU host"))])
def test_verify_with_flex_kernel_equals_eager(model, device, monkeypatch):
    """DFLASH_ATTENTION=flex (on CPU: inductor's C++ flex kernel; on CUDA the default): the compiled static step
    reads the cache through a BlockMask built outside the compiled function, once per step, and passed in. Its
    logits equal the eager forward's (gather + SDPA) across every key bucket (tables of 16, 32 and 38 blocks), and
    after warm-up nothing compiles: the mask is as wide as the cache, its batch dimension dynamic."""
    from dflash_core import flex_attention

    monkeypatch.setenv("DFLASH_ATTENTION", "flex")
    if device == "cuda":
        model = copy.deepcopy(model).to(device)
    tol = 1e-5 if device == "cpu" else 1e-4
    eager = _verify_steps(_target(model))  # no static step: every forward gathers + SDPA, whatever the setting
    built: list[bool] = []  # per mask built: was it inside a compiled region?
    real = flex_attention.paged_block_mask

    def spy(*args, **kwargs):
        built.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "paged_block_mask", spy)
    # one width bucket: the flex step compiles a graph per width (its mask's query length is a constant), and a
    # cold inductor cache takes about a minute a graph for the C++ flex kernel; batches 2 and 4 share it
    shapes = StaticShapes(batch_sizes=(2, 4), widths=(4,), compiled=True)
    runner = _target(model, shapes)
    step = runner._static_step
    assert step.kernel == "flex"
    _warm_up(runner, runner.k_cache[0])
    graphs = _graphs()
    compiled = _verify_steps(runner)
    assert _graphs() == graphs  # nothing compiled after warm-up, at any key bucket
    assert set(shapes.calls) == {(2, 4), (4, 4)} and sum(shapes.calls.values()) == 21
    plan = shapes.warm_up_plan(runner.device, step.cap, graph_per_width=True)
    # one mask per step (warm-up's too), never inside a compiled region
    assert len(built) == 2 * len(plan.keys) * plan.calls + 21 and not any(built)
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            assert torch.equal(c.logits.argmax(-1), e.logits.argmax(-1))
            torch.testing.assert_close(c.logits, e.logits, rtol=tol, atol=tol)
            torch.testing.assert_close(c.features, e.features, rtol=tol, atol=tol)


# (requests, tokens proposed, context rows accepted after it): 2 or 3 rows a step (context bucket 4), proposing 3
# or 7 tokens (block widths 4 and 8) for 2 and 3 requests (batch buckets 2 and 4); 250 or 260 rows take the
# contexts to the next key bucket (more rows than a block: the drafter writes all but the last 1..8 of them to its
# cache at once, so the proposal after them still fits a context bucket).
_DRAFT_STEPS = [(3, 3, 2), (2, 7, 3), (1, 1, 1), (1, 3, 2), (3, 7, 250), (3, 3, 2), (2, 3, 260), (3, 7, 2), (2, 3, 2),
                (3, 3, 2)]


def _proposals(model, draft, static: StaticShapes | None) -> list:
    """A batched drafter fed the same features: the prompts' (longer than a block: written to the cache before the
    first proposal, all but the last rows), then the steps of `_DRAFT_STEPS`: one request proposing one token (a
    block of 2) and a context of one row among them, padded to buckets of 2 (the one graph serves them).
    The draft's pages are the target's block-id space; the requests'
    tables are shuffled ids."""
    # a GPU's limit on held-back context rows (a block: a proposal then never writes beforehand, one copy each)
    drafter = DFlashDrafter(draft, _target(model), block_size=8, max_slots=4, max_len=MAX_LEN, static=static,
                            pending_blocks=1)
    assert drafter.pages is not None and drafter.pages.k[0].shape[0] == TARGET_BLOCKS * KV_BLOCK
    graphs = None
    if static is not None:
        _warm_up(drafter, drafter.pages.k[0])
        assert not any(t[KV_BLOCK:].any() for t in drafter.pages.k)  # warm-up wrote the null block only
        graphs = _graphs()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(3, MAX_LEN, 64, generator=g)
    ids = (torch.randperm(TARGET_BLOCKS - 1, generator=g) + 1).tolist()
    per = math.ceil(MAX_LEN / KV_BLOCK)
    states = [drafter.new_state(i, [], ids[i * per : (i + 1) * per]) for i in range(3)]
    pos = [20, 9, 31]
    for st, p in zip(states, pos):
        drafter.extend_context(st, feats[0, :p])
    outs = []
    for step, (rows_n, n, accepted) in enumerate(_DRAFT_STEPS):
        items = [DraftRequest(states[r], 5 + r + step, pos[r], n) for r in range(rows_n)]
        with count_transfers() as counts:
            outs.append(drafter.propose_scored(items))
        assert (counts.h2d, counts.d2h) == (1, 1)  # a proposal's integer inputs in one copy, its choices in one
        for r in range(rows_n):
            drafter.extend_context(states[r], feats[r, pos[r] : pos[r] + accepted])
            pos[r] += accepted
    assert max(pos) > 512
    if graphs is not None:
        assert _graphs() == graphs  # nothing compiled after warm-up, at any key bucket
    return outs


@pytest.fixture(scope="module")
def dflash2_draft(draft):
    """`draft` with DFlash 2's convolution and candidate selector, random."""
    cfg = replace(draft.cfg, dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                                   selector_top_k=4))
    torch.manual_seed(5)
    out = DFlashDraft(cfg).eval()
    out.load_state_dict(draft.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(0.1 * torch.randn(p.shape))
    return out


def test_dflash2_draft_compiled_equals_eager(model, dflash2_draft):
    """A DFlash 2 draft under the step scope: its selector walks eagerly around the compiled layer region."""
    eager = _proposals(model, dflash2_draft, None)
    shapes = StaticShapes(batch_sizes=(1, 2, 4), widths=(1, 2, 4, 8), compiled=True, scope="step")
    compiled = _proposals(model, dflash2_draft, shapes)
    assert sum(shapes.calls.values()) == len(_DRAFT_STEPS)
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            assert c.tokens == e.tokens
            assert c.confidence == pytest.approx(e.confidence, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("scope", ["layer", "step"])
def test_draft_compiled_equals_eager(model, draft, scope, monkeypatch):
    monkeypatch.setenv(CPU_STEP_ENV, "torch")  # the eager PyTorch draft (the fused CPU step: tests/test_cpu_step.py)
    eager = _proposals(model, draft, None)
    shapes = StaticShapes(batch_sizes=(1, 2, 4), widths=(1, 2, 4, 8), compiled=True, scope=scope)
    compiled = _proposals(model, draft, shapes)
    # every step ran the compiled step, the first and those after the long contexts too (their context rows were
    # written as they came: the proposal carries at most a block of them)
    assert set(shapes.calls) == {(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)}
    assert sum(shapes.calls.values()) == len(_DRAFT_STEPS)
    for e_step, c_step in zip(eager, compiled, strict=True):
        for e, c in zip(e_step, c_step, strict=True):
            assert c.tokens == e.tokens
            assert c.confidence == pytest.approx(e.confidence, rel=1e-5, abs=1e-6)


def test_buckets_and_sizes():
    assert default_batch_sizes(8) == (2, 4, 8) and default_batch_sizes(6) == (2, 4, 6)
    assert default_batch_sizes(1) == (2,)
    shapes = StaticShapes((1, 2, 8), (1, 4))  # 1 is padded to 2: a dimension of 1 would be a graph of its own
    assert shapes.batch_sizes == (2, 8) and shapes.widths == (2, 4)
    assert shapes.batch_bucket(1) == 2 and shapes.width_bucket(1) == 2 and shapes.batch_bucket(9) is None
    assert parse_sizes("16, 4,1,4", "compile_batch_sizes") == (1, 4, 16)
    with pytest.raises(ValueError, match="compile_batch_sizes"):
        parse_sizes("0,2", "compile_batch_sizes")
    assert kv_bucket(1, 10_000) == 256 and kv_bucket(257, 10_000) == 512 and kv_bucket(9000, 5000) == 5000
    assert key_buckets(601) == (256, 512, 601) and key_buckets(100) == (100,) and key_buckets(512) == (256, 512)
    assert {kv_bucket(n, 601) for n in range(1, 602)} == set(key_buckets(601))
    # warm-up: on CUDA every shape at every key bucket, three calls each (reduce-overhead records a shape on its
    # second call); elsewhere the extreme buckets once (one graph serves them all), every width for the flex kernel
    wide = StaticShapes((2, 4, 8), (2, 4, 8, 16))
    cuda = wide.warm_up_plan(torch.device("cuda"), 600)
    assert (cuda.batch_sizes, cuda.widths, cuda.keys, cuda.calls) == ((2, 4, 8), (2, 4, 8, 16), (256, 512, 600), 3)
    cpu = wide.warm_up_plan(torch.device("cpu"), 600)
    assert (cpu.batch_sizes, cpu.widths, cpu.keys, cpu.calls) == ((2, 8), (2, 16), (256,), 1)
    assert wide.warm_up_plan(torch.device("cpu"), 600, graph_per_width=True).widths == (2, 4, 8, 16)
    shapes = StaticShapes((1, 4), (1, 2, 4, 8, 16))
    assert shapes.batch_bucket(3) == 4 and shapes.batch_bucket(5) is None and shapes.width_bucket(5) == 8


def _engine(model, draft, static: bool, num_blocks: int, prefix: bool):
    """An engine over the 1-layer pair on a pool of `num_blocks` blocks; its steps compiled (`static`) or eager."""
    from dflash_core.engine import Engine

    def shapes() -> StaticShapes | None:
        return StaticShapes(batch_sizes=(1, 2, 4), widths=(1, 2, 4, 8), compiled=True) if static else None

    target = NativeTarget(model, [0], max_slots=4, max_len=MAX_LEN, static=shapes(), num_blocks=num_blocks,
                          kv_block=KV_BLOCK)
    drafter = DFlashDrafter(draft, target, block_size=8, max_slots=4, max_len=MAX_LEN, static=shapes())
    return Engine(target, drafter, speculation="fixed", enable_prefix_caching=prefix)


def test_engine_compiled_with_prefix_caching_and_preemption_equals_eager(model, draft):
    """`--compile` through the engine: six requests of ~500 tokens behind a shared 100-token prefix, greedy and
    seeded, on a pool too small for four of them at once (preemption) and with prefix caching on, give the eager
    engine's tokens (roomy pool, caching off), and nothing compiles after warm-up. The pool has the other tests'
    block count, so its compiled graphs are theirs (inductor's cache hits)."""
    from dflash_core.generate import run_to_completion
    from dflash_core.sampling import SamplingParams

    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(4, 380, (100,), generator=g).tolist()
    prompts = [prefix + torch.randint(4, 380, (400 + 7 * i,), generator=g).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **(dict(temperature=0.8, seed=i) if i % 2 else {}))
              for i in range(6)]
    eager = run_to_completion(_engine(model, draft, False, 6 * 40, prefix=False), prompts, params)
    compiled = _engine(model, draft, True, TARGET_BLOCKS, prefix=True)  # 118 blocks; a request takes ~28
    compiled.warm_up()
    graphs = _graphs()
    first = run_to_completion(compiled, prompts, params)
    again = run_to_completion(compiled, prompts, params)  # the prompts' full blocks now come from the cache
    assert _graphs() == graphs  # nothing compiled while serving
    want = [o.token_ids for o in eager]
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    stats = compiled.kv_stats()
    assert stats.preemptions > 0 and stats.prefix_hits >= 6 * 96
    assert sum(o.stats.cached_tokens for o in again) >= 6 * 96


def test_cpu_compiler_checks_run_in_the_background():
    """On CPU, start-up starts inductor's vector-set checks in threads (one per set the CPU reports) and does not
    wait for them; once they are done, inductor's own list of usable sets is what they found. Elsewhere: none."""
    from torch._inductor import cpu_vec_isa

    from dflash_core.compile import probe_cpu_compiler, wait_for_cpu_probes

    assert probe_cpu_compiler(torch.device("cuda")) == []
    threads = probe_cpu_compiler(torch.device("cpu"))
    wait_for_cpu_probes()  # what the first compiled call does: inductor never checks a set a probe is checking
    if cpu_vec_isa.x86_isa_checker():  # an x86 CPU that reports vector sets
        assert threads and all(t.name.startswith("isa-probe-") for t in threads)
    assert not any(t.is_alive() for t in threads)
    if threads:
        probed = {t.name.removeprefix("isa-probe-") for t in threads}
        assert {str(i) for i in cpu_vec_isa.valid_vec_isa_list()} <= probed
