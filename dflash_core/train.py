"""dflash-train: train a DFlash draft for any transformers causal LM target.

Recipe (DFlash paper, z-lab checkpoints): the target writes (or the data supplies) a response for every prompt; random
anchor positions a are drawn in the response; each block is [x_a, mask x (B-1)] at positions a..a+B-1; block queries
see the target's context features at positions < a plus their own block (bidirectionally); the loss is cross-entropy
against x_{a+k} at block rows k = 1..B-1, weighted exp(-(k-1)/gamma). The target's embedding and lm_head are used
frozen. The output folder is a z-lab-format draft (config.json + model.safetensors) that dflash_core loads unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash_core.cli_help import HelpFormatter
from dflash_core.config import DraftConfig, build_target_layer_ids
from dflash_core.draft import DFlashDraft

CHECKPOINT_DIR = "checkpoint"
DATA_FILE = "train_data.pt"
MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")


class UsageError(Exception):
    """Bad input: reported as one clear message with a non-zero exit status."""


@dataclass
class Example:
    """One training sequence: prompt ids followed by response ids."""

    prompt: list[int]
    response: list[int] | None


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The dflash-train command line (every option documented, with its default)."""
    p = argparse.ArgumentParser(prog="dflash-train", description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("target and data")
    g.add_argument("--target", required=True, help="target model: a local folder or a hub id (transformers causal LM)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the target's)")
    g.add_argument(
        "--data", required=True, type=Path,
        help="JSONL prompts: {'messages': [...]} (chat; a final assistant message is used as the response) or "
             "{'prompt'|'text': str} (plain text; optional 'response'|'completion')",
    )
    g.add_argument("--output", required=True, type=Path, help="output folder for the draft (config.json + weights)")
    g.add_argument("--regenerate", action="store_true", help="let the target regenerate responses the data has")
    g.add_argument("--max-samples", type=int, default=None, help="use at most this many rows of --data (default: all)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are cut from the left")
    g.add_argument("--max-new-tokens", type=int, default=256, help="response length limit when generating")
    g.add_argument("--gen-batch-size", type=int, default=32, help="prompts per batched generate call")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses, >0 = sampled")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling for generated responses")
    g.add_argument("--cache-hidden", action="store_true",
                   help="compute the chosen target layers' hidden states once and keep them in memory (fp16) "
                        "instead of running the target in every step")
    g = p.add_argument_group("draft architecture")
    g.add_argument("--block-size", type=int, default=16, help="block size B (>= 2)")
    g.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    g.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
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
    g.add_argument("--eval-n", type=int, default=32, help="held-out prompts to use")
    g.add_argument("--eval-max-new-tokens", type=int, default=256, help="tokens per held-out prompt")
    g.add_argument("--eval-speedup", action="store_true",
                   help="also time plain autoregressive decoding, interleaved, and report the speedup")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------- data


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a clear UsageError for missing, unreadable or malformed files."""
    if not path.is_file():
        raise UsageError(f"data file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{n}: each line must be a JSON object")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise UsageError(f"data file {path} is empty: no prompts to train on")
    return rows


def encode_rows(rows: list[dict[str, Any]], tok: Any, regenerate: bool, max_prompt: int) -> list[Example]:
    """Tokenize prompts (chat template for `messages`) and any given responses (ending in EOS)."""
    out: list[Example] = []
    eos = tok.eos_token_id
    for n, row in enumerate(rows, 1):
        response_text = None
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise UsageError(f"row {n}: 'messages' must be a non-empty list")
            if msgs[-1].get("role") == "assistant":
                response_text, msgs = msgs[-1].get("content", ""), msgs[:-1]
            if not msgs:
                raise UsageError(f"row {n}: no prompt messages before the assistant reply")
            if getattr(tok, "chat_template", None):
                prompt = _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + "\nassistant:"
                prompt = tok(text, add_special_tokens=True)["input_ids"]
        else:
            text = row.get("prompt", row.get("text"))
            if not isinstance(text, str) or not text:
                raise UsageError(f"row {n}: needs 'messages', 'prompt' or 'text'")
            prompt = tok(text, add_special_tokens=True)["input_ids"]
            response_text = row.get("response", row.get("completion"))
        prompt = prompt[-max_prompt:]
        response = None
        if response_text and not regenerate:
            response = tok(response_text, add_special_tokens=False)["input_ids"]
            if eos is not None:
                response = response + [eos]
        out.append(Example(prompt, response))
    return out


def _ids(enc: Any) -> list[int]:
    """apply_chat_template returns a list in some transformers versions and a BatchEncoding in others."""
    if isinstance(enc, dict) or hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(t) for t in enc]


@torch.no_grad()
def generate_responses(
    model: Any, tok: Any, examples: list[Example], *, batch_size: int, max_new_tokens: int, temperature: float,
    top_p: float, seed: int, eos_ids: list[int], pad_id: int,
) -> None:
    """Fill missing responses with the target's own (batched, left-padded) generations, ending at EOS."""
    todo = [i for i, ex in enumerate(examples) if ex.response is None]
    if not todo:
        return
    todo.sort(key=lambda i: len(examples[i].prompt))
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", dynamic_ncols=True, mininterval=2)
    for start in range(0, len(todo), batch_size):
        idx = todo[start : start + batch_size]
        width = max(len(examples[i].prompt) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = examples[i].prompt
            ids[r, width - len(p) :] = torch.tensor(p)
            att[r, width - len(p) :] = 1
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        out = model.generate(
            input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids or None, pad_token_id=pad_id, **kwargs,
        )
        for r, i in enumerate(idx):
            resp = out[r, width:].tolist()
            for j, t in enumerate(resp):
                if t in eos_ids:
                    resp = resp[: j + 1]
                    break
            examples[i].response = resp
        bar.update(len(idx))
    bar.close()


# ---------------------------------------------------------------- target helpers


def target_layers(model: Any) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


def rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(getattr(cfg, "rope_theta", None) or params.get("rope_theta", 10000.0))


def resolve_mask_token(tok: Any, model: Any, requested: int | None) -> tuple[int, str | None]:
    """(mask id, note). Resizes the target's embeddings when a new token has to be added."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if requested is not None:
        if not 0 <= requested < vocab:
            raise UsageError(f"--mask-token-id {requested} is outside the target vocabulary (0..{vocab - 1})")
        return requested, None
    for name in MASK_NAMES:
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and 0 <= tid < vocab:
            return tid, None
    if len(tok) < vocab:
        return len(tok), f"mask token: unused id {len(tok)} (tokenizer has {len(tok)} tokens, model {vocab} rows)"
    tok.add_special_tokens({"additional_special_tokens": ["<|mask|>"]})
    model.resize_token_embeddings(len(tok), mean_resizing=True)
    return tok.convert_tokens_to_ids("<|mask|>"), (
        f"no free token id: added <|mask|> = {len(tok) - 1}; the target's vocabulary grew to {len(tok)}, "
        "so serve the resized target saved in OUTPUT/target_resized"
    )


def context_features(model: Any, ids: torch.Tensor, att: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated hidden states `output_hidden_states[i+1]` of the chosen layers: [b, s, len(ids)*H]."""
    out = model(input_ids=ids, attention_mask=att, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


# ---------------------------------------------------------------- the training batch


def make_block_batch(
    seqs: list[torch.Tensor], resp_starts: list[int], block_size: int, n_anchors: int, mask_id: int,
    pad_id: int, gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Anchors, block tokens/positions, labels, loss weights and the [b,1,q,S+q] visibility mask for a batch."""
    b, B = len(seqs), block_size
    S = max(len(s) for s in seqs)
    tokens = torch.full((b, S), pad_id, dtype=torch.long)
    att = torch.zeros((b, S), dtype=torch.long)
    anchors = torch.zeros((b, n_anchors), dtype=torch.long)
    valid = torch.zeros((b, n_anchors), dtype=torch.bool)
    for r, (s, start) in enumerate(zip(seqs, resp_starts)):
        tokens[r, : len(s)] = s
        att[r, : len(s)] = 1
        lo, hi = start, len(s) - 2  # anchor needs at least one label after it
        if hi < lo:
            continue
        cand = torch.arange(lo, hi + 1)
        pick = cand[torch.randperm(len(cand), generator=gen)[:n_anchors]].sort().values
        anchors[r, : len(pick)] = pick
        valid[r, : len(pick)] = True
    offs = torch.arange(B)
    pos = anchors[:, :, None] + offs  # [b, n, B]
    lengths = att.sum(1)
    label_ok = (pos < lengths[:, None, None]) & (offs > 0) & valid[:, :, None]
    labels = torch.where(label_ok, tokens.gather(1, pos.clamp(max=S - 1).view(b, -1)).view(b, n_anchors, B), -100)
    block_tokens = torch.full((b, n_anchors, B), mask_id, dtype=torch.long)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    q = n_anchors * B
    ctx_vis = torch.arange(S)[None, None, :] < anchors.repeat_interleave(B, dim=1)[:, :, None]  # [b, q, S]
    blk = torch.arange(q) // B
    blk_vis = (blk[:, None] == blk[None, :]).expand(b, q, q)
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]
    return {"tokens": tokens, "att": att, "block_tokens": block_tokens.view(b, q), "block_pos": pos.view(b, q),
            "labels": labels.view(b, q), "mask": mask, "n_anchors": torch.tensor(n_anchors)}


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, float, int]:
    """Weighted CE over block rows 1..B-1; also the estimated acceptance length (1 + leading correct rows)."""
    b, q, V = logits.shape
    k = torch.arange(q) % block_size
    w = torch.exp(-(k.clamp(min=1) - 1).float() / gamma)[None].expand(b, q)
    ok = labels >= 0
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.clamp(min=0).reshape(-1), reduction="none").view(b, q)
    wsum = (w * ok).sum().clamp(min=1e-6)
    loss = (ce * w * ok).sum() / wsum
    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & ok).view(b, -1, block_size)[:, :, 1:]
        has = ok.view(b, -1, block_size)[:, :, 1].reshape(-1)
        lead = correct.long().cumprod(-1).sum(-1).reshape(-1)[has]
        tau = 1.0 + lead.float().mean().item() if len(lead) else 1.0
    return loss, tau, int(has.sum())


# ---------------------------------------------------------------- checkpoints


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_modes(path: Path) -> None:
    """Make a written file or folder (recursively) readable like a normal file: 0644 / 0755 less the umask.

    tempfile.mkdtemp makes 0700 folders and safetensors writes 0600 files; weights written that way are
    unreadable to anyone else, e.g. the serving container's user (uid 1000)."""
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o755 if p.is_dir() else 0o644) & ~mask)


def atomic_dir_write(final: Path, write: Any) -> None:
    """Write a folder through a temporary sibling, then swap it in: never a half-written checkpoint."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=final.parent))
    try:
        write(tmp)
        share_modes(tmp)
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(out: Path, draft: DFlashDraft, opt: torch.optim.Optimizer, step: int, gen: torch.Generator) -> None:
    def write(tmp: Path) -> None:
        draft.save(tmp)
        torch.save({"step": step, "optimizer": opt.state_dict(), "gen": gen.get_state(),
                    "torch_rng": torch.get_rng_state()}, tmp / "trainer_state.pt")

    atomic_dir_write(out / CHECKPOINT_DIR, write)


def save_final(out: Path, draft: DFlashDraft) -> None:
    """config.json + model.safetensors into the output folder, each file replaced atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".final.tmp", dir=out))
    try:
        draft.save(tmp)
        share_modes(tmp)
        for name in ("model.safetensors", "config.json"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- evaluation


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams (1.0 for sequences shorter than n)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def load_eval_prompts(path: Path, tok: Any, n: int) -> list[list[int]]:
    """Held-out prompts as token ids (chat template for `messages`)."""
    return [ex.prompt for ex in encode_rows(read_jsonl(path, n), tok, regenerate=True, max_prompt=4096)]


def _run_one(engine: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float, Any]:
    from dflash_core.sampling import SamplingParams

    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    toks: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                toks.extend(o.new_token_ids)
    elapsed = time.perf_counter() - t0
    stats = engine.stats(rid)
    engine.release(rid)
    return toks, elapsed, stats


def evaluate(
    target: str | Path, draft: str | Path, prompts_path: Path, *, n: int = 32, max_new_tokens: int = 256,
    speedup: bool = False, device: str = "cpu",
) -> dict[str, Any]:
    """Greedy, batch 1, with the engine: acceptance length and answer diversity on held-out prompts; with
    `speedup`, also `dflash-bench offline` on the same prompts (plain vs DFlash interleaved per prompt)."""
    from dflash_core.loading import load_models

    spec = load_models(str(target), str(draft), device=device, dtype="float32")
    prompts = load_eval_prompts(prompts_path, spec.tokenizer, n)
    drafts = accepted = tokens = 0
    t_spec = 0.0
    ratios: list[float] = []
    per_prompt: list[float] = []
    _run_one(spec.engine, prompts[0], 8)  # warm-up
    for prompt in tqdm(prompts, desc="eval", dynamic_ncols=True, mininterval=2):
        toks, dt, st = _run_one(spec.engine, prompt, max_new_tokens)
        t_spec += dt
        drafts += st.num_drafts
        accepted += st.num_accepted_tokens
        tokens += len(toks)
        per_prompt.append(st.mean_acceptance_length)
        ratios.append(distinct_ngram_ratio(toks))
    result: dict[str, Any] = {
        "prompts": len(prompts), "generated_tokens": tokens, "block_size": spec.block_size,
        "acceptance_length": 1.0 + accepted / max(1, drafts), "drafts": drafts, "accepted_tokens": accepted,
        "acceptance_length_median_per_prompt": statistics.median(per_prompt),
        "distinct_4gram_median": statistics.median(ratios), "distinct_4gram_min": min(ratios),
        "dflash_seconds": t_spec, "dflash_tokens_per_s": tokens / t_spec,
        "max_new_tokens": max_new_tokens, "device": spec.device, "threads": torch.get_num_threads(),
    }
    if speedup:
        from dflash_core.bench import load_prompts, run_offline

        del spec  # the benchmark loads its own copy
        bench = run_offline(load_prompts(str(prompts_path), n), target=str(target), draft=str(draft),
                            device=device, dtype="float32", max_tokens=max_new_tokens, progress=False,
                            dataset=str(prompts_path))
        summary = bench["summary"]
        result.update(
            ar_seconds=summary["plain"]["total_time_s"], ar_tokens_per_s=summary["plain"]["output_tokens_per_s"],
            dflash_seconds=summary["dflash"]["total_time_s"],
            dflash_tokens_per_s=summary["dflash"]["output_tokens_per_s"],
            speedup=summary["speedup"], bench_acceptance_length=summary["mean_acceptance_length"],
            outputs_identical=summary["identical_outputs"] == summary["num_prompts"],
        )
    return result


# ---------------------------------------------------------------- main


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
    if args.block_size < 2:
        raise UsageError(f"--block-size must be at least 2 (got {args.block_size})")
    for name in ("steps", "batch_size", "anchors", "num_layers", "max_new_tokens", "gen_batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.gamma <= 0:
        raise UsageError("--gamma must be positive")
    if not Path(args.target).exists() and (args.target.startswith((".", "/", "~")) or args.target.count("/") != 1):
        raise UsageError(f"target {args.target!r} is neither a local folder nor a hub id (owner/name)")
    if not args.data.is_file():
        raise UsageError(f"data file {args.data} does not exist")
    if args.eval_data is not None and not args.eval_data.is_file():
        raise UsageError(f"eval data file {args.eval_data} does not exist")


def load_target_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    except Exception as exc:  # hub unreachable, missing files, unknown architecture: one message
        raise UsageError(f"cannot load target {args.target!r}: {str(exc).splitlines()[0]}") from None
    model.to(args.device).eval()
    model.requires_grad_(False)
    return model, tok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = read_jsonl(args.data, args.max_samples)
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


def train(args: argparse.Namespace, rows: list[dict[str, Any]], model: Any, tok: Any) -> int:
    """Data -> responses -> (cached) features -> draft training -> final folder -> held-out evaluation."""
    out: Path = args.output
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    L = target_layers(model)
    tcfg = model.config.get_text_config()
    mask_id, note = resolve_mask_token(tok, model, args.mask_token_id)
    if note:
        print(f"dflash-train: {note}", file=sys.stderr)
        if "resized" in note:
            model.save_pretrained(out / "target_resized")
            tok.save_pretrained(out / "target_resized")
            share_modes(out / "target_resized")
    if args.target_layer_ids:
        try:
            layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            raise UsageError(
                f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}"
            ) from None
        if any(not 0 <= i < L for i in layer_ids):
            raise UsageError(f"--target-layer-ids {layer_ids} outside the target's {L} layers")
    else:
        layer_ids = build_target_layer_ids(L, args.num_layers)
    H = int(tcfg.hidden_size)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    cfg = DraftConfig(
        hidden_size=H, intermediate_size=int(args.intermediate_size or tcfg.intermediate_size),
        num_hidden_layers=args.num_layers, num_attention_heads=int(tcfg.num_attention_heads),
        num_key_value_heads=int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads),
        head_dim=int(getattr(tcfg, "head_dim", None) or H // tcfg.num_attention_heads), vocab_size=vocab,
        num_target_layers=L, block_size=args.block_size, mask_token_id=mask_id, target_layer_ids=layer_ids,
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)), rope_theta=rope_theta(tcfg),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
    )
    eos_ids = _eos_ids(model, tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

    # Data: reuse the generated responses of an interrupted run.
    data_path = out / DATA_FILE
    if args.resume and data_path.exists():
        examples = [Example(p, r) for p, r in torch.load(data_path)]
    else:
        examples = encode_rows(rows, tok, args.regenerate, args.max_prompt_tokens)
        generate_responses(model, tok, examples, batch_size=args.gen_batch_size, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed, eos_ids=eos_ids,
                           pad_id=pad_id)
        tmp = data_path.with_suffix(".tmp")
        torch.save([(ex.prompt, ex.response) for ex in examples], tmp)
        os.replace(tmp, data_path)
    seqs, starts = [], []
    for ex in examples:
        s = (ex.prompt + (ex.response or []))[: args.max_seq_len]
        if len(s) - 2 >= len(ex.prompt):
            seqs.append(torch.tensor(s, dtype=torch.long))
            starts.append(len(ex.prompt))
    if not seqs:
        raise UsageError("no training sequence has a response of at least 2 tokens")
    n_resp = sum(len(s) - st for s, st in zip(seqs, starts))
    print(f"dflash-train: {len(seqs)} sequences, {n_resp} response tokens; target layers {layer_ids} of {L}; "
          f"mask id {mask_id}; block size {args.block_size}", flush=True)

    device = torch.device(args.device)
    embed_w = model.get_input_embeddings().weight.detach()
    head_w = model.get_output_embeddings().weight.detach()
    cache: list[torch.Tensor] | None = None
    if args.cache_hidden:
        cache = []
        with torch.no_grad():
            for i in tqdm(range(0, len(seqs), 16), desc="features", dynamic_ncols=True, mininterval=2):
                chunk = seqs[i : i + 16]
                S = max(len(s) for s in chunk)
                ids = torch.full((len(chunk), S), pad_id, dtype=torch.long)
                att = torch.zeros_like(ids)
                for r, s in enumerate(chunk):
                    ids[r, : len(s)], att[r, : len(s)] = s, 1
                feats = context_features(model, ids.to(device), att.to(device), layer_ids)
                cache.extend(feats[r, : len(s)].to(torch.float16).cpu() for r, s in enumerate(chunk))

    torch.manual_seed(args.seed)
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
    warmup = max(1, int(0.04 * args.steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

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
            group["lr"] = lr_at(step)
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
    if args.eval_data is not None:
        target_path = out / "target_resized" if (out / "target_resized").exists() else args.target
        try:
            res = evaluate(target_path, out, args.eval_data, n=args.eval_n, max_new_tokens=args.eval_max_new_tokens,
                           speedup=args.eval_speedup, device=args.device)
        except ImportError as exc:
            print(f"dflash-train: skipping held-out evaluation (engine unavailable: {exc})", file=sys.stderr)
        else:
            summary["eval"] = res
            msg = f"held-out acceptance length {res['acceptance_length']:.2f} on {res['prompts']} prompts"
            if "speedup" in res:
                msg += f", speedup {res['speedup']:.2f}x over autoregressive"
            print(f"dflash-train: {msg}", flush=True)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _eos_ids(model: Any, tok: Any) -> list[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tok.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


if __name__ == "__main__":
    raise SystemExit(main())
