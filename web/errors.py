"""Client-facing errors: one exception, rendered in OpenAI's error shape or as a
WebSocket `error` event."""

from __future__ import annotations

from typing import Any

# WebSocket `error` codes and the HTTP status each one maps to.
STATUS_OF_CODE = {
    "invalid_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "too_many_requests": 429,
    "overloaded": 503,
    "shutting_down": 503,
    "unavailable": 503,
    "timeout": 504,
    "engine_error": 500,
}
_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "server_overloaded",
    504: "timeout_error",
    500: "server_error",
}
MAX_MESSAGE_CHARS = 2000


class ApiError(Exception):
    """A request the server refuses or could not serve.

    `code` is one of STATUS_OF_CODE; `param` names the offending field when there is one;
    `close` asks an HTTP answer to close its connection (a body left unread);
    the message says what is wrong and what is allowed. Both are made safe to send
    whatever the client sent: lone surrogates escaped, the message cut to
    MAX_MESSAGE_CHARS."""

    def __init__(
        self, code: str, message: str, param: str | None = None, *, close: bool = False
    ) -> None:
        if code not in STATUS_OF_CODE:
            raise ValueError(f"unknown error code {code!r}")
        message = _sendable(message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.code, self.message = code, message
        self.param = None if param is None else _sendable(str(param))[:200]
        self.close = close  # HTTP: close the connection after the answer (body left unread)

    @property
    def status(self) -> int:
        return STATUS_OF_CODE[self.code]

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPE[self.status],
                "param": self.param,
                "code": self.code,
            }
        }

    def event(self, request_id: str | None = None) -> dict[str, Any]:
        """The WebSocket `error` event."""
        event = {"type": "error", "id": request_id, "code": self.code, "message": self.message}
        return event | ({"param": self.param} if self.param is not None else {})


def _sendable(text: str) -> str:
    """`text` with lone surrogates (which no UTF-8 encoder takes) as \\udxxx escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, *, close: bool = False) -> ApiError:
    return ApiError("invalid_request", message, param, close=close)
