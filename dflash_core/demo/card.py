"""Held-out evaluation of the demo pair and its MODEL_CARD.md."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from dflash_core.train import evaluate


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def evaluate_and_write_card(target_dir: Path, draft_dir: Path, heldout: Path, summary: dict[str, Any]) -> dict:
    """Interleaved AR vs DFlash on the held-out prompts (greedy, batch 1, CPU); writes quality.json + the card."""
    t0 = time.time()
    res = evaluate(target_dir, draft_dir, heldout, n=32, max_new_tokens=256, speedup=True, device="cpu")
    res["eval_seconds"] = time.time() - t0
    res["cpu"] = platform.processor() or platform.machine()
    res["cpu_count"] = os.cpu_count()
    out = target_dir.parent
    (out / "quality.json").write_text(json.dumps(res, indent=2) + "\n")
    write_card(out, summary, res)
    return res


def write_card(out: Path, summary: dict[str, Any], res: dict[str, Any]) -> None:
    t, d = summary.get("target", {}), summary.get("draft", {})
    dcfg = json.loads((out / "draft" / "config.json").read_text())
    draft_params = sum(
        v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(out / "draft" / "model.safetensors")).values()
    )
    total_min = (t.get("seconds", 0) + d.get("seconds", 0) + res.get("eval_seconds", 0)) / 60
    root = str(Path(__file__).resolve().parents[2]) + "/"
    train_command = d.get("train_command", "").replace(root, "")
    stages = summary.get("stage_commands", [])
    ran = ""
    if stages and stages != [summary.get("command")]:
        ran = "This copy was produced by running its stages one after another:\n\n```\n" + "\n".join(stages) + "\n```\n"
    card = f"""# DFlash demo pair (bundled with dflash-serve)

A tiny chat target and its DFlash draft, rebuilt from scratch offline on CPU by one command. They exist so that
`dflash-serve` works out of the box with no model hub and no GPU; they are not useful language models.

## Rebuild

```
{summary.get("command", "python -m dflash_core.demo.build")}
```

{ran}
Seed {summary.get("seed")} (every random choice is seeded; all other options at their defaults, torch threads 1).
Measured build time on this machine: target {t.get("seconds", 0) / 60:.1f} min, draft (target responses +
training + held-out acceptance) {d.get("seconds", 0) / 60:.1f} min, evaluation \
{res.get("eval_seconds", 0) / 60:.1f} min, total {total_min:.1f} min ({res["cpu_count"]} CPU cores shared with other
work, torch {torch.__version__}).

## Data (nothing downloaded)

- Synthetic chats made by `dflash_core/demo/synth.py` (seeded): step-by-step addition, subtraction,
  multiplication and division, word problems (shopping, groups, change, speed, sharing), unit and temperature
  conversions, small Python functions, a few facts and greetings; ChatML format.
- Python standard-library source from the running interpreter (`sysconfig.get_paths()["stdlib"]`),
  {t.get("code_fraction", 0):.0%} of the documents.
- Held-out: the 32 prompts in `dflash_core/demo/heldout_prompts.jsonl`, excluded from every training set.

## Target (`target/`)

Qwen3 architecture (`Qwen3ForCausalLM`), {t.get("params", 0) / 1e6:.2f} M parameters: {t.get("layers")} layers, hidden
{t.get("hidden")}, intermediate {t.get("intermediate")}, 4 heads / 2 KV heads, tied embeddings, float32. Byte-level BPE
tokenizer with {t.get("vocab_size")} tokens (digits split one by one), ChatML template, specials `<|im_start|>`,
`<|im_end|>` (EOS), `<|endoftext|>` (pad), `<|mask|>` (the draft's mask token). Trained {t.get("steps")} steps x
{t.get("batch_size")} x {t.get("seq_len")} tokens ({t.get("train_tokens", 0) / 1e6:.2f} M tokens), AdamW lr
{t.get("lr")}, cosine, bf16 autocast; final training loss {t.get("final_loss", 0):.3f}.

## Draft (`draft/`)

DFlash draft in z-lab format, {draft_params / 1e6:.2f} M parameters (plus the target's frozen embedding and head):
{dcfg["num_hidden_layers"]} layer(s), block size {dcfg["block_size"]}, target layer ids
{dcfg["dflash_config"]["target_layer_ids"]}, mask token id {dcfg["dflash_config"]["mask_token_id"]}. Trained with:

```
{train_command}
```

on the target's own greedy responses to synthetic prompts (not the held-out ones).

## Quality (held-out, measured by `python -m dflash_core.demo.build --stage eval`)

{res["prompts"]} held-out chat prompts, greedy, batch 1, CPU float32, up to {res["max_new_tokens"]} new tokens.
Speed is `dflash-bench offline` (plain autoregressive and DFlash runs of the same target interleaved per prompt in
one process), run by the build as
`dflash-bench offline --dataset heldout --num-prompts 32 --max-tokens 256 --device cpu --dtype float32 --threads 1`
would run it:

| figure | value |
|---|---|
| mean acceptance length (tau, B={res["block_size"]}) | {res["acceptance_length"]:.2f} |
| end-to-end speedup over autoregressive | {res["speedup"]:.2f}x |
| tokens/s autoregressive / DFlash | {res["ar_tokens_per_s"]:.1f} / {res["dflash_tokens_per_s"]:.1f} |
| DFlash output identical to autoregressive | {res["outputs_identical"]} |
| median distinct-4-gram ratio of the answers | {res["distinct_4gram_median"]:.3f} \
(min {res["distinct_4gram_min"]:.3f}) |
| generated tokens | {res["generated_tokens"]} |

Timing is wall-clock (prefill included) on a shared {res["cpu_count"]}-core CPU, torch threads: {res["threads"]};
speedups depend on the machine and its load.

## Limits

The target knows only the synthetic task families above and its arithmetic is often wrong (it copies the
numbers from the question and follows the step-by-step format, but the computed results are unreliable). Its
answers are varied (distinct-4-gram ratio above), yet they follow a few answer templates, and the held-out prompts
are new instances of the same task families: a draft accepts far more tokens here than it would for a general chat
model (the DFlash paper reports tau 4-8 for Qwen3-8B). Read the figures as a working demo, not a benchmark.
Sizes: target {folder_mb(out / "target"):.1f} MB, draft {folder_mb(out / "draft"):.1f} MB.
"""
    (out / "MODEL_CARD.md").write_text(card)
