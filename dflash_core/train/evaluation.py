"""Held-out evaluation of a trained draft with the engine: acceptance length, answer diversity, and (optionally)
the speedup over plain autoregressive decoding measured by `dflash-bench offline`."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_core.train.data import encode_rows, read_rows


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams (1.0 for sequences shorter than n)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def load_eval_prompts(path: Path, tok: Any, n: int) -> list[list[int]]:
    """Held-out prompts as token ids (chat template for `messages`)."""
    return [ex.prompt for ex in encode_rows(read_rows(path, n), tok, regenerate=True, max_prompt=4096)]


def evaluate(
    target: str | Path, draft: str | Path, prompts_path: Path, *, n: int = 32, max_new_tokens: int = 256,
    speedup: bool = False, device: str = "cpu",
) -> dict[str, Any]:
    """Greedy, batch 1, with the engine: acceptance length and answer diversity on held-out prompts; with
    `speedup`, also `dflash-bench offline` on the same prompts (plain vs DFlash interleaved per prompt)."""
    from dflash_core.config import EngineConfig
    from dflash_core.generate import run_to_completion
    from dflash_core.loading import load_models
    from dflash_core.sampling import SamplingParams
    from dflash_core.stats import mean_acceptance_length

    # keep the training's thread setting (the engine's default would be 1 on a CPU device); full blocks, so that the
    # acceptance length measures the draft, not the adaptive policy's reading of this machine's load
    spec = load_models(EngineConfig(str(target), str(draft), device=device, dtype="float32",
                                    threads=torch.get_num_threads(), speculation="fixed"))
    prompts = load_eval_prompts(prompts_path, spec.tokenizer, n)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    drafts = accepted = tokens = 0
    t_spec = 0.0
    ratios: list[float] = []
    per_prompt: list[float] = []
    run_to_completion(spec.engine, prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    for prompt in tqdm(prompts, desc="eval", dynamic_ncols=True, mininterval=2):
        t0 = time.perf_counter()
        (res,) = run_to_completion(spec.engine, [prompt], params)
        t_spec += time.perf_counter() - t0
        st = res.stats
        assert st is not None  # set once a request has finished
        drafts += st.num_drafts
        accepted += st.num_accepted_tokens
        tokens += len(res.token_ids)
        per_prompt.append(st.mean_acceptance_length)
        ratios.append(distinct_ngram_ratio(res.token_ids))
    result: dict[str, Any] = {
        "prompts": len(prompts), "generated_tokens": tokens, "block_size": spec.block_size,
        "acceptance_length": mean_acceptance_length(accepted, drafts), "drafts": drafts, "accepted_tokens": accepted,
        "acceptance_length_median_per_prompt": statistics.median(per_prompt),
        "distinct_4gram_median": statistics.median(ratios), "distinct_4gram_min": min(ratios),
        "dflash_seconds": t_spec, "dflash_tokens_per_s": tokens / t_spec,
        # the engine's own estimate over plain steps of the same batch, from its measured step costs (None unmeasured)
        "estimated_speedup": spec.engine.estimated_speedup(),
        "max_new_tokens": max_new_tokens, "device": spec.device, "threads": torch.get_num_threads(),
    }
    if speedup:
        from dflash_core.bench import load_prompts, run_offline

        del spec  # the benchmark loads its own copy
        bench = run_offline(load_prompts(str(prompts_path), n), target=str(target), draft=str(draft),
                            device=device, dtype="float32", max_tokens=max_new_tokens, progress=False,
                            dataset=str(prompts_path), threads=torch.get_num_threads())
        summary = bench["summary"]
        result.update(
            ar_seconds=summary["plain"]["total_time_s"], ar_tokens_per_s=summary["plain"]["output_tokens_per_s"],
            dflash_seconds=summary["dflash"]["total_time_s"],
            dflash_tokens_per_s=summary["dflash"]["output_tokens_per_s"],
            speedup=summary["speedup"], bench_acceptance_length=summary["mean_acceptance_length"],
            outputs_identical=summary["identical_outputs"] == summary["num_prompts"],
        )
    return result
