"""dflash-train: train a DFlash draft for any transformers causal LM target.

Recipe (DFlash paper, z-lab checkpoints): the target writes (or the data supplies) a response for every prompt; random
anchor positions a are drawn in the response; each block is [x_a, mask x (B-1)] at positions a..a+B-1; block queries
see the target's context features at positions < a plus their own block (bidirectionally); the loss is cross-entropy
against x_{a+k} at block rows k = 1..B-1, weighted exp(-(k-1)/gamma). The target's embedding and lm_head are used
frozen. The output folder is a z-lab-format draft (config.json + model.safetensors) that dflash_core loads unchanged.

Targets: any transformers causal LM: dense (Qwen3, Llama, Qwen2), MoE (Qwen3-MoE, gpt-oss) and hybrid Gated DeltaNet
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next) alike; the draft reads only the target's hidden states, embeddings and head. The
draft (Qwen3-style, full rotary) copies the target's width, heads, vocabulary, RoPE base and RoPE type (a type the
draft does not implement falls back to the default RoPE with the target's base, with a note on stderr).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_core.cli_help import HelpFormatter
from dflash_core.train.data import UsageError, read_rows
from dflash_core.train.loop import train
from dflash_core.train.traffic import is_traffic, read_traffic


def build_parser() -> argparse.ArgumentParser:
    """The dflash-train command line (every option documented, with its default)."""
    p = argparse.ArgumentParser(prog="dflash-train", description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target", required=True, help="target model: a local folder or a hub id (transformers causal LM)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the target's)")
    g.add_argument(
        "--data", required=True, type=Path,
        help="JSONL prompts: {'messages': [...]} (chat; a final assistant message is used as the response) or "
             "{'prompt'|'text': str} (plain text; optional 'response'|'completion'); or a folder of traffic recorded "
             "by dflash-serve --record-traffic (its outputs are the responses)",
    )
    g.add_argument("--output", required=True, type=Path, help="output folder for the draft (config.json + weights)")
    g.add_argument("--heldout-fraction", type=float, default=0.1,
                   help="recorded traffic (--data FOLDER): the share of requests, chosen by id, kept out of training "
                        "and written to OUTPUT/heldout.jsonl")
    g.add_argument("--regenerate", action="store_true", help="let the target regenerate responses the data has")
    g.add_argument("--max-samples", type=int, default=None, help="use at most this many rows of --data (default: all)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are cut from the left")
    g.add_argument("--max-new-tokens", type=int, default=256, help="response length limit when generating")
    g.add_argument("--gen-batch-size", type=int, default=32, help="prompts per batched generate call")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses, >0 = sampled")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for generated responses")
    g.add_argument("--cache-hidden", action="store_true",
                   help="compute the chosen target layers' hidden states once and keep them in memory (fp16; "
                        "bf16 for a sequence with values beyond fp16's range) "
                        "instead of running the target in every step")
    g = p.add_argument_group("draft architecture")
    g.add_argument("--init-draft", default=None,
                   help="continue training this draft folder (its config decides the architecture, block size, "
                        "target layers and mask token) instead of a new random draft (default: none)")
    g.add_argument("--block-size", type=int, default=16, help="block size B (>= 2)")
    g.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    g.add_argument("--intermediate-size", type=int, default=None,
                   help="draft MLP width (default: the target's intermediate_size; for an MoE target whose config "
                        "has none, e.g. Qwen3.5-MoE, the width a token activates: moe_intermediate_size x "
                        "num_experts_per_tok + shared_expert_intermediate_size; else 3 x hidden_size)")
    g.add_argument("--target-layer-ids", default=None,
                   help="comma-separated target layer ids for the context features (default: z-lab rule, "
                        "num-layers ids spread over 1..L-3)")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id (default: a <|mask|>-like token, else the first unused id below the "
                        "model's vocab_size, else a new <|mask|> token with the target's embeddings resized)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    g.add_argument("--anchors", type=int, default=16, help="blocks (anchor positions) per sequence per step")
    g.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (cosine decay, 4%% warmup)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block rows: exp(-(k-1)/gamma)")
    g.add_argument("--max-seq-len", type=int, default=1024, help="training sequences are cut to this many tokens")
    g.add_argument("--seed", type=int, default=0, help="seed for every random choice")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, default=200, help="write a checkpoint every N steps (0: never)")
    g.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint when present")
    g.add_argument("--overwrite", action="store_true", help="allow a non-empty output folder")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-data", type=Path, default=None,
                   help="held-out JSONL prompts: after training, measure the real acceptance length with the engine "
                        "(default: none, no evaluation)")
    g.add_argument("--eval-heldout", action="store_true",
                   help="recorded traffic: evaluate on the held-out slice (OUTPUT/heldout.jsonl) after training; "
                        "with --init-draft the old draft too, and the comparison goes to OUTPUT/gate.json")
    g.add_argument("--gate-margin", type=float, default=0.05,
                   help="with --init-draft and --eval-heldout: the new draft is promoted only when its held-out "
                        "acceptance length beats the old one's by this share")
    g.add_argument("--eval-n", type=int, default=32, help="held-out prompts to use")
    g.add_argument("--eval-max-new-tokens", type=int, default=256, help="tokens per held-out prompt")
    g.add_argument("--eval-speedup", action="store_true",
                   help="also time plain autoregressive decoding, interleaved, and report the speedup")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line (argparse exits on unknown options)."""
    return build_parser().parse_args(argv)


def check_output(out: Path, resume: bool, overwrite: bool) -> list[Path]:
    """Create the output folder (returns what was created, for cleanup) or raise UsageError."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not (resume or overwrite):
        raise UsageError(f"output folder {out} is not empty (pass --resume to continue or --overwrite)")
    created = []
    parent = out
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        for d in created:
            shutil.rmtree(d, ignore_errors=True)
        raise UsageError(f"output folder {out} is not writable: {exc.strerror or exc}") from None
    return created


def validate_args(args: argparse.Namespace) -> None:
    """Refuse impossible settings and missing inputs (UsageError) before anything is loaded."""
    if args.block_size < 2:
        raise UsageError(f"--block-size must be at least 2 (got {args.block_size})")
    for name in ("steps", "batch_size", "anchors", "num_layers", "max_new_tokens", "gen_batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.gamma <= 0:
        raise UsageError("--gamma must be positive")
    if not Path(args.target).exists() and (args.target.startswith((".", "/", "~")) or args.target.count("/") != 1):
        raise UsageError(f"target {args.target!r} is neither a local folder nor a hub id (owner/name)")
    if not args.data.is_file() and not is_traffic(args.data):
        raise UsageError(f"data file {args.data} does not exist")
    if is_traffic(args.data) and args.regenerate:
        raise UsageError("--regenerate: recorded traffic holds the target's own outputs, nothing to regenerate")
    if not 0 <= args.heldout_fraction < 1:
        raise UsageError(f"--heldout-fraction must be in [0, 1) (got {args.heldout_fraction})")
    if args.eval_heldout and (not is_traffic(args.data) or args.heldout_fraction == 0 or args.eval_data):
        raise UsageError("--eval-heldout needs recorded traffic (--data FOLDER), a held-out slice and no --eval-data")
    if args.gate_margin < 0:
        raise UsageError(f"--gate-margin must be >= 0 (got {args.gate_margin})")
    if args.init_draft is not None and not Path(args.init_draft).expanduser().is_dir():
        raise UsageError(f"--init-draft {args.init_draft}: no such draft folder")
    if args.eval_data is not None and not args.eval_data.is_file():
        raise UsageError(f"eval data file {args.eval_data} does not exist")


def load_target_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """The target (float32, eval mode, frozen, on --device) and its tokenizer; UsageError when either fails."""
    from transformers import AutoTokenizer

    from dflash_core.loading import load_target

    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        model = load_target(args.target, torch.device(args.device), torch.float32)
    except Exception as exc:  # hub unreachable, missing files, unknown architecture: one message
        raise UsageError(f"cannot load target {args.target!r}: {str(exc).splitlines()[0]}") from None
    model.requires_grad_(False)
    return model, tok


def main(argv: list[str] | None = None) -> int:
    """dflash-train: 0 on success, 2 on bad input (one message, no output left behind), 130 on Ctrl-C."""
    args = parse_args(argv)
    try:
        validate_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = read_traffic(args.data, args.max_samples) if is_traffic(args.data) else read_rows(args.data,
                                                                                                   args.max_samples)
        model, tok = load_target_and_tokenizer(args)
        created = check_output(args.output, args.resume, args.overwrite)
        try:
            return train(args, rows, model, tok)
        except UsageError:
            for d in created:
                shutil.rmtree(d, ignore_errors=True)
            raise
    except UsageError as exc:
        print(f"dflash-train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted (the last complete checkpoint is kept)", file=sys.stderr)
        return 130

