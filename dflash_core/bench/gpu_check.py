"""`dflash-bench gpu-check`: the one-command GPU readiness check (`scripts/gpu_check.sh` runs it).

On a CUDA machine: a test subset on the card (tests whose device is `auto` run on CUDA), then a synthetic benchmark
with random-weight bf16 targets shaped like Qwen3-8B and Qwen3.5-9B (nothing downloaded): ms per plain step (one
token a row), per verify step at widths 4, 8 and 16, and per draft step (a z-lab-shaped 5-layer draft proposing
15 tokens), at batch 1, 4, 16 and 32, eager and compiled (static shapes, CUDA graphs), and the peak memory. It
reports the physical anchors: the compiled plain step at batch 1 against weights / bandwidth (an H200 reads 4.8
TB/s: Qwen3-8B's 16.4 GB of bf16 weights bound a plain step near 3.4 ms, 290 tok/s; target within 1.3x) and the
16-wide verify step against the plain step at batch 1 (target within 1.15x). Each figure: three warm calls, then
20 timed with CUDA events, with the graphs compiled (recompiles) and host syncs counted over the timed calls; the
peak memory is set against `dflash-bench memory`'s estimate. Last, quantized linear layers (`gpu_quant.quant_check`):
whether the FP8 and int8 kernels pass their probes on the card, and their ms per multiply against bf16 and the
dequantizing forward. Writes gpu_check.json and gpu_check.png.

`--quick` (a borrowed GPU host, under 8 minutes): Qwen3-8B only, batch 1, 8 and 32, widths 1, 4 and 16, no test
subset, then an end-to-end part (`gpu_e2e`): the server's app on the random pair, DFlash with a scripted drafter
against `--no-speculative` at concurrency 1, 8 and 32.

`--dry-run` runs the same code on CPU with tiny shapes, eager only (an inductor compile on CPU costs a minute),
the end-to-end part at concurrency 1 and 2, so the check cannot rot; without CUDA and without `--dry-run` it exits
2 with a clear message. The hybrid target (Qwen3.5-9B) runs eagerly in both modes: its recurrent layers are not
compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.gpu_quant import format_quant, quant_check
from dflash_core.bench.measure import environment
from dflash_core.bench.memory import MODEL_SHAPES
from dflash_core.cli_help import HelpFormatter

if TYPE_CHECKING:
    import torch

H200_BANDWIDTH = 4.8e12  # bytes/s
PLAIN_BOUND_RATIO = 1.3  # compiled plain step at batch 1 vs weights / bandwidth
VERIFY_RATIO = 1.15  # 16-wide verify vs plain step at batch 1
HOST_MS_TARGET = 0.5  # the host's time of a plain step at batch 1 (everything that is not a device kernel)
TEST_SUBSET = ["tests/test_native.py", "tests/test_compile.py", "tests/test_bf16.py", "tests/test_hybrid.py",
               "tests/test_engine.py", "tests/test_memory_budget.py"]


@dataclass
class Plan:
    """What one run measures."""

    device: torch.device
    models: dict[str, dict[str, Any]]  # name -> transformers config fields
    drafts: dict[str, dict[str, Any]]  # name -> DraftConfig fields
    batches: tuple[int, ...]
    widths: tuple[int, ...]  # 1 = a plain step
    context: int  # tokens already in every slot's cache
    iters: int
    modes: tuple[str, ...]
    notes: list[str] = field(default_factory=list)
    warm: int = 3  # untimed calls before the timed ones (compiles, records CUDA graphs)
    e2e_levels: tuple[int, ...] = ()  # the end-to-end part's concurrency levels (none: skipped)
    e2e_tokens: int = 64  # tokens per end-to-end request
    e2e_prompt: int = 128  # prompt tokens per end-to-end request
    memory_preset: tuple[str, str] | None = None  # `dflash-bench memory` names of the target and the draft
    e2e_after_s: float | None = None  # the end-to-end part is left out when the steps took longer than this


def _tiny(kind: str) -> dict[str, Any]:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                tie_word_embeddings=False)
    if kind == "qwen3_5_text":
        return dict(base, model_type=kind, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    return dict(base, model_type="qwen3")


def _full(name: str) -> dict[str, Any]:
    shape = dict(MODEL_SHAPES[name])
    shape.pop("qk_norm", None)
    shape.pop("attn_output_gate", None)
    shape.setdefault("model_type", "qwen3")
    return shape


def _draft_fields(shape: dict[str, Any], target_layers: int) -> dict[str, Any]:
    ids = [1 + i * max(1, (target_layers - 4) // 4) for i in range(min(5, target_layers - 1))]
    return dict(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                num_hidden_layers=5 if shape["hidden_size"] > 64 else 1,
                num_attention_heads=shape["num_attention_heads"] if shape["hidden_size"] <= 64 else 32,
                num_key_value_heads=shape["num_key_value_heads"] if shape["hidden_size"] <= 64 else 8,
                head_dim=shape["head_dim"] if shape["hidden_size"] <= 64 else 128, vocab_size=shape["vocab_size"],
                num_target_layers=target_layers, block_size=16, mask_token_id=3, target_layer_ids=ids,
                max_position_embeddings=shape["max_position_embeddings"])


def make_plan(dry_run: bool, iters: int | None = None, quick: bool = False) -> Plan:
    """The full check on CUDA, the quick one (Qwen3-8B only, batch 1/8/32, widths 1/4/16, end to end at 1/8/32),
    or the tiny CPU dry run (the quick check's code at tiny shapes)."""
    import torch

    if dry_run:
        models = {"tiny-qwen3": _tiny("qwen3"), "tiny-qwen3.5": _tiny("qwen3_5_text")}
        return Plan(torch.device("cpu"), models, {k: _draft_fields(v, v["num_hidden_layers"]) for k, v in
                                                 models.items()}, (1, 2), (1, 4), 32, iters or 2, ("eager",),
                    ["dry run: tiny shapes on CPU, eager only"], warm=1, e2e_levels=(1, 2), e2e_tokens=48,
                    e2e_prompt=8)
    if not torch.cuda.is_available():
        raise BenchError("gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "`scripts/gpu_check.sh --dry-run` runs it on CPU with tiny shapes")
    names = {"Qwen3-8B": "Qwen/Qwen3-8B"} if quick else {"Qwen3-8B": "Qwen/Qwen3-8B", "Qwen3.5-9B": "Qwen/Qwen3.5-9B"}
    notes: list[str] = []
    models = {k: _full(v) for k, v in names.items()}
    drafts = {k: _draft_fields(v, v["num_hidden_layers"]) for k, v in models.items()}
    if quick:
        return Plan(torch.device("cuda"), models, drafts, (1, 8, 32), (1, 4, 16), 1024, iters or 20,
                    ("eager", "compiled"), notes, e2e_levels=(1, 8, 32), e2e_tokens=128, e2e_prompt=256,
                    memory_preset=("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"), e2e_after_s=330)
    return Plan(torch.device("cuda"), models, drafts, (1, 4, 16, 32), (1, 4, 8, 16), 1024, iters or 20,
                ("eager", "compiled"), notes, memory_preset=("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"))


def _progress(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def _config(fields: dict[str, Any]) -> Any:
    from transformers import Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    fields = dict(fields)
    kind = fields.pop("model_type", "qwen3")
    return (Qwen3_5TextConfig if kind == "qwen3_5_text" else Qwen3Config)(**fields)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    """Graphs dynamo has compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _time_ms(fn: Any, device: torch.device, iters: int, warm: int = 3) -> dict[str, Any]:
    """`warm` untimed calls (compiles, records graphs), then `iters` timed ones: CUDA events on CUDA (device time
    of the whole run, per call), the wall clock on CPU; the graphs compiled and host syncs during the timed calls
    (syncs: torch's sync debug mode, CUDA only)."""
    import warnings

    import torch

    for _ in range(warm):
        fn()
    _sync(device)
    graphs = _graphs()
    syncs = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        _sync(device)
        ms = start.elapsed_time(end) / iters
        syncs = sum("synchroniz" in str(w.message) for w in caught) / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
    recompiles = _graphs() - graphs
    return dict(ms=ms, host_ms=_host_ms(fn, device, iters), recompiles=recompiles, syncs_per_call=syncs)


def _host_ms(fn: Any, device: torch.device, iters: int) -> float:
    """The host's time per call: the median wall time from a call's start, on an idle device, to its return
    (Python, the runner's bookkeeping, input copies and kernel or graph launches; a call that synchronizes inside
    waits for the device too, which `syncs_per_call` shows). On CPU it is the call's wall time."""
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def make_pair(name: str, plan: Plan) -> tuple[Any, Any]:
    """A random-weight bf16 target and draft, initialised on the plan's device (no hub, no host copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_core.config import DraftConfig
    from dflash_core.draft import DFlashDraft

    torch.manual_seed(0)
    with plan.device:
        model = AutoModelForCausalLM.from_config(_config(plan.models[name]), dtype=torch.bfloat16).eval()
        draft = DFlashDraft(DraftConfig(**plan.drafts[name])).to(torch.bfloat16).eval()
    return model, draft


def _measure_model(name: str, plan: Plan, mode: str, model: Any, draft: Any) -> list[dict[str, Any]]:
    """ms per step for every (kind, batch, width) of one model in one mode."""
    import torch

    from dflash_core.compile import StaticShapes
    from dflash_core.runners.base import DraftRequest
    from dflash_core.runners.drafter import DFlashDrafter
    from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES, HybridTarget
    from dflash_core.runners.native import NativeTarget

    dev, dtype = plan.device, torch.bfloat16
    hybrid = model.config.model_type in HYBRID_MODEL_TYPES
    compiled = mode == "compiled" and not hybrid
    if mode == "compiled" and hybrid:
        plan.notes.append(f"{name}: hybrid runner, compiled rows are eager")
    max_slots, max_len = max(plan.batches), plan.context + 64
    static = StaticShapes(plan.batches, plan.widths) if compiled else None
    runner_cls = HybridTarget if hybrid else NativeTarget
    kwargs = {} if hybrid else {"static": static}
    target = runner_cls(model, draft.cfg.target_layer_ids, max_slots=max_slots, max_len=max_len, **kwargs)
    draft_static = StaticShapes(plan.batches, tuple(sorted({*plan.widths, 16}))) if compiled else None
    drafter = DFlashDrafter(draft, target, block_size=16, max_slots=max_slots, max_len=max_len, static=draft_static)
    caches = [target.new_cache(i) for i in range(max_slots)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: list[dict[str, Any]] = []
    feat = torch.zeros(4, len(draft.cfg.target_layer_ids) * draft.cfg.hidden_size, device=dev, dtype=dtype)
    states = [drafter.new_state(i, []) for i in range(max_slots)]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for b in plan.batches:
        for width in plan.widths:
            def verify(b: int = b, width: int = width) -> None:
                for c in caches[:b]:
                    c.length = plan.context  # the same context every call: timing, not decoding
                    if hybrid:
                        target.crop(c, plan.context)
                target.forward_batch([([5] * width, plan.context, c) for c in caches[:b]], features=True)
            rows.append(dict(model=name, mode=mode, kind="plain" if width == 1 else "verify", batch=b, width=width,
                             **_time_ms(verify, dev, plan.iters, plan.warm)))

        def propose(b: int = b) -> None:
            for st in states[:b]:
                st.pending[:], st.pending_rows = [feat], feat.shape[0]  # 4 accepted rows of context a step
            drafter.propose_scored([DraftRequest(st, 5, plan.context, 15) for st in states[:b]])
        rows.append(dict(model=name, mode=mode, kind="draft", batch=b, width=16,
                         **_time_ms(propose, dev, plan.iters, plan.warm)))
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    for r in rows:
        r.update(weights_bytes=weights, peak_memory_bytes=peak)
    return rows


def anchors(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The physical anchors per model: compiled plain b1 vs weights / H200 bandwidth, verify-16 vs plain at b1."""
    out: dict[str, Any] = {}
    for name in sorted({r["model"] for r in rows}):
        def ms(kind: str, width: int, name: str = name, key: str = "ms") -> float | None:
            found = [r[key] for r in rows if r["model"] == name and r["kind"] == kind and r["batch"] == 1
                     and r["width"] == width and r["mode"] == ("compiled" if any(
                         x["mode"] == "compiled" for x in rows) else "eager")]
            return found[0] if found else None
        weights = next(r["weights_bytes"] for r in rows if r["model"] == name)
        bound_ms = weights / H200_BANDWIDTH * 1e3
        plain, verify = ms("plain", 1), ms("verify", 16)
        out[name] = dict(
            bound_ms_h200=bound_ms, plain_ms=plain, verify16_ms=verify,
            plain_vs_bound=None if plain is None else plain / bound_ms, plain_vs_bound_target=PLAIN_BOUND_RATIO,
            verify16_vs_plain=None if plain is None or verify is None else verify / plain,
            verify16_vs_plain_target=VERIFY_RATIO, plain_host_ms=ms("plain", 1, key="host_ms"),
            plain_host_ms_target=HOST_MS_TARGET)
    return out


def _plot(rows: list[dict[str, Any]], path: Path, e2e: dict[str, Any] | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in rows})
    panels = len(models) + (e2e is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    if e2e is not None:
        ax = axes[0][-1]
        for run, pts in e2e["runs"].items():
            ax.plot([p["concurrency"] for p in pts], [p["tok_s"] for p in pts], marker="o", label=run)
        ax.set(title=f"{e2e['model']} end to end (scripted rate {e2e['rate']})", xlabel="concurrency",
               ylabel="output tok/s", xscale="log")
        ax.legend(fontsize=6)
    for ax, name in zip(axes[0], models):
        series = sorted({(r["mode"], r["kind"], r["width"]) for r in rows if r["model"] == name})
        for mode, kind, width in series:
            pts = sorted((r["batch"], r["ms"]) for r in rows
                         if (r["model"], r["mode"], r["kind"], r["width"]) == (name, mode, kind, width))
            ax.plot(*zip(*pts), marker="o", linestyle="-" if mode == "compiled" else "--",
                    label=f"{kind} w{width} {mode}")
        ax.set(title=name, xlabel="batch", ylabel="ms per step", xscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_tests(tests: list[str]) -> dict[str, Any]:
    """pytest over `tests` on this machine (device auto: CUDA); the exit code and the summary line."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *tests], capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return dict(tests=tests, returncode=proc.returncode, summary=last, seconds=time.perf_counter() - t0)


def memory_check(plan: Plan, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured peak against `dflash-bench memory`'s estimate for the same slots and length (CUDA only)."""
    first = next(iter(plan.models))  # the preset's model (Qwen3-8B)
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes") and r["model"] == first]
    if plan.memory_preset is None or not peaks:
        return None
    from dflash_core.bench.memory import memory_estimate

    est = memory_estimate(*plan.memory_preset, max_model_len=plan.context + 64 - 17,
                          max_running_requests=max(plan.batches))
    return dict(preset=list(plan.memory_preset), peak_bytes=max(peaks), estimate_total_bytes=est["total_bytes"],
                estimate=est, peak_vs_estimate=max(peaks) / est["total_bytes"])


def run_gpu_check(out_dir: Path, dry_run: bool, tests: bool = True, iters: int | None = None,
                  quick: bool = False) -> dict[str, Any]:
    """The whole check; writes gpu_check.json (and gpu_check.png with matplotlib) to `out_dir`."""
    import torch

    from dflash_core.bench.gpu_e2e import run_e2e
    from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES

    plan = make_plan(dry_run, iters, quick)
    t0 = time.perf_counter()
    result: dict[str, Any] = dict(mode="gpu-check", dry_run=dry_run, quick=quick, environment=environment())
    if plan.device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(plan.device)
    result["tests"] = run_tests(TEST_SUBSET) if tests and not dry_run and not quick else None
    rows: list[dict[str, Any]] = []
    e2e = None
    out_dir.mkdir(parents=True, exist_ok=True)

    def write(rows: list[dict[str, Any]], e2e: dict[str, Any] | None) -> None:  # after each part: a cut run keeps it
        result.update(rows=rows, anchors=anchors(rows), memory=memory_check(plan, rows), e2e=e2e, notes=plan.notes,
                      seconds=time.perf_counter() - t0)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    for name in plan.models:
        t1 = time.perf_counter()
        model, draft = make_pair(name, plan)
        plan.notes.append(f"{name}: random init {time.perf_counter() - t1:.1f} s")
        with torch.inference_mode():
            for mode in plan.modes:
                _progress(f"{name} {mode} steps ({time.perf_counter() - t0:.0f} s in)")
                rows.extend(_measure_model(name, plan, mode, model, draft))
                write(rows, e2e)
                if plan.device.type == "cuda":
                    torch.cuda.empty_cache()  # the last runner's caches are unreferenced now
        late = plan.e2e_after_s is not None and time.perf_counter() - t0 > plan.e2e_after_s
        if plan.e2e_levels and e2e is None and late:
            plan.notes.append(f"end-to-end part left out: the steps took over {plan.e2e_after_s:.0f} s")
        elif plan.e2e_levels and e2e is None and model.config.model_type not in HYBRID_MODEL_TYPES:
            _progress(f"{name} end to end at {plan.e2e_levels} ({time.perf_counter() - t0:.0f} s in)")
            e2e = dict(model=name, **run_e2e(model, draft, plan.e2e_levels, plan.e2e_tokens, plan.e2e_prompt))
        del model, draft
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
    _progress(f"quantized linear layers ({time.perf_counter() - t0:.0f} s in)")
    with torch.inference_mode():
        result["quant"] = quant_check(plan.device, lambda fn: _time_ms(fn, plan.device, plan.iters)["ms"])
    write(rows, e2e)
    result["plot"] = str(out_dir / "gpu_check.png") if _plot(rows, out_dir / "gpu_check.png", e2e) else None
    return result


def format_gpu_check(result: dict[str, Any]) -> str:
    """A short terminal report: the steps, then the anchors."""
    lines = [f"{'model':14} {'mode':9} {'kind':7} {'batch':>5} {'width':>5} {'ms':>9} {'host ms':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['model']:14} {r['mode']:9} {r['kind']:7} {r['batch']:5d} {r['width']:5d} {r['ms']:9.3f} "
                     f"{r['host_ms']:9.3f}")
    for name, a in result["anchors"].items():
        pb = "n/a" if a["plain_vs_bound"] is None else f"{a['plain_vs_bound']:.2f}x"
        vp = "n/a" if a["verify16_vs_plain"] is None else f"{a['verify16_vs_plain']:.2f}x"
        lines.append(f"{name}: plain step b1 vs weights/4.8 TB/s: {pb} (target <= {PLAIN_BOUND_RATIO}x); "
                     f"verify-16 vs plain b1: {vp} (target <= {VERIFY_RATIO}x); host time of a plain step b1: "
                     f"{'n/a' if a['plain_host_ms'] is None else format(a['plain_host_ms'], '.3f')} ms "
                     f"(target <= {HOST_MS_TARGET} ms)")
    for r in (result.get("e2e") or {}).get("runs", {}).get("dflash-scripted", []):
        acc = "n/a" if r["tokens_per_row_step"] is None else f"{r['tokens_per_row_step']:.2f}"
        lines.append(f"e2e c={r['concurrency']}: DFlash (scripted, rate {result['e2e']['rate']}) {r['tok_s']:.1f} "
                     f"tok/s, {r['speedup']:.2f}x --no-speculative; tokens per verify {acc} (set rate gives "
                     f"{result['e2e']['expected_tokens_per_step']:.2f})")
    if result.get("memory"):
        m = result["memory"]
        lines.append(f"peak memory {m['peak_bytes'] / 1e9:.2f} GB vs dflash-bench memory "
                     f"{m['estimate_total_bytes'] / 1e9:.2f} GB ({m['peak_vs_estimate']:.2f}x)")
    lines += format_quant(result.get("quant") or {})
    if result.get("tests"):
        lines.append(f"tests: {result['tests']['summary']} (exit {result['tests']['returncode']})")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """The `gpu-check` mode's arguments."""
    p = sub.add_parser(
        "gpu-check", help="GPU readiness: tests, eager vs compiled step times",
        description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, eager only (CI)")
    p.add_argument("--quick", action="store_true",
                   help="Qwen3-8B only, batch 1/8/32, widths 1/4/16, end to end at 1/8/32; no test subset")
    p.add_argument("--no-tests", action="store_true", help="skip the test subset")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default: 20; dry run 2)")
    p.add_argument("--output-dir", type=Path, default=Path("gpu-check"),
                   help="where gpu_check.json and gpu_check.png go (default: gpu-check)")


def main(args: argparse.Namespace) -> int:
    """Run the mode; 0 when it ran and (on CUDA) the tests passed."""
    try:
        result = run_gpu_check(args.output_dir, args.dry_run, tests=not args.no_tests, iters=args.iters,
                               quick=args.quick)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code
    print(format_gpu_check(result) + f"\nwrote {args.output_dir / 'gpu_check.json'}")
    return 1 if result["tests"] and result["tests"]["returncode"] else 0
