"""Host work held until the thread next waits for the device (`dflash_core/overlap.py`): it runs inside the next
forward's wait (the fused C call, else the step's device-to-host copy), in order, once, on its own thread only;
the server's worker posts each step's events that way."""

from __future__ import annotations

import inspect
import logging
import threading

import pytest

from dflash_core.cpu_step.fused import CPU_STEP_ENV
from dflash_core.llm import LLM
from dflash_core.overlap import hold, run_held
from dflash_core.sampling import SamplingParams


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


@pytest.mark.parametrize(("mode", "wait"), [("fused", "run_kernel"), ("torch", "to_host")])
def test_work_held_before_a_step_runs_inside_that_steps_wait_for_the_device(
        monkeypatch: pytest.MonkeyPatch, mode: str, wait: str) -> None:
    """The demo pair, DFlash at full width: the prefill, then draft-and-verify steps; each step runs what was held
    before it from inside the first wait of its forwards (the fused draft's or target's C call; the copy of the
    choices to the host where PyTorch runs the forwards), not after the step."""
    monkeypatch.setenv(CPU_STEP_ENV, mode)
    engine = LLM(device="cpu", speculative=True, speculation="fixed").engine
    assert engine.target.cpu_step == mode
    engine.add_request(list(range(5, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
    callers: list[list[str]] = []
    for step in range(4):
        hold(lambda: callers.append([frame.function for frame in inspect.stack()]))
        engine.step()
        assert len(callers) == step + 1
    assert all(wait in names and "step" in names for names in callers)
