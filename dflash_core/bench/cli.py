"""The `dflash-bench` command line: arguments, the mode's run, then the report, the JSON and the plots."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_core.bench import gpu_check, kv_capacity, prefix, profile
from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import header
from dflash_core.bench.memory import format_memory, memory_from_preset
from dflash_core.bench.offline import run_offline
from dflash_core.bench.output import BENCH_DIR_ENV, DEFAULT_DIR_NAME, resolve_output_dir, safe_name, write_json
from dflash_core.bench.plots import plot_offline, plot_serve
from dflash_core.bench.prompts import DATASET_CHOICES, load_prompts
from dflash_core.bench.report import format_offline, format_serve
from dflash_core.bench.schema import SCHEMA_VERSION, validate
from dflash_core.bench.serve import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_DURATION_S,
    DEFAULT_REPEATS,
    compare_levels,
    format_prefix_cache,
    run_serve,
    run_serve_pair,
)
from dflash_core.bench.stall import format_stall, run_stall
from dflash_core.cli_help import HelpFormatter
from dflash_core.config import BACKENDS, SPEC_SAMPLING
from dflash_core.speculation import POLICIES

BENCH_EXTRA = 'pip install "dflash-serve[bench]"'


def require_extra(mode: str, modules: Sequence[str]) -> None:
    """BenchError (exit 2) naming the `bench` extra when a package `mode` needs (openai, matplotlib) is missing."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BenchError(f"dflash-bench {mode} needs {' and '.join(missing)}, which the `bench` extra installs: "
                         f"{BENCH_EXTRA}")


def _concurrency(text: str) -> list[int]:
    """--concurrency: comma-separated levels, each >= 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-bench` command line: the offline, serve, stall, memory, prefix, capacity, profile and gpu-check
    modes."""
    p = argparse.ArgumentParser(
        prog="dflash-bench",
        description="DFlash vs plain decoding, measured side by side.",
        epilog="See `python -c 'import dflash_core.bench as b; help(b)'` for the metrics.",
        formatter_class=HelpFormatter,
    )
    sub = p.add_subparsers(
        dest="mode",
        required=True,
        title="modes",
        description="`dflash-bench MODE --help` shows a mode's options",
        metavar="MODE",
    )

    def common(sp: argparse.ArgumentParser, max_tokens: int, num_prompts: int | None) -> None:
        sp.add_argument(
            "--dataset",
            default="all",
            help=f"{', '.join(DATASET_CHOICES)}, or a .jsonl file "
            "(default: all = chat, math and code interleaved)",
        )
        sp.add_argument(
            "--num-prompts",
            type=int,
            default=num_prompts,
            help="prompts to run" + ("" if num_prompts else " (default: per concurrency level, see below)"),
        )
        sp.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens per request")
        sp.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
        sp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
        sp.add_argument("--seed", type=int, default=0, help="request i uses seed + i; also samples datasets")
        sp.add_argument(
            "--output-dir",
            type=Path,
            default=None,
            help=f"folder for the JSON and the plots (default: ${BENCH_DIR_ENV}, else ./{DEFAULT_DIR_NAME} when "
            f"writable, else ~/{DEFAULT_DIR_NAME}, else <temp dir>/dflash-bench-results-<uid>)",
        )
        sp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    gpu_check.add_parser(sub)
    prefix.add_parser(sub)  # before offline: the help test reads the lines after offline, serve, stall and memory
    kv_capacity.add_parser(sub)
    profile.add_parser(sub)
    off = sub.add_parser(
        "offline",
        help="in-process: plain vs DFlash decoding of one target",
        description="In-process: plain decoding vs DFlash on the same target, prompt by prompt, interleaved.",
        formatter_class=HelpFormatter,
    )
    common(off, max_tokens=128, num_prompts=16)
    off.add_argument("--target", help="target folder or hub id (default: the bundled demo pair)")
    off.add_argument("--draft", help="DFlash draft folder or hub id (default: the demo draft)")
    off.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the target's)")
    off.add_argument("--block-size", type=int, help="block size B (default: the draft's)")
    off.add_argument("--backend", default="auto", choices=list(BACKENDS),
                     help="target forward, as dflash-serve --backend")
    off.add_argument("--speculation", default="adaptive", choices=list(POLICIES),
                     help="the width policy, as dflash-serve --speculation (fixed: the full block every step; "
                          "tree: a tree of --tree-budget nodes every step)")
    off.add_argument("--tree-budget", type=int, default=32,
                     help="the most draft nodes of a verified tree, as dflash-serve --tree-budget (0: chains only)")
    off.add_argument("--spec-sampling", default="keyed", choices=list(SPEC_SAMPLING),
                     help="how sampled requests accept draft tokens, as dflash-serve --spec-sampling (keyed: seeded "
                          "text equal to plain decoding's; rejection: rejection sampling, text not compared)")
    off.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    off.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16"
    )
    off.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 is off")
    off.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, as dflash-serve)")
    off.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")

    srv = sub.add_parser(
        "serve",
        help="over HTTP: a concurrency sweep against a running server",
        description="Over the OpenAI API: a concurrency sweep against a running server (dflash-serve, vLLM, "
        "SGLang, ...).",
        formatter_class=HelpFormatter,
    )
    common(srv, max_tokens=64, num_prompts=None)
    srv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="default: $OPENAI_API_KEY or EMPTY",
    )
    srv.add_argument("--model", help="default: the first model of /v1/models")
    srv.add_argument(
        "--concurrency",
        type=_concurrency,
        default=list(DEFAULT_CONCURRENCY),
        help="comma-separated levels (default 1,2,4,8,12,16); requests per round: --num-prompts, or by "
        "default 2 x concurrency (at least 4, at most 32)",
    )
    srv.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="least rounds per level; each round sends the level's requests again and the table shows "
        "the spread of tokens/s over rounds",
    )
    srv.add_argument(
        "--min-duration",
        type=float,
        default=DEFAULT_MIN_DURATION_S,
        metavar="SECONDS",
        help="least seconds per level: rounds go on until both --repeats and this are reached",
    )
    srv.add_argument(
        "--label",
        help="name of this run in tables, plots and file names (default: dflash or "
        "baseline for dflash-serve, else the model id)",
    )
    srv.add_argument(
        "--compare", type=Path, metavar="BASELINE_JSON", help="a serve JSON to compare with (default: none)"
    )
    srv.add_argument(
        "--baseline-url",
        help="a second server to sweep side by side (e.g. the same target with --no-speculative): each level runs "
        "on it, then on --base-url, and the comparison and plots show both (default: none)",
    )
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    srv.add_argument(
        "--shared-prefix-tokens", type=int, default=0, metavar="N",
        help="every prompt begins with the same system message of about N tokens (a fixed text, sized with the "
        "server's token counts); each level reports the server's prefix-cache hit rate from /metrics (default: 0, "
        "no shared prefix)")

    stall = sub.add_parser(
        "stall",
        help="over HTTP: a long prompt's prefill vs running streams",
        description="Over the OpenAI API: some streams run, then a long prompt arrives; reports the running "
        "streams' median inter-chunk gap and their largest gap while the long prompt is prefilled.",
        formatter_class=HelpFormatter,
    )
    stall.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    stall.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                       help="default: $OPENAI_API_KEY or EMPTY")
    stall.add_argument("--model", help="default: the first model of /v1/models")
    stall.add_argument("--streams", type=int, default=4, help="streams running when the long prompt arrives")
    stall.add_argument("--prompt-tokens", type=int, default=1500, help="tokens of the long prompt")
    stall.add_argument("--max-tokens", type=int, default=256, help="output tokens of each running stream")
    stall.add_argument("--output-dir", type=Path, default=None, help="folder for stall.json (default: as serve)")

    mem = sub.add_parser(
        "memory",
        help="GPU memory of presets: weights and the KV pool per card",
        description="GPU memory of YAML presets (configs/*.yaml) on the native backend: weights, and the KV "
        "block pool (target and draft pages) that fits beside them per card, in tokens and in requests that run "
        "at once. Activations and the CUDA context are reserved as the server reserves them. "
        "Model shapes: built in for the presets' hub ids, else read from a local folder's config.json.",
        formatter_class=HelpFormatter,
    )
    mem.add_argument("presets", nargs="+", type=Path, metavar="PRESET", help="YAML preset files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`dflash-bench MODE ...`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode == "gpu-check":
        return gpu_check.main(args)
    if args.mode in ("prefix", "capacity", "profile"):
        return {"prefix": prefix, "capacity": kv_capacity, "profile": profile}[args.mode].main(args, argv)
    if args.mode == "memory":
        try:
            print(format_memory([memory_from_preset(path) for path in args.presets]))
        except BenchError as exc:
            print(f"dflash-bench: error: {exc}", file=sys.stderr)
            return exc.code
        return 0
    if args.mode == "stall":
        try:
            result = {**header("stall", argv), **run_stall(
                args.base_url.rstrip("/"), load_prompts("chat", 8), api_key=args.api_key, model=args.model,
                streams=args.streams, long_tokens=args.prompt_tokens, max_tokens=args.max_tokens)}
            path = resolve_output_dir(args.output_dir) / "stall.json"
        except BenchError as exc:
            print(f"dflash-bench: error: {exc}", file=sys.stderr)
            return exc.code
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(format_stall(result) + f"\nwrote {path}")
        return 0
    if args.max_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--max-tokens and --num-prompts must be >= 1")
    if args.mode == "serve" and (args.repeats < 1 or args.min_duration < 0 or args.shared_prefix_tokens < 0):
        parser.error("--repeats must be >= 1, --min-duration and --shared-prefix-tokens >= 0")
    try:
        return _main(args, argv)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code


def _main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Run the offline or serve mode; BenchError for what the user must fix."""
    baseline = None
    if args.mode == "serve" and args.compare is not None:
        try:
            baseline = json.loads(args.compare.read_text(encoding="utf-8"))
            if isinstance(baseline, dict) and baseline.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(
                    f"schema_version {baseline.get('schema_version')}, this dflash-bench writes "
                    f"{SCHEMA_VERSION}: rerun the baseline"
                )
            validate(baseline)
        except Exception as exc:
            raise BenchError(f"--compare {args.compare}: not a dflash-bench serve JSON ({exc})") from None
        if baseline.get("mode") != "serve":
            raise BenchError(f"--compare {args.compare}: not a serve result")
    out_dir = resolve_output_dir(args.output_dir)
    prompts = load_prompts(args.dataset, args.num_prompts, args.seed)
    if args.mode != "offline" and any(p.token_ids is not None for p in prompts):
        raise BenchError(f"{args.dataset} holds recorded requests (prompt_token_ids): they run in "
                         f"`dflash-bench offline` only")
    require_extra(args.mode, (["openai"] if args.mode == "serve" else []) + ([] if args.no_plots else ["matplotlib"]))
    progress = not args.no_progress
    if args.mode == "offline":
        body = run_offline(
            prompts,
            target=args.target,
            draft=args.draft,
            tokenizer=args.tokenizer,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            backend=args.backend,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            warmup=not args.no_warmup,
            progress=progress,
            dataset=args.dataset,
            threads=args.threads,
            speculation=args.speculation,
            spec_sampling=args.spec_sampling,
            tree_budget=args.tree_budget,
        )
        result = {**header("offline", argv), **body}
        json_path = out_dir / "offline.json"
        write_json(result, json_path)
        print(format_offline(result))
        plots = [] if args.no_plots else plot_offline(result, out_dir)
        failed = False
    else:
        if args.baseline_url and args.compare is not None:
            raise BenchError("--baseline-url and --compare both name a baseline: give one")
        serve_args = dict(
            api_key=args.api_key,
            model=args.model,
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            timeout=args.timeout,
            label=args.label,
            dataset=args.dataset,
            progress=progress,
            repeats=args.repeats,
            min_duration=args.min_duration,
            shared_prefix_tokens=args.shared_prefix_tokens,
        )
        if args.baseline_url:
            body, base_body = run_serve_pair(args.base_url.rstrip("/"), args.baseline_url.rstrip("/"), prompts,
                                             **serve_args)
            baseline = {**header("serve", argv), **base_body}
            base_path = out_dir / f"serve_{safe_name(baseline['label'])}.json"
            if base_body["label"] == body["label"]:
                base_path = out_dir / f"serve_{safe_name(baseline['label'])}_baseline.json"
            write_json(baseline, base_path)
            print(format_serve(baseline) + "\n")
            body["comparison"]["baseline_file"] = str(base_path)
        else:
            body = run_serve(args.base_url.rstrip("/"), prompts, **serve_args)
        result = {**header("serve", argv), **body}
        if baseline is not None and args.compare is not None:
            result["comparison"] = compare_levels(result, baseline, str(args.compare))
        json_path = out_dir / f"serve_{safe_name(result['label'])}.json"
        write_json(result, json_path)
        print(format_serve(result))
        if format_prefix_cache(result):
            print("\n" + format_prefix_cache(result))
        plots = [] if args.no_plots else plot_serve(result, out_dir, baseline)
        failed = any(lv["failed"] for lv in result["levels"])
    print("\nwrote " + ", ".join(str(p) for p in [json_path, *plots]))
    if failed:
        print("dflash-bench: error: some requests failed (see 'errors' in the JSON)", file=sys.stderr)
        return 1
    return 0
