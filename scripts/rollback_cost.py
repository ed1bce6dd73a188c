#!/usr/bin/env python3
"""What rolling back a hybrid target's recurrent state costs, as a share of the verify step it follows.

A random-weight Qwen3.5-shaped target (hybrid: 3 Gated DeltaNet layers to 1 full-attention layer) runs on the
native hybrid runner: prefill a prompt, then verify blocks of `--block` tokens and crop each back to `--keep`
accepted tokens, timing the verify forward and the crop separately. Prints one JSON line.

    python scripts/rollback_cost.py                          # small shapes, CPU, 1 thread
    python scripts/rollback_cost.py --hidden 1024 --layers 16 --batch 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from dflash_core.runners.hybrid import HybridTarget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--keep", type=int, default=6, help="accepted tokens + the bonus token kept by each crop")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads = args.hidden // 64
    cfg = Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=64,
        linear_value_head_dim=64, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    target = HybridTarget(model, None, max_slots=args.batch, max_len=args.prompt + args.block * (args.steps + 2))
    caches = [target.new_cache(i) for i in range(args.batch)]
    for c in caches:
        target.forward(torch.randint(4, 4096, (args.prompt,)).tolist(), 0, c, features=False)
    verify, crop = [], []
    for _ in range(args.steps):
        rows = [(torch.randint(4, 4096, (args.block,)).tolist(), c.length, c) for c in caches]
        starts = [c.length for c in caches]
        t0 = time.perf_counter()
        target.forward_batch(rows, features=True)
        t1 = time.perf_counter()
        for c, s in zip(caches, starts):
            target.crop(c, s + args.keep)
        t2 = time.perf_counter()
        verify.append(t1 - t0)
        crop.append(t2 - t1)
    v, c = statistics.median(verify), statistics.median(crop)
    print(json.dumps({**vars(args), "verify_ms": round(v * 1e3, 3), "rollback_ms": round(c * 1e3, 3),
                      "rollback_share_of_verify": round(c / v, 4)}))


if __name__ == "__main__":
    main()
