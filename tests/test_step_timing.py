"""Step costs are the device's time (`dflash_core/timing.py`): a forward returns as soon as its kernels are queued,
and the device time shows up where the host waits for the results. A fake device that queues work (its results'
host transfer is where the time goes) must still be seen at its real cost by the width policy and the decode pace.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from dflash_core.config import EngineConfig
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.runners.base import PerRequestDrafter, TargetOutput
from dflash_core.sampling import SamplingParams
from dflash_core.timing import CudaTimer, DeviceTimer, HostTimer, StepClock, device_timer
from tests.helpers import make_tiny_pair

DEVICE_S = 0.03  # what the fake device takes for each piece of work a host waits for


class QueuedResult(torch.Tensor):
    """A result of a device that queues work: computed "in the background", so reading it on the host (the
    step's `.tolist()`) waits DEVICE_S."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.tolist, torch.Tensor.item):
            time.sleep(DEVICE_S)
        return super().__torch_function__(func, types, args, kwargs or {})


class QueueingTarget:
    """A target runner whose forward returns at once, its logits on the queueing device."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, rows: Any, features: bool, last_only: bool = False) -> list[TargetOutput]:
        outs = self.inner.forward_batch(rows, features, last_only)
        return [TargetOutput(o.logits.as_subclass(QueuedResult), o.features) for o in outs]


class WrongDrafter(PerRequestDrafter):
    """Proposes token 1 always: mostly rejected, which changes the speed only."""

    block_size = 4

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> None:
        return None

    def extend_context(self, state: Any, features: torch.Tensor) -> None:
        pass

    def propose(self, state: Any, last_token: int, position: int, n: int) -> list[int]:
        return [1] * n


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Any:
    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("timing"), arch="llama")
    config = EngineConfig(str(target_dir), None, backend="native", device="cpu", dtype="float32")
    return load_models(config).engine.target


def run(engine: Engine, prompt: list[int], n: int) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while engine.is_running(rid):
        for step in engine.step():
            out.extend(step.new_token_ids)
    return out


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_the_policy_sees_what_the_device_takes(target: Any, speculative: bool) -> None:
    """Every prefill, verify and plain step's cost sample includes the device time that only the host's wait for
    the results shows; so do the decode pace (the prefill room, the speedup gauge) and the policy's plain step.
    The output is the unwrapped target's."""
    prompt = list(range(5, 17))
    drafter = WrongDrafter() if speculative else None
    reference = run(Engine(target, drafter, eos_token_ids=[]), prompt, 12)
    engine = Engine(QueueingTarget(target), drafter, eos_token_ids=[])
    assert run(engine, prompt, 12) == reference
    samples = [seconds for _, seconds in engine.policy.costs.target.samples]
    assert len(samples) >= 4
    assert min(samples) >= DEVICE_S, samples  # host clocks read before the sync see a few milliseconds
    assert engine.policy.costs.plain_step(1) >= DEVICE_S
    assert engine.pace.decode_seconds is not None and engine.pace.decode_seconds >= DEVICE_S


class LateTimer(DeviceTimer):
    """A device whose spans finish only when the test says so (CUDA events not yet reached)."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.n = 0

    def start(self) -> int:
        self.n += 1
        return self.n

    def stop(self, mark: int) -> int:
        return mark

    def seconds(self, span: int) -> float | None:
        return 0.5 if span in self.done else None


def test_a_span_is_read_at_the_first_sync_after_the_device_finished_it() -> None:
    timer = LateTimer()
    clock = StepClock(timer)
    got: list[tuple[str, float]] = []
    first = clock.stop(clock.start(), lambda s: got.append(("first", s)))
    clock.stop(clock.start(), lambda s: got.append(("second", s)))
    clock.synced()
    assert got == []  # nothing finished: nothing read, nothing waited for
    timer.done.add(first)
    clock.synced()
    assert got == [("first", 0.5)]
    timer.done.add(first + 1)
    clock.synced()
    clock.synced()
    assert got == [("first", 0.5), ("second", 0.5)]  # each once


def test_host_timer_spans_end_at_the_sync() -> None:
    now = [10.0]
    timer = HostTimer(clock=lambda: now[0])
    span = timer.stop(timer.start())
    now[0] = 10.5  # the host waits for the device here
    assert timer.seconds(span) is None
    timer.synced()
    now[0] = 99.0
    assert timer.seconds(span) == 0.5
    assert isinstance(device_timer("cpu"), HostTimer) and isinstance(device_timer(None), HostTimer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_the_kernels_not_their_launch() -> None:
    """On CUDA the span is stopped right after the kernels are queued; read after the sync it has their time."""
    assert isinstance(device_timer("cuda"), CudaTimer)
    clock = StepClock(device_timer("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()  # warm
    got: list[float] = []
    t0 = time.perf_counter()
    mark = clock.start()
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    clock.stop(mark, got.append)
    launched = time.perf_counter() - t0
    a.sum().tolist()  # the step's sync
    synced = time.perf_counter() - t0
    clock.synced()
    assert len(got) == 1
    assert got[0] > 2 * launched and got[0] <= synced * 1.05 + 1e-3, (got, launched, synced)
