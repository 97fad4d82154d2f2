"""The SDK's errors: every failure the SDK raises is one of these, never a bare
TimeoutError, a websockets ConnectionClosed or a KeyError of a malformed event.

    PagedServeError                 code: the server's error code; request_id; param
    ├── ConnectionLostError         the socket closed or could not be opened
    ├── AuthenticationError         a wrong or missing API key (close 1008)
    ├── InvalidRequestError         `param` names the offending field
    ├── NotFoundError               a session that is closed, expired or another's
    ├── OverloadedError             queue full, per-connection cap, engine unhealthy,
    │                               server shutting down: retry later (or elsewhere)
    ├── RequestTimeout              past the call's `timeout` (then cancelled on the
    │                               server) or the server's --request-timeout; also a
    │                               builtin TimeoutError, for `except TimeoutError`
    └── ServerError                 the server failed the request (engine_error)
"""

from __future__ import annotations

from typing import Any


class PagedServeError(Exception):
    """Base of the SDK's errors; `code` is the server's error code, `request_id` the
    request it ended (None for a connection-wide one), `param` the field it names."""

    code = "error"

    def __init__(
        self, message: str, request_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id, self.param = request_id, param


class ConnectionLostError(PagedServeError):
    code = "connection_lost"


class AuthenticationError(PagedServeError):
    code = "unauthorized"


class InvalidRequestError(PagedServeError):
    code = "invalid_request"


class NotFoundError(PagedServeError):
    code = "not_found"


class OverloadedError(PagedServeError):
    """The server's queue (or this connection's, or this key's, request cap) is full,
    the server is shutting down, or its engine is unhealthy for now: retry later (or
    elsewhere)."""

    code = "overloaded"


class RequestTimeout(PagedServeError, TimeoutError):
    """The request ran past its time limit: the call's `timeout` (the SDK cancelled it
    on the server) or the server's --request-timeout."""

    code = "timeout"


class ServerError(PagedServeError):
    """The server could not serve the request (an engine failure, not the request's)."""

    code = "engine_error"


RequestTimeoutError = RequestTimeout  # the names of earlier releases
EngineError = ServerError

_ERRORS: dict[str, type[PagedServeError]] = {
    cls.code: cls
    for cls in (
        ConnectionLostError,
        AuthenticationError,
        InvalidRequestError,
        NotFoundError,
        OverloadedError,
        RequestTimeout,
        ServerError,
    )
}
_ERRORS |= {"too_many_requests": OverloadedError, "shutting_down": OverloadedError}
_ERRORS |= {"unavailable": OverloadedError}  # the engine is unhealthy for now
RETRYABLE_CODES = frozenset({"overloaded", "too_many_requests", "unavailable"})


def error_of(event: dict[str, Any], request_id: str | None) -> PagedServeError:
    """The exception of a server `error` event (an unknown code is a ServerError)."""
    code = event.get("code")
    cls = _ERRORS.get(code, ServerError) if isinstance(code, str) else ServerError
    message = event.get("message")
    error = cls(message if isinstance(message, str) else "request failed", request_id)
    param = event.get("param")
    error.param = param if isinstance(param, str) else None
    error.code = code if isinstance(code, str) else cls.code  # the server's exact code
    return error


def close_error(code: int | None, reason: str | None, lost: str) -> PagedServeError:
    """The error of a closed socket: 1008 (policy: a wrong or missing key) is an
    authentication failure, any other close a lost connection."""
    if code == 1008:
        return AuthenticationError(reason or "invalid API key")
    return ConnectionLostError(lost + (f": {reason}" if reason else ""))
