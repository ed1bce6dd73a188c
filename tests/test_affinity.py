"""`--one-core`'s pinning (server/affinity.py): threads onto one core and back, and the threads and processes
that pinned threads start, which get the server's original cores back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from server import affinity

pytestmark = pytest.mark.skipif(not affinity.supported(), reason="thread affinity needs Linux and more than one core")


def test_sharing_one_core_pins_the_threads_and_gives_their_cores_back() -> None:
    before = os.sched_getaffinity(0)
    parked = threading.Event()
    done = threading.Event()
    other: list[int] = []

    def park() -> None:
        other.append(threading.get_native_id())
        parked.set()
        done.wait(10)

    t = threading.Thread(target=park)
    t.start()
    parked.wait(10)
    try:
        with affinity.sharing_one_core([threading.get_native_id(), other[0]]) as core:
            assert core in before
            assert os.sched_getaffinity(0) == os.sched_getaffinity(other[0]) == {core}
        assert os.sched_getaffinity(0) == os.sched_getaffinity(other[0]) == before
    finally:
        done.set()
        t.join()


def test_a_process_started_while_spawning_runs_on_every_core_and_the_thread_stays_pinned() -> None:
    before = os.sched_getaffinity(0)
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with affinity.sharing_one_core([threading.get_native_id()]) as core:
        pinned = subprocess.run(show, capture_output=True, text=True, check=True)
        with affinity.spawning():
            free = subprocess.run(show, capture_output=True, text=True, check=True)
        assert os.sched_getaffinity(0) == {core}
    assert pinned.stdout.strip() == str([core])  # what a child inherits from a pinned thread
    assert free.stdout.strip() == str(sorted(before))


def test_a_pool_thread_started_by_a_pinned_thread_gets_the_original_cores_back_for_unpinned_calls() -> None:
    from concurrent.futures import ThreadPoolExecutor

    before = os.sched_getaffinity(0)
    with affinity.sharing_one_core([threading.get_native_id()]) as core, ThreadPoolExecutor(1) as pool:
        inherited = pool.submit(lambda: os.sched_getaffinity(0)).result()
        freed = pool.submit(affinity.unpinned(lambda: os.sched_getaffinity(0))).result()
    assert inherited == {core} and freed == before


def test_one_core_is_the_default_only_where_pytorch_runs_a_cpu_forward_on_one_thread() -> None:
    """The fused CPU step's C call releases the GIL for the whole forward: the event loop then works on another
    core meanwhile, so it does not share the worker's."""
    assert affinity.default_on("cpu", 1, "torch")
    assert not affinity.default_on("cpu", 1, "fused")
    assert not affinity.default_on("cpu", 2, "torch")
    assert not affinity.default_on("cuda", 1, "torch")


def test_a_thread_released_after_a_pin_is_back_on_every_core() -> None:
    before = os.sched_getaffinity(0)
    affinity.pin_current_thread(affinity.choose_core())
    assert os.sched_getaffinity(0) != before
    affinity.release_current_thread()
    assert os.sched_getaffinity(0) == before
