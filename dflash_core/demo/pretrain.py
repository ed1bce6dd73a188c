"""Train the small Qwen3-architecture demo target on synthetic chats mixed with Python standard-library source."""

from __future__ import annotations

import json
import math
import random
import shutil
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash_core.chat import render_chat
from dflash_core.demo.synth import examples
from dflash_core.demo.tokenizer import save_tokenizer, train_tokenizer


def stdlib_texts(max_chars: int, seed: int) -> list[str]:
    """Source text of the running interpreter's standard library (top-level modules, seeded order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return out


def chat_text(tok: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> str:
    """A chat rendered with the ChatML template."""
    return render_chat(tok, messages, add_generation_prompt=False)


def build_tokenizer(seed: int, exclude: set[str], vocab_size: int, folder: Path) -> PreTrainedTokenizerFast:
    """Train and save the demo tokenizer on a sample of the synthetic chats and stdlib source."""
    gen = examples(seed + 1, exclude)
    texts = [f"{ex[0]['content']}\n{ex[1]['content']}" for ex, _ in zip(gen, range(20000))]
    texts += stdlib_texts(1_500_000, seed)
    tok = train_tokenizer(texts, vocab_size)
    save_tokenizer(tok, folder)
    # Keep the chat template inside tokenizer_config.json, where most loaders look for it.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = folder / "chat_template.jinja"
    cfg["chat_template"] = jinja.read_text() if jinja.exists() else tok.chat_template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # a name transformers 4.x also knows
    jinja.unlink(missing_ok=True)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return tok


def token_stream(
    tok: PreTrainedTokenizerFast, seed: int, exclude: set[str], code_fraction: float, n_docs: int
) -> list[int]:
    """Documents separated by <|endoftext|>: synthetic chats with probability 1-code_fraction, else a stdlib chunk."""
    rng = random.Random(seed + 2)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    chunks: list[str] = []
    for text in stdlib_texts(50_000_000, seed):
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), 40):
            chunks.append("".join(lines[i : i + 40]))
    rng.shuffle(chunks)
    gen = examples(seed + 3, exclude)
    docs: list[str] = []
    ci = 0
    for _ in range(n_docs):
        if rng.random() < code_fraction and ci < len(chunks):
            docs.append(chunks[ci])
            ci += 1
        else:
            docs.append(chat_text(tok, next(gen)))
    ids: list[int] = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    return ids


def batches(ids: list[int], seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless shuffled batches of packed rows [batch, seq_len + 1]."""
    data = torch.tensor(ids, dtype=torch.long)
    n_rows = (len(data) - 1) // seq_len
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n_rows, generator=gen)
        for start in range(0, n_rows - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield torch.stack([data[r * seq_len : r * seq_len + seq_len + 1] for r in rows.tolist()])


def target_config(
    vocab_size: int, tok: PreTrainedTokenizerFast, layers: int, hidden: int, intermediate: int
) -> Qwen3Config:
    """The demo target's Qwen3 config."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def pretrain_target(
    folder: Path, seed: int, exclude: set[str], *, steps: int, batch_size: int = 8, seq_len: int = 256,
    lr: float = 3e-3, layers: int = 6, hidden: int = 256, intermediate: int = 512, vocab_size: int = 4096,
    code_fraction: float = 0.1,
    bf16: bool = False, partial_every: int = 100,
) -> dict:
    """Build the tokenizer, train the target for `steps` steps and save both to `folder`. Returns a summary."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(seed)
    tok = build_tokenizer(seed, exclude, vocab_size, folder)
    n_docs = int(steps * batch_size * seq_len / 110 * 1.1) + 1000
    ids = token_stream(tok, seed, exclude, code_fraction, n_docs)
    print(f"[target] tokenizer {len(tok)} tokens; {len(ids):,} training tokens ({time.time() - t0:.0f}s)", flush=True)
    cfg = target_config(len(tok), tok, layers, hidden, intermediate)
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))

    model.train()
    data = batches(ids, seq_len, batch_size, seed)
    bar = tqdm(range(steps), desc="target", mininterval=5, dynamic_ncols=True)
    ema = None
    for step in bar:
        batch = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        if partial_every and (step + 1) % partial_every == 0 and step + 1 < steps:
            model.save_pretrained(str(folder / "partial"), safe_serialization=True)
    shutil.rmtree(folder / "partial", ignore_errors=True)
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False)
    model.save_pretrained(str(folder), safe_serialization=True)
    return {"params": n_params, "train_tokens": steps * batch_size * seq_len, "final_loss": ema,
            "seconds": time.time() - t0, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
            "layers": layers, "hidden": hidden, "intermediate": intermediate, "vocab_size": len(tok),
            "code_fraction": code_fraction, "bf16": bf16}
