"""The `/v1/stream` WebSocket protocol: many requests multiplexed on one connection.

Client -> server (JSON text frames, or msgpack binary frames):
  {"type": "auth", "token": KEY}                      first message, when no header
  {"type": "generate", "id": ID, "prompt" | "messages" | "prompt_token_ids": ...,
   "params": {...sampling fields...}}
  {"type": "generate", "id": ID, "session_id": SID, "message": TEXT, "params": {...}}
  {"type": "cancel", "id": ID}
  {"type": "session.open", "session_id"?: SID, "system"?: TEXT}
  {"type": "session.close", "session_id": SID}
  {"type": "ping"}
Server -> client (msgpack binary frames when the URL says `?encoding=msgpack`):
  {"type": "delta", "id", "text", "token_ids", "logprobs"?}
  {"type": "done", "id", "finish_reason", "stop_reason", "usage", "timing", "session_id"?}
  {"type": "error", "id", "code", "message"}
  {"type": "session", "session_id", "messages"}    {"type": "pong"}

A slow reader never holds anything up: events go into a per-connection buffer where a
request's unsent deltas merge into one, and a writer task drains it at the reader's pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack
from starlette.websockets import WebSocket, WebSocketDisconnect

from web.errors import ApiError, invalid
from web.generation import Generator, Timing
from web.params import SAMPLING_FIELDS, chat_messages, sampling_params
from web.sessions import SessionStore

logger = logging.getLogger(__name__)
_conn_ids = itertools.count()
MAX_ID_LEN = 128
MAX_CONTROL_EVENTS = 1024  # unsent non-delta events before a connection is closed
SLOW_READER_CLOSE = 4008  # close code: the client left MAX_CONTROL_EVENTS events unread
SHUTDOWN_CLOSE = 1001  # close code ("going away"): the server is shutting down
GENERATE_KEYS = {"type", "id", "prompt", "messages", "prompt_token_ids", "session_id"}
GENERATE_KEYS |= {"message", "params"}


@dataclass(frozen=True)
class StreamLimits:
    """Per-connection limits of the WebSocket endpoint."""

    max_requests: int = 64  # concurrent requests on one connection
    default_max_tokens: int = 256


class EventBuffer:
    """Events waiting for a slow client, in order; a request's unsent deltas coalesce.

    Deltas merge, so only the other events (done, error, pong, session) can pile up:
    past MAX_CONTROL_EVENTS of them `push` refuses (returns False) from then on, and the
    connection is closed with SLOW_READER_CLOSE."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque()
        self.open_delta: dict[str, dict[str, Any]] = {}  # id -> its unsent delta event
        self.ready = asyncio.Event()
        self.overflowed = False

    def push(self, event: dict[str, Any]) -> bool:
        if self.overflowed:
            return False
        rid = event.get("id")
        if event["type"] == "delta":
            pending = self.open_delta.get(rid)
            if pending is not None:
                pending["text"] += event["text"]
                pending["token_ids"] += event["token_ids"]
                if "logprobs" in event:
                    pending.setdefault("logprobs", []).extend(event["logprobs"])
                return True
            self.open_delta[rid] = event
        else:
            self.open_delta.pop(rid, None)  # later deltas must not merge before this
            if len(self.events) - len(self.open_delta) >= MAX_CONTROL_EVENTS:
                self.overflowed = True
                return False
        self.events.append(event)
        self.ready.set()
        return True

    def pop(self) -> dict[str, Any] | None:
        if not self.events:
            self.ready.clear()
            return None
        event = self.events.popleft()
        if event["type"] == "delta" and self.open_delta.get(event["id"]) is event:
            del self.open_delta[event["id"]]
        return event


class StreamConnection:
    """One WebSocket client: reads commands, runs its requests, writes events."""

    def __init__(
        self,
        ws: WebSocket,
        generator: Generator,
        sessions: SessionStore,
        limits: StreamLimits,
        api_keys: frozenset[str],
        binary: bool,
    ) -> None:
        self.ws, self.generator, self.sessions = ws, generator, sessions
        self.limits, self.api_keys, self.binary = limits, api_keys, binary
        self.prefix = f"ws{next(_conn_ids)}-"
        self.buffer = EventBuffer()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.authorized = not api_keys or _bearer(ws.headers.get("authorization")) in api_keys
        self.closing = False
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        """Runs until the client disconnects or `close()` is called."""
        await self.ws.accept()
        self._writer = asyncio.create_task(self._write())
        try:
            await self._read()
        finally:
            await self._cancel_requests()
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._writer

    async def close(self, code: int, reason: str, flush_s: float = 1.0) -> None:
        """Ends the connection: open requests are aborted (each gets its `done` with
        finish_reason "abort"), the events already queued get `flush_s` seconds to
        reach the client, then the socket closes with `code`."""
        if self.closing:
            return
        self.closing = True
        await self._cancel_requests()
        self.buffer.ready.set()
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._writer), flush_s)
            self._writer.cancel()
        with contextlib.suppress(Exception):
            await self.ws.close(code, reason)

    async def _cancel_requests(self) -> None:
        for task in self.tasks.values():
            task.cancel()  # their generators abort the engine requests
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # -- reading -----------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                frame = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if frame["type"] == "websocket.disconnect" or self.closing:
                return
            try:
                message = _parse(frame)
                if not self.authorized:
                    self._authorize(message)
                    continue
                self._dispatch(message)
            except ApiError as err:
                if err.code == "unauthorized":
                    await self.ws.close(1008, err.message[:120])
                    return
                self._emit(err.event(_id_of(frame)))

    def _authorize(self, message: dict[str, Any]) -> None:
        if message.get("type") == "auth" and message.get("token") in self.api_keys:
            self.authorized = True
            return
        raise ApiError("unauthorized", "invalid or missing API key")

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "generate":
            self._generate(message)
        elif kind == "cancel":
            task = self.tasks.get(_request_id(message))
            if task is not None:
                task.cancel()
        elif kind == "ping":
            self._emit({"type": "pong"})
        elif kind == "session.open":
            session = self.sessions.open(message.get("session_id"), message.get("system"))
            self._emit(
                {"type": "session", "session_id": session.session_id, "messages": session.messages}
            )
        elif kind == "session.close":
            self.sessions.close(str(message.get("session_id")))
        elif kind == "auth":
            pass  # already authorized (or no key configured)
        else:
            raise invalid(
                f"unknown message type {kind!r}; expected generate, cancel, ping, "
                "session.open, session.close or auth",
                "type",
            )

    def _generate(self, message: dict[str, Any]) -> None:
        rid = _request_id(message)
        unknown = set(message) - GENERATE_KEYS
        if unknown:
            raise invalid(f"unknown field(s) {sorted(unknown)} in generate", sorted(unknown)[0])
        if rid in self.tasks:
            raise invalid(f"id {rid!r} is already in flight on this connection", "id")
        if len(self.tasks) >= self.limits.max_requests:
            raise ApiError(
                "too_many_requests",
                f"at most {self.limits.max_requests} concurrent requests per connection",
            )
        body = message.get("params") or {}
        if not isinstance(body, dict):
            raise invalid(f"params must be an object, got {body!r}", "params")
        params = sampling_params(
            _check_params(body), chat=False, default_max_tokens=self.limits.default_max_tokens
        )
        prompt, turn = self._prompt(message)
        self.tasks[rid] = asyncio.create_task(self._run(rid, prompt, params, turn))

    def _prompt(self, message: dict[str, Any]):
        sid = message.get("session_id")
        if sid is not None:
            text = message.get("message")
            if isinstance(text, dict):
                text = text.get("content")
            if not isinstance(text, str) or not text:
                raise invalid("a session turn needs a non-empty 'message' string", "message")
            session = self.sessions.get(str(sid))
            user = {"role": "user", "content": text}
            return self.sessions.begin_turn(session, user), (session, user)
        given = [
            k for k in ("prompt", "messages", "prompt_token_ids") if message.get(k) is not None
        ]
        if len(given) != 1:
            raise invalid("set exactly one of prompt, messages, prompt_token_ids (or session_id)")
        value = message[given[0]]
        if given[0] == "prompt" and not isinstance(value, str):
            raise invalid(f"prompt must be a string, got {type(value).__name__}", "prompt")
        if given[0] == "prompt_token_ids" and not (
            isinstance(value, list) and all(type(t) is int for t in value)
        ):
            raise invalid("prompt_token_ids must be a list of ints", "prompt_token_ids")
        if given[0] == "messages":
            value = chat_messages(value)
        return value, None

    async def _run(self, rid: str, prompt, params, turn) -> None:
        timing = Timing(time.monotonic())
        reply: str | None = None
        text: list[str] = []
        try:
            async for out in self.generator.stream(prompt, params, self.prefix + rid, timing):
                if out.finish_reason == "error":
                    raise ApiError("engine_error", out.error or "the request failed")
                if out.text or out.token_ids:
                    text.append(out.text)
                    self._emit(_delta_event(rid, out))
                if out.finish_reason is not None:
                    reply = "".join(text) if out.finish_reason in ("stop", "length") else None
                    done = {
                        "type": "done",
                        "id": rid,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                        "usage": _usage(out),
                        "timing": timing.summary(),
                    }
                    if turn is not None:
                        done["session_id"] = turn[0].session_id
                    self._emit(done)
        except asyncio.CancelledError:
            self._emit(
                {
                    "type": "done",
                    "id": rid,
                    "finish_reason": "abort",
                    "stop_reason": None,
                    "usage": None,
                    "timing": timing.summary(),
                }
            )
        except ApiError as err:
            self._emit(err.event(rid))
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            logger.exception("request %s failed", rid)
            self._emit(ApiError("engine_error", str(exc)).event(rid))
        finally:
            self.tasks.pop(rid, None)
            if turn is not None:
                self.sessions.end_turn(turn[0], turn[1], reply)

    # -- writing -----------------------------------------------------------------
    def _emit(self, event: dict[str, Any]) -> None:
        if not self.buffer.push(event) and self._closer is None:
            logger.warning("%s: client is not reading its events; closing", self.prefix)
            reason = f"client left {MAX_CONTROL_EVENTS} events unread"
            self._closer = asyncio.create_task(self.close(SLOW_READER_CLOSE, reason, 0.0))

    async def _write(self) -> None:
        """Sends the buffered events at the client's pace; after `close()` starts, ends
        once the buffer is empty."""
        while True:
            await self.buffer.ready.wait()
            while (event := self.buffer.pop()) is not None:
                if self.binary:
                    await self.ws.send_bytes(msgpack.packb(event, use_bin_type=True))
                else:
                    await self.ws.send_text(json.dumps(event, ensure_ascii=False))
            if self.closing:
                return


def _parse(frame: dict[str, Any]) -> dict[str, Any]:
    try:
        if frame.get("bytes") is not None:
            message = msgpack.unpackb(frame["bytes"], raw=False)
        else:
            message = json.loads(frame.get("text") or "")
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise invalid(f"invalid JSON/msgpack frame: {exc}") from None
    if not isinstance(message, dict):
        raise invalid(f"a message must be an object, got {type(message).__name__}")
    return message


def _id_of(frame: dict[str, Any]) -> str | None:
    with contextlib.suppress(ApiError):
        rid = _parse(frame).get("id")
        return rid if isinstance(rid, str) else None
    return None


def _request_id(message: dict[str, Any]) -> str:
    rid = message.get("id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_LEN:
        raise invalid(f"id must be a string of 1 to {MAX_ID_LEN} characters, got {rid!r}", "id")
    return rid


def _check_params(body: dict[str, Any]) -> dict[str, Any]:
    allowed = {*SAMPLING_FIELDS, "max_tokens", "logprobs", "logit_bias"}
    unknown = set(body) - allowed
    if unknown:
        raise invalid(
            f"unknown sampling field(s) {sorted(unknown)}; allowed: {sorted(allowed)}",
            sorted(unknown)[0],
        )
    return body


def _delta_event(rid: str, out) -> dict[str, Any]:
    event = {"type": "delta", "id": rid, "text": out.text, "token_ids": list(out.token_ids)}
    if out.logprobs is not None:
        event["logprobs"] = [
            [
                {
                    "token_id": c.token_id,
                    "logprob": c.logprob,
                    "rank": c.rank,
                    "token": c.decoded_token,
                }
                for c in row
            ]
            for row in out.logprobs
        ]
    return event


def _usage(out) -> dict[str, int]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None
