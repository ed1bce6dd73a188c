"""What the serving worker uses of an engine (`ServingEngine`): `dflash_core.engine.Engine`, or the scripted
fake of the tests (tests/fake_engine.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dflash_core.grammar import GrammarBackend
    from dflash_core.kv.pool import KVStats
    from dflash_core.outputs import StepOutput
    from dflash_core.sampling import SamplingParams
    from dflash_core.stats import RequestStats


class ServingEngine(Protocol):
    """What the worker uses of an engine: ``dflash_core.engine.Engine`` (tests/fake_engine.py: a scripted one).

    Called from the worker thread only. A request's last ``StepOutput`` has a ``finish_reason`` ("stop", "length",
    "abort", "error"); its ``stats`` still answer until ``release``.
    """

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request and return its id (ValueError: an impossible request, answered with 400)."""

    def abort(self, request_id: int) -> None:
        """End the request with "abort" at the next step."""

    def step(self) -> list[StepOutput]:
        """Advance every active request by one iteration: one output per request that advanced."""

    def stats(self, request_id: int) -> RequestStats:
        """The request's counters (its speculative summary)."""

    def release(self, request_id: int) -> None:
        """Forget a finished request's stats."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens a request may hold (the app bounds max_tokens with it)."""

    @property
    def block_size(self) -> int:
        """Draft block size (1: plain decoding), reported by /v1/models and the metrics."""

    @property
    def max_verify_width(self) -> int:
        """The most tokens one verify row checks (the block, or a tree's nodes and root): the metrics' buckets."""

    @property
    def draft_version(self) -> int:
        """The draft proposing: 1 at start, one more per swap (/v1/models and the admin API show it)."""

    def estimated_speedup(self) -> float | None:
        """Estimated speedup over plain decoding at the current load (None: not measured yet)."""

    def num_waiting(self) -> int:
        """Requests added but not admitted yet (waiting for KV memory, or preempted)."""

    def kv_stats(self) -> KVStats | None:
        """The KV block pool's usage, prefix-cache counters and preemptions (None: not paged)."""

    @property
    def grammar(self) -> GrammarBackend | None:
        """The backend that compiles structured outputs (None: they are refused); the app compiles with it in its
        preparation threads, so that ``add_request`` only copies the compiled grammar."""
