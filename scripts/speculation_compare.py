"""Side-by-side in-process comparisons of speculation settings on the demo pair: acceptance and speed.

    python scripts/speculation_compare.py sampling [--temperatures 0.7 1.0] [--seeds 2] [--rounds 2]
    python scripts/speculation_compare.py tree [--temperatures 0] [--streams 1 8] [--tree-budget 32] [--rounds 2]

`sampling`: `--spec-sampling keyed` against `rejection` at each temperature, with the full block every step
(`--speculation fixed`: the draft's acceptance, not the width policy's) and with the adaptive policy (tok/s), 8
requests at a time. `tree`: the chain (`--speculation adaptive --tree-budget 0`), the tree (`--speculation tree`)
and the adaptive policy weighing both (`--speculation adaptive --tree-budget N`), at each number of concurrent
streams. Every prompt of the bundled sets runs `--seeds` times (one request each, seed 1000 s + i, ending at EOS or
`--max-tokens`); the acceptance length is pooled over all the steps of all the requests (accepted draft tokens over
verify steps, plus one); tok/s is output tokens over the wall time of the whole batch. Rounds alternate the order of
the variants; one torch thread. A benchmark command, not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import transformers

from dflash_core.bench.offline import prompt_ids
from dflash_core.bench.prompts import load_prompts
from dflash_core.config import EngineConfig
from dflash_core.generate import run_to_completion
from dflash_core.loading import load_models
from dflash_core.sampling import SamplingParams


def run(settings: dict[str, Any], prompts: list[list[int]], temperature: float, seeds: int, max_tokens: int,
        streams: int) -> dict[str, Any]:
    """One variant over every prompt and seed, `streams` requests at a time; its pooled figures."""
    engine = load_models(EngineConfig(max_running_requests=streams, **settings)).engine
    engine.warm_up()
    work = [(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 * s + i))
            for s in range(seeds) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs = run_to_completion(engine, [p for p, _ in work], [sp for _, sp in work])
    seconds = time.perf_counter() - t0
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    steps = sum(o.stats.num_drafts for o in outs)
    produced = sum(len(o.token_ids) for o in outs)
    return {"requests": len(outs), "tokens": produced, "verify_steps": steps, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / max(steps, 1), "tokens_per_s": produced / seconds,
            "outputs": [o.token_ids for o in outs]}


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    if args.compare == "sampling":
        return [(f"{policy}/{mode}", dict(speculation=policy, spec_sampling=mode))
                for policy in ("fixed", "adaptive") for mode in ("keyed", "rejection")]
    return [("chain", dict(speculation="adaptive", tree_budget=0)),
            ("tree", dict(speculation="tree", tree_budget=args.tree_budget)),
            ("adaptive", dict(speculation="adaptive", tree_budget=args.tree_budget))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compare", choices=["sampling", "tree"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=None,
                    help="default: 0.7 1.0 (sampling), 0 (tree)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="default: 8 (sampling), 1 8 (tree)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree-budget", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.disable_progress_bar()
    temperatures = args.temperatures or ([0.7, 1.0] if args.compare == "sampling" else [0.0])
    streams_list = args.streams or ([8] if args.compare == "sampling" else [1, 8])
    tok = load_models(EngineConfig(speculative=False)).tokenizer
    prompts = [prompt_ids(tok, p) for p in load_prompts("all", args.prompts)]
    results = []
    for temperature in temperatures:
        for streams in streams_list:
            named = variants(args)
            for r in range(args.rounds):
                for name, settings in (named if r % 2 == 0 else named[::-1]):
                    res = run(settings, prompts, temperature, args.seeds, args.max_tokens, streams)
                    res.update(variant=name, temperature=temperature, streams=streams, round=r)
                    results.append(res)
                    print(f"T={temperature} streams={streams} {name:20s} round {r}: acceptance length "
                          f"{res['acceptance_length']:.2f} ({res['accepted_tokens']}/{res['verify_steps']} steps), "
                          f"{res['tokens_per_s']:.0f} tok/s over {res['requests']} requests", flush=True)
            # keyed (greedy or seeded) output is the target's own whatever the speculation: identical across variants
            same = {res["variant"]: res["outputs"] for res in results
                    if res["temperature"] == temperature and res["streams"] == streams
                    and "rejection" not in res["variant"]}
            first = next(iter(same.values()))
            print(f"  outputs identical across {', '.join(same)}: {all(o == first for o in same.values())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
