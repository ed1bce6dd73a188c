"""Host work held until the thread next waits for the device (`dflash_core/overlap.py`): it runs inside the next
forward's wait (the fused C call, the step's device-to-host copy), or before a PyTorch forward on a CPU, in order,
once, on its own thread only; the server's worker posts each step's events that way."""

from __future__ import annotations

import inspect
import logging
import threading

import pytest
import torch

from dflash_core.cpu_step.fused import CPU_STEP_ENV, FUSED_PREFILL_TOKENS
from dflash_core.llm import LLM
from dflash_core.overlap import hold, run_held
from dflash_core.sampling import SamplingParams
from dflash_core.transfer import to_host


def test_held_work_runs_in_order_once_and_only_on_its_own_thread(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[int] = []
    hold(lambda: ran.append(1))
    hold(lambda: [][0])  # a failing piece: logged, the rest still run
    hold(lambda: ran.append(2))
    other = threading.Thread(target=run_held)
    other.start()
    other.join()
    assert ran == []  # another thread's wait runs its own work only
    with caplog.at_level(logging.ERROR, logger="dflash.overlap"):
        run_held()
    assert ran == [1, 2]
    assert "held host work failed" in caplog.text
    run_held()
    assert ran == [1, 2]
    hold(lambda: ran.append(3))  # the step's copy to the host: where the host waits for a GPU
    assert to_host(torch.tensor([7])) == [7] and ran == [1, 2, 3]


@pytest.mark.parametrize(("mode", "waits"), [("fused", {"run_kernel"}), ("torch", {"_eager", "to_host"})])
def test_work_held_before_a_step_runs_inside_that_steps_wait_for_the_device(
        monkeypatch: pytest.MonkeyPatch, mode: str, waits: set[str]) -> None:
    """The demo pair, DFlash at full width: the prefill, then draft-and-verify steps; each step runs what was held
    before it from inside the first wait of its forwards (the fused draft's or target's C call), or where PyTorch
    runs them on the CPU, before the target's forward or at the copy of the draft's proposals: not after the
    step."""
    monkeypatch.setenv(CPU_STEP_ENV, mode)
    engine = LLM(device="cpu", speculative=True, speculation="fixed").engine
    assert engine.target.cpu_step == mode
    engine.add_request(list(range(5, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
    callers: list[list[str]] = []
    for step in range(4):
        hold(lambda: callers.append([frame.function for frame in inspect.stack()]))
        engine.step()
        assert len(callers) == step + 1
    assert all(waits & set(names) and "step" in names for names in callers)


def test_a_prefill_left_to_pytorch_runs_held_work_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than the fused step takes at once is prefilled by PyTorch's forward, which computes as it is
    called: what was held runs before that forward, not after it."""
    monkeypatch.setenv(CPU_STEP_ENV, "fused")
    engine = LLM(device="cpu", speculative=False, prefill_chunk=0).engine
    engine.add_request(list(range(5, 5 + FUSED_PREFILL_TOKENS + 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    callers: list[list[str]] = []
    hold(lambda: callers.append([frame.function for frame in inspect.stack()]))
    engine.step()
    assert len(callers) == 1 and "_eager" in callers[0] and "to_host" not in callers[0]
