"""`dflash-bench serve`: a concurrency sweep of streamed chat completions against an OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.measure import distribution, environment, progress_bar, ratio, spread
from dflash_core.bench.prompts import Message, Prompt
from dflash_core.stats import mean_acceptance_length

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 12, 16)
DEFAULT_REPEATS = 3
DEFAULT_MIN_DURATION_S = 10.0
# The shared prefix of `--shared-prefix-tokens`: this sentence repeated in a system message before every prompt.
SHARED_PREFIX_SENTENCE = "Shared instructions: answer accurately, keep units consistent and show every step. "
# Prefix-cache counters (tokens), vLLM's names first; a `_total` suffix (prometheus_client's) is accepted.
PREFIX_COUNTER_NAMES = ("vllm:prefix_cache_{}", "dflash_prefix_cache_{}", "dflash:prefix_cache_{}")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")  # a Prometheus sample: name, value


def metrics_url(base_url: str) -> str:
    """The server's Prometheus endpoint: /metrics at the root of an OpenAI base URL (.../v1)."""
    root = base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/metrics"


def parse_prefix_counters(text: str) -> dict[str, float] | None:
    """{"hits", "queries"} of a Prometheus text page (summed over label sets); None when it has neither."""
    families: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:  # comments, blank lines
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        name = m.group(1).removesuffix("_total")
        families[name] = families.get(name, 0.0) + value
    out = {}
    for kind in ("hits", "queries"):
        found = next((families[n.format(kind)] for n in PREFIX_COUNTER_NAMES if n.format(kind) in families), None)
        if found is None:
            return None
        out[kind] = found
    return out


def read_prefix_counters(base_url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The server's prefix-cache counters now; None when it has no /metrics or no such counters."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url(base_url), timeout=timeout) as resp:
            return parse_prefix_counters(resp.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def prefix_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Prefix-cache hits and queries (tokens) between two readings, and the hit rate (null without counters)."""
    if before is None or after is None:
        return {"hits": None, "queries": None, "hit_rate": None}
    hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
    return {"hits": int(hits), "queries": int(queries), "hit_rate": hits / queries if queries > 0 else None}


def with_prefix(prompt: Prompt, text: str) -> Prompt:
    """The prompt behind a system message `text` (joined to its own system message, if it has one)."""
    msgs = [dict(m) for m in prompt.messages]
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = text + "\n\n" + msgs[0]["content"]
    else:
        msgs.insert(0, {"role": "system", "content": text})
    return Prompt(msgs, prompt.source)


async def _shared_prefix(client: Any, model: str, tokens: int) -> tuple[str, int]:
    """(a text of about `tokens` tokens as a system message, its measured prompt tokens), sized with the server's
    own token counts (usage.prompt_tokens of 1-token completions)."""
    async def count(repeats: int) -> int:
        r = await client.chat.completions.create(
            model=model, max_tokens=1, temperature=0,
            messages=[{"role": "system", "content": SHARED_PREFIX_SENTENCE * repeats},
                      {"role": "user", "content": "Hi"}])
        return int(r.usage.prompt_tokens)

    one, eleven = await count(1), await count(11)
    per = max((eleven - one) / 10, 1e-9)
    repeats = max(1, round(tokens / per))
    return SHARED_PREFIX_SENTENCE * repeats, round(repeats * per)


def _itl_samples(chunk_times: list[float], tokens: int) -> list[float]:
    """Per-token latencies of one stream: the gap before each content chunk after the first, divided by
    the mean number of tokens per chunk."""
    if len(chunk_times) < 2 or tokens < 2:
        return []
    per_chunk = tokens / len(chunk_times)
    return [(b - a) / per_chunk for a, b in zip(chunk_times, chunk_times[1:])]


async def _stream_request(
    client: Any,
    model: str,
    messages: list[Message],
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> dict[str, Any]:
    """One streamed chat completion, timed chunk by chunk."""
    start = time.perf_counter()
    chunks: list[float] = []  # arrival times of chunks with content
    pieces: list[str] = []
    usage_tokens: int | None = None
    spec: dict[str, Any] | None = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or []:
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    chunks.append(now)
                    pieces.append(text)
            if chunk.usage is not None:
                usage_tokens = int(chunk.usage.completion_tokens)
            extra = chunk.model_extra or {}
            if isinstance(extra.get("dflash"), dict):
                spec = extra["dflash"]
    except Exception as exc:  # a failed request is counted and reported, the sweep goes on
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(chunks)
    ttft = chunks[0] - start if chunks else end - start
    e2e = end - start
    itl = _itl_samples(chunks, tokens)
    return {
        "ok": True,
        "tokens": tokens,
        "ttft": ttft,
        "e2e": e2e,
        "itl": itl,
        "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None,
        "spec": spec,
        "text": "".join(pieces),
    }


def _round_result(results: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """One round of a level: its requests and their wall time."""
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
    }


def _level_result(
    concurrency: int, results: list[dict[str, Any]], duration: float, rounds: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A level's figures over all its requests; `duration` is the total wall time of its rounds."""
    rounds = rounds or [_round_result(results, duration)]
    per_round = max(len(results) // len(rounds), 1)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    specs = [r["spec"] for r in ok if r["spec"] is not None]
    spec_sum = None
    mean_al = None
    if ok and len(specs) == len(ok):
        spec_sum = {
            k: sum(int(s.get(k, 0)) for s in specs)
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }
        mean_al = mean_acceptance_length(spec_sum["num_accepted_tokens"], spec_sum["num_drafts"])
    return {
        "concurrency": concurrency,
        "repeats": len(rounds),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "ttft_s": distribution([r["ttft"] for r in ok]),
        "itl_s": distribution([v for r in ok for v in r["itl"]]),
        "tpot_s": distribution([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_latency_s": distribution([r["e2e"] for r in ok]),
        "mean_acceptance_length": mean_al,
        "dflash": spec_sum,
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "spread": {
            "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in rounds]),
            "request_throughput": spread([r["request_throughput"] for r in rounds]),
        },
        "rounds": rounds,
        # each request's text, by its index in the round (request i: prompt i, seed + i; every round sends the
        # same requests, in order): a side-by-side sweep compares them with the baseline's
        "outputs": {str(i % per_round): r["text"] for i, r in enumerate(results) if r["ok"]},
    }


def default_num_prompts(concurrency: int) -> int:
    """Requests per concurrency level by default: enough to fill the slots a few times, bounded."""
    return min(max(2 * concurrency, 4), 32)


async def _serve_async(
    base_url: str,
    api_key: str,
    model: str | None,
    prompts: list[Prompt],
    concurrency: list[int],
    num_prompts: int | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    timeout: float,
    progress: bool,
    repeats: int = 1,
    min_duration: float = 0.0,
    shared_prefix_tokens: int = 0,
) -> tuple[str, dict[str, Any], list[dict[str, Any]], int | None]:
    """(model id, its /models entry, the levels' results, the shared prefix's measured tokens): a warm-up request,
    then each level in rounds, the server's prefix-cache counters read before and after each level."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    try:
        try:
            entries = [m.model_dump() for m in (await client.models.list()).data]
        except openai.APIError as exc:
            if model is None or isinstance(exc, openai.APIConnectionError):
                raise BenchError(
                    f"cannot list models at {base_url}/models: {type(exc).__name__}: {exc}"
                ) from None
            entries = []  # --model given: a server without /models is fine
        if model is None:
            if not entries:
                raise BenchError(f"{base_url}/models lists no model; pass --model")
            model = str(entries[0]["id"])
        info = next((e for e in entries if e.get("id") == model), {"id": model})
        prefix_tokens = None
        if shared_prefix_tokens > 0:
            try:
                text, prefix_tokens = await _shared_prefix(client, model, shared_prefix_tokens)
            except openai.APIError as exc:
                raise BenchError(f"sizing the shared prefix: {type(exc).__name__}: {exc}") from None
            prompts = [with_prefix(p, text) for p in prompts]

        warm = await _stream_request(
            client, model, prompts[0].messages, min(max_tokens, 8), temperature, top_p, seed
        )
        if not warm["ok"]:
            raise BenchError(f"the warm-up request failed: {warm['error']}")
        counts = [num_prompts or default_num_prompts(c) for c in concurrency]
        bar = progress_bar(sum(counts) * repeats, "serve", progress)
        levels = []
        try:
            for c, n in zip(concurrency, counts):
                sem = asyncio.Semaphore(c)

                async def one(i: int, sem: asyncio.Semaphore = sem) -> dict[str, Any]:
                    async with sem:
                        r = await _stream_request(
                            client,
                            model,
                            prompts[i % len(prompts)].messages,
                            max_tokens,
                            temperature,
                            top_p,
                            seed + i,
                        )
                    bar.update(1)
                    return r

                bar.set_description(f"serve c={c}")
                results: list[dict[str, Any]] = []
                rounds: list[dict[str, Any]] = []
                elapsed = 0.0
                counters = await asyncio.to_thread(read_prefix_counters, base_url)
                # rounds until both minimums are met; every round sends the same requests
                while len(rounds) < repeats or elapsed < min_duration:
                    if len(rounds) >= repeats:
                        bar.total += n
                        bar.refresh()
                    t0 = time.perf_counter()
                    batch = list(await asyncio.gather(*(one(i) for i in range(n))))
                    took = time.perf_counter() - t0
                    elapsed += took
                    results += batch
                    rounds.append(_round_result(batch, took))
                levels.append(_level_result(c, results, elapsed, rounds))
                levels[-1]["prefix_cache"] = prefix_delta(
                    counters, await asyncio.to_thread(read_prefix_counters, base_url))
        finally:
            bar.close()
    finally:
        await client.close()
    return model, info, levels, prefix_tokens


def compare_levels(result: dict[str, Any], baseline: dict[str, Any], baseline_file: str) -> dict[str, Any]:
    """Speedups of `result` over `baseline` at the concurrency levels both measured."""
    base = {lv["concurrency"]: lv for lv in baseline["levels"]}
    rows = []
    for lv in result["levels"]:
        b = base.get(lv["concurrency"])
        if b is None:
            continue
        rows.append(
            {
                "concurrency": lv["concurrency"],
                "output_throughput_speedup": ratio(lv["output_tokens_per_s"], b["output_tokens_per_s"]),
                "request_throughput_speedup": ratio(lv["request_throughput"], b["request_throughput"]),
                "ttft_p50_ratio": ratio(lv["ttft_s"]["p50"], b["ttft_s"]["p50"]),
                "itl_p50_ratio": ratio(lv["itl_s"]["p50"], b["itl_s"]["p50"]),
                "tpot_p50_ratio": ratio(lv["tpot_s"]["p50"], b["tpot_s"]["p50"]),
            }
        )
    return {"baseline_label": baseline["label"], "baseline_file": baseline_file, "levels": rows}


def _auto_label(info: dict[str, Any], model: str) -> str:
    """dflash or baseline for a dflash-serve server (its /models entry says), else the model id."""
    spec = info.get("dflash")
    if isinstance(spec, dict):
        return "dflash" if spec.get("draft") and int(spec.get("block_size") or 1) > 1 else "baseline"
    return model


def run_serve_pair(
    base_url: str, baseline_url: str, prompts: list[Prompt], *, concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    label: str | None = None, baseline_label: str | None = None, **kwargs: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep against two servers side by side: at each concurrency level the baseline's rounds, then the
    server's, so both see the same machine conditions. Returns (server result, baseline result); the server's
    has the comparison filled in (its `baseline_file` is set by the caller)."""
    runs: dict[str, list[dict[str, Any]]] = {"server": [], "baseline": []}
    for c in concurrency:
        runs["baseline"].append(run_serve(baseline_url, prompts, concurrency=[c], label=baseline_label, **kwargs))
        runs["server"].append(run_serve(base_url, prompts, concurrency=[c], label=label, **kwargs))

    def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
        out = dict(parts[0])
        out["config"] = {**parts[0]["config"], "concurrency": list(concurrency)}
        out["levels"] = [lv for part in parts for lv in part["levels"]]
        return out

    server, baseline = merged(runs["server"]), merged(runs["baseline"])
    server["comparison"] = compare_levels(server, baseline, "")
    for row, mine, theirs in zip(server["comparison"]["levels"], server["levels"], baseline["levels"]):
        same = [k for k in mine["outputs"] if k in theirs["outputs"]]
        row["identical_outputs"] = sum(mine["outputs"][k] == theirs["outputs"][k] for k in same)
        row["compared_outputs"] = len(same)
    return server, baseline


def run_serve(
    base_url: str,
    prompts: list[Prompt],
    *,
    api_key: str = "EMPTY",
    model: str | None = None,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    num_prompts: int | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    timeout: float = 600.0,
    label: str | None = None,
    dataset: str = "custom",
    progress: bool = True,
    repeats: int = DEFAULT_REPEATS,
    min_duration: float = DEFAULT_MIN_DURATION_S,
    shared_prefix_tokens: int = 0,
) -> dict[str, Any]:
    """The concurrency sweep against an OpenAI-compatible server; the `serve` result (without the header).

    Each level runs rounds of its requests until it has run at least `repeats` rounds and `min_duration`
    seconds. `shared_prefix_tokens`: every prompt starts with the same system message of about that many tokens;
    each level reports the server's prefix-cache hit rate over its rounds (`prefix_cache`, from /metrics)."""
    model, info, levels, prefix_tokens = asyncio.run(
        _serve_async(
            base_url,
            api_key,
            model,
            prompts,
            list(concurrency),
            num_prompts,
            max_tokens,
            temperature,
            top_p,
            seed,
            timeout,
            progress,
            repeats,
            min_duration,
            shared_prefix_tokens,
        )
    )
    config = {
        "base_url": base_url,
        "model": model,
        "dataset": dataset,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "concurrency": list(concurrency),
        "num_prompts": num_prompts,
        "repeats": repeats,
        "min_duration_s": min_duration,
        "shared_prefix_tokens": shared_prefix_tokens,
        "shared_prefix_prompt_tokens": prefix_tokens,  # the shared text's tokens, by the server's counts
    }
    return {
        "environment": environment(),
        "label": label or _auto_label(info, model),
        "config": config,
        "server": info,
        "levels": levels,
        "comparison": None,
    }


def format_prefix_cache(result: dict[str, Any]) -> str:
    """A line per level with the prefix-cache hit rate beside tok/s ('' when the server reports no counters and
    no shared prefix was asked for)."""
    cfg = result["config"]
    levels = [lv for lv in result["levels"] if lv.get("prefix_cache")]
    if not cfg.get("shared_prefix_tokens") and all(lv["prefix_cache"]["hit_rate"] is None for lv in levels):
        return ""
    head = (f"shared prefix: {cfg.get('shared_prefix_prompt_tokens')} tokens before every prompt"
            if cfg.get("shared_prefix_tokens") else "no shared prefix")
    rows = []
    for lv in levels:
        pc = lv["prefix_cache"]
        if pc["hits"] is None:
            rate = "n/a (no prefix-cache counters at /metrics)"
        elif pc["hit_rate"] is None:
            rate = "n/a (no lookups: prefix caching off?)"
        else:
            rate = f"{100 * pc['hit_rate']:.1f}% ({pc['hits']}/{pc['queries']} tokens)"
        rows.append(f"  c={lv['concurrency']}: {lv['output_tokens_per_s']:.1f} out tok/s, prefix cache hit rate {rate}")
    return "\n".join([f"{head}; the server's prefix cache over each level:", *rows])
