"""`dflash-bench offline`: plain decoding and DFlash on the same target, in-process, interleaved prompt by prompt."""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any

from dflash_core.bench.errors import BenchError, IdentityError
from dflash_core.bench.measure import distribution, environment, progress_bar, ratio
from dflash_core.bench.prompts import Message, Prompt
from dflash_core.chat import NoChatTemplateError, encode_chat
from dflash_core.config import EngineConfig
from dflash_core.stats import mean_acceptance_length


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids: a recorded request's own, else its chat rendered (`encode_prompt`)."""
    return list(prompt.token_ids) if prompt.token_ids is not None else encode_prompt(tokenizer, prompt.messages)


def encode_prompt(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of a chat as dflash-serve builds them: the chat template with the generation prompt."""
    try:
        return encode_chat(tokenizer, messages)
    except NoChatTemplateError:
        raise BenchError(
            "the tokenizer has no chat template, so the benchmark's chat prompts cannot be rendered: "
            "pass --tokenizer with one that has a chat template"
        ) from None


def _run_request(engine: Any, prompt_ids: list[int], params: Any) -> tuple[list[int], dict[str, Any]]:
    """One request alone on `engine`, timed; (output token ids, measurements)."""
    from dflash_core.generate import iter_steps

    t0 = time.perf_counter()
    ttft: float | None = None
    done = None
    lengths: list[int] = []  # acceptance length of every draft/verify step (plain steps drafted nothing)
    try:
        with closing(iter_steps(engine, [prompt_ids], params)) as steps:  # closing: a failure aborts the request
            for req, out in steps:
                if out.error:
                    raise BenchError(f"the engine failed: {out.error}", code=1)
                if out.num_draft_tokens:
                    lengths.append(out.acceptance_length)
                if ttft is None and out.new_token_ids:
                    ttft = time.perf_counter() - t0
                if req.finished:
                    done = req
    except ValueError as exc:  # the engine refused the prompt, e.g. prompt + max_tokens beyond the context
        raise BenchError(f"the engine refused a request: {exc}") from None
    total = time.perf_counter() - t0
    if done is None or done.stats is None:
        raise BenchError("the engine ended a request without finishing it", code=1)
    stats, tokens = done.stats, done.token_ids
    ttft = total if ttft is None else ttft
    n = len(tokens)
    run: dict[str, Any] = {
        "output_tokens": n,
        "time_s": total,
        "ttft_s": ttft,
        "decode_tokens_per_s": (n - 1) / (total - ttft) if n > 1 and total > ttft else None,
        "finish_reason": done.finish_reason,
    }
    if engine.drafter is not None:
        run.update(
            num_drafts=stats.num_drafts,
            num_accepted_tokens=stats.num_accepted_tokens,
            mean_acceptance_length=stats.mean_acceptance_length,
            acceptance_lengths=lengths,
        )
    return tokens, run


def _engine_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of one engine's runs: tokens, time, throughput, decode throughput and TTFT."""
    tokens = sum(r["output_tokens"] for r in runs)
    total = sum(r["time_s"] for r in runs)
    decode_tokens = sum(max(r["output_tokens"] - 1, 0) for r in runs)
    decode_time = sum(r["time_s"] - r["ttft_s"] for r in runs)
    return {
        "output_tokens": tokens,
        "total_time_s": total,
        "output_tokens_per_s": tokens / total if total > 0 else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 and decode_tokens else None,
        "ttft_s": distribution([r["ttft_s"] for r in runs]),
    }


def _summary(rows: list[dict[str, Any]], bsz: int, greedy: bool) -> dict[str, Any]:
    """The `summary` of an offline result from its per-prompt rows."""
    counts = [0] * bsz
    for r in rows:
        for a in r["dflash"]["acceptance_lengths"]:
            counts[min(a, bsz) - 1] += 1
    steps = sum(counts)
    drafts = sum(r["dflash"]["num_drafts"] for r in rows)
    accepted = sum(r["dflash"]["num_accepted_tokens"] for r in rows)
    per_prompt_al = [r["dflash"]["mean_acceptance_length"] for r in rows]
    p_sum, d_sum = _engine_summary([r["plain"] for r in rows]), _engine_summary([r["dflash"] for r in rows])
    return {
        "num_prompts": len(rows),
        "block_size": bsz,
        "plain": p_sum,
        "dflash": d_sum,
        "speedup": p_sum["total_time_s"] / d_sum["total_time_s"] if d_sum["total_time_s"] > 0 else 0.0,
        "mean_prompt_speedup": sum(r["speedup"] for r in rows) / len(rows) if rows else 0.0,
        "decode_speedup": ratio(d_sum["decode_tokens_per_s"], p_sum["decode_tokens_per_s"]),
        "mean_acceptance_length": mean_acceptance_length(accepted, drafts),
        "mean_acceptance_length_per_prompt": sum(per_prompt_al) / len(per_prompt_al) if rows else 1.0,
        "acceptance_histogram": {
            "counts": counts,
            "fractions": [c / steps if steps else 0.0 for c in counts],
        },
        "identity_checked": greedy,
        "identical_outputs": sum(r["identical"] for r in rows),
    }


def plain_twin(dflash: Any) -> Any:
    """A plain-decoding engine beside `dflash`: the same runner, so the same slots, and the same scheduler settings,
    so prompts are prefilled in the same chunks."""
    from dflash_core.engine import Engine

    return Engine(dflash.target, None, eos_token_ids=dflash.eos_token_ids, max_model_len=dflash.max_model_len,
                  kv=dflash.kv, max_num_batched_tokens=dflash.scheduler.max_num_batched_tokens,
                  prefill_chunk=dflash.scheduler.prefill_chunk)


def run_offline(
    prompts: list[Prompt],
    *,
    target: str | None = None,
    draft: str | None = None,
    tokenizer: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    block_size: int | None = None,
    backend: str = "auto",
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
    dataset: str = "custom",
    threads: int | None = None,
    speculation: str = "adaptive",
    spec_sampling: str = "keyed",
    tree_budget: int = 32,
) -> dict[str, Any]:
    """Plain decoding and DFlash on the same target, interleaved prompt by prompt: the `offline` result
    without its header. Raises IdentityError when greedy outputs differ. No target: the demo pair. `threads`:
    torch's CPU threads (None: the engine's default, 1 on a CPU device)."""
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams

    if target is not None and draft is None:
        raise BenchError("offline needs a draft (--draft) to compare with plain decoding")
    t0 = time.perf_counter()
    try:
        config = EngineConfig(target, draft, tokenizer, device=device, dtype=dtype, block_size=block_size,
                              backend=backend, threads=threads, speculation=speculation,
                              spec_sampling=spec_sampling, tree_budget=tree_budget)
        models = load_models(config)
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(f"cannot load the models: {exc}") from None
    load_time = time.perf_counter() - t0
    dflash = models.engine
    if dflash.drafter is None:
        raise BenchError("offline needs a draft with block size >= 2")
    plain = plain_twin(dflash)
    bsz = dflash.block_size
    encoded = [prompt_ids(models.tokenizer, p) for p in prompts]

    def params(i: int, n: int = max_tokens) -> Any:
        return SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i)

    greedy = params(0).greedy  # the engine's rule: temperature below SAMPLING_EPS is greedy
    if warmup and encoded:
        for eng in (plain, dflash):
            _run_request(eng, encoded[0], params(-1, min(max_tokens, 16)))
    rows: list[dict[str, Any]] = []
    bar = progress_bar(len(prompts), "offline", progress)
    try:
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            order = (plain, dflash) if i % 2 == 0 else (dflash, plain)
            results = {id(eng): _run_request(eng, ids, params(i)) for eng in order}
            (p_tok, p_run), (d_tok, d_run) = results[id(plain)], results[id(dflash)]
            identical = p_tok == d_tok
            if greedy and not identical:
                pos = next(
                    (k for k, (a, b) in enumerate(zip(p_tok, d_tok)) if a != b), min(len(p_tok), len(d_tok))
                )
                raise IdentityError(i, pos, p_tok, d_tok)
            rows.append(
                {
                    "index": i,
                    "source": prompt.source,
                    "prompt_tokens": len(ids),
                    "plain": p_run,
                    "dflash": d_run,
                    "speedup": p_run["time_s"] / d_run["time_s"],
                    "identical": identical,
                }
            )
            bar.update(1)
    finally:
        bar.close()

    config_out = {
        "target": models.target_name,
        "draft": str(models.draft_name),
        "tokenizer": tokenizer,
        "dataset": dataset,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "block_size": bsz,
        "device": models.device,
        "dtype": models.dtype,
        "backend": models.backend,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "load_time_s": load_time,
    }
    summary = _summary(rows, bsz, greedy)
    # the engine's own estimate of its speedup (decode steps, measured step costs), to set against decode_speedup
    summary["estimated_speedup"] = dflash.estimated_speedup()
    return {"environment": environment(), "config": config_out, "summary": summary, "prompts": rows}
