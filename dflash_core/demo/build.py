"""Rebuild the bundled demo pair from scratch, offline, on CPU: `python -m dflash_core.demo.build`.

Stages: (1) tokenizer + Qwen3 target trained on synthetic chats and stdlib source; (2) draft prompts written as
JSONL; (3) `dflash-train` (the target generates the responses, then the draft is trained); (4) evaluation on two
held-out sets, the generator's (new instances of the training templates) and a hand-written one (wordings no template
produces): acceptance length, distinct 4-grams, and speedup with each side at its fastest torch thread setting,
written to `quality.json` and MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as dflash-bench: busy-waiting threads slow a shared CPU

import torch  # noqa: E402

from dflash_core.demo.synth import examples, generatable_wordings, heldout_prompts  # noqa: E402
from dflash_core.jsonl import read_jsonl, write_jsonl  # noqa: E402

DEMO_DIR = Path(__file__).resolve().parent
HELDOUT = DEMO_DIR / "heldout_prompts.jsonl"
HANDWRITTEN = DEMO_DIR / "handwritten_prompts.jsonl"
MODELS = DEMO_DIR.parent / "demo_models"


def heldout_set() -> set[str]:
    """Prompt texts of the held-out set (never used for training)."""
    return {m[0]["content"] for m in heldout_prompts()}


def write_heldout(path: Path = HELDOUT) -> None:
    """The 32 held-out chat prompts (user message only)."""
    write_jsonl(path, [{"messages": m[:1]} for m in heldout_prompts()])


def handwritten_texts(path: Path = HANDWRITTEN) -> list[str]:
    """The hand-written held-out prompts (user message only)."""
    return [row["messages"][0]["content"] for row in read_jsonl(path)]


def check_handwritten(n: int = 100_000) -> None:
    """Fail the build if the generator can produce a hand-written held-out wording (numbers aside)."""
    hits = generatable_wordings(handwritten_texts(), n=n)
    if hits:
        raise SystemExit(f"the generator produces hand-written held-out wordings: {hits}")


def write_draft_prompts(path: Path, n: int, seed: int) -> None:
    """Prompts for draft training (no responses: the target writes them)."""
    gen = examples(seed + 10, heldout_set())
    write_jsonl(path, [{"messages": ex[:1]} for ex, _ in zip(gen, range(n))])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_core.demo.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=MODELS, help="output folder (target/ and draft/ go under it)")
    p.add_argument("--work", type=Path, default=Path("/tmp/dflash_demo_work"), help="scratch folder")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stage", choices=["all", "target", "draft", "eval"], default="all")
    p.add_argument("--target-steps", type=int, default=1200)
    p.add_argument("--target-layers", type=int, default=6)
    p.add_argument("--target-hidden", type=int, default=256)
    p.add_argument("--target-intermediate", type=int, default=512)
    p.add_argument("--draft-prompts", type=int, default=4000)
    p.add_argument("--draft-steps", type=int, default=1600)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast for the target (fast only on CPUs with AVX512-BF16/AMX; default float32)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = args.out / "target", args.out / "draft"
    log_path = args.work / "build_summary.json"
    summary = json.loads(log_path.read_text()) if log_path.exists() and args.stage != "all" else {}
    command = " ".join(["python -m dflash_core.demo.build", *(argv if argv is not None else sys.argv[1:])])
    summary["command"] = "python -m dflash_core.demo.build"
    summary.setdefault("stage_commands", []).append(command)
    summary["seed"] = args.seed
    summary["work"] = str(args.work)
    t_all = time.time()
    if args.stage in ("all", "target"):
        from dflash_core.demo.pretrain import pretrain_target

        write_heldout()
        check_handwritten()
        tmp = args.work / "target"
        shutil.rmtree(tmp, ignore_errors=True)
        summary["target"] = pretrain_target(
            tmp, args.seed, heldout_set(), steps=args.target_steps, layers=args.target_layers,
            hidden=args.target_hidden, intermediate=args.target_intermediate, bf16=args.bf16,
        )
        shutil.rmtree(target_dir, ignore_errors=True)
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, target_dir)
        log_path.write_text(json.dumps(summary, indent=2))
    if args.stage in ("all", "draft"):
        from dflash_core import train

        t0 = time.time()
        prompts = args.work / "draft_prompts.jsonl"
        write_draft_prompts(prompts, args.draft_prompts, args.seed)
        tmp = args.work / "draft"
        shutil.rmtree(tmp, ignore_errors=True)
        train_args = [
            "--target", str(target_dir), "--data", str(prompts), "--output", str(tmp),
            "--num-layers", str(args.draft_layers), "--block-size", "16", "--steps", str(args.draft_steps),
            "--max-new-tokens", "160", "--seed", str(args.seed), "--cache-hidden", "--threads", str(args.threads),
            "--eval-data", str(HELDOUT), "--eval-n", "32",
        ]
        rc = train.main(train_args)
        if rc:
            return rc
        shutil.rmtree(draft_dir, ignore_errors=True)
        shutil.copytree(tmp, draft_dir, ignore=shutil.ignore_patterns("checkpoint*", "train_data*"))
        summary["draft"] = {"seconds": time.time() - t0, "train_command": "dflash-train " + " ".join(train_args)}
        log_path.write_text(json.dumps(summary, indent=2))
    if args.stage in ("all", "eval"):
        from dflash_core.demo.card import evaluate_and_write_card

        summary["eval"] = evaluate_and_write_card(
            target_dir, draft_dir, {"heldout": HELDOUT, "handwritten": HANDWRITTEN}, summary
        )
        log_path.write_text(json.dumps(summary, indent=2))
    print(f"[build] stage {args.stage} done in {time.time() - t_all:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
