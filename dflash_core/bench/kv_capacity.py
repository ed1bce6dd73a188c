"""`dflash-bench capacity`: how many requests one KV budget runs with the block pool, and preemption when it is short.

Concurrency: the budget is the blocks of the old slot layout (`--slots` x `--max-len` positions, plus the null
block). The slot layout runs `--slots` requests at once whatever their length; the block pool gives each request
only the blocks it uses, so many short requests run together. Both engines run the same short requests over the same
number of blocks; the result has the peak number running at once in each, their wall time, and whether every
output equals the target alone's.

Preemption: a pool too small for the requests' growth. When a running request needs a block and none is free, the
newest running request gives its blocks back and is recomputed later; every request still completes, and each
output equals the run with room for all (and, greedy, the target alone's). The result counts the preemptions.
Exit 1 when an output differs or a request does not complete.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import environment
from dflash_core.bench.offline import encode_prompt
from dflash_core.bench.prefix import (
    TURNS,
    add_model_args,
    kv_stats,
    load_pair,
    model_kwargs,
    paged_engine,
    params_for,
    write_result,
)
from dflash_core.cli_help import HelpFormatter


def _prompts(tokenizer: Any, n: int, tail: str = "") -> list[list[int]]:
    """`n` short, distinct chat prompts."""
    return [encode_prompt(tokenizer, [{"role": "user", "content": f"{TURNS[i % len(TURNS)]}{tail} ({i})"}])
            for i in range(n)]


def _run(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """All requests added at once, stepped to the end: outputs by prompt, the peak number running, wall time."""
    from dflash_core.generate import RequestOutput

    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {rid: RequestOutput(i, rid, p) for i, (rid, p) in enumerate(zip(ids, prompts))}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            req = outs[out.request_id]
            req.token_ids.extend(out.new_token_ids)
            if out.finish_reason is not None:
                req.finish_reason, req.error = out.finish_reason, out.error
                req.stats = engine.stats(out.request_id)
                engine.release(out.request_id)
        peak = max(peak, engine.scheduler.num_running())  # decoding or prefilling: holding KV
    took = time.perf_counter() - t0
    done = [outs[rid] for rid in ids]
    tokens = sum(len(o.token_ids) for o in done)
    return {
        "tokens": [o.token_ids for o in done],
        "finish_reasons": [o.finish_reason for o in done],
        "errors": [o.error for o in done if o.error],
        "preemptions": [o.stats.preemptions if o.stats else 0 for o in done],
        "peak_running": peak, "time_s": took, "output_tokens": tokens,
        "output_tokens_per_s": tokens / took if took > 0 else 0.0,
    }


def _summary(run: dict[str, Any], engine: Any) -> dict[str, Any]:
    """A run's figures without its tokens."""
    keep = ("peak_running", "time_s", "output_tokens", "output_tokens_per_s", "finish_reasons", "errors")
    per_block = getattr(engine.target, "kv_bytes_per_block", None)
    if per_block is not None and engine.drafter is not None:  # the draft's pages share the block ids
        per_block += getattr(engine.drafter, "draft_bytes_per_block", 0) or 0
    out = {k: run[k] for k in keep}
    out["kv"] = kv_stats(engine)
    out["kv_bytes"] = per_block * engine.target.num_blocks if per_block else None  # target + draft
    return out


def run_concurrency(pair: dict[str, Any], *, slots: int, max_len: int, num_requests: int, max_tokens: int,
                    temperature: float, seed: int, kv_block: int) -> dict[str, Any]:
    """The same short requests on the slot layout and on a block pool of the same size."""
    budget = slots * math.ceil(max_len / kv_block) + 1
    prompts = _prompts(pair["tokenizer"], num_requests)
    params = [params_for(max_tokens, temperature, seed + i, ignore_eos=True) for i in range(num_requests)]
    # prefix caching off: the prompts share the chat template's opening, and what is measured here is memory by need
    slot_eng = paged_engine(pair, None, slots, max_len, prefix=False, kv_block=kv_block)  # the slot layout's blocks
    if slot_eng.target.num_blocks != budget:
        raise BenchError(f"the slot layout has {slot_eng.target.num_blocks} blocks, expected {budget}")
    pool_eng = paged_engine(pair, budget, num_requests, max_len, prefix=False, kv_block=kv_block)
    slot_run, pool_run = _run(slot_eng, prompts, params), _run(pool_eng, prompts, params)
    plain = _run(paged_engine(pair, budget, num_requests, max_len, prefix=False, draft=False, kv_block=kv_block),
                 prompts, params)
    reference = plain["tokens"] if temperature <= 0 else slot_run["tokens"]
    return {
        "budget_blocks": budget,
        "budget_tokens": (budget - 1) * kv_block,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "slot_layout": _summary(slot_run, slot_eng),
        "block_pool": _summary(pool_run, pool_eng),
        "concurrency_gain": pool_run["peak_running"] / max(slot_run["peak_running"], 1),
        "reference": "target alone" if temperature <= 0 else "slot layout (seeded sampling)",
        "identical_outputs": sum(a == b for a, b in zip(pool_run["tokens"], reference)),
        # seeded: the slot layout is the reference (the same draft and seeds), so it is not counted against itself
        "slot_layout_identical": sum(a == b for a, b in zip(slot_run["tokens"], reference)) if temperature <= 0
        else None,
        "all_identical": pool_run["tokens"] == reference == slot_run["tokens"],
    }


def run_preemption(pair: dict[str, Any], *, num_requests: int, max_tokens: int, blocks: int | None,
                   temperature: float, seed: int, kv_block: int) -> dict[str, Any]:
    """The requests in a pool too small for them (preempted, recomputed) and in a roomy one."""
    prompts = _prompts(pair["tokenizer"], num_requests, " Then explain it to a child")
    params = [params_for(max_tokens, temperature, seed + i, ignore_eos=True) for i in range(num_requests)]
    # one request's blocks at its longest: prompt, output and a verify block
    one = math.ceil((max(map(len, prompts)) + max_tokens + pair["block_size"]) / kv_block)
    if blocks is None:  # room for about a third of the requests at their longest, and always for one of them
        blocks = 1 + max(one + 1, math.ceil(num_requests * one / 3))
    if blocks < one + 1:
        raise BenchError(f"--preempt-blocks {blocks}: one request needs {one} blocks plus the null block")
    roomy_blocks = num_requests * (one + 1) + 1
    max_len = (one + 1) * kv_block
    tight = paged_engine(pair, blocks, num_requests, max_len, kv_block=kv_block)
    roomy = paged_engine(pair, roomy_blocks, num_requests, max_len, kv_block=kv_block)
    t_run, r_run = _run(tight, prompts, params), _run(roomy, prompts, params)
    same = sum(a == b for a, b in zip(t_run["tokens"], r_run["tokens"]))
    plain_same = None
    if temperature <= 0:
        plain = _run(paged_engine(pair, roomy_blocks, num_requests, max_len, draft=False, kv_block=kv_block),
                     prompts, params)
        plain_same = sum(a == b for a, b in zip(t_run["tokens"], plain["tokens"]))
    completed = sum(r == "length" for r in t_run["finish_reasons"])
    return {
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "blocks_per_request": one,
        "tight_blocks": blocks,
        "roomy_blocks": roomy_blocks,
        "tight": _summary(t_run, tight),
        "roomy": _summary(r_run, roomy),
        "preemptions": sum(t_run["preemptions"]),
        "preemptions_per_request": t_run["preemptions"],
        "completed": completed,
        "identical_to_roomy": same,
        "identical_to_target_alone": plain_same,
        "all_identical": same == num_requests and plain_same in (None, num_requests)
        and completed == num_requests,
    }


def run_capacity(*, target: str | None = None, draft: str | None = None, tokenizer: str | None = None,
                 device: str = "auto", dtype: str = "auto", block_size: int | None = None,
                 threads: int | None = None, temperature: float = 0.0, seed: int = 0, kv_block: int = 16,
                 slots: int = 2, max_len: int = 1024, num_requests: int = 48, max_tokens: int = 16,
                 preempt_requests: int = 6, preempt_max_tokens: int = 64,
                 preempt_blocks: int | None = None) -> dict[str, Any]:
    """Both measurements; the `capacity` result without its header."""
    import torch

    pair = load_pair(target, draft, tokenizer, device, dtype, block_size, threads)
    if max_len > pair["max_len"]:
        raise BenchError(f"--max-len {max_len}: the model allows {pair['max_len']}")
    conc = run_concurrency(pair, slots=slots, max_len=max_len, num_requests=num_requests, max_tokens=max_tokens,
                           temperature=temperature, seed=seed, kv_block=kv_block)
    pre = run_preemption(pair, num_requests=preempt_requests, max_tokens=preempt_max_tokens, blocks=preempt_blocks,
                         temperature=temperature, seed=seed, kv_block=kv_block)
    config = {**pair["config"], "slots": slots, "max_len": max_len, "kv_block_size": kv_block,
              "temperature": temperature, "seed": seed, "threads": torch.get_num_threads(),
              "load_time_s": pair["load_time_s"]}
    return {"environment": environment(), "config": config, "concurrency": conc, "preemption": pre,
            "all_identical": conc["all_identical"] and pre["all_identical"]}


def format_capacity(result: dict[str, Any]) -> str:
    """The terminal tables of a capacity result."""
    from dflash_core.bench.report import _table

    cfg, c, p = result["config"], result["concurrency"], result["preemption"]
    n = c["num_requests"]
    rows = [[name, str(r["peak_running"]), str(r["kv"]["preemptions"]), f"{r['time_s']:.2f}",
             f"{r['output_tokens_per_s']:.1f}", "reference" if same is None else f"{same}/{n}"]
            for name, r, same in (("slot layout", c["slot_layout"], c["slot_layout_identical"]),
                                  ("block pool", c["block_pool"], c["identical_outputs"]))]
    conc = _table(["layout", "peak running", "preemptions", "time s", "out tok/s", f"same as {c['reference']}"],
                  rows)
    mib = c["block_pool"]["kv_bytes"]
    mib = "" if mib is None else f", {mib / 2**20:.1f} MiB of target + draft KV"
    m = p["num_requests"]
    prow = [[name, str(blocks), str(r["kv"]["preemptions"] if r["kv"] else "-"),
             f"{sum(f == 'length' for f in r['finish_reasons'])}/{m}", f"{r['time_s']:.2f}"]
            for name, blocks, r in (("tight", p["tight_blocks"], p["tight"]), ("roomy", p["roomy_blocks"],
                                                                                 p["roomy"]))]
    pre = _table(["pool", "blocks", "preemptions", "completed", "time s"], prow)
    alone = p["identical_to_target_alone"]
    return (
        f"dflash-bench capacity: {cfg['target']} + {cfg['draft']} on {cfg['device']} ({cfg['threads']} threads), "
        f"KV blocks of {cfg['kv_block_size']}\n"
        f"one budget: {c['budget_blocks']} blocks ({cfg['slots']} slots x {cfg['max_len']} positions + the null "
        f"block{mib}), {n} requests of {c['max_tokens']} tokens (prompts {min(c['prompt_tokens'])}-"
        f"{max(c['prompt_tokens'])} tokens)\n{conc}\n"
        f"block pool: {c['concurrency_gain']:.1f}x the slot layout's concurrent requests\n\n"
        f"preemption: {m} requests of {p['max_tokens']} tokens, {p['blocks_per_request']} blocks each at their "
        f"longest\n{pre}\n"
        f"tight vs roomy: {p['identical_to_roomy']}/{m} identical"
        + ("" if alone is None else f"; vs the target alone: {alone}/{m}")
        + f"; {p['preemptions']} preemptions" + ("" if p["preemptions"] else " (none: lower --preempt-blocks)")
    )


def add_parser(sub: Any) -> None:
    """The `capacity` mode's arguments."""
    p = sub.add_parser(
        "capacity", help="in-process: concurrent requests in one KV budget, and preemption",
        description=__doc__.split("\n\n", 1)[1], formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--slots", type=int, default=2, help="the slot layout whose blocks are the budget")
    p.add_argument("--max-len", type=int, default=1024, help="positions per slot of that layout")
    p.add_argument("--num-requests", type=int, default=48,
                   help="short requests sent at once (more than the budget holds: memory decides how many run)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens of each short request")
    p.add_argument("--preempt-requests", type=int, default=6, help="requests of the preemption run")
    p.add_argument("--preempt-max-tokens", type=int, default=64, help="output tokens of each of them")
    p.add_argument("--preempt-blocks", type=int, default=None,
                   help="blocks of the tight pool (default: about a third of what the requests need)")


def main(args: argparse.Namespace, argv: Any = None) -> int:
    """Run the mode; 1 when an output differs or a request does not complete."""
    sizes = (args.slots, args.max_len, args.num_requests, args.max_tokens, args.preempt_requests,
             args.preempt_max_tokens, args.kv_block_size)
    if min(sizes) < 1:
        print("dflash-bench: error: counts and lengths must be >= 1", file=sys.stderr)
        return 2
    try:
        body = run_capacity(slots=args.slots, max_len=args.max_len, num_requests=args.num_requests,
                            max_tokens=args.max_tokens, preempt_requests=args.preempt_requests,
                            preempt_max_tokens=args.preempt_max_tokens, preempt_blocks=args.preempt_blocks,
                            **model_kwargs(args))
        path = write_result("capacity", body, argv, args.output_dir)
    except BenchError as exc:
        print(f"dflash-bench: error: {exc}", file=sys.stderr)
        return exc.code
    print(format_capacity(body) + f"\nwrote {path}")
    if not body["all_identical"]:
        print("dflash-bench: error: an output differs or a request did not complete", file=sys.stderr)
        return 1
    return 0
