"""Async Python SDK for a pagedserve server (WebSocket `/v1/stream`); needs no torch.

    async with AsyncClient("ws://127.0.0.1:8000", api_key=KEY) as client:
        async for delta in client.stream("Once upon a time", max_tokens=64):
            print(delta.text, end="")
        result = await client.complete("Hello", temperature=0)
        chat = client.chat_session(system="You are terse.")
        async for delta in chat.send("hi"):
            ...

Many requests share the one connection. Leaving a `stream` loop early (or `cancel()`)
cancels the request on the server. Errors raise typed exceptions: AuthenticationError,
InvalidRequestError, OverloadedError, NotFoundError, EngineError, ConnectionLostError.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import websockets


class PagedServeError(Exception):
    """Base of the SDK's errors; `code` is the server's error code."""

    code = "error"

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class AuthenticationError(PagedServeError):
    code = "unauthorized"


class InvalidRequestError(PagedServeError):
    code = "invalid_request"


class OverloadedError(PagedServeError):
    """The server's queue (or this connection's request cap) is full, the server is
    shutting down, or its engine is unhealthy for now: retry later (or elsewhere)."""

    code = "overloaded"


class NotFoundError(PagedServeError):
    code = "not_found"


class EngineError(PagedServeError):
    code = "engine_error"


class RequestTimeoutError(EngineError):
    """The request ran past the server's --request-timeout."""

    code = "timeout"


class ConnectionLostError(PagedServeError):
    code = "connection_lost"


_ERRORS: dict[str, type[PagedServeError]] = {
    cls.code: cls
    for cls in (
        AuthenticationError,
        InvalidRequestError,
        OverloadedError,
        NotFoundError,
        EngineError,
        RequestTimeoutError,
        ConnectionLostError,
    )
}
_ERRORS |= {"too_many_requests": OverloadedError, "shutting_down": OverloadedError}
_ERRORS |= {"unavailable": OverloadedError}  # the engine is unhealthy for now


@dataclass(frozen=True)
class Delta:
    """New text and token ids of one request since its previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Completion:
    """A finished request: all its text and tokens, why it stopped, usage and timing."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    usage: Usage | None
    timing: dict[str, float | None] = field(default_factory=dict)


class Stream:
    """One request's deltas; iterate it once. `result` is set when it finishes."""

    def __init__(self, client: AsyncClient, request_id: str, message: dict[str, Any]) -> None:
        self.client, self.request_id, self._message = client, request_id, message
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started = self._finished = False
        self._text: list[str] = []
        self._tokens: list[int] = []
        self.result: Completion | None = None

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta:
        if not self._started:
            self._started = True
            await self.client._start(self)
        if self._finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        kind = event["type"]
        if kind == "delta":
            self._text.append(event["text"])
            self._tokens += event["token_ids"]
            return Delta(event["text"], event["token_ids"], event.get("logprobs"))
        self._finish()
        if kind == "done":
            usage = event.get("usage")
            self.result = Completion(
                "".join(self._text),
                self._tokens,
                event["finish_reason"],
                event.get("stop_reason"),
                Usage(**usage) if usage else None,
                event.get("timing") or {},
            )
            raise StopAsyncIteration
        raise _error(event, self.request_id)

    async def cancel(self) -> None:
        """Cancels the request on the server (its stream ends with finish_reason abort)."""
        if self._started and not self._finished:
            await self.client._send({"type": "cancel", "id": self.request_id})

    async def aclose(self) -> None:
        """Called when a loop is left early: cancel what is still running."""
        if not self._finished:
            await self.cancel()
            self._finish()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    def _finish(self) -> None:
        self._finished = True
        self.client._streams.pop(self.request_id, None)

    def _deliver(self, event: dict[str, Any]) -> None:
        self._queue.put_nowait(event)


class ChatSession:
    """A multi-turn chat whose history the server keeps (a server-side session)."""

    def __init__(self, client: AsyncClient, system: str | None) -> None:
        self.client, self.system = client, system
        self.session_id: str | None = None

    def send(self, text: str, **sampling: Any) -> _LazyStream:
        """Streams the reply to `text`; the turn joins the history once it completes."""
        return _LazyStream(self, text, sampling)

    async def close(self) -> None:
        if self.session_id is not None:
            await self.client._send({"type": "session.close", "session_id": self.session_id})


class _LazyStream:
    """`chat.send()`'s stream: opens the session on first use."""

    def __init__(self, chat: ChatSession, text: str, sampling: dict[str, Any]) -> None:
        self.chat, self.text, self.sampling = chat, text, sampling
        self._stream: Stream | None = None

    def __aiter__(self) -> _LazyStream:
        return self

    async def __anext__(self) -> Delta:
        if self._stream is None:
            chat = self.chat
            if chat.session_id is None:
                chat.session_id = await chat.client._open_session(chat.system)
            body = {"session_id": chat.session_id, "message": self.text}
            self._stream = chat.client._stream(body, self.sampling)
        return await self._stream.__anext__()

    @property
    def result(self) -> Completion | None:
        return None if self._stream is None else self._stream.result

    async def cancel(self) -> None:
        if self._stream is not None:
            await self._stream.cancel()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()


class AsyncClient:
    """A connection to `url` (ws://host:port); use as `async with`.

    `reconnect=True` opens a new connection for new requests after the old one was lost
    (requests that were in flight on it fail with ConnectionLostError)."""

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000",
        api_key: str | None = None,
        reconnect: bool = True,
        open_timeout: float = 10.0,
    ) -> None:
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1/stream"):
            self.url += "/v1/stream"
        self.api_key, self.reconnect, self.open_timeout = api_key, reconnect, open_timeout
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, Stream] = {}
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._lost: str | None = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Opens the connection; a wrong API key raises AuthenticationError here."""
        await self._open()
        await self.ping()  # an invalid key closes the socket (1008) before the pong

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def ping(self, timeout: float = 10.0) -> None:
        await self._request({"type": "ping"}, "pong", timeout)

    # -- requests --------------------------------------------------------------------
    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        **sampling: Any,
    ) -> Stream:
        """One request (a text prompt, token ids, or chat `messages`); sampling fields as
        in the OpenAI API / vLLM (max_tokens, temperature, top_p, seed, stop, ...)."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages")
        if messages is not None:
            body: dict[str, Any] = {"messages": messages}
        elif isinstance(prompt, str):
            body = {"prompt": prompt}
        else:
            body = {"prompt_token_ids": list(prompt)}
        return self._stream(body, sampling)

    async def complete(self, prompt=None, *, messages=None, **sampling: Any) -> Completion:
        return await self.stream(prompt, messages=messages, **sampling).collect()

    def chat_session(self, system: str | None = None) -> ChatSession:
        return ChatSession(self, system)

    def _stream(self, body: dict[str, Any], sampling: dict[str, Any]) -> Stream:
        rid = f"r{next(self._ids)}"
        return Stream(self, rid, {"type": "generate", "id": rid, **body, "params": sampling})

    async def _start(self, stream: Stream) -> None:
        self._streams[stream.request_id] = stream
        await self._send(stream._message)

    async def _open_session(self, system: str | None) -> str:
        event = await self._request({"type": "session.open", "system": system}, "session")
        return event["session_id"]

    async def _request(self, message: dict, reply: str, timeout: float = 10.0) -> dict:
        future = asyncio.get_running_loop().create_future()
        self._waiters[reply] = future  # one outstanding control call per kind
        await self._send(message)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.pop(reply, None)

    async def _send(self, message: dict[str, Any]) -> None:
        async with self._lock:
            if self._lost is not None:
                if not self.reconnect:
                    raise ConnectionLostError(self._lost)
                await self._open()
            try:
                await self._ws.send(json.dumps(message))
            except websockets.ConnectionClosed as exc:
                raise self._closed_error(exc) from None

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await websockets.connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.open_timeout,
                max_size=None,
            )
        except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
            raise ConnectionLostError(f"cannot connect to {self.url}: {exc}") from None
        self._lost = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        ws = self._ws
        try:
            async for frame in ws:
                self._dispatch(json.loads(frame))
        except websockets.ConnectionClosed:
            pass
        error = self._closed_error_from(ws)
        self._lost = str(error)
        for stream in list(self._streams.values()):
            stream._deliver({"type": "error", "code": error.code, "message": str(error)})
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("delta", "done") or (kind == "error" and event.get("id")):
            stream = self._streams.get(event.get("id"))
            if stream is not None:
                stream._deliver(event)
            return
        if kind == "error":  # a connection-level error answers the pending control call
            future = next((f for f in self._waiters.values() if not f.done()), None)
            if future is not None:
                future.set_exception(_error(event, None))
            return
        future = self._waiters.get(kind)
        if future is not None and not future.done():
            future.set_result(event)

    def _closed_error(self, exc: websockets.ConnectionClosed) -> PagedServeError:
        rcvd = exc.rcvd
        lost = f"connection to {self.url} lost: {exc}"
        return _close_error(rcvd and rcvd.code, rcvd and rcvd.reason, lost)

    def _closed_error_from(self, ws: Any) -> PagedServeError:
        lost = f"connection to {self.url} closed (code {ws.close_code})"
        return _close_error(ws.close_code, ws.close_reason, lost)


def _close_error(code: int | None, reason: str | None, lost: str) -> PagedServeError:
    """1008 (policy: a wrong or missing key) is an auth failure; any other close a loss."""
    if code == 1008:
        return AuthenticationError(reason or "invalid API key")
    return ConnectionLostError(lost)


def _error(event: dict[str, Any], request_id: str | None) -> PagedServeError:
    cls = _ERRORS.get(event.get("code", ""), PagedServeError)
    return cls(event.get("message", "request failed"), request_id)
