"""``APIError``: an error answered with the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

``retry_later`` makes the 429 / 503 a client should retry (with ``Retry-After``).
"""

from __future__ import annotations

from typing import Any

RETRY_AFTER_S = 1  # the Retry-After of every 429 / 503 of the server
_RETRY_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable (a parse helper process sends it back to the server)."""
        return (_rebuild_api_error, (self.status, self.message, self.type, self.param, self.code, self.headers))


def _rebuild_api_error(
    status: int, message: str, type: str, param: str | None, code: str | None, headers: dict[str, str]
) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


def retry_later(status: int, message: str, code: str) -> APIError:
    """A 429 or 503 the client should retry: OpenAI's error type for the status, and ``Retry-After``."""
    return APIError(
        status, message, type=_RETRY_TYPES[status], code=code, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
