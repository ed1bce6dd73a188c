"""`dflash-bench prefix`: a multi-turn conversation behind a long system prompt, prefix caching on and off.

Each turn sends the whole conversation again (as chat UIs and agent frameworks do): the system prompt, every earlier
user message and reply, then a short new user message. With automatic prefix caching the engine finds the previous
turn's full KV blocks in its prefix index and prefills only the new tokens (`cached_tokens`), so from turn 2 on the
time to first token is a fraction of turn 1's. Both engines run in the same process, turn by turn (which goes first
alternates), each over its own block pool on the same weights; the reply of the cached run is fed back, and the
uncached run must produce the same tokens every turn (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import environment, header
from dflash_core.bench.offline import encode_prompt
from dflash_core.bench.output import resolve_output_dir
from dflash_core.cli_help import HelpFormatter

KV_BLOCK = 16
# Short user messages, one per turn (cycled past six turns).
TURNS = [
    "Convert 5 kilometers to meters.",
    "Now add 12 to that and explain the step.",
    "How many centimeters is the result?",
    "What is 12 times 7?",
    "Divide that by 4 and round down.",
    "Summarize your answers in one line.",
]
_RULE = "Rule {i}: convert units carefully, show the arithmetic, and answer briefly."


# ---- shared with `dflash-bench capacity` ----
def load_pair(target: str | None, draft: str | None, tokenizer: str | None, device: str, dtype: str,
              block_size: int | None, threads: int | None) -> dict[str, Any]:
    """The weights, tokenizer and settings of a target/draft pair (no target: the demo pair), for engines with block
    pools of our choosing. The loaded engine's own caches are dropped."""
    import torch

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from dflash_core.runners.native import NativeTarget

    if target is not None and draft is None:
        raise BenchError("this mode needs a draft (--draft) with the target")
    t0 = time.perf_counter()
    try:
        models = load_models(EngineConfig(target, draft, tokenizer, device=device, dtype=dtype,
                                          block_size=block_size, backend="native", threads=threads,
                                          speculation="fixed"))
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(f"cannot load the models: {exc}") from None
    eng = models.engine
    if type(eng.target) is not NativeTarget:  # the hybrid's recurrent state is not checkpointed yet
        raise BenchError(f"this mode runs the native attention target; {models.target_name} loads as "
                         f"{type(eng.target).__name__}")
    if eng.drafter is None:
        raise BenchError("this mode needs a draft with block size >= 2")
    pair = {
        "model": eng.target.model, "layer_ids": eng.target.layer_ids, "max_len": eng.target.max_len,
        "draft": eng.drafter.draft, "block_size": eng.block_size, "eos": eng.eos_token_ids,
        "tokenizer": models.tokenizer, "max_num_batched_tokens": eng.scheduler.max_num_batched_tokens,
        "prefill_chunk": eng.scheduler.prefill_chunk, "load_time_s": time.perf_counter() - t0,
        "config": {"target": models.target_name, "draft": str(models.draft_name), "device": models.device,
                   "dtype": models.dtype, "block_size": eng.block_size},
    }
    del models, eng  # the loaded engine's own block pool: freed before ours are allocated
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return pair


def paged_engine(pair: dict[str, Any], num_blocks: int | None, max_slots: int, max_len: int | None = None, *,
                 prefix: bool = True, draft: bool = True, kv_block: int = KV_BLOCK) -> Any:
    """An engine over the pair's weights with its own block pool of `num_blocks` blocks (None: the slot layout's,
    `max_slots` x `max_len` positions), fixed-width speculation (or the target alone: `draft=False`)."""
    from dflash_core.engine import Engine
    from dflash_core.runners.drafter import DFlashDrafter
    from dflash_core.runners.native import NativeTarget

    max_len = max_len or pair["max_len"]
    target = NativeTarget(pair["model"], pair["layer_ids"], max_slots=max_slots, max_len=max_len,
                          num_blocks=num_blocks, kv_block=kv_block)
    drafter = None
    if draft:
        drafter = DFlashDrafter(pair["draft"], target, block_size=pair["block_size"], max_slots=max_slots,
                                max_len=max_len)
    return Engine(target, drafter, eos_token_ids=pair["eos"], speculation="fixed", enable_prefix_caching=prefix,
                  max_num_batched_tokens=pair["max_num_batched_tokens"], prefill_chunk=pair["prefill_chunk"])


def params_for(max_tokens: int, temperature: float, seed: int, ignore_eos: bool = False) -> Any:
    """Greedy (temperature 0) or seeded sampling."""
    from dflash_core.sampling import SamplingParams

    sampled = dict(temperature=temperature, seed=seed) if temperature > 0 else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampled)


def timed_request(engine: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    """One request alone on `engine`: its tokens, time to first token, total time and cache figures."""
    from dflash_core.generate import iter_steps

    t0 = time.perf_counter()
    ttft, done = None, None
    with closing(iter_steps(engine, [prompt], params)) as steps:
        for req, out in steps:
            if out.error:
                raise BenchError(f"the engine failed: {out.error}", code=1)
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            if req.finished:
                done = req
    total = time.perf_counter() - t0
    if done is None or done.stats is None:
        raise BenchError("the engine ended a request without finishing it", code=1)
    return {"tokens": done.token_ids, "ttft_s": total if ttft is None else ttft, "time_s": total,
            "cached_tokens": done.stats.cached_tokens, "preemptions": done.stats.preemptions,
            "finish_reason": done.finish_reason}


def kv_stats(engine: Any) -> dict[str, Any] | None:
    """The engine's block pool counters as a dict (None: not paged)."""
    stats = engine.kv_stats()
    if stats is None:
        return None
    return {k: getattr(stats, k) for k in ("num_blocks", "block_size", "usage", "prefix_queries", "prefix_hits",
                                            "preemptions")}


# ---- the prefix mode ----
def system_prompt(tokenizer: Any, tokens: int) -> str:
    """Numbered rules, as many as make the rendered system message at least `tokens` tokens."""
    n = max(tokens // 20, 1)
    while True:
        text = " ".join(_RULE.format(i=i) for i in range(n))
        have = len(encode_prompt(tokenizer, [{"role": "system", "content": text}]))
        if have >= tokens:
            return text
        n += max((tokens - have) // 20, 1)


def run_prefix(*, target: str | None = None, draft: str | None = None, tokenizer: str | None = None,
               device: str = "auto", dtype: str = "auto", block_size: int | None = None,
               threads: int | None = None, turns: int = 6, system_tokens: int = 1000, max_tokens: int = 64,
               temperature: float = 0.0, seed: int = 0, kv_block: int = KV_BLOCK, warmup: bool = True,
               ) -> dict[str, Any]:
    """The conversation with caching on and off; the `prefix` result without its header."""
    pair = load_pair(target, draft, tokenizer, device, dtype, block_size, threads)
    tok = pair["tokenizer"]
    system = system_prompt(tok, system_tokens)
    first = encode_prompt(tok, [{"role": "system", "content": system}, {"role": "user", "content": TURNS[0]}])
    # room for the whole conversation (each turn: a user message, a reply, the template's markers) and a warm-up
    need = len(first) + turns * (max_tokens + 64) + 2 * pair["block_size"]
    if need > pair["max_len"]:
        raise BenchError(f"the conversation needs {need} positions, the model allows {pair['max_len']}: lower "
                         "--system-tokens, --turns or --max-tokens")
    num_blocks = 2 * math.ceil(need / kv_block) + 1
    engines = {name: paged_engine(pair, num_blocks, 1, prefix=name == "on", kv_block=kv_block)
               for name in ("on", "off")}
    params = params_for(max_tokens, temperature, seed)
    if warmup:  # a prompt as long as turn 1 that shares no block with it: the first long prefill's one-off costs
        warm = encode_prompt(tok, [{"role": "user", "content": system.replace("Rule", "Note")}])
        for eng in engines.values():
            timed_request(eng, warm, params_for(4, 0.0, 0))
    messages = [{"role": "system", "content": system}]
    rows: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": TURNS[turn % len(TURNS)]})
        prompt = encode_prompt(tok, messages)
        order = ("off", "on") if turn % 2 == 0 else ("on", "off")
        runs = {name: timed_request(engines[name], prompt, params) for name in order}
        on, off = runs["on"], runs["off"]
        rows.append({
            "turn": turn + 1, "prompt_tokens": len(prompt), "output_tokens": len(on["tokens"]),
            "identical": on["tokens"] == off["tokens"],
            **{f"{name}_{k}": runs[name][k] for name in ("on", "off") for k in ("cached_tokens", "ttft_s", "time_s")},
        })
        messages.append({"role": "assistant", "content": tok.decode(on["tokens"], skip_special_tokens=True)})
    for name in ("on", "off"):
        for r in rows:
            r[f"{name}_ttft_ratio"] = r[f"{name}_ttft_s"] / rows[0][f"{name}_ttft_s"]
    later = rows[1:]
    worst = max((r["on_ttft_ratio"] for r in later), default=None)
    summary = {
        "turns": turns,
        "identical_turns": sum(r["identical"] for r in rows),
        "all_identical": all(r["identical"] for r in rows),
        "max_later_ttft_ratio": worst,
        "mean_later_ttft_ratio": sum(r["on_ttft_ratio"] for r in later) / len(later) if later else None,
        "ttft_ratio_target": 0.3,
        "meets_target": worst is not None and worst <= 0.3,
        "later_cached_tokens": sum(r["on_cached_tokens"] for r in later),
        "later_prompt_tokens": sum(r["prompt_tokens"] for r in later),
        "kv": {name: kv_stats(eng) for name, eng in engines.items()},
    }
    import torch

    config = {**pair["config"], "turns": turns, "system_tokens": system_tokens, "max_tokens": max_tokens,
              "temperature": temperature, "seed": seed, "kv_block_size": kv_block, "num_blocks": num_blocks,
              "prefill_chunk": pair["prefill_chunk"], "threads": torch.get_num_threads(),
              "load_time_s": pair["load_time_s"]}
    return {"environment": environment(), "config": config, "summary": summary, "turns": rows}


def format_prefix(result: dict[str, Any]) -> str:
    """The terminal table of a prefix result."""
    from dflash_core.bench.report import _table

    cfg, s = result["config"], result["summary"]
    rows = [[str(r["turn"]), str(r["prompt_tokens"]), str(r["on_cached_tokens"]), str(r["off_cached_tokens"]),
             f"{1000 * r['on_ttft_s']:.0f}", f"{1000 * r['off_ttft_s']:.0f}", f"{r['on_ttft_ratio']:.2f}",
             f"{r['off_ttft_ratio']:.2f}", "yes" if r["identical"] else "NO"] for r in result["turns"]]
    table = _table(["turn", "prompt tok", "cached on", "cached off", "TTFT on ms", "TTFT off ms", "on / turn 1",
                    "off / turn 1", "same text"], rows)
    worst = s["max_later_ttft_ratio"]
    verdict = "-" if worst is None else f"{worst:.2f}x (target <= {s['ttft_ratio_target']}x: " \
        f"{'met' if s['meets_target'] else 'NOT met'})"
    return (f"dflash-bench prefix: {cfg['target']} + {cfg['draft']} on {cfg['device']} ({cfg['threads']} threads), "
            f"{cfg['turns']} turns behind a {cfg['system_tokens']}-token system prompt, max_tokens "
            f"{cfg['max_tokens']}, KV blocks of {cfg['kv_block_size']}\n{table}\n"
            f"turns 2-{cfg['turns']}: TTFT at most {verdict} turn 1's with caching on; "
            f"{s['identical_turns']}/{cfg['turns']} turns give the same text with caching off")


def add_parser(sub: Any) -> None:
    """The `prefix` mode's arguments."""
    p = sub.add_parser(
        "prefix", help="in-process: a 6-turn conversation, prefix caching on vs off",
        description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--turns", type=int, default=6, help="conversation turns")
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens of the system prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="reply tokens per turn")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, device and output options of the in-process KV modes (prefix, capacity)."""
    p.add_argument("--target", help="target folder or hub id (default: the bundled demo pair)")
    p.add_argument("--draft", help="DFlash draft folder or hub id (default: the demo draft)")
    p.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the target's)")
    p.add_argument("--block-size", type=int, help="DFlash block size (default: the draft's)")
    p.add_argument("--kv-block-size", type=int, default=KV_BLOCK, help="positions per KV block")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, as dflash-serve)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; above, request i samples with seed + i")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--output-dir", type=Path, default=None, help="folder for the JSON (default: as offline)")


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `add_model_args`' options."""
    return dict(target=args.target, draft=args.draft, tokenizer=args.tokenizer, device=args.device,
                dtype=args.dtype, block_size=args.block_size, threads=args.threads, temperature=args.temperature,
                seed=args.seed, kv_block=args.kv_block_size)


def write_result(mode: str, body: dict[str, Any], argv: Any, output_dir: Path | None) -> Path:
    """The result with its header, as `<output dir>/<mode>.json`."""
    import json

    path = resolve_output_dir(output_dir) / f"{mode}.json"
    path.write_text(json.dumps({**header(mode, argv), **body}, indent=2) + "\n", encoding="utf-8")
    return path


def main(args: argparse.Namespace, argv: Any = None) -> int:
    """Run the mode; 1 when a turn's text differs with caching off."""
    if min(args.turns, args.system_tokens, args.max_tokens, args.kv_block_size) < 1:
        print("dflash-bench: error: --turns, --system-tokens, --max-tokens and --kv-block-size must be >= 1",
              file=sys.stderr)
        return 2
    try:
        body = run_prefix(turns=args.turns, system_tokens=args.system_tokens, max_tokens=args.max_tokens,
                          warmup=not args.no_warmup, **model_kwargs(args))
        path = write_result("prefix", body, argv, args.output_dir)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code
    print(format_prefix(body) + f"\nwrote {path}")
    if not body["summary"]["all_identical"]:
        print("dflash-bench: error: the text differs with prefix caching off", file=sys.stderr)
        return 1
    return 0
