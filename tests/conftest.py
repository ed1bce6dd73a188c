"""Test-wide settings: one compute thread per process, and the ``slow`` marker on the heavy tests.

The suite runs a pytest process beside server subprocesses on 2 cores; several OpenMP pools spinning on the same
cores make tiny-model forwards many times slower than one thread each.

``make test`` (CI) runs everything. ``make test-fast`` (``pytest -m "not slow"``) runs the core engine and server
tests and needs only the ``dev`` extra: the files and tests below are marked ``slow`` here, in one place, because
they need a heavy tool or package (Ray, kubectl, hadolint, scipy, matplotlib, Prometheus, mkdocs) or minutes of
CPU (training, torch.compile, benchmarks, two model servers side by side). A test file may also mark a test itself
with ``@pytest.mark.slow``.
"""

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
SLOW_FILES = {
    "test_ray_serve.py": "a local Ray cluster (the ray extra)",
    "test_k8s.py": "kubectl and kubernetes-validate render and check the manifests",
    "test_containers.py": "hadolint, shellcheck and the lock's package metadata",
    "test_compile.py": "torch.compile builds C++ kernels",
    "test_train.py": "dflash-train runs",
    "test_train_families.py": "dflash-train on every model family",
    "test_train_learns.py": "a training run long enough to learn",
    "test_bench.py": "dflash-bench runs, a server and plots (matplotlib)",
    "test_gpu_check.py": "plots (matplotlib)",
    "test_prometheus_e2e.py": "a Prometheus server scraping a model server",
    "test_docs_site.py": "mkdocs build (the docs extra)",
    "test_server_e2e.py": "two model servers side by side",
    "test_structured_e2e.py": "two demo-pair servers side by side",
    "test_tool_choice_e2e.py": "two demo-pair servers side by side",
    "test_demo_quality.py": "the demo pair's acceptance on both backends and two servers",
    "test_bf16.py": "the demo pair in bfloat16 on held-out prompts",
    "test_demo_server.py": "the default command serving the demo pair",
    "test_startup.py": "dflash-serve processes started to fail or to log",
    "test_shutdown.py": "gated server processes drained by SIGTERM",
    "test_connections.py": "a server process and connection floods",
    "test_backends_matrix.py": "every family x backend x block size (test_engine.py keeps three families fast)",
    "test_adapt.py": "a server adapting its draft: dflash-train in a child process, two drafts measured",
    "test_draft_swap_server.py": "a gated server process whose draft is swapped under load",
    "test_quant_gptq_awq.py": "GPTQModel (a cached side venv) writes the checkpoints and runs transformers' reference",
}
SLOW_TESTS = {
    "test_sampling_reference.py::test_accepted_tokens_follow_the_exact_target_law": "scipy's chi-square test",
    "test_speculation.py::test_estimated_speedup_agrees_with_the_benchmark": "a dflash-bench offline run",
    "test_memory_budget.py::test_serve_logs_the_budget_and_refuses_in_one_line": "dflash-serve processes",
    "test_logs.py::test_server_log_json_is_one_json_object_per_line": "a server process",
    "test_hybrid.py::test_dflash_serve_runs_a_hybrid_target_natively": "a server process",
    "test_server_hardening.py::test_megabytes_of_message_cost_neither_time_nor_memory": "a 7.65 MB message",
    "test_traffic.py::test_dflash_train_continues_a_draft_on_recorded_traffic": "dflash-train runs and evaluations",
    "test_traffic.py::test_an_unwritable_folder_stops_start_up_in_one_line": "a server process",
}
# ``core``: the engine's exactness on the hf, native and hybrid runners, the draft, compile and sampling, run by
# CI's short job on the GPU host's software (``.ci/core_torch211.sh``: torch 2.11, transformers 5.17, Python 3.12);
# a test of these files listed in SLOW_TESTS is left out.
CORE_FILES = ("test_engine.py", "test_native.py", "test_hybrid.py", "test_draft.py", "test_draft_device.py",
              "test_exactness.py", "test_compile.py", "test_sampling_reference.py", "test_step_timing.py",
              "test_quant.py", "test_quant_mxfp4.py")


@pytest.fixture(autouse=True)
def _test_thread_on_every_core() -> Iterator[None]:
    """An in-process server (`--one-core` is its default on a CPU running PyTorch's forward) pins the thread that ran
    its event loop, often this one: after each test it goes back on every core, or the rest of the session, and
    every process it starts, would share one core. Host work a failed test left held on it is run (and dropped)."""
    yield
    from dflash_core.overlap import run_held
    from server import affinity

    affinity.release_current_thread()
    run_held()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "core: the core tests CI also runs on torch 2.11 (tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the heavy files and tests ``slow``; a name listed here that no longer exists is an error."""
    for name in SLOW_FILES:
        if not (TESTS / name).is_file():
            raise pytest.UsageError(f"tests/conftest.py marks {name} slow, but there is no such file")
    for item in items:
        path = Path(str(item.path))
        if path.parent != TESTS:
            continue
        test_id = f"{path.name}::{item.name.split('[')[0]}"
        if path.name in SLOW_FILES or test_id in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if path.name in CORE_FILES and test_id not in SLOW_TESTS:
            item.add_marker(pytest.mark.core)
    collected = {f"{Path(str(i.path)).name}::{i.name.split('[')[0]}" for i in items}
    full_run = not config.args or config.args == [str(TESTS)] or config.args == ["tests"]
    missing = [t for t in SLOW_TESTS if t.split("::")[0] not in SLOW_FILES and t not in collected]
    if full_run and not config.option.keyword and missing:
        raise pytest.UsageError(f"tests/conftest.py marks tests slow that were not collected: {missing}")
