"""`dflash-bench profile`: where a plain decoding step and a DFlash step spend their time on CPU, in-process.

Plain decoding and DFlash (fixed width: the full block every step) on the same target, one request at a time
(greedy, ignore_eos), after a warm-up request. First an un-profiled pass over the prompts: wall time per generated
token and per engine step, the reference. Then the first prompt once more under torch.profiler (CPU), with the
target's forward, the drafter, sampling and the detokenizer labelled: the model's operators by category (self CPU
times) and the Python time of each phase (its labelled time less the operators inside it); the rest of the step is
the engine's own (scheduler, bookkeeping). The profiler inflates its figures; their shares of the step are the
useful output. Last, the serving paths (dflash_core/bench/serving_paths.py): the same prompts in-process, through
the server's worker thread and streamed over HTTP from a dflash-serve subprocess, in alternating rounds: what
the worker hand-off and HTTP + SSE add per token, and the HTTP path's share of the in-process rate.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import environment
from dflash_core.bench.offline import encode_prompt, plain_twin
from dflash_core.bench.prefix import write_result
from dflash_core.bench.prompts import load_prompts
from dflash_core.bench.serving_paths import (
    PATHS,
    STAGES,
    compare_paths,
    one_core,
    run_alone,
    serve_args,
    serve_command,
    serving,
)
from dflash_core.cli_help import HelpFormatter

PHASES = ("target", "draft", "sampling", "detokenizer")
CATEGORIES = ("ops: matmul", "ops: attention", "ops: norms+elementwise", "ops: fused target (C)",
              "ops: fused draft (C)",
              "py: target forward", "py: draft",
              "py: sampling", "py: detokenizer", "py: engine rest")
_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::baddbmm"}
_ATTENTION = {"aten::index_select", "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_LABEL = "dflash::"
# the fused CPU steps' C calls (`dflash_core/cpu_step/`), each recorded as one operator
_FUSED = {"fused_target_step": "ops: fused target (C)", "fused_draft_step": "ops: fused draft (C)"}


def op_category(name: str) -> str:
    """An operator's category: matmul, attention (scaled dot product and the KV gathers / scatters), a fused CPU
    step's C call (`dflash_core/cpu_step/`: a whole target or draft forward) or the rest."""
    if name in _FUSED:
        return _FUSED[name]
    if name in _MATMUL:
        return "ops: matmul"
    if "scaled_dot_product" in name or name in _ATTENTION:
        return "ops: attention"
    return "ops: norms+elementwise"


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`fn` inside a profiler range named `dflash::label` (a fused step's operator: its own name)."""
    import torch

    name = label if label in _FUSED else _LABEL + label

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def _phase_labels(engine: Any) -> Iterator[None]:
    """Label the target forward, the drafter and sampling (the engine's module-level choosers) for one pass."""
    import dflash_core.engine as engine_mod
    from dflash_core.runners.drafter import DFlashDrafter
    from dflash_core.runners.native import NativeTarget

    patched = [(engine.target, "forward_batch", "target"), (engine.target, "forward_tree", "target")]
    fused = engine.target.fused_step if isinstance(engine.target, NativeTarget) else None
    if fused is not None:  # its C call as an operator of its own, inside the target's phase
        patched.append((fused, "run_kernel", "fused_target_step"))
    if engine.drafter is not None:
        patched += [(engine.drafter, "propose_scored", "draft"), (engine.drafter, "extend_context", "draft")]
        fused_draft = engine.drafter.fused_step if isinstance(engine.drafter, DFlashDrafter) else None
        if fused_draft is not None:
            patched.append((fused_draft, "run_kernel", "fused_draft_step"))
    for obj, name, label in patched:
        setattr(obj, name, _labelled(getattr(obj, name), label))  # an instance attribute over the method
    saved = {name: getattr(engine_mod, name) for name in ("step_choices", "choose_tokens")}
    for name, fn in saved.items():
        setattr(engine_mod, name, _labelled(fn, "sampling"))
    try:
        yield
    finally:
        for obj, name, _ in patched:
            delattr(obj, name)
        for name, fn in saved.items():
            setattr(engine_mod, name, fn)


def _run(engine: Any, tokenizer: Any, prompt: list[int], params: Any, label: bool = False) -> tuple[int, int]:
    """One request alone (`run_alone`), its detokenizer labelled when `label`; (tokens, steps)."""
    import torch

    scope = (lambda: torch.profiler.record_function(_LABEL + "detokenizer")) if label else contextlib.nullcontext
    _, tokens, steps = run_alone(engine, tokenizer, prompt, params, scope)
    return tokens, steps


def breakdown(prof: Any, total_us: float) -> dict[str, float]:
    """Microseconds by category of a profiled pass lasting `total_us`: operators' self CPU times by kind
    (key_averages), each labelled phase's time less the operators inside it, and the rest (the engine's own)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for avg in prof.key_averages():
        if not avg.key.startswith(_LABEL):
            out[op_category(avg.key)] += avg.self_cpu_time_total
    phase_total = dict.fromkeys(PHASES, 0.0)
    ops_in = dict.fromkeys([*PHASES, None], 0.0)
    for ev in prof.events():
        if ev.name.startswith(_LABEL):
            parent = ev.cpu_parent
            if not (parent is not None and parent.name.startswith(_LABEL)):  # outermost label only
                phase_total[ev.name[len(_LABEL):]] += ev.cpu_time_total
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(_LABEL):
            parent = parent.cpu_parent
        ops_in[None if parent is None else parent.name[len(_LABEL):]] += ev.self_cpu_time_total
    names = dict(zip(PHASES, ("py: target forward", "py: draft", "py: sampling", "py: detokenizer")))
    for phase in PHASES:
        out[names[phase]] = phase_total[phase] - ops_in[phase]
    out["py: engine rest"] = total_us - sum(phase_total.values()) - ops_in[None]
    return out


def profile_engine(engine: Any, tokenizer: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Warm-up, the timed pass and the profiled pass of one engine."""
    from torch.profiler import ProfilerActivity, profile

    _run(engine, tokenizer, prompts[0], params)
    tokens = steps = 0
    t0 = time.perf_counter()
    for p in prompts:
        n, s = _run(engine, tokenizer, p, params)
        tokens, steps = tokens + n, steps + s
    wall = time.perf_counter() - t0
    # one request: the profiler records ~10^3 operators a step, and reading them back costs far more than the run
    with _phase_labels(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        t1 = time.perf_counter()
        prof_steps = _run(engine, tokenizer, prompts[0], params, label=True)[1]
        prof_wall = time.perf_counter() - t1
    parts = breakdown(prof, prof_wall * 1e6)
    total_us = sum(parts.values())
    return {
        "output_tokens": tokens, "steps": steps, "time_s": wall, "tokens_per_s": tokens / wall,
        "ms_per_token": 1000 * wall / tokens, "ms_per_step": 1000 * wall / steps, "tokens_per_step": tokens / steps,
        "profiled": {
            "time_s": prof_wall, "steps": prof_steps,
            "ms_per_step": {k: v / 1000 / prof_steps for k, v in parts.items()},
            "share": {k: v / total_us for k, v in parts.items()},
        },
    }


def run_profile(*, target: str | None = None, draft: str | None = None, num_prompts: int = 8, max_tokens: int = 128,
                threads: int = 1, http_rounds: int = 3, serve_extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Plain decoding and fixed-width DFlash on one target, timed then profiled, then (unless `http_rounds` is 0)
    the same requests through the server's worker thread and over HTTP; the result without its header."""
    import torch

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams

    if target is not None and draft is None:
        raise BenchError("profile needs a draft (--draft) with the target")
    if http_rounds:
        serve_command()  # a missing dflash-serve is an error before the in-process part, not after it
    try:
        models = load_models(EngineConfig(target, draft, device="cpu", threads=threads, speculation="fixed",
                                          max_running_requests=8))
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(f"cannot load the models: {exc}") from None
    dflash = models.engine
    if dflash.drafter is None:
        raise BenchError("profile needs a draft with block size >= 2")
    plain = plain_twin(dflash)
    pairs = (("plain", plain), ("dflash", dflash))
    chats = load_prompts("chat", num_prompts)
    prompts = [encode_prompt(models.tokenizer, p.messages) for p in chats]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        engines = {name: profile_engine(eng, models.tokenizer, prompts, params) for name, eng in pairs}
        if http_rounds:
            args = [[*serve_args(target, draft, threads, speculative=n == "dflash"), *serve_extra] for n, _ in pairs]
            with serving(*args) as servers:
                for (name, eng), server in zip(pairs, servers):
                    engines[name]["paths"] = compare_paths(eng, models.tokenizer, name, server, chats, params,
                                                           http_rounds,
                                                           one_core(threads, serve_extra, eng.target.cpu_step))
    except ValueError as exc:  # the engine refused the prompt
        raise BenchError(f"the engine refused a request: {exc}") from None
    config = {"target": models.target_name, "draft": str(models.draft_name), "device": models.device,
              "dtype": models.dtype, "block_size": dflash.block_size, "speculation": "fixed",
              "num_prompts": num_prompts, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
              "http_rounds": http_rounds, "serve_extra": list(serve_extra)}
    return {"environment": environment(), "config": config, **engines,
            "speedup": engines["plain"]["time_s"] / engines["dflash"]["time_s"]}


def format_profile(result: dict[str, Any]) -> str:
    """The terminal table: un-profiled totals, then the profiled breakdown per engine step."""
    from dflash_core.bench.report import _table

    cfg, p, d = result["config"], result["plain"], result["dflash"]
    rows = [[name, f"{p[k]:{fmt}}", "", f"{d[k]:{fmt}}", ""] for name, k, fmt in (
        ("tok/s", "tokens_per_s", ".1f"), ("ms / token", "ms_per_token", ".3f"), ("ms / step", "ms_per_step", ".3f"),
        ("tokens / step", "tokens_per_step", ".2f"))]
    rows.append(["-- profiled pass --", "ms/step", "% step", "ms/step", "% step"])
    for cat in CATEGORIES:
        rows.append([cat, *(f"{e['profiled'][m][cat]:{f}}" for e in (p, d) for m, f in
                            (("ms_per_step", ".3f"), ("share", ".1%")))])
    rows.append(["total (profiled)", *(f"{sum(e['profiled'][m].values()):{f}}" for e in (p, d) for m, f in
                                       (("ms_per_step", ".3f"), ("share", ".1%")))])
    table = _table(["", "plain", "", f"dflash B={cfg['block_size']}", ""], rows)
    text = (f"dflash-bench profile: {cfg['target']} + {cfg['draft']} on {cfg['device']} ({cfg['threads']} threads), "
            f"{cfg['num_prompts']} prompts x {cfg['max_tokens']} tokens, one at a time, greedy, fixed width\n{table}\n"
            f"DFlash {result['speedup']:.2f}x plain (un-profiled wall time). The profiler inflates its figures: the "
            "un-profiled rows are the reference, the profiled shares show where a step goes.")
    if "paths" in p:
        text += "\n\n" + format_paths(p["paths"], d["paths"], cfg)
    return text


def format_paths(plain: dict[str, Any], dflash: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The serving table: each path's rate and share of the in-process rate, and the per-token cost of the
    worker hand-off and of HTTP + SSE (medians of the rounds' differences of adjacent paths)."""
    from dflash_core.bench.report import _table

    rows = [[path, *(f"{e[path][k]:{f}}" for e in (plain, dflash) for k, f in
                     (("tokens_per_s", ".1f"), ("ms_per_token", ".3f"), ("share_of_in_process", ".1%")))]
            for path in PATHS]
    for label, (key, _, _) in zip(("worker hand-off", "http + sse"), STAGES):
        rows.append([f"{label} (ms/token)", *(x for e in (plain, dflash) for x in ("", f"{e[key]:+.3f}", ""))])
    table = _table(["", "plain tok/s", "ms/token", "of in-process", "dflash tok/s", "ms/token", "of in-process"], rows)
    return (f"Serving paths: the same prompts from chat messages to text, one at a time, {cfg['http_rounds']} "
            "alternating rounds (medians; a path's share and what it adds: medians of its rounds' ratios and "
            f"differences); http streams from a dflash-serve subprocess with the same settings\n{table}")


def add_parser(sub: Any) -> None:
    """The `profile` mode's arguments."""
    p = sub.add_parser("profile", help="in-process: where a plain and a DFlash step spend CPU time",
                       description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    p.add_argument("--target", help="target folder or hub id (default: the bundled demo pair)")
    p.add_argument("--draft", help="DFlash draft folder or hub id (default: the demo draft)")
    p.add_argument("--prompts", type=int, default=8, help="shipped chat prompts, run one at a time")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--http-rounds", type=int, default=3,
                   help="alternating rounds of the serving paths (in-process, worker thread, HTTP from a dflash-serve "
                        "subprocess); 0 skips them")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the dflash-serve subprocesses, repeated for several (e.g. "
                        "--serve-arg=--no-one-core)")
    p.add_argument("--output-dir", type=Path, default=None, help="folder for profile.json (default: as offline)")


def main(args: argparse.Namespace, argv: Any = None) -> int:
    """Run the mode: the table, and profile.json in the output folder."""
    if min(args.prompts, args.max_tokens, args.threads) < 1 or args.http_rounds < 0:
        print("dflash-bench: error: --prompts, --max-tokens and --threads must be >= 1, --http-rounds >= 0",
              file=sys.stderr)
        return 2
    try:
        body = run_profile(target=args.target, draft=args.draft, num_prompts=args.prompts,
                           max_tokens=args.max_tokens, threads=args.threads, http_rounds=args.http_rounds,
                           serve_extra=tuple(args.serve_arg))
        path = write_result("profile", body, argv, args.output_dir)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code
    print(format_profile(body) + f"\nwrote {path}")
    return 0
