"""A scripted engine for fast, deterministic tests of the worker and the app (no model, no subprocess).

``FakeEngine`` implements what ``server.serving_engine.ServingEngine`` asks of ``dflash_core.engine.Engine``
(add_request, abort, step, stats, release) plus the attributes the app reads (``max_model_len``, ``block_size``),
and returns the real ``StepOutput`` and ``RequestStats`` objects. What a request does is a ``Script``, chosen by a
key that its decoded prompt contains:

    engine.script("alpha", Script(["Hello E", gate, "ND tail"]))

Each script item is one engine step: text (encoded with the tokenizer) or token ids commit those tokens at once;
``Fail(message)`` ends the request with finish reason "error"; a ``threading.Event`` holds the request (no output)
until it is set, then is passed over. The last token item carries the script's ``finish_reason`` (a script that
ends with a gate finishes with no tokens once the gate opens). ``max_tokens`` cuts a script with "length", as the
engine does. Tests then wait on what the engine saw: ``added``, ``aborted``, ``released``, ``emitted``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_core.grammar import GrammarBackend
from dflash_core.outputs import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, StepOutput
from dflash_core.overlap import run_held
from dflash_core.sampling import SamplingParams
from dflash_core.stats import RequestStats

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "dflash_core" / "demo_models" / "target"
IDLE_S = 0.002  # a step in which no request could advance sleeps this long (the worker would spin otherwise)
WAIT_S = 5.0  # how long ``wait_until`` waits before failing the test


@functools.cache
def demo_tokenizer() -> Any:
    """The bundled demo target's tokenizer (byte-level BPE with a chat template), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S, what: str = "the condition") -> None:
    """Poll ``predicate`` from a test thread (AssertionError after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@dataclass(frozen=True)
class Fail:
    """A script item: the request fails at this step (``StepOutput`` with finish reason "error")."""

    message: str = "scripted failure"


Item = str | Sequence[int] | Fail | threading.Event


@dataclass
class Script:
    """What the engine does with one request: one item per step (see the module docstring)."""

    steps: list[Item]
    finish_reason: str = FINISH_LENGTH  # of the last token item
    stop_token_id: int | None = None  # appended to the last token item, with finish reason "stop" (an EOS)


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    script: Script
    stats: RequestStats
    cursor: int = 0
    generated: int = 0
    aborted: bool = False


@dataclass
class FakeEngine:
    """A scripted engine (thread-safe: the worker thread drives it, tests read it)."""

    tokenizer: Any = None  # encodes text items and decodes prompts to find their script
    block_size: int = 4
    max_model_len: int = 512
    default: Script = field(default_factory=lambda: Script(["ok"]))
    eos_token_ids: list[int] = field(default_factory=list)
    drafter: None = None  # the engine's attribute; a fake has no draft model
    draft_version: int = 1  # the engine's attribute: the draft proposing (/v1/models shows it)

    @property
    def max_verify_width(self) -> int:
        """A chain's: the block (the fake verifies no trees)."""
        return self.block_size

    grammar: GrammarBackend | None = None  # the app compiles constraints with it; the fake only keeps them
    added: list[int] = field(default_factory=list)  # request ids, in admission order
    prompts: dict[int, str] = field(default_factory=dict)  # request id -> decoded prompt
    params: dict[int, SamplingParams] = field(default_factory=dict)  # request id -> its parameters
    aborted: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)
    emitted: dict[int, int] = field(default_factory=dict)  # request id -> tokens committed so far
    final_stats: dict[int, RequestStats] = field(default_factory=dict)  # of finished requests, kept after release
    steps: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._scripts: dict[str, Script] = {}
        self._refusals: dict[str, str] = {}
        self._step_error: Exception | None = None
        self._active: dict[int, _Request] = {}
        self._finished: dict[int, RequestStats] = {}

    # --- scripting (test side) ---------------------------------------------------------------------------

    def script(self, key: str, script: Script) -> None:
        """Requests whose decoded prompt contains ``key`` follow ``script`` (first matching key wins)."""
        with self._lock:
            self._scripts[key] = script

    def refuse(self, key: str, message: str = "the engine refuses this request") -> None:
        """``add_request`` raises ValueError(message) for prompts that contain ``key`` (the worker's 400)."""
        with self._lock:
            self._refusals[key] = message

    def fail_next_step(self, error: Exception) -> None:
        """The next ``step()`` raises ``error`` (a failure of the whole step, not of one request)."""
        with self._lock:
            self._step_error = error

    def request_id(self, key: str) -> int:
        """The id of the (last) request whose prompt contains ``key``."""
        with self._lock:
            return [rid for rid, text in self.prompts.items() if key in text][-1]

    def running(self) -> list[int]:
        """Ids of the requests added and not finished."""
        with self._lock:
            return list(self._active)

    # --- the engine interface (worker thread) ------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        params.validate()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        text = self.tokenizer.decode(prompt) if self.tokenizer is not None else ""
        with self._lock:
            refusal = next((m for k, m in self._refusals.items() if k in text), None)
            if refusal is not None:
                raise ValueError(refusal)
            script = next((s for k, s in self._scripts.items() if k in text), self.default)
            rid = len(self.added)
            self.added.append(rid)
            self.prompts[rid] = text
            self.params[rid] = params
            self.emitted[rid] = 0
            stats = RequestStats(prompt_tokens=len(prompt), block_size=self.block_size)
            self._active[rid] = _Request(rid, prompt, params, script, stats)
            return rid

    def abort(self, request_id: int) -> None:
        with self._lock:
            req = self._active.get(request_id)
            if req is not None:
                req.aborted = True
                self.aborted.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._active)

    def estimated_speedup(self) -> float | None:
        return None  # a scripted engine measures nothing

    def num_running(self) -> int:
        with self._lock:
            return len(self._active)

    def num_waiting(self) -> int:
        return 0  # every added request runs at once: no KV memory to wait for

    def kv_stats(self) -> None:
        return None  # no KV block pool

    def stats(self, request_id: int) -> RequestStats:
        with self._lock:
            req = self._active.get(request_id)
            return req.stats if req is not None else self._finished[request_id]

    def release(self, request_id: int) -> None:
        with self._lock:
            self._finished.pop(request_id, None)
            self.released.add(request_id)

    def step(self) -> list[StepOutput]:
        run_held()  # where a real step's forward waits for the device (dflash_core/overlap.py)
        with self._lock:
            self.steps += 1
            error, self._step_error = self._step_error, None
            if error is not None:
                raise error
            outputs = [out for req in list(self._active.values()) if (out := self._advance(req)) is not None]
        if not outputs:
            time.sleep(IDLE_S)
        return outputs

    # --- internals ---------------------------------------------------------------------------------------

    def _advance(self, req: _Request) -> StepOutput | None:
        """The request's output of this step (None: held by a gate)."""
        if req.aborted:
            return self._retire(req, StepOutput(req.id, [], finish_reason=FINISH_ABORT))
        steps = req.script.steps
        while req.cursor < len(steps) and isinstance(steps[req.cursor], threading.Event):
            gate = steps[req.cursor]
            assert isinstance(gate, threading.Event)
            if not gate.is_set():
                return None
            req.cursor += 1
        if req.cursor == len(steps):  # the script ended with a gate
            return self._retire(req, StepOutput(req.id, [], finish_reason=req.script.finish_reason))
        item = steps[req.cursor]
        req.cursor += 1
        if isinstance(item, Fail):
            return self._retire(req, StepOutput(req.id, [], finish_reason=FINISH_ERROR, error=item.message))
        assert not isinstance(item, threading.Event)
        return self._commit(req, self._token_ids(item), last=req.cursor == len(steps))

    def _token_ids(self, item: str | Sequence[int]) -> list[int]:
        if isinstance(item, str):
            return list(self.tokenizer(item, add_special_tokens=False)["input_ids"])
        return [int(t) for t in item]

    def _commit(self, req: _Request, tokens: list[int], last: bool) -> StepOutput:
        finish: str | None = req.script.finish_reason if last else None
        stop_token = req.script.stop_token_id if last else None
        if stop_token is not None:
            tokens, finish = [*tokens, stop_token], FINISH_STOP
        room = req.params.max_tokens - req.generated
        if len(tokens) >= room:  # the budget ends the request, as in the engine (a stop token within it wins)
            if len(tokens) > room or finish is None:
                tokens, finish, stop_token = tokens[:room], FINISH_LENGTH, None
        prefill = req.generated == 0
        drafted = 0 if prefill else self.block_size - 1
        accepted = 0 if prefill else min(max(len(tokens) - 1, 0), drafted)
        out = StepOutput(
            req.id,
            tokens,
            finish_reason=finish,
            stop_token_id=stop_token,
            acceptance_length=len(tokens),
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            is_prefill=prefill,
        )
        if not prefill:
            req.stats.record_step(drafted, accepted)
        req.generated += len(tokens)
        req.stats.generated_tokens = req.generated
        self.emitted[req.id] += len(tokens)
        return self._retire(req, out) if finish is not None else out

    def _retire(self, req: _Request, out: StepOutput) -> StepOutput:
        del self._active[req.id]
        self._finished[req.id] = self.final_stats[req.id] = req.stats
        return out
