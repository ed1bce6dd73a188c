"""The training run: data -> responses -> (cached) features -> draft training -> final folder -> evaluation.

Random numbers: `random` and torch are seeded with --seed at the start, torch again before the draft is built,
and anchors and batch order come from one `torch.Generator` seeded with --seed (all three saved in checkpoints).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_core.chat import eos_token_ids
from dflash_core.draft import DFlashDraft
from dflash_core.draft_formats import read_draft_config
from dflash_core.jsonl import write_jsonl
from dflash_core.train.batches import block_loss, context_features, make_block_batch
from dflash_core.train.checkpoint import CHECKPOINT_DIR, DATA_FILE, save_checkpoint, save_final, share_modes
from dflash_core.train.data import Example, UsageError, encode_rows
from dflash_core.train.evaluation import evaluate
from dflash_core.train.responses import generate_responses
from dflash_core.train.target import draft_config, layer_ids_for, resolve_mask_token, target_layers
from dflash_core.train.traffic import HELDOUT_FILE, check_init_draft, is_traffic, split_heldout


def training_examples(
    args: argparse.Namespace, rows: list[dict[str, Any]], model: Any, tok: Any, eos_ids: list[int], pad_id: int
) -> list[Example]:
    """Encoded rows with every response filled in; saved to OUTPUT/train_data.pt, and reused from there by --resume
    (the generated responses of an interrupted run)."""
    data_path = args.output / DATA_FILE
    if args.resume and data_path.exists():
        return [Example(p, r) for p, r in torch.load(data_path)]
    examples = encode_rows(rows, tok, args.regenerate, args.max_prompt_tokens)
    generate_responses(model, tok, examples, batch_size=args.gen_batch_size, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_ids=eos_ids,
                       pad_id=pad_id)
    tmp = data_path.with_suffix(".tmp")
    torch.save([(ex.prompt, ex.response) for ex in examples], tmp)
    os.replace(tmp, data_path)
    return examples


def training_sequences(examples: list[Example], max_seq_len: int) -> tuple[list[torch.Tensor], list[int]]:
    """(sequences cut to `max_seq_len`, response starts) of the examples with a response of at least 2 tokens."""
    seqs, starts = [], []
    for ex in examples:
        s = (ex.prompt + (ex.response or []))[:max_seq_len]
        if len(s) - 2 >= len(ex.prompt):
            seqs.append(torch.tensor(s, dtype=torch.long))
            starts.append(len(ex.prompt))
    if not seqs:
        raise UsageError("no training sequence has a response of at least 2 tokens")
    return seqs, starts


FP16_MAX = torch.finfo(torch.float16).max


def compact(feats: torch.Tensor) -> torch.Tensor:
    """Features in fp16, or in bf16 when a value is beyond fp16's range (the massive activations some targets'
    hidden states carry would become inf)."""
    return feats.to(torch.float16 if feats.abs().max() <= FP16_MAX else torch.bfloat16)


@torch.no_grad()
def cache_features(
    model: Any, seqs: list[torch.Tensor], layer_ids: list[int], pad_id: int, device: torch.device
) -> list[torch.Tensor]:
    """Every sequence's context features, computed once (16 sequences a forward) and kept on the CPU in fp16
    (`compact`)."""
    cache: list[torch.Tensor] = []
    for i in tqdm(range(0, len(seqs), 16), desc="features", dynamic_ncols=True, mininterval=2):
        chunk = seqs[i : i + 16]
        S = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), S), pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, : len(s)], att[r, : len(s)] = s, 1
        feats = context_features(model, ids.to(device), att.to(device), layer_ids)
        cache.extend(compact(feats[r, : len(s)]).cpu() for r, s in enumerate(chunk))
    return cache


def cosine_lr(step: int, peak: float, steps: int) -> float:
    """Linear warmup over the first 4% of `steps` (at least one), then cosine decay to 0."""
    warmup = max(1, int(0.04 * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(args: argparse.Namespace, rows: list[dict[str, Any]], model: Any, tok: Any) -> int:
    """Data -> responses -> (cached) features -> draft training -> final folder -> held-out evaluation."""
    out: Path = args.output
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    L = target_layers(model)
    if is_traffic(args.data):
        rows, heldout = split_heldout(rows, args.heldout_fraction)
        write_jsonl(out / HELDOUT_FILE, heldout)
        print(f"dflash-train: recorded traffic: {len(rows)} requests to train on, {len(heldout)} held out "
              f"({out / HELDOUT_FILE})", flush=True)
    init: DFlashDraft | None = None
    if args.init_draft is not None:  # its config decides: architecture, block, target layers, mask token
        cfg = read_draft_config(args.init_draft)
        check_init_draft(cfg, model, L)
        init = DFlashDraft.from_folder(args.init_draft, device=args.device)
        mask_id, layer_ids, args.block_size = cfg.mask_token_id, list(cfg.target_layer_ids), cfg.block_size
        print(f"dflash-train: continuing {args.init_draft} (block size {cfg.block_size}, "
              f"{cfg.num_hidden_layers} layers)", file=sys.stderr)
    else:
        mask_id, note = resolve_mask_token(tok, model, args.mask_token_id)
        if note:
            print(f"dflash-train: {note}", file=sys.stderr)
            if "resized" in note:
                model.save_pretrained(out / "target_resized")
                tok.save_pretrained(out / "target_resized")
                share_modes(out / "target_resized")
        layer_ids = layer_ids_for(args.target_layer_ids, L, args.num_layers)
        cfg, notes = draft_config(model, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
                                  block_size=args.block_size, mask_id=mask_id, layer_ids=layer_ids)
        for line in notes:
            print(f"dflash-train: {line}", file=sys.stderr)
    eos_ids = eos_token_ids(model, tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

    data_path = out / DATA_FILE
    examples = training_examples(args, rows, model, tok, eos_ids, pad_id)
    seqs, starts = training_sequences(examples, args.max_seq_len)
    n_resp = sum(len(s) - st for s, st in zip(seqs, starts))
    print(f"dflash-train: {len(seqs)} sequences, {n_resp} response tokens; target layers {layer_ids} of {L}; "
          f"mask id {mask_id}; block size {args.block_size}", flush=True)

    device = torch.device(args.device)
    embed_w = model.get_input_embeddings().weight.detach()
    head_w = model.get_output_embeddings().weight.detach()
    cache = cache_features(model, seqs, layer_ids, pad_id, device) if args.cache_hidden else None

    torch.manual_seed(args.seed)
    if init is not None:
        draft = init.to(device)
    else:
        draft = DFlashDraft(cfg).to(device)
        for mod in draft.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
    draft.train()
    decay = [p for p in draft.parameters() if p.ndim >= 2]
    no_decay = [p for p in draft.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    step0 = 0
    ckpt = out / CHECKPOINT_DIR
    if args.resume and (ckpt / "trainer_state.pt").exists():
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        loaded = DFlashDraft.from_folder(ckpt, device=device)
        draft.load_state_dict(loaded.state_dict())
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["torch_rng"])
        step0 = int(state["step"])
        print(f"dflash-train: resumed from {ckpt} at step {step0}", flush=True)

    order: list[int] = []
    t0 = time.time()
    ema_loss = ema_tau = None
    bar = tqdm(range(step0, args.steps), initial=step0, total=args.steps, desc="train", dynamic_ncols=True,
               mininterval=2)
    for step in bar:
        if len(order) < args.batch_size:
            order += torch.randperm(len(seqs), generator=gen).tolist()
        idx, order = order[: args.batch_size], order[args.batch_size :]
        batch = make_block_batch([seqs[i] for i in idx], [starts[i] for i in idx], args.block_size, args.anchors,
                                 mask_id, pad_id, gen)
        b, S = batch["tokens"].shape
        if cache is not None:
            feats = torch.zeros(b, S, cache[0].shape[-1])
            for r, i in enumerate(idx):
                feats[r, : len(cache[i])] = cache[i].float()
            feats = feats.to(device)
        else:
            with torch.no_grad():
                feats = context_features(model, batch["tokens"].to(device), batch["att"].to(device), layer_ids)
        ctx_pos = torch.arange(S, device=device).expand(b, S)
        block_emb = draft.embed(batch["block_tokens"].to(device), embed_w)
        hidden = draft(block_emb, batch["block_pos"].to(device), feats, ctx_pos, mask=batch["mask"].to(device))
        logits = draft.logits(hidden, head_w)
        loss, tau, _ = block_loss(logits, batch["labels"].to(device), args.block_size, args.gamma)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.lr, args.steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_tau = tau if ema_tau is None else 0.95 * ema_tau + 0.05 * tau
        bar.set_postfix(loss=f"{ema_loss:.3f}", tau_est=f"{ema_tau:.2f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(out, draft, opt, step + 1, gen)
    bar.close()
    draft.eval()
    save_final(out, draft)
    shutil.rmtree(ckpt, ignore_errors=True)
    data_path.unlink(missing_ok=True)
    summary: dict[str, Any] = {"steps": args.steps, "train_seconds": time.time() - t0, "final_loss": ema_loss,
                               "tau_estimate": ema_tau, "sequences": len(seqs), "response_tokens": n_resp}
    print(f"dflash-train: saved draft to {out} (loss {ema_loss:.3f}, estimated tau {ema_tau:.2f})", flush=True)
    if args.eval_data is not None or args.eval_heldout:
        held_out_evaluation(args, out, summary)
        if args.init_draft is not None and args.eval_heldout and "eval" in summary:
            summary["gate"] = gate(args, out, summary["eval"])
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def gate(args: argparse.Namespace, out: Path, new: dict[str, Any]) -> dict[str, Any]:
    """The old draft (`--init-draft`) measured on the same held-out slice as the new one: the new draft is promoted
    only when its acceptance length beats the old one's by `--gate-margin`. Written to OUTPUT/gate.json."""
    target_path = out / "target_resized" if (out / "target_resized").exists() else args.target
    old = evaluate(target_path, args.init_draft, out / HELDOUT_FILE, n=args.eval_n,
                   max_new_tokens=args.eval_max_new_tokens, speedup=args.eval_speedup, device=args.device)
    keys = ("acceptance_length", "acceptance_length_median_per_prompt", "estimated_speedup", "speedup",
            "dflash_tokens_per_s", "prompts", "generated_tokens")
    report = {
        "heldout": str(out / HELDOUT_FILE), "margin": args.gate_margin,
        "old": {"draft": str(args.init_draft), **{k: old[k] for k in keys if k in old}},
        "new": {"draft": str(out), **{k: new[k] for k in keys if k in new}},
        "promote": new["acceptance_length"] >= old["acceptance_length"] * (1 + args.gate_margin),
    }
    (out / "gate.json").write_text(json.dumps(report, indent=2) + "\n")
    verdict = "promote the new draft" if report["promote"] else f"keep {args.init_draft}"
    print(f"dflash-train: gate: held-out acceptance length {old['acceptance_length']:.2f} (old) -> "
          f"{new['acceptance_length']:.2f} (new), margin {args.gate_margin:.0%}: {verdict} ({out / 'gate.json'})",
          flush=True)
    return report


def held_out_evaluation(args: argparse.Namespace, out: Path, summary: dict[str, Any]) -> None:
    """Evaluate the saved draft on --eval-data into `summary["eval"]` (skipped, with a note, without the engine)."""
    target_path = out / "target_resized" if (out / "target_resized").exists() else args.target
    try:
        res = evaluate(target_path, out, args.eval_data or out / HELDOUT_FILE, n=args.eval_n,
                       max_new_tokens=args.eval_max_new_tokens, speedup=args.eval_speedup, device=args.device)
    except ImportError as exc:
        print(f"dflash-train: skipping held-out evaluation (engine unavailable: {exc})", file=sys.stderr)
        return
    summary["eval"] = res
    msg = f"held-out acceptance length {res['acceptance_length']:.2f} on {res['prompts']} prompts"
    if "speedup" in res:
        msg += f", speedup {res['speedup']:.2f}x over autoregressive"
    print(f"dflash-train: {msg}", flush=True)
