"""One request of the SDK as the user holds it (`Stream`), its results, and chat
sessions. They ride on a `Connection` (web/client_connection.py), which `AsyncClient`
(web/client.py) implements; this module never imports the client."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from web.client_connection import Connection, Wire
from web.client_errors import (
    RETRYABLE_CODES,
    PagedServeError,
    RequestTimeout,
    ServerError,
    error_of,
)


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
    """A finished request: all its text and tokens, why it stopped, usage and timing;
    `dropped_messages`: the oldest chat messages left out so the prompt fits the
    model's context (a session turn, or `fit_history=True`)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    usage: Usage | None
    timing: dict[str, float | None] = field(default_factory=dict)
    dropped_messages: int = 0


Body = Callable[[], Awaitable[dict[str, Any]]]


class Stream:
    """One request's deltas; iterate it once. `result` is set when it finishes.

    Ends with `Completion` in `result`, or raises a PagedServeError. Stopping early
    cancels the request on the server: `async with`, `aclose()`, `cancel()` (the
    stream then ends with finish_reason "abort"), cancelling the task that iterates it,
    its `timeout` running out (RequestTimeout), or dropping it (a `break` out of
    `async for d in client.stream(...)`: the stream is collected at once, and a
    finalizer sends the cancel)."""

    def __init__(
        self, client: Connection, body: Body, params: dict[str, Any], timeout: float | None
    ) -> None:
        self.client, self._body, self._params, self.timeout = client, body, params, timeout
        self.request_id: str | None = None  # its id on the wire (a retry gets a new one)
        self.result: Completion | None = None
        self._wire: Wire | None = None
        self._finalizer: weakref.finalize | None = None
        self._started = self._finished = False
        self._deadline: float | None = None
        self._attempt = 0
        self._text: list[str] = []
        self._tokens: list[int] = []

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta:
        if self._finished:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                if self.timeout is not None:
                    self._deadline = time.monotonic() + self.timeout
                await self._send()
            while True:
                event = await self._next_event()
                kind = event.get("type")
                if kind == "delta":
                    return self._on_delta(event)
                if kind == "done":
                    self._on_done(event)
                    raise StopAsyncIteration
                await self._on_error(error_of(event, self.request_id))
        except asyncio.CancelledError:
            await self.aclose()
            raise
        except PagedServeError:  # the stream has ended with it
            self._finished = True
            raise

    async def _send(self) -> None:
        body = await self._within_deadline(self._body())
        self._wire = self.client._register()
        self.request_id = self._wire.request_id
        self._finalizer = weakref.finalize(self, self.client._abandon, self._wire)
        message = {"type": "generate", "id": self.request_id, **body, "params": self._params}
        try:
            await self.client._send(message)
        except BaseException:
            self._close()
            self._finished = True
            raise

    async def _next_event(self) -> dict[str, Any]:
        event = await self._within_deadline(self._wire.events.get())
        return event if isinstance(event, dict) else {"type": "error", "message": repr(event)}

    async def _within_deadline(self, work: Awaitable[Any]) -> Any:
        if self._deadline is None:
            return await work
        try:
            async with asyncio.timeout_at(_loop_time(self._deadline)) as limit:
                return await work
        except TimeoutError:
            if not limit.expired():
                raise
        await self.aclose()
        raise RequestTimeout(
            f"no result within {self.timeout:g} s (timeout); the request was cancelled "
            "on the server",
            self.request_id,
        ) from None

    def _on_delta(self, event: dict[str, Any]) -> Delta:
        text, tokens = event.get("text") or "", list(event.get("token_ids") or ())
        self._text.append(text)
        self._tokens += tokens
        return Delta(text, tokens, event.get("logprobs"))

    def _on_done(self, event: dict[str, Any]) -> None:
        self._close()
        self._finished = True
        counts, usage = event.get("usage"), None
        if isinstance(counts, dict):
            keys = ("prompt_tokens", "completion_tokens", "total_tokens")
            usage = Usage(*(int(counts.get(k) or 0) for k in keys))
        self.result = Completion(
            "".join(self._text),
            self._tokens,
            event.get("finish_reason") or "stop",
            event.get("stop_reason"),
            usage,
            event.get("timing") or {},
            event.get("dropped_messages") or 0,
        )

    async def _on_error(self, error: PagedServeError) -> None:
        """Retries an overloaded request that has produced nothing yet (the retry
        policy's backoff, within the deadline), else raises `error`."""
        self._close()
        policy = self.client.retry
        fresh = not self._tokens and not self._text
        delay = policy.delay(self._attempt)
        retry = error.code in RETRYABLE_CODES and fresh and self._attempt < policy.max_retries
        if retry and self._deadline is not None:
            retry = time.monotonic() + delay < self._deadline  # time left to wait for it
        if not retry:  # the stream ends with `error`
            self._finished = True
            if self._attempt and error.code in RETRYABLE_CODES:
                error.args = (f"{error.args[0]} (after {self._attempt} retries)",)
            raise error
        self._attempt += 1
        await asyncio.sleep(delay)
        await self._send()

    async def cancel(self) -> None:
        """Cancels the request on the server (its stream ends with finish_reason
        "abort"); does nothing once it has ended."""
        if self._wire is not None and not self._finished:
            await self.client._send_cancel(self._wire.request_id)

    async def aclose(self) -> None:
        """Stops the request now: cancels what is still running on the server."""
        running = self._wire is not None and not self._finished
        self._finished = True
        if running:
            self._close()
            await self.client._send_cancel(self._wire.request_id)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        async for _ in self:
            pass
        if self.result is None:
            raise ServerError("the stream ended without a result", self.request_id)
        return self.result

    def _close(self) -> None:
        """Stops listening for this attempt's events (nothing to cancel any more)."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._wire is not None:
            self.client._unregister(self._wire)


class ChatSession:
    """A multi-turn chat whose history the server keeps (a server-side session): it
    drops the oldest turns (never the system prompt) when a turn's prompt would not fit
    the model's context. Opened on the first `send` (once, however many sends race)."""

    def __init__(self, client: Connection, system: str | None) -> None:
        self.client, self.system = client, system
        self.session_id: str | None = None
        self._opening: asyncio.Future[str] | None = None

    def send(self, text: str, *, timeout: float | None | object = ..., **sampling: Any) -> Stream:
        """Streams the reply to `text`; the turn joins the history once it completes.
        `timeout` and sampling fields as in `AsyncClient.stream`."""

        async def body() -> dict[str, Any]:
            return {"session_id": await self.open(), "message": text}

        return Stream(self.client, body, sampling, self.client._timeout_of(timeout))

    async def open(self) -> str:
        """The session's id, opening it on the server if need be."""
        if self.session_id is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self.client._open_session(self.system))
            try:
                self.session_id = await asyncio.shield(self._opening)
            except PagedServeError:
                self._opening = None  # a later send tries again
                raise
        return self.session_id

    async def history(self) -> list[dict[str, str]]:
        """The messages the server keeps for this session (system prompt first)."""
        if self.session_id is None:
            return [] if self.system is None else [{"role": "system", "content": self.system}]
        message = {"type": "session.open", "session_id": self.session_id}
        event = await self.client._call(message, "session", 30.0)
        return list(event.get("messages") or ())

    async def close(self) -> None:
        """Closes the session on the server; sending on it afterwards is NotFoundError."""
        if self.session_id is not None:
            await self.client._send({"type": "session.close", "session_id": self.session_id})


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
