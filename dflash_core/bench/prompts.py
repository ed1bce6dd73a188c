"""The prompts a benchmark runs: the shipped sets, the demo's held-out set, JSONL files and public benchmarks."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.jsonl import JSONLError, read_jsonl

SHIPPED_SETS = ("chat", "math", "code")
Message = dict[str, str]


@dataclass
class Prompt:
    """One conversation to complete (or, from recorded traffic, a prompt's token ids), and the set it came from."""

    messages: list[Message]
    source: str
    token_ids: list[int] | None = None  # a recorded request's prompt (`--record-traffic`): no chat template


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
HELDOUT_PATH = Path(__file__).resolve().parent.parent / "demo" / "heldout_prompts.jsonl"


def _row_messages(row: dict[str, Any]) -> list[Message] | None:
    """The conversation of a prompt row: `messages` (a trailing assistant message dropped), `prompt` or the first
    of `turns`; None when the row has none of them."""
    if isinstance(row.get("messages"), list) and row["messages"]:
        msgs = row["messages"]
        if msgs[-1].get("role") == "assistant" and len(msgs) > 1:
            msgs = msgs[:-1]
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": str(row["turns"][0])}]
    return None


def read_prompts(path: str | Path, source: str) -> list[Prompt]:
    """Prompts from a JSONL file; a trailing assistant message (a reference answer) is dropped."""
    try:
        rows = read_jsonl(path)
    except JSONLError as exc:  # names the file and the line
        raise BenchError(str(exc)) from None
    out = []
    for k, row in enumerate(rows):
        ids = row.get("prompt_token_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):  # a recorded request
            out.append(Prompt([], source, token_ids=ids))
            continue
        try:
            messages = _row_messages(row)
        except (KeyError, TypeError, AttributeError) as exc:
            raise BenchError(
                f"{path}:{_line_number(path, k)}: not a prompt row ({type(exc).__name__}: {exc})"
            ) from None
        if messages is None:
            raise BenchError(f"{path}:{_line_number(path, k)}: expected 'messages', 'prompt', 'turns' or "
                             f"'prompt_token_ids'")
        out.append(Prompt(messages, source))
    if not out:
        raise BenchError(f"{path}: no prompts")
    return out


def _line_number(path: str | Path, k: int) -> int:
    """The 1-based line number of row `k` of a JSONL file (`read_jsonl` skips blank lines)."""
    with open(path, encoding="utf-8") as f:
        return [n for n, line in enumerate(f, 1) if line.strip()][k]


def shipped_prompts(name: str) -> list[Prompt]:
    """One of the prompt sets shipped in dflash_core/prompts."""
    ref = resources.files("dflash_core") / "prompts" / f"{name}.jsonl"
    with resources.as_file(ref) as path:
        return read_prompts(path, name)


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
        if not HELDOUT_PATH.exists():
            raise BenchError(f"the demo's held-out set is missing at {HELDOUT_PATH}")
        prompts = read_prompts(HELDOUT_PATH, "heldout")
    elif dataset in HF_DATASETS:
        prompts = hf_prompts(dataset)
        if num_prompts is not None and num_prompts < len(prompts):
            prompts = random.Random(seed).sample(prompts, num_prompts)
    elif Path(dataset).is_file():
        prompts = read_prompts(dataset, Path(dataset).stem)
    else:
        raise BenchError(
            f"unknown dataset {dataset!r}: choose one of {', '.join(DATASET_CHOICES)} or a .jsonl file"
        )
    if num_prompts is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
