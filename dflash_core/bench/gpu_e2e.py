"""The GPU check's end-to-end part: the server's app (HTTP, worker thread, engine) on a random-weight pair, with
DFlash against `--no-speculative`, at concurrency levels (1, 8, 32 on CUDA).

Random weights accept almost none of a random draft's tokens, so a scripted drafter stands in for acceptance:
`ScriptedDrafter` runs the real draft (its compute is timed as in serving) and then replaces each proposed token
with the token a recorded plain greedy run of the same prompt chose at that position, with probability `rate`,
else with another token. Where the speculative run's own greedy choice leaves the recorded one (bf16 rounds a
16-wide verify and a one-token step differently), later proposals stop matching: the acceptance reported is the
one measured, next to the set rate.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from dflash_core.runners.base import Drafter, DraftRequest, Proposal

RATE = 0.8  # the scripted drafter's per-position chance of proposing the recorded token


@dataclass
class _ScriptedState:
    inner: Any
    prompt: tuple[int, ...]


class ScriptedDrafter(Drafter):
    """The real draft's compute, then proposals copied from `script` (prompt -> recorded greedy output) at `rate`
    per position, a wrong token otherwise (seeded by prompt and position: the same for every run)."""

    def __init__(self, inner: Drafter, script: dict[tuple[int, ...], list[int]], rate: float, vocab: int) -> None:
        self.inner, self.script, self.rate, self.vocab = inner, script, rate, vocab
        self.block_size, self.max_slots = inner.block_size, inner.max_slots
        self.prefix_cacheable = inner.prefix_cacheable

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> _ScriptedState:
        return _ScriptedState(self.inner.new_state(slot, prompt_token_ids, blocks, cached), tuple(prompt_token_ids))

    def context_written(self, state: _ScriptedState) -> int:
        return self.inner.context_written(state.inner)

    def extend_context(self, state: _ScriptedState, features: Any) -> None:
        self.inner.extend_context(state.inner, features)

    def catch_up(self, states: Any) -> None:
        self.inner.catch_up([st.inner for st in states])

    def warm_up(self) -> float:
        return self.inner.warm_up()

    def propose_batch(self, items: Any) -> list[list[int]]:
        return [p.tokens for p in self.propose_scored(items)]

    def propose_scored(self, items: Any, sampling: Any = None, candidates: int = 0) -> list[Proposal]:
        real = self.inner.propose_scored([DraftRequest(it.state.inner, *it[1:]) for it in items], sampling,
                                          candidates)
        out = []
        for it, prop in zip(items, real):
            seq = [*it.state.prompt, *self.script.get(it.state.prompt, [])]
            tokens = []
            for i, drafted in enumerate(prop.tokens):
                at = it.position + 1 + i  # position holds last_token; the proposal starts after it
                right = seq[at] if at < len(seq) else drafted
                rng = random.Random(hash((it.state.prompt, at)))
                tokens.append(right if rng.random() < self.rate else (right + 1) % self.vocab)
            out.append(Proposal(tokens, [self.rate] * len(tokens)))
        return out


def id_tokenizer(vocab: int) -> Any:
    """A tokenizer that names every id (`t0`, `t1`, ...): the server decodes what a random model emits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` distinct prompts of `length` token ids."""
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def record(engine: Any, batch: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Plain greedy outputs of `batch` on `engine` (no drafter), all at once."""
    from dflash_core.sampling import SamplingParams

    ids = {engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)): tuple(p)
           for p in batch}
    out: dict[tuple[int, ...], list[int]] = {p: [] for p in ids.values()}
    while engine.has_unfinished():
        for step in engine.step():
            out[ids[step.request_id]].extend(step.new_token_ids)
    for rid in ids:
        engine.release(rid)
    return out


class _Server:
    """uvicorn serving `app` in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from dflash_core.bench.serving_paths import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                   log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="gpu-check-uvicorn", daemon=True)

    def __enter__(self) -> str:
        import httpx

        self.thread.start()
        url, deadline = f"http://127.0.0.1:{self.port}", time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if not self.thread.is_alive():
                break
            time.sleep(0.1)
        raise RuntimeError("the in-process server did not become ready")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(60)


class _Tally:
    """Draft tokens proposed and accepted over the engine's steps (wraps `engine.step`)."""

    def __init__(self, engine: Any) -> None:
        self.drafted = self.accepted = self.steps = 0
        self.start = (0, 0, 0)
        step = engine.step

        def counted() -> list[Any]:
            outs = step()
            for out in outs:
                if not out.is_prefill and out.verify_width:
                    self.steps += 1
                    self.drafted += out.num_draft_tokens
                    self.accepted += out.num_accepted_tokens
            return outs
        engine.step = counted

    def snapshot(self) -> tuple[int, int, int]:
        return self.drafted, self.accepted, self.steps

    def mark(self) -> None:
        """Where a level's timed requests start (after its warm request)."""
        self.start = self.snapshot()


async def _level(url: str, batch: list[list[int]], max_tokens: int, mark: Any) -> dict[str, Any]:
    import httpx

    async def one(client: httpx.AsyncClient, p: list[int]) -> int:
        r = await client.post(f"{url}/v1/completions", json=dict(
            model="gpu-check", prompt=p, max_tokens=max_tokens, temperature=0, ignore_eos=True))
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, batch[0])  # warm: the first request of a level
        mark()
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, p) for p in batch)))
    seconds = time.perf_counter() - t0
    return dict(concurrency=len(batch), tokens=tokens, seconds=seconds, tok_s=tokens / seconds)


def run_e2e(model: Any, draft: Any, levels: tuple[int, ...], max_tokens: int, prompt_len: int,
            rate: float = RATE) -> dict[str, Any]:
    """tok/s through the server's app with the scripted drafter and without a draft, per concurrency level."""
    from dflash_core.engine import Engine
    from dflash_core.loading import LoadedModels
    from dflash_core.runners.drafter import DFlashDrafter
    from dflash_core.runners.hybrid import HYBRID_MODEL_TYPES, HybridTarget
    from dflash_core.runners.native import NativeTarget
    from server.app import create_app
    from server.settings import Settings

    slots, vocab = max(levels), model.config.vocab_size
    max_len = prompt_len + max_tokens + 2 * draft.cfg.block_size + 8
    runner_cls = HybridTarget if model.config.model_type in HYBRID_MODEL_TYPES else NativeTarget
    batch = prompts(slots, prompt_len, vocab)
    tok = id_tokenizer(vocab)
    n = draft.cfg.block_size - 1  # tokens a full proposal drafts; a verify commits 1 + the accepted prefix
    result: dict[str, Any] = dict(rate=rate, max_tokens=max_tokens, prompt_tokens=prompt_len, compiled=False,
                                  expected_tokens_per_step=(1 - rate ** (n + 1)) / (1 - rate) if rate < 1 else n + 1,
                                  runs={})
    script: dict[tuple[int, ...], list[int]] = {}
    for name in ("no-speculative", "dflash-scripted"):
        target = runner_cls(model, draft.cfg.target_layer_ids, max_slots=slots, max_len=max_len)
        drafter = None
        if name != "no-speculative":
            inner = DFlashDrafter(draft, target, block_size=draft.cfg.block_size, max_slots=slots, max_len=max_len)
            drafter = ScriptedDrafter(inner, script, rate, vocab)
        engine = Engine(target, drafter, max_model_len=max_len - draft.cfg.block_size - 1, max_slots=slots)
        if drafter is None:
            script.update(record(engine, batch, max_tokens))
        models = LoadedModels(engine=engine, tokenizer=tok, target_name="random", draft_name=None if drafter is None
                              else "random-draft", device=str(target.device), dtype=str(model.dtype),
                              block_size=engine.block_size, backend=target.backend)
        app = create_app(Settings(served_model_name="gpu-check", max_running_requests=slots), models=models)
        rows, tally = [], _Tally(engine)
        with _Server(app) as url:
            for level in levels:
                row = asyncio.run(_level(url, batch[:level], max_tokens, tally.mark))
                drafted, accepted, steps = (b - a for a, b in zip(tally.start, tally.snapshot()))
                row.update(draft_tokens=drafted, accepted_tokens=accepted, decode_rows=steps,
                           acceptance_rate=accepted / drafted if drafted else None,
                           tokens_per_row_step=(accepted + steps) / steps if steps else None)
                rows.append(row)
        result["runs"][name] = rows
    for plain, spec in zip(result["runs"]["no-speculative"], result["runs"]["dflash-scripted"]):
        spec["speedup"] = spec["tok_s"] / plain["tok_s"]
    return result
