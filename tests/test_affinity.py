"""`--one-core`'s pinning (server/affinity.py): threads onto one core and back, and helper processes that get
the server's original cores back."""

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
            env = affinity.child_env()
            assert env is not None and env[affinity.AFFINITY_ENV] == ",".join(map(str, sorted(before)))
        assert os.sched_getaffinity(0) == os.sched_getaffinity(other[0]) == before
        assert affinity.child_env() is None  # nothing pinned any more
    finally:
        done.set()
        t.join()


def test_a_helper_started_from_a_pinned_thread_gets_the_original_cores_back() -> None:
    before = os.sched_getaffinity(0)
    code = "import os; from server import affinity; affinity.restore_in_child(); print(sorted(os.sched_getaffinity(0)))"
    with affinity.sharing_one_core([threading.get_native_id()]) as core:
        pinned = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                capture_output=True, text=True, check=True)
        restored = subprocess.run([sys.executable, "-c", code], env=affinity.child_env(), capture_output=True,
                                  text=True, check=True)
    assert pinned.stdout.strip() == str([core])  # what a child inherits from a pinned thread
    assert restored.stdout.strip() == str(sorted(before))


def test_a_pool_thread_started_by_a_pinned_thread_gets_the_original_cores_back_for_unpinned_calls() -> None:
    from concurrent.futures import ThreadPoolExecutor

    before = os.sched_getaffinity(0)
    with affinity.sharing_one_core([threading.get_native_id()]) as core, ThreadPoolExecutor(1) as pool:
        inherited = pool.submit(lambda: os.sched_getaffinity(0)).result()
        freed = pool.submit(affinity.unpinned(lambda: os.sched_getaffinity(0))).result()
    assert inherited == {core} and freed == before
