"""Async Python SDK for a pagedserve server (WebSocket `/v1/stream`); needs no torch.

    async with AsyncClient("ws://127.0.0.1:8000", api_key=KEY, timeout=60) as client:
        async for delta in client.stream("Once upon a time", max_tokens=64):
            print(delta.text, end="")
        result = await client.complete("Hello", temperature=0, timeout=5)
        chat = client.chat_session(system="You are terse.")
        async for delta in chat.send("hi"):
            ...

Many requests, chat sessions and pings share the one connection, each reply matched
to its call by a client-chosen id. Leaving a `stream` early (a `break`, `aclose()`,
`cancel()`, a timeout, a cancelled task) cancels the request on the server. Requests
refused for overload before their first token are retried with capped exponential
backoff. Every error is a PagedServeError (see web/client_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import OrderedDict
from typing import Any

import websockets

from web.client_connection import RetryPolicy, Wire
from web.client_errors import (
    AuthenticationError,
    ConnectionLostError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PagedServeError,
    RequestTimeout,
    RequestTimeoutError,
    ServerError,
    close_error,
    error_of,
)
from web.client_stream import ChatSession, Completion, Delta, Stream, Usage

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "ChatSession",
    "Completion",
    "ConnectionLostError",
    "Delta",
    "EngineError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "PagedServeError",
    "RequestTimeout",
    "RequestTimeoutError",
    "RetryPolicy",
    "ServerError",
    "Stream",
    "Usage",
]
UNSET: Any = ...  # a call's `timeout` left out: the client's default


class AsyncClient:
    """A connection to `url` (ws://host:port); use as `async with`.

    `timeout`: the default per-request limit in seconds (None: none), overridden by a
    call's own `timeout=`; past it the request is cancelled on the server and raises
    RequestTimeout. `max_retries`: how often a request refused for overload before its
    first token is sent again (`retry` for the whole RetryPolicy). `reconnect=True`
    opens a new connection for new requests after the old one was lost (requests in
    flight on it fail with ConnectionLostError)."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000",
        api_key: str | None = None,
        *,
        timeout: float | None = None,
        max_retries: int = 2,
        retry: RetryPolicy | None = None,
        reconnect: bool = True,
        open_timeout: float = 10.0,
    ) -> None:
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1/stream"):
            self.url += "/v1/stream"
        self.api_key, self.reconnect, self.open_timeout = api_key, reconnect, open_timeout
        self.timeout = _check_timeout(timeout)
        self.retry = retry or RetryPolicy(max_retries=max_retries)
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._wires: dict[str, Wire] = {}  # requests in flight, by id
        self._calls: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()
        self._background: set[asyncio.Task[None]] = set()  # cancels of dropped streams
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._lost: PagedServeError | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Opens the connection; a wrong API key raises AuthenticationError here."""
        async with self._lock:
            await self._open()
        await self.ping()  # an invalid key closes the socket (1008) before the pong

    async def close(self) -> None:
        """Closes the connection (the server aborts what is still running on it)."""
        self._closed = True
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5.0)

    async def ping(self, timeout: float = 10.0) -> None:
        """A round trip to the server; RequestTimeout if no answer within `timeout`."""
        await self._call({"type": "ping"}, "pong", timeout)

    # -- requests --------------------------------------------------------------------
    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        fit_history: bool = False,
        timeout: float | None = UNSET,
        **sampling: Any,
    ) -> Stream:
        """One request (a text prompt, token ids, or chat `messages`); sampling fields as
        in the OpenAI API / vLLM (max_tokens, temperature, top_p, seed, stop, ...), and
        `structured_outputs` (a dict of vLLM's StructuredOutputsParams fields, e.g.
        `{"json": schema}`: what the output must match; docs/structured_outputs.md).
        `fit_history`: the server leaves out the oldest messages (never system ones)
        that would not fit the model's context. `timeout`: this request's limit."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if messages is not None:
            body: dict[str, Any] = {"messages": messages}
            body |= {"fit_history": True} if fit_history else {}
        elif isinstance(prompt, str):
            body = {"prompt": prompt}
        else:
            body = {"prompt_token_ids": list(prompt)}

        async def ready() -> dict[str, Any]:
            return body

        return Stream(self, ready, sampling, self._timeout_of(timeout))

    async def complete(
        self, prompt=None, *, messages=None, timeout: float | None = UNSET, **sampling: Any
    ) -> Completion:
        """`stream(...)` collected into one Completion."""
        return await self.stream(prompt, messages=messages, timeout=timeout, **sampling).collect()

    def chat_session(self, system: str | None = None) -> ChatSession:
        return ChatSession(self, system)

    # -- what streams and sessions use -----------------------------------------------
    def _timeout_of(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is UNSET else _check_timeout(timeout)

    def _register(self) -> Wire:
        wire = Wire(f"r{next(self._ids)}")
        self._wires[wire.request_id] = wire
        return wire

    def _unregister(self, wire: Wire) -> None:
        self._wires.pop(wire.request_id, None)

    def _abandon(self, wire: Wire) -> None:
        """A stream nobody holds any more (its finalizer): cancel it on the server."""
        if self._wires.pop(wire.request_id, None) is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the socket
            self._loop.call_soon_threadsafe(self._spawn_cancel, wire.request_id)

    def _spawn_cancel(self, request_id: str) -> None:
        task = asyncio.ensure_future(self._send_cancel(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_cancel(self, request_id: str) -> None:
        """Best effort: on a lost connection the server aborted the request already."""
        if self._ws is None or self._lost is not None or self._closed:
            return
        with contextlib.suppress(PagedServeError):
            await self._send({"type": "cancel", "id": request_id})

    async def _open_session(self, system: str | None) -> str:
        event = await self._call({"type": "session.open", "system": system}, "session", 30.0)
        session_id = event.get("session_id")
        if not isinstance(session_id, str):
            raise ServerError(f"session.open was answered without a session_id: {event}")
        return session_id

    async def _call(self, message: dict[str, Any], reply: str, timeout: float) -> dict:
        """Sends a control message under a call id of its own and returns the reply
        (`reply`: its type) that carries that id."""
        call_id = f"c{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (reply, future)
        try:
            await self._send({**message, "id": call_id})
            limit = asyncio.timeout(timeout)
            try:
                async with limit:
                    return await future
            except TimeoutError:
                if not limit.expired():
                    raise
            raise RequestTimeout(f"no {reply!r} from {self.url} within {timeout:g} s") from None
        finally:
            self._calls.pop(call_id, None)

    async def _send(self, message: dict[str, Any]) -> None:
        """Sends one frame, opening a connection first when there is none (or, with
        `reconnect`, when the last one was lost)."""
        async with self._lock:
            if self._closed:
                raise ConnectionLostError(f"this client's connection to {self.url} is closed")
            if self._ws is None or self._lost is not None:
                if self._lost is not None and not self.reconnect:
                    raise _fresh(self._lost)
                await self._open()
            try:
                await self._ws.send(json.dumps(message))
            except websockets.ConnectionClosed as exc:
                raise self._closed_error(exc) from None

    async def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await websockets.connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.open_timeout,
                max_size=None,
            )
        except (OSError, websockets.WebSocketException, TimeoutError) as exc:
            raise ConnectionLostError(f"cannot connect to {self.url}: {exc}") from None
        self._lost = None
        self._reader = asyncio.create_task(self._read(self._ws))

    async def _read(self, ws: Any) -> None:
        """Routes the server's events until the socket closes, then fails whatever was
        still waiting on it."""
        try:
            async for frame in ws:
                self._dispatch(_decode(frame))
        except websockets.ConnectionClosed:
            pass
        finally:
            error = self._closed_error_from(ws)
            if ws is self._ws:
                self._lost = error
            for wire in list(self._wires.values()):
                wire.events.put_nowait({"type": "error", "code": error.code, "message": str(error)})
            for _, future in self._calls.values():
                if not future.done():
                    future.set_exception(_fresh(error))

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind, rid = event.get("type"), event.get("id")
        wire = self._wires.get(rid) if isinstance(rid, str) else None
        if wire is not None and kind in ("delta", "done", "error"):
            wire.events.put_nowait(event)
            return
        call = self._calls.pop(rid, None) if isinstance(rid, str) else None
        if call is None and rid is None and kind in ("pong", "session", "error"):
            call = self._oldest_call(kind)  # a server older than call ids, or an unread frame
        if call is None:
            return  # a request given up on: its last events
        _, future = call
        if future.done():
            return
        if kind == "error":
            future.set_exception(error_of(event, None))
        else:
            future.set_result(event)

    def _oldest_call(self, kind: str) -> tuple[str, asyncio.Future] | None:
        for call_id, (reply, _) in self._calls.items():
            if kind in (reply, "error"):
                return self._calls.pop(call_id)
        return None

    def _closed_error(self, exc: websockets.ConnectionClosed) -> PagedServeError:
        rcvd = exc.rcvd
        lost = f"connection to {self.url} lost: {exc}"
        return close_error(rcvd and rcvd.code, rcvd and rcvd.reason, lost)

    def _closed_error_from(self, ws: Any) -> PagedServeError:
        lost = f"connection to {self.url} closed (code {ws.close_code})"
        return close_error(ws.close_code, ws.close_reason, lost)


def _decode(frame: str | bytes) -> dict[str, Any]:
    """A server event; a frame that is not one becomes an `error` event naming it."""
    try:
        event = json.loads(frame)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        return {"type": "error", "code": "engine_error", "message": f"bad frame {frame!r:.80}"}
    return event


def _fresh(error: PagedServeError) -> PagedServeError:
    """A new exception like `error` (one instance raised in two places tangles their
    tracebacks)."""
    return type(error)(str(error), error.request_id, error.param)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        message = f"timeout must be a number of seconds > 0 or None, got {timeout!r}"
        raise InvalidRequestError(message, param="timeout")
    return timeout
