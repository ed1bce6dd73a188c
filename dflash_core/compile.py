"""Static shapes for the decode step, and `torch.compile` of the step functions.

A decode step (a verify forward of the target, a proposal of the draft) is padded to a bucket: the batch to the
smallest batch size of `batch_sizes` that holds it, the tokens per row to the smallest of `widths`, and the keys it
attends over to a power of two (`kv_bucket`), capped at the cache's columns. A bounded set of shapes can then go
through `torch.compile`; on CUDA `mode="reduce-overhead"` records a CUDA graph per shape, so a step is one graph
replay instead of hundreds of kernel launches. Prefill (long, ragged prompts) stays eager.

The batch, width and key-length dimensions are marked dynamic (`maybe_mark_dynamic`), and no bucket is 1: dynamo
specialises a dimension of size 1 (a graph of its own for each such case of each dimension, and inductor's
decompositions branch on it), so a batch of 1 or a width of 1 is padded to 2 (`MIN_BUCKET`). Inductor then compiles
ONE graph per step function for every bucket (with the flex attention kernel, the target's step one per width
bucket: its BlockMask's query length is a constant), and a context growing past a key bucket recompiles nothing.
`--compile-cache` keeps the compiled code for the next start. The padding is cheap where compiling is the default:
on a GPU a step at batch 1 reads every weight once whether it carries 1 token or 4.

What one graph holds (`scope`, `--compile-scope`): the whole step ("step", CUDA's default: one CUDA graph replays
it), or one layer ("layer", the default elsewhere): the step runs eagerly around a compiled layer region that every
layer calls with its own weights and cache tensors as inputs (no layer index, no Python int of the step's shape),
so dynamo traces and inductor generates a layer's code once, not once per layer. On CPU, start-up also runs
inductor's check of the CPU's vector instruction sets in the background while the weights load
(`probe_cpu_compiler`).

CUDA graphs are still recorded per concrete shape, and `mode="reduce-overhead"` records a shape on its second call
(the first warms it up): so warm-up calls every (batch, width, key bucket) shape `WARM_UP_CALLS_CUDA` times on CUDA,
and elsewhere the smallest and largest (batch, width) buckets once at the smallest key bucket (`warm_up_plan`: the
first call compiles, the others check that the extremes compile nothing more; tests run every bucket).
`StepFunction` clones a compiled step's outputs on CUDA, since the next replay overwrites the graph's output memory.

Caches are written in place: a step writes its keys/values into per-layer cache tensors (graph inputs) with
`index_put_`, never into a view of a bigger tensor, which inductor would copy whole around every step.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_core.config import COMPILE_SCOPES, parse_sizes

__all__ = ["DEFAULT_WIDTHS", "StaticShapes", "StepFunction", "compile_enabled", "default_batch_sizes", "key_buckets",
           "kv_bucket", "parse_sizes", "timed_warm_up", "use_compile_cache"]

DEFAULT_WIDTHS = (1, 2, 4, 8, 16)  # the engine's verify widths (1 = a plain step, run in the bucket of 2)
MIN_KV_BUCKET = 256
RECOMPILE_LIMIT = 64  # per step function: one graph is expected; a headroom before dynamo gives up
MIN_BUCKET = 2  # the smallest batch or width bucket: dimensions of size 1 are specialised (one more graph each)
WARM_UP_CALLS_CUDA = 3  # reduce-overhead: the first call warms a shape up, the second records it, the third replays


def default_batch_sizes(max_slots: int) -> tuple[int, ...]:
    """Powers of two from MIN_BUCKET up to the slot count, and the slot count itself: 2, 4, 8 for 8 slots."""
    sizes = {max(MIN_BUCKET, max_slots)}
    b = MIN_BUCKET
    while b < max_slots:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def default_scope(device: torch.device) -> str:
    """What one compiled graph holds by default: the whole step on CUDA (one CUDA graph replays it), one layer
    elsewhere (a graph every layer reuses: inductor compiles a layer once, not once per layer)."""
    return "step" if device.type == "cuda" else "layer"


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """--compile / --no-compile, or by default: on for CUDA, off elsewhere (a CPU compile costs seconds a shape)."""
    return device.type == "cuda" if setting is None else bool(setting)


def probe_cpu_compiler(device: torch.device) -> list[threading.Thread]:
    """Start inductor's check of the CPU's vector instruction sets in background threads (CPU compile only).

    Before its first C++ kernel, inductor builds and loads a test program for each instruction set the CPU reports
    (AMX, AVX-512 VNNI, AVX-512, AVX2), one after another: about 20 s on 2 cores with an empty compile cache. Started
    when loading begins, the checks run side by side and under the weights' loading and dynamo's trace; inductor
    then finds their results cached (the checks and their results are torch's own). The first compiled call waits
    for them (`wait_for_cpu_probes`): a check still running while inductor checks the same instruction set would
    race on its compiler flags. Returns the threads started."""
    if device.type != "cpu":
        return []
    try:
        from torch._inductor import cpu_vec_isa

        reported = cpu_vec_isa.x86_isa_checker()
        isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if str(isa) and all(flag in reported for flag in str(isa).split())]
    except Exception:  # another architecture, or a torch without these internals: inductor checks as usual
        return []
    threads = [threading.Thread(target=bool, args=(isa,), name=f"isa-probe-{isa}", daemon=True) for isa in isas]
    for t in threads:
        t.start()
    _PROBES.extend(threads)
    return threads


_PROBES: list[threading.Thread] = []  # vector-set checks started by `probe_cpu_compiler`, not yet waited for


def wait_for_cpu_probes() -> None:
    """Wait for the vector-set checks `probe_cpu_compiler` started (before anything compiles)."""
    while _PROBES:
        _PROBES.pop().join()


def use_compile_cache(directory: str | None) -> None:
    """Keep inductor's on-disk caches (compiled graphs, autograd graphs) in `directory` (None: torch's default)."""
    if directory:
        os.makedirs(directory, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)


def kv_bucket(kv_len: int, cap: int) -> int:
    """Keys a step attends over: the next power of two >= kv_len (at least MIN_KV_BUCKET), at most `cap`."""
    n = MIN_KV_BUCKET
    while n < kv_len:
        n *= 2
    return min(n, cap)


def key_buckets(cap: int) -> tuple[int, ...]:
    """Every key bucket `kv_bucket` gives under `cap`: 256, 512, ... and `cap` itself."""
    sizes, n = [], MIN_KV_BUCKET
    while n < cap:
        sizes.append(n)
        n *= 2
    return (*sizes, cap)


def _bucket(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


def _ends(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({sizes[0], sizes[-1]}))


@dataclass(frozen=True)
class WarmUpPlan:
    """What a warm-up runs: every (batch, width) bucket pair of these, at each of these key buckets, `calls`
    times in a row."""

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    keys: tuple[int, ...]
    calls: int


@dataclass
class StaticShapes:
    """The buckets a runner pads its decode steps to, and whether the padded step is compiled.

    `compiled` False runs the same padded step eagerly (the reference the compiled one is tested against).
    `calls` counts the steps run per (batch bucket, width bucket): what a test or a benchmark checks ran.
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    compiled: bool = True
    mode: str | None = None  # torch.compile mode; None: "reduce-overhead" on CUDA, "default" elsewhere
    scope: str | None = None  # what one graph holds: "layer" or "step" (None: `default_scope` of the device)
    calls: Counter[tuple[int, int]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.scope not in (None, *COMPILE_SCOPES):
            raise ValueError(f"compile scope must be one of {', '.join(COMPILE_SCOPES)}, got {self.scope!r}")
        # a bucket of 1 becomes MIN_BUCKET: one graph for every bucket (see the module docstring)
        self.batch_sizes = tuple(sorted({max(MIN_BUCKET, s) for s in self.batch_sizes}))
        self.widths = tuple(sorted({max(MIN_BUCKET, s) for s in self.widths}))

    def by_layer(self, device: torch.device) -> bool:
        """Whether a compiled step is a layer region (compiled once, called by every layer) in an eager step."""
        return self.compiled and (self.scope or default_scope(device)) == "layer"

    def batch_bucket(self, b: int) -> int | None:
        return _bucket(self.batch_sizes, b)

    def width_bucket(self, n: int) -> int | None:
        return _bucket(self.widths, n)

    def warm_up_plan(self, device: torch.device, cap: int, graph_per_width: bool = False) -> WarmUpPlan:
        """The shapes a warm-up runs and how many calls each. On CUDA every (batch, width, key bucket) shape,
        `WARM_UP_CALLS_CUDA` times: a CUDA graph is recorded per concrete shape. Elsewhere one graph serves every
        shape, so the smallest and the largest batch and width buckets at the smallest key bucket, once each: the
        first call compiles, the others check the extremes reuse it (every width when the kernel compiles a graph
        per width: `graph_per_width`, the flex kernel)."""
        if self.compiled and device.type == "cuda":
            return WarmUpPlan(self.batch_sizes, self.widths, key_buckets(cap), WARM_UP_CALLS_CUDA)
        widths = self.widths if graph_per_width else _ends(self.widths)
        return WarmUpPlan(_ends(self.batch_sizes), widths, key_buckets(cap)[:1], 1)

    def wrap(
        self, fn: Callable[..., Any], device: torch.device, dynamic: dict[int, tuple[int, ...]] | None = None
    ) -> StepFunction:
        """`fn` as a step function: compiled (or not), its outputs safe to keep past the next call. `dynamic`:
        argument index -> the dimensions of that tensor argument that vary between buckets."""
        return StepFunction(fn, device, self.compiled, self.mode, dynamic or {})


class StepFunction:
    """A padded step function, compiled on first call of each shape class.

    Under CUDA graphs the outputs live in the graph's memory pool and the next replay overwrites them, so they are
    cloned before they are returned (the engine keeps a step's features for the next draft).
    """

    def __init__(
        self, fn: Callable[..., Any], device: torch.device, compiled: bool, mode: str | None,
        dynamic: dict[int, tuple[int, ...]],
    ) -> None:
        self.device = device
        self.dynamic = dynamic
        self.cuda = device.type == "cuda"
        self.compiled = compiled
        if compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            mode = mode or ("reduce-overhead" if self.cuda else "default")
            self.fn = torch.compile(fn, mode=mode, fullgraph=True)
        else:
            self.fn = fn

    def __call__(self, *args: Any) -> Any:
        if self.compiled:
            wait_for_cpu_probes()
            for i, dims in self.dynamic.items():
                if isinstance(args[i], torch.Tensor):  # an optional input may be None (the kernel's other one)
                    for d in dims:
                        torch._dynamo.maybe_mark_dynamic(args[i], d)
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
        out = self.fn(*args)
        if not (self.compiled and self.cuda):
            return out
        return tuple(None if t is None else t.clone() for t in out)


def timed_warm_up(name: str, runs: Sequence[Callable[[], Any]], log: Any, calls: int = 1) -> float:
    """Run every shape's warm-up call `calls` times in a row (compiling it; on CUDA warming up, recording and
    replaying its graph); log and return the seconds."""
    t0 = time.perf_counter()
    for run in runs:
        for _ in range(calls):
            run()
    elapsed = time.perf_counter() - t0
    log.info("%s: %d static shapes warmed up (%d call%s each) in %.1f s", name, len(runs), calls,
             "" if calls == 1 else "s", elapsed)
    return elapsed
