"""What the engine's `step()` returns for a request (``StepOutput``, with ``TokenLogprob``s) and its finish
reasons."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.grammar_checks import GrammarFailure

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What one `step()` did for one request."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    acceptance_length: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    is_prefill: bool = False
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    verify_width: int = 0  # tokens this request's verify row checked (1: a plain step; 0: no verify)
    error_type: str | None = None  # with `error`: the OpenAI error type of a failure the request caused (else None)


def failed_output(request_id: int, exc: BaseException) -> StepOutput:
    """The last output of a request whose step raised: a grammar of the client's that cannot go on is the request's
    own `invalid_request_error` (its message as is); anything else is an engine error."""
    if isinstance(exc, GrammarFailure):
        return StepOutput(request_id, [], FINISH_ERROR, error=str(exc), error_type="invalid_request_error")
    return StepOutput(request_id, [], FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")
