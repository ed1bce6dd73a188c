"""dflash-bench: DFlash against plain decoding of the same target, measured side by side.

``dflash-bench offline``
    In-process. Loads the target once and builds two engines on the same target object: plain
    autoregressive decoding (block size 1) and DFlash. Every prompt runs on both, interleaved prompt by
    prompt (plain first on even prompts, DFlash first on odd ones, so slow drift cancels), with the same
    sampling settings and seed, after one warm-up request per engine that is not counted. Greedy (the
    default) must give token-identical outputs: the first difference stops the run with exit code 3, naming
    the prompt and the output position.
    Per request: wall time from ``add_request`` to the last token (``time_s``), time to first token
    (``ttft_s``: the prefill step), decode throughput ``(output_tokens - 1) / (time_s - ttft_s)``, and for
    DFlash the acceptance length of every draft/verify step (``RequestStats.acceptance_lengths``: accepted
    draft tokens + 1, in 1..B). Summary figures:

    - ``speedup``: total plain wall time / total DFlash wall time over the same prompts (prefill included);
    - ``mean_prompt_speedup``: the mean over prompts of the per-prompt ratio;
    - ``decode_speedup``: plain decode time per token / DFlash decode time per token (prefill excluded);
    - ``mean_acceptance_length``: 1 + accepted / drafts over all steps (vLLM's definition; what the
      server's ``dflash`` field and ``/metrics`` report); ``mean_acceptance_length_per_prompt``: the mean of
      per-prompt means (z-lab's benchmark); ``acceptance_histogram``: steps by acceptance length 1..B.

    CPU: torch's thread count unless ``--threads``; ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
    sets it (OpenMP's busy-wait makes small models 10-20x slower on a CPU shared with other processes).

``dflash-bench serve --base-url URL``
    Over the OpenAI API against any OpenAI-compatible server (dflash-serve, vLLM, SGLang): streaming chat
    completions with ``stream_options.include_usage``, a sweep over concurrency levels (a semaphore keeps
    that many requests in flight), one warm-up request first. A level runs in rounds: each round sends the
    level's requests (``--num-prompts``, by default 2 x concurrency, at least 4, at most 32; the same
    requests every round) and waits for all of them. A level runs at least ``--repeats`` rounds (default 3)
    and at least ``--min-duration`` seconds (default 10), so one slow or fast second does not decide it.
    Per level: request throughput, output tokens/s (total tokens / total time of the level's rounds), their
    spread over the rounds (min, max and sample standard deviation of each round's figure), and p50/p90/p99
    of time to first token, inter-token latency, time per output token and end-to-end latency over all the
    level's requests.

    - TTFT: from sending the request to the first chunk with non-empty ``delta.content``.
    - Output tokens: ``usage.completion_tokens`` of the final usage chunk (the number of content chunks
      when the server sends no usage).
    - ITL: a stream chunk can carry several tokens (with DFlash, a whole accepted block) and the API does
      not say how many. A request's ``completion_tokens`` are taken as evenly spread over its content
      chunks: the gap before a chunk divided by the request's mean tokens per chunk is the latency of each
      token the chunk carries. This is exact for servers that stream one token per chunk (plain decoding);
      with DFlash a gap is shared by its block. Percentiles are over all such gaps of a level (every chunk of
      a request counts the same number of tokens). The first chunk's tokens belong to TTFT, not ITL.
      (Sharing tokens out by characters instead was tried: it skews one-token chunks by their length.)
    - TPOT: ``(e2e - ttft) / (completion_tokens - 1)`` per request: exact, no assumption about chunks.
    - Mean acceptance length: ``1 + sum(num_accepted_tokens) / sum(num_drafts)`` over the ``dflash``
      fields of the usage chunks when the server sends them (dflash-serve does; 1.0 with
      ``--no-speculative``), else null.

    ``--compare BASELINE_JSON`` (the JSON of an earlier ``serve`` run, e.g. against dflash-serve
    ``--no-speculative``) prints and records the speedup at each concurrency level.

``dflash-bench memory PRESET.yaml ...``
    The GPU memory the native backend allocates at start-up for YAML presets: weights (target + the draft's
    own), the target's slot KV cache (``max_running_requests x (max_model_len + B + 1)`` rows) and the draft's
    (one row more per slot), as a Markdown table. Nothing is loaded or downloaded: the presets' models have
    built-in shapes (``MODEL_SHAPES``), local folders are read from their ``config.json``.

Prompt sets: ``chat``, ``math``, ``code`` (32 each, shipped in ``dflash_core/prompts``), ``all`` (the three
interleaved), ``heldout`` (the demo pair's held-out set, ``dflash_core/demo/heldout_prompts.jsonl``), a
JSONL file (``{"messages": [...]}``, ``{"prompt": "..."}`` or ``{"turns": [...]}`` per line), and, through
the ``datasets`` package with network access, ``gsm8k``, ``math500``, ``humaneval``, ``mbpp`` and
``mt-bench`` (first turn), with the prompt formats of z-lab's DFlash benchmark.

Output: a table on the terminal, a JSON file (``BENCH_SCHEMA``) and PNG plots in the output folder:
``--output-dir``, else ``$DFLASH_BENCH_DIR``, else ``./bench-results`` when the current folder is writable,
else ``~/bench-results``, else ``<temp dir>/dflash-bench-results-<uid>`` (an image's root-owned working
folder falls through to the home folder); an output folder named explicitly that cannot be written stops
the run before it starts (exit 2). Files:
``offline.json``, ``offline_speedup.png``, ``offline_acceptance.png``; ``serve_<label>.json``,
``serve_<label>_throughput.png``, ``serve_<label>_latency.png``.

Exit codes: 0 done; 1 a request failed (serve) or the engine failed; 2 bad arguments, an output folder
that cannot be written, a dataset that cannot be loaded, models that cannot be loaded or an unreachable
server; 3 greedy DFlash output differs
from plain decoding (offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_core.cli_help import HelpFormatter

SCHEMA_VERSION = 2  # 2: serve levels run in rounds (repeats, rounds, spread; config repeats, min_duration_s)
SHIPPED_SETS = ("chat", "math", "code")
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_REPEATS = 3
DEFAULT_MIN_DURATION_S = 10.0
BENCH_DIR_ENV = "DFLASH_BENCH_DIR"
DEFAULT_DIR_NAME = "bench-results"
Message = dict[str, str]

# ---- the JSON schema -----------------------------------------------------------------------------

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer", "minimum": 0}
_STR_OR_NULL = {"type": ["string", "null"]}
_DIST = {
    "type": "object",
    "description": "mean and percentiles of a quantity in seconds (null without samples)",
    "required": ["mean", "p50", "p90", "p99"],
    "properties": {k: _NUM_OR_NULL for k in ("mean", "p50", "p90", "p99")},
    "additionalProperties": False,
}
_SPREAD = {
    "type": "object",
    "description": "spread of a per-round figure over a level's rounds (stdev: sample, null under 2 rounds)",
    "required": ["min", "max", "stdev"],
    "properties": {"min": _NUM, "max": _NUM, "stdev": _NUM_OR_NULL},
    "additionalProperties": False,
}
_ROUND = {
    "type": "object",
    "description": "one round of a level: its requests sent together (at most `concurrency` in flight)",
    "required": ["duration_s", "completed", "failed", "output_tokens", "output_tokens_per_s", "request_throughput"],
    "properties": {
        "duration_s": _NUM,
        "completed": {"type": "integer", "minimum": 0},
        "failed": {"type": "integer", "minimum": 0},
        "output_tokens": {"type": "integer", "minimum": 0},
        "output_tokens_per_s": _NUM,
        "request_throughput": _NUM,
    },
    "additionalProperties": False,
}
_COMMON = {
    "schema_version": {"const": SCHEMA_VERSION},
    "created": {"type": "string", "description": "UTC time, ISO 8601"},
    "command": {"type": "string", "description": "the command line that produced the file"},
    "environment": {
        "type": "object",
        "required": ["python", "platform", "cpu", "cpu_count", "torch", "dflash_serve"],
        "properties": {
            "python": {"type": "string"},
            "platform": {"type": "string"},
            "cpu": {"type": "string"},
            "cpu_count": {"type": ["integer", "null"]},
            "torch": _STR_OR_NULL,
            "torch_threads": {"type": ["integer", "null"]},
            "gpu": _STR_OR_NULL,
            "omp_wait_policy": _STR_OR_NULL,
            "dflash_serve": {"type": "string"},
        },
    },
}
_RUN = {
    "type": "object",
    "description": "one request of one prompt on one engine",
    "required": ["output_tokens", "time_s", "ttft_s", "decode_tokens_per_s", "finish_reason"],
    "properties": {
        "output_tokens": _INT,
        "time_s": _NUM,
        "ttft_s": _NUM,
        "decode_tokens_per_s": _NUM_OR_NULL,
        "finish_reason": {"type": "string"},
        "num_drafts": _INT,
        "num_accepted_tokens": _INT,
        "mean_acceptance_length": _NUM,
        "acceptance_lengths": {"type": "array", "items": {"type": "integer", "minimum": 1}},
    },
}
_ENGINE_SUMMARY = {
    "type": "object",
    "required": ["output_tokens", "total_time_s", "output_tokens_per_s", "decode_tokens_per_s", "ttft_s"],
    "properties": {
        "output_tokens": _INT,
        "total_time_s": _NUM,
        "output_tokens_per_s": _NUM,
        "decode_tokens_per_s": _NUM_OR_NULL,
        "ttft_s": _DIST,
    },
}
OFFLINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "mode",
        "created",
        "command",
        "environment",
        "config",
        "summary",
        "prompts",
    ],
    "properties": {
        **_COMMON,
        "mode": {"const": "offline"},
        "config": {
            "type": "object",
            "required": [
                "target",
                "draft",
                "dataset",
                "num_prompts",
                "max_tokens",
                "block_size",
                "device",
                "dtype",
                "temperature",
                "top_p",
                "top_k",
                "seed",
            ],
            "properties": {
                "target": {"type": "string"},
                "draft": {"type": "string"},
                "tokenizer": _STR_OR_NULL,
                "dataset": {"type": "string"},
                "num_prompts": _INT,
                "max_tokens": {"type": "integer", "minimum": 1},
                "block_size": {"type": "integer", "minimum": 2},
                "device": {"type": "string"},
                "dtype": {"type": "string"},
                "backend": {"type": "string"},
                "temperature": _NUM,
                "top_p": _NUM,
                "top_k": {"type": "integer"},
                "seed": {"type": "integer"},
                "load_time_s": _NUM,
            },
        },
        "summary": {
            "type": "object",
            "required": [
                "num_prompts",
                "block_size",
                "plain",
                "dflash",
                "speedup",
                "mean_prompt_speedup",
                "decode_speedup",
                "mean_acceptance_length",
                "mean_acceptance_length_per_prompt",
                "acceptance_histogram",
                "identity_checked",
                "identical_outputs",
            ],
            "properties": {
                "num_prompts": _INT,
                "block_size": {"type": "integer", "minimum": 2},
                "plain": _ENGINE_SUMMARY,
                "dflash": _ENGINE_SUMMARY,
                "speedup": _NUM,
                "mean_prompt_speedup": _NUM,
                "decode_speedup": _NUM_OR_NULL,
                "mean_acceptance_length": _NUM,
                "mean_acceptance_length_per_prompt": _NUM,
                "acceptance_histogram": {
                    "type": "object",
                    "description": "index k counts draft/verify steps that committed k + 1 tokens (1..B)",
                    "required": ["counts", "fractions"],
                    "properties": {
                        "counts": {"type": "array", "items": _INT},
                        "fractions": {"type": "array", "items": _NUM},
                    },
                },
                "identity_checked": {"type": "boolean", "description": "greedy: outputs had to be identical"},
                "identical_outputs": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "prompts with equal output",
                },
            },
        },
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "source", "prompt_tokens", "plain", "dflash", "speedup", "identical"],
                "properties": {
                    "index": _INT,
                    "source": {"type": "string"},
                    "prompt_tokens": _INT,
                    "plain": _RUN,
                    "dflash": _RUN,
                    "speedup": _NUM,
                    "identical": {"type": "boolean"},
                },
            },
        },
    },
}
_LEVEL = {
    "type": "object",
    "required": [
        "concurrency",
        "repeats",
        "num_requests",
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_tokens",
        "output_tokens_per_s",
        "ttft_s",
        "itl_s",
        "tpot_s",
        "e2e_latency_s",
        "mean_acceptance_length",
        "dflash",
        "errors",
        "spread",
        "rounds",
    ],
    "properties": {
        "concurrency": {"type": "integer", "minimum": 1},
        "repeats": {"type": "integer", "minimum": 1, "description": "rounds run at this level"},
        "num_requests": _INT,
        "completed": _INT,
        "failed": _INT,
        "duration_s": _NUM,
        "request_throughput": _NUM,
        "output_tokens": _INT,
        "output_tokens_per_s": _NUM,
        "ttft_s": _DIST,
        "itl_s": _DIST,
        "tpot_s": _DIST,
        "e2e_latency_s": _DIST,
        "mean_acceptance_length": _NUM_OR_NULL,
        "dflash": {
            "type": ["object", "null"],
            "description": "sums of the servers' per-request dflash fields; null when it sends none",
            "required": ["num_drafts", "num_draft_tokens", "num_accepted_tokens"],
            "properties": {k: _INT for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        },
        "errors": {"type": "array", "items": {"type": "string"}, "description": "the first few failures"},
        "spread": {
            "type": "object",
            "description": "run-to-run spread of the level's throughput over its rounds",
            "required": ["output_tokens_per_s", "request_throughput"],
            "properties": {"output_tokens_per_s": _SPREAD, "request_throughput": _SPREAD},
        },
        "rounds": {"type": "array", "items": _ROUND, "minItems": 1},
    },
}
SERVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "mode",
        "created",
        "command",
        "environment",
        "label",
        "config",
        "server",
        "levels",
        "comparison",
    ],
    "properties": {
        **_COMMON,
        "mode": {"const": "serve"},
        "label": {"type": "string"},
        "config": {
            "type": "object",
            "required": [
                "base_url",
                "model",
                "dataset",
                "max_tokens",
                "temperature",
                "concurrency",
                "repeats",
                "min_duration_s",
            ],
            "properties": {
                "base_url": {"type": "string"},
                "model": {"type": "string"},
                "dataset": {"type": "string"},
                "max_tokens": {"type": "integer", "minimum": 1},
                "temperature": _NUM,
                "top_p": _NUM,
                "seed": {"type": "integer"},
                "concurrency": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "num_prompts": {"type": ["integer", "null"]},
                "repeats": {"type": "integer", "minimum": 1, "description": "least rounds per level"},
                "min_duration_s": {"type": "number", "minimum": 0, "description": "least seconds per level"},
            },
        },
        "server": {"type": "object", "description": "the model entry of /v1/models, as the server sent it"},
        "levels": {"type": "array", "items": _LEVEL},
        "comparison": {
            "type": ["object", "null"],
            "required": ["baseline_label", "baseline_file", "levels"],
            "properties": {
                "baseline_label": {"type": "string"},
                "baseline_file": {"type": "string"},
                "levels": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": [
                            "concurrency",
                            "output_throughput_speedup",
                            "request_throughput_speedup",
                            "ttft_p50_ratio",
                            "itl_p50_ratio",
                            "tpot_p50_ratio",
                        ],
                        "properties": {
                            "concurrency": {"type": "integer"},
                            "output_throughput_speedup": _NUM_OR_NULL,
                            "request_throughput_speedup": _NUM_OR_NULL,
                            "ttft_p50_ratio": _NUM_OR_NULL,
                            "itl_p50_ratio": _NUM_OR_NULL,
                            "tpot_p50_ratio": _NUM_OR_NULL,
                        },
                    },
                },
            },
        },
    },
}
BENCH_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dflash-bench result",
    "description": "The JSON written by `dflash-bench offline` or `dflash-bench serve` (the module "
    "docstring says how every figure is measured). Ratios: *_speedup = baseline time / this time (or "
    "this throughput / baseline throughput), > 1 is faster; *_ratio = this latency / baseline latency.",
    "oneOf": [OFFLINE_SCHEMA, SERVE_SCHEMA],
}


class BenchError(RuntimeError):
    """A failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class IdentityError(BenchError):
    """Greedy DFlash output differs from plain decoding."""

    def __init__(self, index: int, position: int, plain: list[int], dflash: list[int]) -> None:
        a = plain[position] if position < len(plain) else "end of output"
        b = dflash[position] if position < len(dflash) else "end of output"
        super().__init__(
            f"greedy DFlash output differs from plain decoding: prompt {index}, first difference at output "
            f"position {position} (plain: {a}, DFlash: {b}; lengths {len(plain)} / {len(dflash)})",
            code=3,
        )
        self.index, self.position = index, position


# ---- prompts -------------------------------------------------------------------------------------


@dataclass
class Prompt:
    messages: list[Message]
    source: str


_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# name -> (load_dataset args, split, row -> user message); formats as in z-lab's DFlash benchmark.
HF_DATASETS: dict[str, tuple[tuple[str, ...], str, Callable[[dict[str, Any]], str]]] = {
    "gsm8k": (("openai/gsm8k", "main"), "test", lambda r: r["question"] + _REASON),
    "math500": (("HuggingFaceH4/MATH-500",), "test", lambda r: r["problem"] + _REASON),
    "humaneval": (
        ("openai/openai_humaneval",),
        "test",
        lambda r: (
            "Write a solution to the following problem "
            "and make sure that it passes the tests:\n```python\n" + r["prompt"] + "\n```"
        ),
    ),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", lambda r: r["prompt"]),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", lambda r: r["prompt"][0]),
}
DATASET_CHOICES = ("all", *SHIPPED_SETS, "heldout", *HF_DATASETS)


def _row_messages(row: dict[str, Any], where: str) -> list[Message]:
    if isinstance(row.get("messages"), list) and row["messages"]:
        msgs = row["messages"]
        if msgs[-1].get("role") == "assistant" and len(msgs) > 1:
            msgs = msgs[:-1]
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": str(row["turns"][0])}]
    raise BenchError(f"{where}: expected 'messages', 'prompt' or 'turns'")


def read_jsonl(path: str | Path, source: str) -> list[Prompt]:
    """Prompts from a JSONL file; a trailing assistant message (a reference answer) is dropped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Prompt(_row_messages(json.loads(line), f"{path}:{i}"), source))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise BenchError(f"{path}:{i}: not a prompt row ({type(exc).__name__}: {exc})") from None
    if not out:
        raise BenchError(f"{path}: no prompts")
    return out


def shipped_prompts(name: str) -> list[Prompt]:
    """One of the prompt sets shipped in dflash_core/prompts."""
    ref = resources.files("dflash_core") / "prompts" / f"{name}.jsonl"
    with resources.as_file(ref) as path:
        return read_jsonl(path, name)


def hf_prompts(name: str) -> list[Prompt]:
    """A public benchmark through `datasets` (network needed the first time)."""
    hint = (
        f"dataset {name!r} is downloaded from the Hugging Face hub: it needs network access and "
        f"`pip install datasets`. The shipped sets chat, math, code and all work offline."
    )
    try:
        import datasets
    except ImportError:
        raise BenchError(f"{hint} (the datasets package is not installed)") from None
    args, split, fmt = HF_DATASETS[name]
    try:
        rows = datasets.load_dataset(*args, split=split)
    except Exception as exc:  # offline, hub unreachable, gated: one message
        raise BenchError(f"{hint} ({type(exc).__name__}: {exc})") from None
    return [Prompt([{"role": "user", "content": fmt(dict(row))}], name) for row in rows]


def load_prompts(dataset: str, num_prompts: int | None, seed: int = 0) -> list[Prompt]:
    """`num_prompts` prompts of a set (all when None): the first ones of a shipped set, a seeded sample of
    a downloaded one; a set with fewer prompts is cycled."""
    if dataset == "all":
        sets = [shipped_prompts(n) for n in SHIPPED_SETS]
        prompts = [p for group in zip(*sets) for p in group]
    elif dataset in SHIPPED_SETS:
        prompts = shipped_prompts(dataset)
    elif dataset == "heldout":
        path = Path(__file__).resolve().parent / "demo" / "heldout_prompts.jsonl"
        if not path.exists():
            raise BenchError(f"the demo's held-out set is missing at {path}")
        prompts = read_jsonl(path, "heldout")
    elif dataset in HF_DATASETS:
        prompts = hf_prompts(dataset)
        if num_prompts is not None and num_prompts < len(prompts):
            prompts = random.Random(seed).sample(prompts, num_prompts)
    elif Path(dataset).is_file():
        prompts = read_jsonl(dataset, Path(dataset).stem)
    else:
        raise BenchError(
            f"unknown dataset {dataset!r}: choose one of {', '.join(DATASET_CHOICES)} or a .jsonl file"
        )
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def encode_chat(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of a chat as dflash-serve builds them: the chat template with the generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


# ---- statistics ----------------------------------------------------------------------------------


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (nearest rank); None without values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(float(v) for v in values)
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs)}
    for q in (50, 90, 99):
        out[f"p{q}"] = xs[max(math.ceil(q / 100 * len(xs)) - 1, 0)]
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def environment() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": None,
        "torch_threads": None,
        "gpu": None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dflash_serve": _version(),
    }
    if "torch" in sys.modules:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _version() -> str:
    from dflash_core import __version__

    return __version__


def _header(mode: str, argv: Sequence[str] | None) -> dict[str, Any]:
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["dflash-bench", *args]),
    }


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)


# ---- offline -------------------------------------------------------------------------------------


def _run_request(engine: Any, prompt_ids: list[int], params: Any) -> tuple[list[int], dict[str, Any]]:
    """One request alone on `engine`, timed; (output token ids, measurements)."""
    t0 = time.perf_counter()
    try:
        rid = engine.add_request(prompt_ids, params)
    except ValueError as exc:  # e.g. prompt + max_tokens beyond the context
        raise BenchError(f"the engine refused a request: {exc}") from None
    tokens: list[int] = []
    ttft: float | None = None
    finish: str | None = None
    while finish is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if out.error:
                raise BenchError(f"the engine failed: {out.error}", code=1)
            tokens.extend(out.new_token_ids)
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            finish = out.finish_reason
    total = time.perf_counter() - t0
    stats = engine.stats(rid)
    engine.release(rid)
    ttft = total if ttft is None else ttft
    n = len(tokens)
    run: dict[str, Any] = {
        "output_tokens": n,
        "time_s": total,
        "ttft_s": ttft,
        "decode_tokens_per_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else None,
        "finish_reason": finish,
    }
    if engine.drafter is not None:
        # A last step with a single token left verifies no draft; it is not a draft/verify step.
        lengths = list(stats.acceptance_lengths)[: stats.num_drafts]
        run.update(
            num_drafts=stats.num_drafts,
            num_accepted_tokens=stats.num_accepted_tokens,
            mean_acceptance_length=stats.mean_acceptance_length,
            acceptance_lengths=lengths,
        )
    return tokens, run


def _engine_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["output_tokens"] for r in runs)
    total = sum(r["time_s"] for r in runs)
    decode_tokens = sum(max(r["output_tokens"] - 1, 0) for r in runs)
    decode_time = sum(r["time_s"] - r["ttft_s"] for r in runs)
    return {
        "output_tokens": tokens,
        "total_time_s": total,
        "output_tokens_per_s": tokens / total if total > 0 else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 and decode_tokens else None,
        "ttft_s": distribution([r["ttft_s"] for r in runs]),
    }


def run_offline(
    prompts: list[Prompt],
    *,
    target: str | None = None,
    draft: str | None = None,
    tokenizer: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    block_size: int | None = None,
    backend: str = "auto",
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
    dataset: str = "custom",
) -> dict[str, Any]:
    """Plain decoding and DFlash on the same target, interleaved prompt by prompt: the `offline` result
    without its header. Raises IdentityError when greedy outputs differ. No target: the demo pair."""
    from dflash_core.engine import Engine
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams

    if target is not None and draft is None:
        raise BenchError("offline needs a draft (--draft) to compare with plain decoding")
    t0 = time.perf_counter()
    try:
        models = load_models(
            target, draft, tokenizer, device=device, dtype=dtype, block_size=block_size, backend=backend
        )
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(f"cannot load the models: {exc}") from None
    load_time = time.perf_counter() - t0
    dflash = models.engine
    if dflash.drafter is None:
        raise BenchError("offline needs a draft with block size >= 2")
    plain = Engine(
        dflash.target, None, eos_token_ids=dflash.eos_token_ids, max_model_len=dflash.max_model_len
    )
    bsz = dflash.block_size
    encoded = [encode_chat(models.tokenizer, p.messages) for p in prompts]

    def params(i: int, n: int = max_tokens) -> Any:
        return SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i)

    greedy = params(0).greedy  # the engine's rule: temperature below SAMPLING_EPS is greedy
    if warmup and encoded:
        for eng in (plain, dflash):
            _run_request(eng, encoded[0], params(-1, min(max_tokens, 16)))
    rows: list[dict[str, Any]] = []
    bar = _progress(len(prompts), "offline", progress)
    try:
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            order = (plain, dflash) if i % 2 == 0 else (dflash, plain)
            results = {id(eng): _run_request(eng, ids, params(i)) for eng in order}
            (p_tok, p_run), (d_tok, d_run) = results[id(plain)], results[id(dflash)]
            identical = p_tok == d_tok
            if greedy and not identical:
                pos = next(
                    (k for k, (a, b) in enumerate(zip(p_tok, d_tok)) if a != b), min(len(p_tok), len(d_tok))
                )
                raise IdentityError(i, pos, p_tok, d_tok)
            rows.append(
                {
                    "index": i,
                    "source": prompt.source,
                    "prompt_tokens": len(ids),
                    "plain": p_run,
                    "dflash": d_run,
                    "speedup": p_run["time_s"] / d_run["time_s"],
                    "identical": identical,
                }
            )
            bar.update(1)
    finally:
        bar.close()

    counts = [0] * bsz
    for r in rows:
        for a in r["dflash"]["acceptance_lengths"]:
            counts[min(a, bsz) - 1] += 1
    steps = sum(counts)
    drafts = sum(r["dflash"]["num_drafts"] for r in rows)
    accepted = sum(r["dflash"]["num_accepted_tokens"] for r in rows)
    per_prompt_al = [r["dflash"]["mean_acceptance_length"] for r in rows]
    p_sum, d_sum = _engine_summary([r["plain"] for r in rows]), _engine_summary([r["dflash"] for r in rows])
    summary = {
        "num_prompts": len(rows),
        "block_size": bsz,
        "plain": p_sum,
        "dflash": d_sum,
        "speedup": p_sum["total_time_s"] / d_sum["total_time_s"] if d_sum["total_time_s"] > 0 else 0.0,
        "mean_prompt_speedup": sum(r["speedup"] for r in rows) / len(rows) if rows else 0.0,
        "decode_speedup": _ratio(d_sum["decode_tokens_per_s"], p_sum["decode_tokens_per_s"]),
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "mean_acceptance_length_per_prompt": sum(per_prompt_al) / len(per_prompt_al) if rows else 1.0,
        "acceptance_histogram": {
            "counts": counts,
            "fractions": [c / steps if steps else 0.0 for c in counts],
        },
        "identity_checked": greedy,
        "identical_outputs": sum(r["identical"] for r in rows),
    }
    config = {
        "target": models.target_name,
        "draft": str(models.draft_name),
        "tokenizer": tokenizer,
        "dataset": dataset,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "block_size": bsz,
        "device": models.device,
        "dtype": models.dtype,
        "backend": models.backend,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "load_time_s": load_time,
    }
    return {"environment": environment(), "config": config, "summary": summary, "prompts": rows}


# ---- serve ---------------------------------------------------------------------------------------


def _itl_samples(chunk_times: list[float], tokens: int) -> list[float]:
    """Per-token latencies of one stream: the gap before each content chunk after the first, divided by
    the mean number of tokens per chunk."""
    if len(chunk_times) < 2 or tokens < 2:
        return []
    per_chunk = tokens / len(chunk_times)
    return [(b - a) / per_chunk for a, b in zip(chunk_times, chunk_times[1:])]


async def _stream_request(
    client: Any,
    model: str,
    messages: list[Message],
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> dict[str, Any]:
    """One streamed chat completion, timed chunk by chunk."""
    start = time.perf_counter()
    chunks: list[float] = []  # arrival times of chunks with content
    usage_tokens: int | None = None
    spec: dict[str, Any] | None = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or []:
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    chunks.append(now)
            if chunk.usage is not None:
                usage_tokens = int(chunk.usage.completion_tokens)
            extra = chunk.model_extra or {}
            if isinstance(extra.get("dflash"), dict):
                spec = extra["dflash"]
    except Exception as exc:  # a failed request is counted and reported, the sweep goes on
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(chunks)
    ttft = chunks[0] - start if chunks else end - start
    e2e = end - start
    itl = _itl_samples(chunks, tokens)
    return {
        "ok": True,
        "tokens": tokens,
        "ttft": ttft,
        "e2e": e2e,
        "itl": itl,
        "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None,
        "spec": spec,
    }


def _round_result(results: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """One round of a level: its requests and their wall time."""
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
    }


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """min, max and sample standard deviation (None under 2 values) of per-round figures."""
    xs = [float(v) for v in values]
    return {"min": min(xs), "max": max(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else None}


def _level_result(
    concurrency: int, results: list[dict[str, Any]], duration: float, rounds: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A level's figures over all its requests; `duration` is the total wall time of its rounds."""
    rounds = rounds or [_round_result(results, duration)]
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    specs = [r["spec"] for r in ok if r["spec"] is not None]
    spec_sum = None
    mean_al = None
    if ok and len(specs) == len(ok):
        spec_sum = {
            k: sum(int(s.get(k, 0)) for s in specs)
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
        d = spec_sum["num_drafts"]
        mean_al = 1.0 + spec_sum["num_accepted_tokens"] / d if d else 1.0
    return {
        "concurrency": concurrency,
        "repeats": len(rounds),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "ttft_s": distribution([r["ttft"] for r in ok]),
        "itl_s": distribution([v for r in ok for v in r["itl"]]),
        "tpot_s": distribution([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_latency_s": distribution([r["e2e"] for r in ok]),
        "mean_acceptance_length": mean_al,
        "dflash": spec_sum,
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "spread": {
            "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in rounds]),
            "request_throughput": spread([r["request_throughput"] for r in rounds]),
        },
        "rounds": rounds,
    }


def default_num_prompts(concurrency: int) -> int:
    """Requests per concurrency level by default: enough to fill the slots a few times, bounded."""
    return min(max(2 * concurrency, 4), 32)


async def _serve_async(
    base_url: str,
    api_key: str,
    model: str | None,
    prompts: list[Prompt],
    concurrency: list[int],
    num_prompts: int | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    timeout: float,
    progress: bool,
    repeats: int = 1,
    min_duration: float = 0.0,
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    try:
        try:
            entries = [m.model_dump() for m in (await client.models.list()).data]
        except openai.APIError as exc:
            if model is None or isinstance(exc, openai.APIConnectionError):
                raise BenchError(
                    f"cannot list models at {base_url}/models: {type(exc).__name__}: {exc}"
                ) from None
            entries = []  # --model given: a server without /models is fine
        if model is None:
            if not entries:
                raise BenchError(f"{base_url}/models lists no model; pass --model")
            model = str(entries[0]["id"])
        info = next((e for e in entries if e.get("id") == model), {"id": model})

        warm = await _stream_request(
            client, model, prompts[0].messages, min(max_tokens, 8), temperature, top_p, seed
        )
        if not warm["ok"]:
            raise BenchError(f"the warm-up request failed: {warm['error']}")
        counts = [num_prompts or default_num_prompts(c) for c in concurrency]
        bar = _progress(sum(counts) * repeats, "serve", progress)
        levels = []
        try:
            for c, n in zip(concurrency, counts):
                sem = asyncio.Semaphore(c)

                async def one(i: int, sem: asyncio.Semaphore = sem) -> dict[str, Any]:
                    async with sem:
                        r = await _stream_request(
                            client,
                            model,
                            prompts[i % len(prompts)].messages,
                            max_tokens,
                            temperature,
                            top_p,
                            seed + i,
                        )
                    bar.update(1)
                    return r

                bar.set_description(f"serve c={c}")
                results: list[dict[str, Any]] = []
                rounds: list[dict[str, Any]] = []
                elapsed = 0.0
                # rounds until both minimums are met; every round sends the same requests
                while len(rounds) < repeats or elapsed < min_duration:
                    if len(rounds) >= repeats:
                        bar.total += n
                        bar.refresh()
                    t0 = time.perf_counter()
                    batch = list(await asyncio.gather(*(one(i) for i in range(n))))
                    took = time.perf_counter() - t0
                    elapsed += took
                    results += batch
                    rounds.append(_round_result(batch, took))
                levels.append(_level_result(c, results, elapsed, rounds))
        finally:
            bar.close()
    finally:
        await client.close()
    return model, info, levels


def compare_levels(result: dict[str, Any], baseline: dict[str, Any], baseline_file: str) -> dict[str, Any]:
    """Speedups of `result` over `baseline` at the concurrency levels both measured."""
    base = {lv["concurrency"]: lv for lv in baseline["levels"]}
    rows = []
    for lv in result["levels"]:
        b = base.get(lv["concurrency"])
        if b is None:
            continue
        rows.append(
            {
                "concurrency": lv["concurrency"],
                "output_throughput_speedup": _ratio(lv["output_tokens_per_s"], b["output_tokens_per_s"]),
                "request_throughput_speedup": _ratio(lv["request_throughput"], b["request_throughput"]),
                "ttft_p50_ratio": _ratio(lv["ttft_s"]["p50"], b["ttft_s"]["p50"]),
                "itl_p50_ratio": _ratio(lv["itl_s"]["p50"], b["itl_s"]["p50"]),
                "tpot_p50_ratio": _ratio(lv["tpot_s"]["p50"], b["tpot_s"]["p50"]),
            }
        )
    return {"baseline_label": baseline["label"], "baseline_file": baseline_file, "levels": rows}


def _auto_label(info: dict[str, Any], model: str) -> str:
    spec = info.get("dflash")
    if isinstance(spec, dict):
        return "dflash" if spec.get("draft") and int(spec.get("block_size") or 1) > 1 else "baseline"
    return model


def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def run_serve(
    base_url: str,
    prompts: list[Prompt],
    *,
    api_key: str = "EMPTY",
    model: str | None = None,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    num_prompts: int | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    timeout: float = 600.0,
    label: str | None = None,
    dataset: str = "custom",
    progress: bool = True,
    repeats: int = DEFAULT_REPEATS,
    min_duration: float = DEFAULT_MIN_DURATION_S,
) -> dict[str, Any]:
    """The concurrency sweep against an OpenAI-compatible server; the `serve` result (without the header).

    Each level runs rounds of its requests until it has run at least `repeats` rounds and `min_duration`
    seconds."""
    model, info, levels = asyncio.run(
        _serve_async(
            base_url,
            api_key,
            model,
            prompts,
            list(concurrency),
            num_prompts,
            max_tokens,
            temperature,
            top_p,
            seed,
            timeout,
            progress,
            repeats,
            min_duration,
        )
    )
    config = {
        "base_url": base_url,
        "model": model,
        "dataset": dataset,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "concurrency": list(concurrency),
        "num_prompts": num_prompts,
        "repeats": repeats,
        "min_duration_s": min_duration,
    }
    return {
        "environment": environment(),
        "label": label or _auto_label(info, model),
        "config": config,
        "server": info,
        "levels": levels,
        "comparison": None,
    }


# ---- memory -------------------------------------------------------------------------------------

# config.json fields of the preset models. Targets: their published configs. Drafts (they share the target's
# embeddings and head): assumed, not read from the hub: 5 layers with the target's layer shapes (z-lab's
# Qwen3-8B-DFlash-b16 reads 5 target layers, [1, 9, 17, 25, 33], one per draft layer). A local folder's
# config.json replaces these (memory_estimate with a path).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960, qk_norm=True),
    "Qwen/Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=40960, qk_norm=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                             vocab_size=128256, tie_word_embeddings=False,
                                             max_position_embeddings=131072, qk_norm=False),
    "z-lab/Qwen3-8B-DFlash-b16": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                                      target_layer_ids=[1, 9, 17, 25, 33], qk_norm=True),
    "z-lab/Qwen3-4B-DFlash-b16": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=5,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                                      target_layer_ids=[1, 9, 17, 25, 33], qk_norm=True),
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": dict(hidden_size=4096, intermediate_size=14336,
                                                        num_hidden_layers=5, num_attention_heads=32,
                                                        num_key_value_heads=8, head_dim=128, block_size=16,
                                                        target_layer_ids=[1, 8, 15, 22, 29], qk_norm=True),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
GB = 1e9


def _model_shape(name: str) -> dict[str, Any]:
    """config.json fields of a preset model, or of a local folder's config.json."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        raise BenchError(f"unknown model {name!r}: pass a local folder with a config.json, or one of "
                         f"{', '.join(MODEL_SHAPES)}")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg = {**cfg, **cfg.get("text_config", {})}
    dflash = cfg.get("dflash_config") or {}
    heads = int(cfg["num_attention_heads"])
    return {
        **cfg,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "qk_norm": cfg.get("model_type") in ("qwen3", None) or "DFlashDraftModel" in cfg.get("architectures", []),
        "target_layer_ids": dflash.get("target_layer_ids") or cfg.get("target_layer_ids") or [],
        "block_size": cfg.get("block_size") or dflash.get("block_size"),
    }


def _layer_params(m: dict[str, Any]) -> int:
    """One decoder layer: attention (q, k, v, o; q/k norms for Qwen3), gated MLP, two RMSNorms."""
    h, hd = int(m["hidden_size"]), int(m["head_dim"])
    q, kv = int(m["num_attention_heads"]) * hd, int(m["num_key_value_heads"]) * hd
    attn = h * q + 2 * h * kv + q * h + (2 * hd if m.get("qk_norm") else 0)
    return attn + 3 * h * int(m["intermediate_size"]) + 2 * h


def target_params(m: dict[str, Any]) -> int:
    """Parameters of a dense decoder LM: embeddings (+ an untied head), layers, final norm."""
    h, v = int(m["hidden_size"]), int(m["vocab_size"])
    heads = v * h * (1 if m.get("tie_word_embeddings") else 2)
    return heads + int(m["num_hidden_layers"]) * _layer_params(m) + h


def draft_params(m: dict[str, Any]) -> int:
    """A DFlash draft's own parameters: fc (features of len(ids) target layers -> hidden), hidden_norm, layers,
    norm (it uses the target's embeddings and head)."""
    h = int(m["hidden_size"])
    return len(m["target_layer_ids"]) * h * h + h + int(m["num_hidden_layers"]) * _layer_params(m) + h


def kv_bytes_per_row(m: dict[str, Any], dtype_bytes: int) -> int:
    """Keys + values of one position over all layers."""
    return 2 * int(m["num_hidden_layers"]) * int(m["num_key_value_heads"]) * int(m["head_dim"]) * dtype_bytes


def memory_estimate(
    target: str,
    draft: str | None,
    *,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    max_running_requests: int = 8,
    block_size: int | None = None,
) -> dict[str, Any]:
    """GPU memory the native backend allocates up front, in bytes: weights, and the slot KV caches it
    preallocates (dflash_core.loading): the target's `max_running_requests x (max_model_len + B + 1)` rows and
    the draft's one row more per slot. Activations, the CUDA context and allocator slack come on top."""
    t = _model_shape(target)
    d = _model_shape(draft) if draft else None
    nbytes = DTYPE_BYTES.get(dtype)
    if nbytes is None:
        raise BenchError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_BYTES)}")
    block = int(block_size or (d or {}).get("block_size") or 1) if d else 1
    length = int(max_model_len or t["max_position_embeddings"])
    rows = length + block + 1
    out: dict[str, Any] = {
        "target": target,
        "draft": draft,
        "dtype": dtype,
        "max_model_len": length,
        "max_running_requests": max_running_requests,
        "block_size": block,
        "target_params": target_params(t),
        "draft_params": draft_params(d) if d else 0,
        "target_kv_rows": rows,
        "draft_kv_rows": rows + 1 if d else 0,
    }
    out["weights_bytes"] = (out["target_params"] + out["draft_params"]) * nbytes
    out["target_kv_bytes"] = kv_bytes_per_row(t, nbytes) * rows * max_running_requests
    out["draft_kv_bytes"] = kv_bytes_per_row(d, nbytes) * (rows + 1) * max_running_requests if d else 0
    out["total_bytes"] = out["weights_bytes"] + out["target_kv_bytes"] + out["draft_kv_bytes"]
    return out


def memory_from_preset(path: Path) -> dict[str, Any]:
    """memory_estimate for a configs/*.yaml preset."""
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BenchError(f"cannot read preset {path}: {exc}") from None
    if not cfg.get("target"):
        raise BenchError(f"{path}: no target (the bundled demo pair is a few MB)")
    est = memory_estimate(
        cfg["target"],
        cfg.get("draft") if cfg.get("speculative", True) else None,
        dtype=cfg.get("dtype") or "auto",
        max_model_len=cfg.get("max_model_len"),
        max_running_requests=int(cfg.get("max_running_requests") or 8),
        block_size=cfg.get("block_size"),
    )
    return {"preset": str(path), **est}


def format_memory(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of memory estimates (GB = 1e9 bytes)."""
    head = ("| preset | target + draft | weights GB | target KV GB | draft KV GB | total GB |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        slots = f"{r['max_running_requests']} x {r['target_kv_rows']:,} rows"
        lines.append(
            f"| `{Path(r['preset']).name}` | {r['target']} ({r['target_params'] / 1e9:.2f} B params) + "
            f"{r['draft'] or 'no draft'} ({r['draft_params'] / 1e9:.2f} B), {r['dtype']} | "
            f"{r['weights_bytes'] / GB:.1f} | {r['target_kv_bytes'] / GB:.1f} ({slots}) | "
            f"{r['draft_kv_bytes'] / GB:.1f} | **{r['total_bytes'] / GB:.1f}** |"
        )
    return "\n".join(lines)


# ---- tables --------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain text, columns right-aligned except the first."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _f(x: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _pcts(d: dict[str, float | None]) -> str:
    return "/".join(_f(d[k], ".0f" if (d[k] or 0) >= 0.1 else ".1f", 1000) for k in ("p50", "p90", "p99"))


def format_offline(result: dict[str, Any]) -> str:
    """The terminal report of an offline run: per-prompt rows, then the side-by-side summary."""
    cfg, s = result["config"], result["summary"]
    per_prompt = _table(
        ["prompt", "set", "in", "out", "plain ms", "dflash ms", "speedup", "accept len"],
        [
            [
                str(r["index"]),
                r["source"],
                str(r["prompt_tokens"]),
                str(r["dflash"]["output_tokens"]),
                _f(r["plain"]["time_s"], ".0f", 1000),
                _f(r["dflash"]["time_s"], ".0f", 1000),
                _f(r["speedup"]) + "x",
                _f(r["dflash"]["mean_acceptance_length"]),
            ]
            for r in result["prompts"]
        ],
    )
    p, d = s["plain"], s["dflash"]
    summary = _table(
        ["", "plain", "DFlash"],
        [
            ["output tokens", str(p["output_tokens"]), str(d["output_tokens"])],
            ["total time (s)", _f(p["total_time_s"]), _f(d["total_time_s"])],
            ["output tokens/s", _f(p["output_tokens_per_s"], ".1f"), _f(d["output_tokens_per_s"], ".1f")],
            ["decode tokens/s", _f(p["decode_tokens_per_s"], ".1f"), _f(d["decode_tokens_per_s"], ".1f")],
            ["TTFT mean (ms)", _f(p["ttft_s"]["mean"], ".1f", 1000), _f(d["ttft_s"]["mean"], ".1f", 1000)],
            ["TTFT p50/p90/p99 (ms)", _pcts(p["ttft_s"]), _pcts(d["ttft_s"])],
            ["mean acceptance length", "1.00", _f(s["mean_acceptance_length"])],
            ["speedup (total time)", "", _f(s["speedup"]) + "x"],
            ["speedup (mean per prompt)", "", _f(s["mean_prompt_speedup"]) + "x"],
            ["decode speedup", "", _f(s["decode_speedup"]) + "x"],
        ],
    )
    hist = "  ".join(f"{k + 1}:{100 * f:.0f}%" for k, f in enumerate(s["acceptance_histogram"]["fractions"]))
    check = (
        f"greedy outputs identical: {s['identical_outputs']}/{s['num_prompts']}"
        if s["identity_checked"]
        else f"sampled (T={cfg['temperature']}): identity not required; equal outputs "
        f"{s['identical_outputs']}/{s['num_prompts']}"
    )
    head = (
        f"dflash-bench offline: target {cfg['target']}, draft {cfg['draft']}, B={cfg['block_size']}, "
        f"{cfg['device']} {cfg['dtype']}, dataset {cfg['dataset']} ({cfg['num_prompts']} prompts), "
        f"max_tokens {cfg['max_tokens']}, T={cfg['temperature']}"
    )
    return "\n\n".join([head, per_prompt, summary, f"acceptance length histogram (1..B): {hist}", check])


def format_serve(result: dict[str, Any]) -> str:
    """The terminal report of a serve run, with the comparison when there is one."""
    cfg = result["config"]
    rows = []
    for lv in result["levels"]:
        tps = lv["spread"]["output_tokens_per_s"]
        rows.append(
            [
                str(lv["concurrency"]),
                f"{lv['completed']}/{lv['num_requests']}",
                str(lv["repeats"]),
                _f(lv["duration_s"], ".1f"),
                _f(lv["request_throughput"]),
                _f(lv["output_tokens_per_s"], ".1f"),
                f"{_f(tps['min'], '.0f')}-{_f(tps['max'], '.0f')}",
                _f(tps["stdev"], ".1f"),
                _pcts(lv["ttft_s"]),
                _pcts(lv["itl_s"]),
                _pcts(lv["tpot_s"]),
                _f(lv["mean_acceptance_length"]),
            ]
        )
    table = _table(
        [
            "conc",
            "ok",
            "rounds",
            "time s",
            "req/s",
            "out tok/s",
            "round tok/s min-max",
            "stdev",
            "TTFT p50/90/99 ms",
            "ITL p50/90/99 ms",
            "TPOT p50/90/99 ms",
            "accept len",
        ],
        rows,
    )
    head = (
        f"dflash-bench serve [{result['label']}]: {cfg['base_url']} model {cfg['model']}, dataset "
        f"{cfg['dataset']}, max_tokens {cfg['max_tokens']}, T={cfg['temperature']}; each level: at least "
        f"{cfg['repeats']} rounds and {cfg['min_duration_s']:g} s (out tok/s over all rounds; min-max and stdev "
        "over rounds)"
    )
    parts = [head, table]
    cmp = result.get("comparison")
    if cmp:
        crow = [
            [
                str(c["concurrency"]),
                _f(c["output_throughput_speedup"]) + "x",
                _f(c["request_throughput_speedup"]) + "x",
                _f(c["ttft_p50_ratio"]),
                _f(c["itl_p50_ratio"]),
                _f(c["tpot_p50_ratio"]),
            ]
            for c in cmp["levels"]
        ]
        parts.append(
            f"{result['label']} vs {cmp['baseline_label']} ({cmp['baseline_file']}); latency ratios: "
            f"{result['label']} / {cmp['baseline_label']}, lower is better"
        )
        parts.append(
            _table(
                [
                    "conc",
                    "out tok/s speedup",
                    "req/s speedup",
                    "TTFT p50 ratio",
                    "ITL p50 ratio",
                    "TPOT p50 ratio",
                ],
                crow,
            )
        )
    errors = [e for lv in result["levels"] for e in lv["errors"]]
    if errors:
        parts.append("failed requests, e.g.: " + errors[0])
    return "\n\n".join(parts)


# ---- plots ---------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_offline(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """offline_speedup.png (per prompt) and offline_acceptance.png (histogram over 1..B)."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    s, rows = result["summary"], result["prompts"]
    paths = [out_dir / "offline_speedup.png", out_dir / "offline_acceptance.png"]

    fig, ax = plt.subplots(figsize=(8, 4))
    sources = sorted({r["source"] for r in rows})
    colors = {src: f"C{i}" for i, src in enumerate(sources)}
    ax.bar(
        [r["index"] for r in rows], [r["speedup"] for r in rows], color=[colors[r["source"]] for r in rows]
    )
    line = ax.axhline(s["speedup"], color="k", linestyle="--", label=f"total time: {s['speedup']:.2f}x")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    handles = [line, *(Patch(color=colors[src], label=src) for src in sources)]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("prompt")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(
        f"DFlash vs plain decoding, B={s['block_size']}, {result['config']['device']} "
        f"(mean acceptance length {s['mean_acceptance_length']:.2f})"
    )
    ax.legend(handles=handles, fontsize=8)
    _save(plt, fig, paths[0])

    fig, ax = plt.subplots(figsize=(8, 4))
    fr = s["acceptance_histogram"]["fractions"]
    ax.bar(range(1, len(fr) + 1), [100 * f for f in fr], color="C0")
    ax.axvline(
        s["mean_acceptance_length"],
        color="k",
        linestyle="--",
        label=f"mean {s['mean_acceptance_length']:.2f}",
    )
    ax.set_xticks(range(1, len(fr) + 1))
    ax.set_xlabel("acceptance length (tokens committed per target forward)")
    ax.set_ylabel("% of draft/verify steps")
    ax.set_title("DFlash acceptance length")
    ax.legend(fontsize=8)
    _save(plt, fig, paths[1])
    return paths


def _save_serve_figure(
    plt: Any, fig: Any, axes: Any, result: dict[str, Any], ylabels: list[str], title: str, path: Path, legend: int
) -> None:
    """Both panels against concurrency (log2 axis, ticks at `result`'s levels), then title and save."""
    conc = [lv["concurrency"] for lv in result["levels"]]
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=legend)
    fig.suptitle(title)
    _save(plt, fig, path)


def plot_serve(result: dict[str, Any], out_dir: Path, baseline: dict[str, Any] | None = None) -> list[Path]:
    """serve_<label>_throughput.png and serve_<label>_latency.png against concurrency (baseline dashed)."""
    plt = _pyplot()
    name = _safe_name(result["label"])
    paths = [out_dir / f"serve_{name}_throughput.png", out_dir / f"serve_{name}_latency.png"]
    runs = [(result, "-")] + ([(baseline, "--")] if baseline else [])

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res, style in runs:
        conc = [lv["concurrency"] for lv in res["levels"]]
        for ax, key in zip(axes, ("output_tokens_per_s", "request_throughput")):
            ys = [lv[key] for lv in res["levels"]]
            lo = [max(y - lv["spread"][key]["min"], 0.0) for y, lv in zip(ys, res["levels"])]
            hi = [max(lv["spread"][key]["max"] - y, 0.0) for y, lv in zip(ys, res["levels"])]
            ax.errorbar(conc, ys, yerr=[lo, hi], fmt=style, marker="o", capsize=3, label=res["label"])
    ylabels = ["output tokens/s (bars: min-max over rounds)", "requests/s (bars: min-max over rounds)"]
    _save_serve_figure(plt, fig, axes, result, ylabels, "throughput against concurrency", paths[0], legend=8)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res, style in runs:
        conc = [lv["concurrency"] for lv in res["levels"]]
        for q, color in (("p50", "C0"), ("p90", "C1"), ("p99", "C3")):
            for ax, key in zip(axes, ("ttft_s", "itl_s")):
                ys = [lv[key][q] * 1000 if lv[key][q] is not None else math.nan for lv in res["levels"]]
                ax.plot(conc, ys, style, color=color, marker="o", label=f"{res['label']} {q}")
    ylabels = ["time to first token (ms)", "inter-token latency (ms)"]
    _save_serve_figure(plt, fig, axes, result, ylabels, "latency against concurrency", paths[1], legend=7)
    return paths


# ---- command line --------------------------------------------------------------------------------


def validate(result: dict[str, Any]) -> None:
    """Check a result against BENCH_SCHEMA (when jsonschema is installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(result, BENCH_SCHEMA)


def _write_json(result: dict[str, Any], path: Path) -> None:
    """Write, then validate (a schema failure is a bug in this module; the measurements stay on disk)."""
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    validate(result)


def _concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


# ---- the output folder ---------------------------------------------------------------------------


def _writable_dir(path: Path) -> str | None:
    """Create `path` if needed and write a probe file in it; None when that works, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dflash-bench-probe"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def default_output_dirs() -> list[Path]:
    """Where results go without --output-dir or $DFLASH_BENCH_DIR, in order: the first writable one wins."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    dirs = [Path(DEFAULT_DIR_NAME)]
    try:
        dirs.append(Path.home() / DEFAULT_DIR_NAME)
    except RuntimeError:  # no HOME and no passwd entry
        pass
    return [*dirs, Path(tempfile.gettempdir()) / f"dflash-bench-results-{uid}"]


def resolve_output_dir(explicit: Path | None) -> Path:
    """The output folder, created and checked writable before any measuring.

    --output-dir, else $DFLASH_BENCH_DIR: used as given, a BenchError (exit 2) when not writable. Else the
    first writable of ./bench-results, ~/bench-results and <temp dir>/dflash-bench-results-<uid>, with a note
    on stderr when it is not the first."""
    env = os.environ.get(BENCH_DIR_ENV, "").strip()
    if explicit is not None or env:
        path, origin = (explicit, "--output-dir") if explicit is not None else (Path(env), f"${BENCH_DIR_ENV}")
        path = path.expanduser()
        why = _writable_dir(path)
        if why:
            raise BenchError(
                f"output folder {path} ({origin}) is not writable ({why}); pass --output-dir or set "
                f"{BENCH_DIR_ENV} to a folder you can write"
            )
        return path
    skipped = []
    for path in default_output_dirs():
        why = _writable_dir(path)
        if why is None:
            if skipped:
                print(
                    f"dflash-bench: {'; '.join(skipped)}; writing results to {path} "
                    f"(--output-dir or ${BENCH_DIR_ENV} choose the folder)",
                    file=sys.stderr,
                )
            return path
        skipped.append(f"{path.absolute()} is not writable ({why})")
    raise BenchError(f"no writable output folder: {'; '.join(skipped)}; pass --output-dir or set {BENCH_DIR_ENV}")


# ---- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
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
    off.add_argument("--backend", default="auto", choices=["auto", "native", "hf"],
                     help="target forward, as dflash-serve --backend")
    off.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    off.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16"
    )
    off.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 is off")
    off.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
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
        help="comma-separated levels (default 1,2,4,8); requests per round: --num-prompts, or by "
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
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    mem = sub.add_parser(
        "memory",
        help="GPU memory of presets: weights + target KV + draft KV",
        description="GPU memory the native backend allocates at start-up for YAML presets (configs/*.yaml): "
        "weights, the target's slot KV cache and the draft's. Activations and the CUDA context come on top. "
        "Model shapes: built in for the presets' hub ids, else read from a local folder's config.json.",
        formatter_class=HelpFormatter,
    )
    mem.add_argument("presets", nargs="+", type=Path, metavar="PRESET", help="YAML preset files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`dflash-bench offline|serve ...`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode == "memory":
        try:
            print(format_memory([memory_from_preset(path) for path in args.presets]))
        except BenchError as exc:
            print(f"dflash-bench: error: {exc}", file=sys.stderr)
            return exc.code
        return 0
    if args.max_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        parser.error("--max-tokens and --num-prompts must be >= 1")
    if args.mode == "serve" and (args.repeats < 1 or args.min_duration < 0):
        parser.error("--repeats must be >= 1 and --min-duration >= 0")
    try:
        return _main(args, argv)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code


def _main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
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
    progress = not args.no_progress
    if args.mode == "offline":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
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
        )
        result = {**_header("offline", argv), **body}
        json_path = out_dir / "offline.json"
        _write_json(result, json_path)
        print(format_offline(result))
        plots = [] if args.no_plots else plot_offline(result, out_dir)
        failed = False
    else:
        body = run_serve(
            args.base_url.rstrip("/"),
            prompts,
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
        )
        result = {**_header("serve", argv), **body}
        if baseline is not None:
            result["comparison"] = compare_levels(result, baseline, str(args.compare))
        json_path = out_dir / f"serve_{_safe_name(result['label'])}.json"
        _write_json(result, json_path)
        print(format_serve(result))
        plots = [] if args.no_plots else plot_serve(result, out_dir, baseline)
        failed = any(lv["failed"] for lv in result["levels"])
    print("\nwrote " + ", ".join(str(p) for p in [json_path, *plots]))
    if failed:
        print("dflash-bench: error: some requests failed (see 'errors' in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
