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
    "engine_error": 500,
}
_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "server_overloaded",
    500: "server_error",
}


class ApiError(Exception):
    """A request the server refuses or could not serve.

    `code` is one of STATUS_OF_CODE; `param` names the offending field when there is one;
    the message says what is wrong and what is allowed."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if code not in STATUS_OF_CODE:
            raise ValueError(f"unknown error code {code!r}")
        self.code, self.message, self.param = code, message, param

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
        return {"type": "error", "id": request_id, "code": self.code, "message": self.message}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param)
