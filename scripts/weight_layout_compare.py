#!/usr/bin/env python3
"""Linear weights stored input-major (the CPU's served layout, `dflash_core/weight_layout.py`) against nn.Linear's
own layout, on one torch thread.

1. The matrix products alone: the demo target's 25 weight matrices of a decode step (its 6 layers' QKV, output,
   gate/up and down projections, and the output head), `F.linear` over each in turn with 1, 2, 4, 16, 64 and 512
   rows, stored either way: ms per pass over all of them, best of `--repeats`.
2. End to end, in one process: two engines on the bundled demo pair, one whose weights keep nn.Linear's layout and
   one served as `load_models` serves them, the same prompts (greedy, `--max-tokens`, EOS ignored for plain
   decoding), alternating which runs first each round: tok/s per round, and whether the texts are identical.

    python scripts/weight_layout_compare.py                      # both parts, plain decoding and DFlash
    python scripts/weight_layout_compare.py --rounds 6 --prompts 16 --out layout.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F

import dflash_core.loading as loading
from dflash_core import LLM, SamplingParams
from dflash_core.bench.prompts import load_prompts
from dflash_core.weight_layout import input_major

ROWS = (1, 2, 4, 16, 64, 512)


def demo_matrices() -> list[torch.Tensor]:
    """The demo target's weight matrices in the order a step multiplies them (nn.Linear's layout)."""
    model = loading.load_target(loading.DEMO_TARGET, torch.device("cpu"), torch.float32)
    mats = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), a.o_proj.weight.detach(),
                 torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), m.down_proj.weight.detach()]
    return [*mats, model.get_output_embeddings().weight.detach()]


def time_pass(mats: list[torch.Tensor], rows: int, repeats: int) -> float:
    """ms per pass of F.linear over every matrix with `rows` input rows, best of `repeats`."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in mats}
    calls = max(3, 400 // rows)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            for w in mats:
                F.linear(xs[w.shape[1]], w)
        best = min(best, (time.perf_counter() - t) / calls * 1e3)
    return best


def matmuls(repeats: int) -> list[dict[str, Any]]:
    standard = demo_matrices()
    relaid = [input_major(w) for w in standard]
    mb = sum(w.numel() * w.element_size() for w in standard) / 1e6
    out = []
    for rows in ROWS:
        a, b = time_pass(standard, rows, repeats), time_pass(relaid, rows, repeats)
        out.append({"rows": rows, "standard_ms": round(a, 3), "input_major_ms": round(b, 3),
                    "speedup": round(a / b, 2), "weights_mb": round(mb, 1)})
        print(f"{rows:4d} rows: nn.Linear layout {a:7.3f} ms, input-major {b:7.3f} ms per pass of {len(standard)} "
              f"matrices ({mb:.1f} MB): {a / b:.2f}x", flush=True)
    return out


def engines(speculative: bool) -> dict[str, LLM]:
    """Two engines on the demo pair: `standard` with nn.Linear's layout, `input_major` as served."""
    served = loading.stores_input_major
    try:
        loading.stores_input_major = lambda device, dtype: False  # type: ignore[assignment]
        standard = LLM(device="cpu", speculative=speculative)
    finally:
        loading.stores_input_major = served  # type: ignore[assignment]
    return {"standard": standard, "input_major": LLM(device="cpu", speculative=speculative)}


def end_to_end(speculative: bool, rounds: int, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    llms = engines(speculative)
    prompts = [p.messages for p in load_prompts("all", num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not speculative)
    for llm in llms.values():
        llm.generate(prompts[:1], params)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in llms}
    texts: dict[str, list[str]] = {}
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for name in order:
            t, tokens, out = time.perf_counter(), 0, []
            for p in prompts:
                g = llms[name].generate([p], params)[0]
                tokens += len(g.token_ids)
                out.append(g.text)
            rates[name].append(round(tokens / (time.perf_counter() - t), 1))
            texts.setdefault(name, out)
    identical = sum(a == b for a, b in zip(texts["standard"], texts["input_major"]))
    mode = "DFlash" if speculative else "plain"
    for name, values in rates.items():
        print(f"{mode:6s} {name:12s} tok/s per round {values}  median {sorted(values)[len(values) // 2]}", flush=True)
    print(f"{mode:6s} identical texts {identical}/{len(prompts)}", flush=True)
    return {"mode": mode, "tok_s": rates, "identical": identical, "prompts": len(prompts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating end-to-end rounds (default: 4)")
    ap.add_argument("--prompts", type=int, default=8, help="shipped chat prompts a round (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens a request (default: 128)")
    ap.add_argument("--repeats", type=int, default=5, help="timings of each matmul pass; the best counts (default: 5)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"matmuls": matmuls(args.repeats),
              "end_to_end": [end_to_end(spec, args.rounds, args.prompts, args.max_tokens) for spec in (False, True)]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
