"""Host <-> device transfers of a decode step's choice (issue 23, findings 5 and 9).

What is counted: the transfers made through `dflash_core.transfer` (`HostToDevice.send`, `to_host`) inside
`verify.step_choices`, the part of a decode step that turns the verify rows' logits into the target's choices (the
processors: grammar bitmasks, min_tokens, logit_bias, penalties; then the batched sampling). Per call it must make
exactly ONE device-to-host transfer (all choices of the step) and at most ONE host-to-device copy (every request's
processor inputs and sampling parameters together), and no other copy to the device: no `torch.tensor` /
`torch.as_tensor` / `Tensor.to(device)` inside it (on CPU a copy cannot be observed, so these calls are what is
counted). The runners' own inputs (token ids, positions, slots) are outside `step_choices` and not counted here.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from dflash_core import engine as engine_module
from dflash_core.generate import run_to_completion
from dflash_core.grammar import StructuredOutput
from dflash_core.processors import build_processor
from dflash_core.sampling import Block, SamplingParams, choose_step, choose_token_tensor
from dflash_core.transfer import HostToDevice, count_transfers, to_host
from tests.demo_engines import accepted_drafts, demo, prompts

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@contextmanager
def uncounted_copies(every_to: bool = True) -> Iterator[list[str]]:
    """Calls that would copy host data to a device outside `dflash_core.transfer` (torch.tensor, as_tensor,
    Tensor.to with a device), while the block runs. `every_to` False: only a `Tensor.to` that changes the tensor's
    device (code we do not own, such as a rotary module's `inv_freq.to(x.device)`, moves nothing)."""
    calls: list[str] = []
    tensor, as_tensor, to = torch.tensor, torch.as_tensor, torch.Tensor.to

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    def to_device(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = to(self, *args, **kwargs)
        if every_to and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)):
            calls.append("Tensor.to(device)")
        elif out.device != self.device:
            calls.append(f"Tensor.to({out.device})")
        return out

    torch.tensor, torch.as_tensor = counted("torch.tensor", tensor), counted("torch.as_tensor", as_tensor)
    torch.Tensor.to = to_device  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        torch.tensor, torch.as_tensor, torch.Tensor.to = tensor, as_tensor, to  # type: ignore[method-assign]


def counted_choices(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, list[str]]]:
    """Each step's `step_choices` call's (rows, h2d, d2h, uncounted copies), recorded while the test runs."""
    seen: list[tuple[int, int, int, list[str]]] = []
    original = engine_module.step_choices

    def choices(*args: Any) -> Any:
        with count_transfers() as counts, uncounted_copies() as copies:
            result = original(*args)
        rows = sum(len(r) for r in result if isinstance(r, list))
        seen.append((rows, counts.h2d, counts.d2h, copies))
        return result

    monkeypatch.setattr(engine_module, "step_choices", choices)
    return seen


CASES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=7),
    "controls": dict(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                     logit_bias={5: 2.0, 9: -100.0}, min_tokens=4),
    "grammar": dict(temperature=0.0, structured=StructuredOutput("json_schema", SCHEMA)),
}


@pytest.mark.parametrize("case", [*CASES, "all at once"])
@pytest.mark.parametrize("speculative", [True, False])
def test_a_decode_step_makes_one_transfer_each_way(case: str, speculative: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    models, plain = demo()
    engine = models.engine if speculative else plain
    seen = counted_choices(monkeypatch)
    if case == "all at once":  # one step holds every kind of request
        params = [SamplingParams(max_tokens=10, **kw) for kw in CASES.values()]
        asked = [prompts()[i % len(prompts())] for i in range(len(params))]
    else:
        params, asked = [SamplingParams(max_tokens=10, **CASES[case])], [prompts()[1]]
    outs = run_to_completion(engine, asked, params)
    assert all(o.error is None for o in outs)
    assert seen and all(rows for rows, *_ in seen)
    for rows, h2d, d2h, copies in seen:
        assert d2h == 1, (case, rows, d2h)  # every choice of the step in one transfer
        assert h2d == (0 if case == "greedy" else 1), (case, rows, h2d)  # greedy without controls sends nothing
        assert copies == [], (case, copies)
    if speculative:
        assert max(rows for rows, *_ in seen) > len(outs)  # verify rows really ran (several per request)
        assert accepted_drafts(outs) > 0 or case != "greedy"


def test_a_rejection_sampling_step_makes_one_transfer_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `--spec-sampling rejection` the draft tokens travel with the step's other inputs: still one copy each
    way, and drawn drafts were accepted."""
    models, _ = demo()
    engine = models.engine
    monkeypatch.setattr(engine, "spec_sampling", "rejection")
    seen = counted_choices(monkeypatch)
    params = [SamplingParams(max_tokens=10, **CASES["sampled"]), SamplingParams(max_tokens=10, temperature=1.0, seed=5)]
    outs = run_to_completion(engine, prompts()[1:3], params)
    assert all(o.error is None for o in outs) and seen
    assert all((d2h, h2d, copies) == (1, 1, []) for _, h2d, d2h, copies in seen), seen
    assert accepted_drafts(outs) > 0


def test_the_step_sends_through_one_staging_buffer() -> None:
    """`HostToDevice` packs every array into one copy, keeps its buffers (grown, never shrunk), returns views."""
    staging = HostToDevice("cpu")
    with count_transfers() as counts:
        a, b, c, d = staging.send([[1, 2, 3], [4, 5, 6]], [7], 8, torch.tensor([[9], [10]], dtype=torch.int32))
        assert counts.h2d == 1 and counts.d2h == 0
        assert a.tolist() == [[1, 2, 3], [4, 5, 6]] and b.tolist() == [7] and c.item() == 8
        assert d.tolist() == [[9], [10]] and a.dtype == d.dtype == torch.int64
        big = staging._device
        (e,) = staging.send(list(range(1000)))
        assert e.tolist() == list(range(1000)) and staging._device.numel() >= 1000 > big.numel()
        grown = staging._device
        (f,) = staging.send([1, 2])
        assert staging._device is grown and f.data_ptr() == grown.data_ptr()  # kept, not shrunk
        assert to_host(f) == [1, 2]
        assert staging.send([]) and counts.h2d == 3  # nothing to copy: no transfer
    assert (counts.h2d, counts.d2h) == (3, 1)


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 1e-6, 0.3, 1.0, 1.7]), top_p=rng.choice([1.0, 0.9, 0.5, 0.05]),
        top_k=rng.choice([0, -1, 1, 3, 40, 1000]), min_p=rng.choice([0.0, 0.1, 0.5]),
        presence_penalty=rng.choice([0.0, 1.0]), frequency_penalty=rng.choice([0.0, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.5]), logit_bias=rng.choice([{}, {3: 5.0, 4: -100.0}]),
        min_tokens=rng.choice([0, 3]))


def test_batched_sampling_equals_per_request_sampling() -> None:
    """Property: over random parameters, logits (ties included) and histories, one `choose_step` for many requests
    gives each request exactly the tokens of its own processing and `choose_token_tensor`, one request at a time."""
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    for trial in range(150):
        vocab = rng.choice([7, 64, 300])
        blocks, expected = [], []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 5)
            logits = torch.randn(n, vocab, generator=g) * rng.choice([0.5, 2.0, 6.0])
            if rng.random() < 0.3:
                logits = torch.randint(-3, 4, (n, vocab), generator=g).float()  # ties, also at the k-th value
            params = random_params(rng)
            seed, first = rng.getrandbits(64), rng.randint(0, 500)
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            draft = [rng.randrange(vocab) for _ in range(n - 1)]
            prompt = [rng.randrange(vocab) for _ in range(4)]
            processor = build_processor(params, prompt, {0, 1}, vocab)
            alone = build_processor(params, prompt, {0, 1}, vocab)
            processed = logits if alone is None else alone.apply(logits, output, draft)
            expected.append(choose_token_tensor(processed, params, seed, first).tolist())
            blocks.append(Block(logits, params, seed, first, processor, output, draft))
        with count_transfers() as counts:
            got = choose_step(blocks)
        assert got == expected, trial
        assert counts.d2h == 1 and counts.h2d <= 1


class Failing:
    """A processor whose device half raises (inputs fine): only its request fails."""

    def inputs(self, logits: torch.Tensor, output: Any, draft: Any) -> list:
        return [[1, 2]]

    def apply_inputs(self, logits: torch.Tensor, output: Any, draft: Any, sent: Any) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_failing_request_is_confined() -> None:
    g = torch.Generator().manual_seed(1)
    sampled = SamplingParams(temperature=1.0, top_p=0.8)
    logits = [torch.randn(3, 50, generator=g) for _ in range(3)]
    blocks = [Block(logits[0], sampled, 11, 5), Block(logits[1], sampled, 12, 9, Failing()), None,
              Block(logits[2], SamplingParams(), 0, 0)]
    got = choose_step(blocks)
    assert got[0] == choose_token_tensor(logits[0], sampled, 11, 5).tolist()
    assert isinstance(got[1], RuntimeError) and got[2] == []
    assert got[3] == logits[2].argmax(-1).tolist()


def test_grammar_masks_travel_as_packed_bitmasks() -> None:
    """A block's masks become llguidance's / xgrammar's int32 bitmask (bit j of word w is token 32 w + j; an
    unconstrained row all ones), read on the device as int64 words and unpacked by shift / and."""
    from dflash_core.grammar import pack_masks, unpack_masks

    g = torch.Generator().manual_seed(2)
    vocab = 1000
    masks = [torch.rand(vocab, generator=g) < 0.3, None, torch.rand(vocab, generator=g) < 0.9]
    packed = pack_masks(masks, vocab)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2 * ((vocab + 63) // 64))
    words = packed[0].tolist()
    assert [bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)] == masks[0].tolist()
    unpacked = unpack_masks(packed.view(torch.int64), vocab)
    assert unpacked[0].tolist() == masks[0].tolist() and unpacked[1].all() and unpacked[2].tolist() == masks[2].tolist()
