"""`dflash-bench stall`: how much a long prompt's prefill stalls the streams already running.

Some streams run (ordinary chat answers, a new one started as one ends); then one request with a long prompt
arrives. Its prefill runs in chunks between the decode
steps of the running streams (`--prefill-chunk` on the server), so their inter-chunk gaps while it is prefilled
should stay close to their usual gap. The result reports the running streams' median gap, their largest gap
during the long prompt's prefill (from its send to its first token) and the ratio of the two.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import environment
from dflash_core.bench.prompts import Prompt

LONG_PROMPT_SENTENCE = "Convert 5 kilometers to meters, then add 12 and explain each step. "


async def _stream(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
                  times: list[float]) -> dict[str, Any]:
    """One greedy streamed chat completion; appends the arrival time of every content chunk to `times`."""
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    prompt_tokens = None
    async for chunk in stream:
        now = time.perf_counter()
        if any(c.delta is not None and c.delta.content for c in chunk.choices or []):
            times.append(now)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return {"prompt_tokens": prompt_tokens}


async def _run(base_url: str, api_key: str, model: str | None, prompts: list[Prompt], streams: int,
               long_tokens: int, max_tokens: int, delay: float) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=600, max_retries=0)
    try:
        if model is None:
            entries = (await client.models.list()).data
            if not entries:
                raise BenchError(f"{base_url}/models lists no model; pass --model")
            model = entries[0].id
        await _stream(client, model, prompts[0].messages, 8, [])  # warm-up
        # A long user message: the sentence repeated, as many times as the server's token counts say.
        async def prompt_tokens(repeats: int) -> int:
            content = LONG_PROMPT_SENTENCE * repeats
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}], max_tokens=1)
            return int(r.usage.prompt_tokens)

        base, ten = await prompt_tokens(1), await prompt_tokens(11)
        per_sentence = max((ten - base) / 10, 1e-9)
        repeats = max(1, 1 + round((long_tokens - base) / per_sentence))
        long_messages = [{"role": "user", "content": LONG_PROMPT_SENTENCE * repeats}]
        times: list[list[float]] = []  # one list per stream (a slot starts a new stream when one ends)
        done = asyncio.Event()

        async def keep_running(slot: int) -> None:
            """Streams of ordinary chat answers, one after another, until the long prompt has its first token."""
            k = slot
            while not done.is_set():
                times.append([])
                await _stream(client, model, prompts[k % len(prompts)].messages, max_tokens, times[-1])
                k += streams

        running = [asyncio.create_task(keep_running(i)) for i in range(streams)]
        await asyncio.sleep(delay)  # the streams are decoding
        long_times: list[float] = []
        sent = time.perf_counter()
        long_result = await _stream(client, model, long_messages, 4, long_times)
        first = long_times[0] if long_times else time.perf_counter()
        done.set()
        await asyncio.gather(*running)
    finally:
        await client.close()
    gaps_all: list[float] = []
    gaps_during: list[float] = []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            gaps_all.append(b - a)
            if b > sent and a < first:  # a gap that overlaps the long prompt's prefill
                gaps_during.append(b - a)
    if not gaps_all or not gaps_during:
        raise BenchError("the running streams ended before the long prompt's first token: raise --max-tokens")
    median = statistics.median(gaps_all)
    worst = max(gaps_during, default=0.0)
    return {
        "model": model,
        "long_prompt_tokens": long_result["prompt_tokens"],
        "long_prompt_ttft_s": first - sent,
        "streams": streams,
        "median_gap_s": median,
        "max_gap_during_prefill_s": worst,
        "gaps_during_prefill": len(gaps_during),
        "stall_ratio": worst / median if median > 0 else None,
    }


def run_stall(base_url: str, prompts: list[Prompt], *, api_key: str = "EMPTY", model: str | None = None,
                     streams: int = 4, long_tokens: int = 1500, max_tokens: int = 256,
                     delay: float = 0.3) -> dict[str, Any]:
    """Run the measurement against a server; the result (see the module docstring)."""
    import openai

    try:
        result = asyncio.run(_run(base_url, api_key, model, prompts, streams, long_tokens, max_tokens, delay))
    except openai.APIError as exc:
        raise BenchError(f"{base_url}: {type(exc).__name__}: {exc}") from None
    return {
        "environment": environment(),
        "config": {"base_url": base_url, "streams": streams, "long_prompt_tokens": long_tokens,
                   "max_tokens": max_tokens, "delay_s": delay},
        **result,
    }


def format_stall(result: dict[str, Any]) -> str:
    ratio = result["stall_ratio"]
    return (
        f"dflash-bench stall: {result['streams']} running streams, then a "
        f"{result['long_prompt_tokens']}-token prompt (its first token after {result['long_prompt_ttft_s']:.2f} s)\n"
        f"running streams: median gap {1000 * result['median_gap_s']:.1f} ms; largest gap during the prefill "
        f"{1000 * result['max_gap_during_prefill_s']:.1f} ms ({result['gaps_during_prefill']} gaps overlap it): "
        f"{'n/a' if ratio is None else f'{ratio:.2f}x'} the median"
    )
