"""The `/v1/stream` WebSocket protocol: many requests multiplexed on one connection.

Client -> server (JSON text frames, or msgpack binary frames):
  {"type": "auth", "token": KEY}                      first message, when no header
  {"type": "generate", "id": ID, "prompt" | "messages" | "prompt_token_ids": ...,
   "fit_history"?: bool, "params": {...sampling fields, "structured_outputs"?...}}
  {"type": "generate", "id": ID, "session_id": SID, "message": TEXT, "params": {...}}
  {"type": "cancel", "id": ID}
  {"type": "session.open", "id"?: ID, "session_id"?: SID, "system"?: TEXT}
  {"type": "session.close", "id"?: ID, "session_id": SID}
  {"type": "ping", "id"?: ID}
Server -> client (msgpack binary frames when the URL says `?encoding=msgpack`):
  {"type": "delta", "id", "text", "token_ids", "logprobs"?}
  {"type": "done", "id", "finish_reason", "stop_reason", "usage", "timing", "session_id"?,
   "dropped_messages"?}
  {"type": "error", "id", "code", "message", "param"?}
  {"type": "session", "id"?, "session_id", "messages"}    {"type": "pong", "id"?}

A control message's optional `id` (a call id the client chooses) comes back on its
answer (`pong`, `session`) and on its `error`, so a client can have several in flight.
A session turn, and `messages` with `fit_history`, leave out the oldest turns (never
the system prompt) that would not fit the model's context with room for the reply
(see web/sessions.py); `dropped_messages` says how many messages were left out.

Connection rule: nothing a client sends closes the socket abnormally or touches its
other requests. A frame that cannot be served gets an `error` event (with its `id` when
it had a readable one); the documented closes are 1008 (bad or missing API key, several
Authorization headers, or no key within `auth_timeout_s`), 1009 (frame over
--max-message-bytes), 4008 (a client that stopped reading: MAX_CONTROL_EVENTS events
unread here, or a keepalive ping unanswered, web/ws_protocol.py) and 1001 (server
shutting down).

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
from dataclasses import dataclass
from typing import Any

import msgpack
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.text.text_checks import check_text
from web.api_keys import ApiKeys, bearer_key
from web.client_concurrency import Client
from web.errors import ApiError, invalid
from web.event_buffer import MAX_CONTROL_EVENTS, EventBuffer
from web.frames import as_object, load_json, load_msgpack
from web.generation import Generator, Timing, failure
from web.params import SAMPLING_FIELDS, chat_messages, only_keys, sampling_params, valid_text
from web.sessions import SessionStore, fit_history

logger = logging.getLogger(__name__)
_conn_ids = itertools.count()
MAX_ID_LEN = 128
POLICY_CLOSE = 1008  # close code: bad or missing API key
SLOW_READER_CLOSE = 4008  # close code: the client left MAX_CONTROL_EVENTS events unread
SHUTDOWN_CLOSE = 1001  # close code ("going away"): the server is shutting down
GENERATE_KEYS = {"type", "id", "prompt", "messages", "prompt_token_ids", "session_id"}
GENERATE_KEYS |= {"message", "params", "fit_history"}


@dataclass(frozen=True)
class StreamLimits:
    """Per-connection limits of the WebSocket endpoint."""

    max_requests: int = 64  # concurrent requests on one connection
    default_max_tokens: int = 256
    auth_timeout_s: float = 5.0  # a socket not authenticated by then is closed


class StreamConnection:
    """One WebSocket client: reads commands, runs its requests, writes events.

    Its sessions belong to its API key when the server has keys (they outlive the
    socket, for a reconnecting client), else to the connection (closed with it)."""

    def __init__(
        self,
        ws: WebSocket,
        generator: Generator,
        sessions: SessionStore,
        limits: StreamLimits,
        api_keys: ApiKeys,
        binary: bool,
    ) -> None:
        self.ws, self.generator, self.sessions = ws, generator, sessions
        self.limits, self.api_keys, self.binary = limits, api_keys, binary
        self.prefix = f"ws{next(_conn_ids)}-"
        self.owner = f"conn:{self.prefix}"
        self.buffer = EventBuffer()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.authorized = not api_keys
        self.client = Client.of_address(ws.client)  # its key's, once it gives one
        self.refusal: str | None = None  # why the handshake's headers are refused
        try:
            self._claim(bearer_key(ws.headers.getlist("authorization")))
        except ValueError as exc:  # several Authorization headers: none is trusted
            self.refusal = str(exc) if api_keys else None
        self.closing = False
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        """Runs until the client disconnects or `close()` is called."""
        await self.ws.accept()
        if self.refusal is not None:
            await self.ws.close(POLICY_CLOSE, self.refusal)
            return
        self._writer = asyncio.create_task(self._write())
        try:
            if not self.authorized:
                await self._await_auth()
            if self.authorized:
                await self._read()
        finally:
            await self._cancel_requests()
            if self.owner.startswith("conn:"):
                self.sessions.close_owned_by(self.owner)
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

    # -- authentication ------------------------------------------------------------
    def _claim(self, key: str | None) -> bool:
        """Authorizes the connection if `key` is one of the server's keys."""
        if self.api_keys.matches(key):
            self.authorized = True
            self.owner = f"key:{ApiKeys.fingerprint(key)}"
            self.client = Client.of_key(key)
        return self.authorized

    async def _await_auth(self) -> None:
        """The first frame must be an `auth` message with a valid key, within the
        timeout; otherwise the socket is closed with 1008."""
        try:
            async with asyncio.timeout(self.limits.auth_timeout_s):
                frame = await self.ws.receive()
        except TimeoutError:
            await self.ws.close(POLICY_CLOSE, "no API key within the authentication timeout")
            return
        except (WebSocketDisconnect, RuntimeError):
            return
        if frame["type"] == "websocket.disconnect":
            return
        with contextlib.suppress(ApiError):
            message = _parse(frame)
            if message.get("type") == "auth" and self._claim(message.get("token")):
                return
        await self.ws.close(POLICY_CLOSE, "invalid or missing API key")

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
                self._dispatch(_parse(frame))
            except ApiError as err:
                self._emit(err.event(_id_of(frame)))
            except Exception:  # a bug, not the client's: its frame fails, the rest go on
                logger.exception("%s: a frame failed", self.prefix)
                self._emit(ApiError("engine_error", "internal error").event(_id_of(frame)))

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "generate":
            self._generate(message)
        elif kind == "cancel":
            task = self.tasks.get(_request_id(message))
            if task is not None:
                task.cancel()
        elif kind == "ping":
            self._emit({"type": "pong"} | _call_id(message))
        elif kind == "session.open":
            only_keys(message, {"type", "id", "session_id", "system"}, "session.open")
            call = _call_id(message)
            session = self.sessions.open(
                self.owner, message.get("session_id"), message.get("system")
            )
            sid, history = session.session_id, session.messages
            self._emit({"type": "session", **call, "session_id": sid, "messages": history})
        elif kind == "session.close":
            only_keys(message, {"type", "id", "session_id"}, "session.close")
            _call_id(message)
            self.sessions.close(self.owner, message.get("session_id"))
        elif kind == "auth":
            pass  # already authorized (or no key configured)
        else:
            raise invalid(
                f"unknown message type {str(kind)[:40]!r}; expected generate, cancel, ping, "
                "session.open, session.close or auth",
                "type",
            )

    def _generate(self, message: dict[str, Any]) -> None:
        rid = _request_id(message)
        only_keys(message, GENERATE_KEYS, "generate")
        if rid in self.tasks:
            raise invalid(f"id {rid!r} is already in flight on this connection", "id")
        if len(self.tasks) >= self.limits.max_requests:
            raise ApiError(
                "too_many_requests",
                f"at most {self.limits.max_requests} concurrent requests per connection",
            )
        concurrency, client = self.generator.concurrency, self.client
        concurrency.check(client)  # refused before a session turn is taken
        body = message.get("params") or {}
        if not isinstance(body, dict):
            raise invalid(f"params must be an object, got {type(body).__name__}", "params")
        params = sampling_params(
            _check_params(body), chat=False, default_max_tokens=self.limits.default_max_tokens
        )
        fit = _fit_field(message)
        prompt, turn = self._prompt(message)  # a session turn holds its session from here
        fit = "message" if turn is not None else fit
        concurrency.acquire(client)  # checked above, with no await since
        task = asyncio.create_task(self._run(rid, prompt, params, turn, fit))
        task.add_done_callback(lambda _: concurrency.release(client))  # cancelled, too
        self.tasks[rid] = task

    def _prompt(self, message: dict[str, Any]):
        sid = message.get("session_id")
        if sid is not None:
            text = message.get("message")
            if isinstance(text, dict):
                text = text.get("content")
            if not isinstance(text, str) or not text:
                raise invalid("a session turn needs a non-empty 'message' string", "message")
            valid_text("message", text)
            session = self.sessions.get(self.owner, sid)
            user = {"role": "user", "content": text}
            return self.sessions.begin_turn(session, user), (session, user)
        given = [
            k for k in ("prompt", "messages", "prompt_token_ids") if message.get(k) is not None
        ]
        if len(given) != 1:
            raise invalid(
                "set exactly one of prompt, messages, prompt_token_ids (or session_id)", "prompt"
            )
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

    async def _run(self, rid: str, prompt, params, turn, fit: str | None) -> None:
        """Streams one request's events; `fit`: the field whose chat history is cut to
        the model's context first (None: the prompt goes as it is)."""
        timing = Timing(time.monotonic())
        reply: str | None = None
        text: list[str] = []
        counted = None  # the latest delta with token counts (an abort carries none)
        ended = _session_of(turn)  # what the `done` event adds
        try:
            if fit is not None:
                prompt, dropped = await self._fit(prompt, params, fit, turn)
                ended |= {"dropped_messages": dropped} if dropped else {}
            async for out in self.generator.stream(prompt, params, self.prefix + rid, timing):
                if out.finish_reason == "error":
                    raise failure(out)
                if out.num_prompt_tokens or out.num_output_tokens:
                    counted = out
                if out.text or out.token_ids:
                    text.append(out.text)
                    self._emit(_delta_event(rid, out))
                if out.finish_reason is not None:
                    reply = "".join(text) if out.finish_reason in ("stop", "length") else None
                    done = self._done(rid, out.finish_reason, out.stop_reason, counted, timing)
                    self._emit(done | ended)
        except asyncio.CancelledError:
            self._emit(self._done(rid, "abort", None, counted, timing) | ended)
        except ApiError as err:
            self._emit(err.event(rid))
        except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
            logger.exception("request %s failed", rid)
            self._emit(ApiError("engine_error", str(exc)).event(rid))
        finally:
            self.tasks.pop(rid, None)
            if turn is not None:
                self.sessions.end_turn(turn[0], turn[1], reply)

    async def _fit(self, messages, params, field: str, turn) -> tuple[list, int]:
        """The chat `messages` cut to the model's context (a session forgets what was
        cut), and how many messages were left out."""
        engine = self.generator.engine

        async def count(candidate: list[dict[str, str]]) -> int:
            try:
                return await engine.count_prompt_tokens(candidate)
            except ValueError as exc:
                raise invalid(str(exc), field) from None
            except RuntimeError as exc:  # an engine down or restarting: retry later
                raise ApiError("unavailable", f"the engine cannot answer: {exc}") from None

        fitted, dropped = await fit_history(
            messages, count, engine.ready.max_model_len, params.max_tokens, field
        )
        if turn is not None and dropped:
            self.sessions.forget_oldest(turn[0], dropped)
        return fitted, dropped

    @staticmethod
    def _done(rid: str, reason: str, stop_reason, counted, timing: Timing) -> dict[str, Any]:
        return {
            "type": "done",
            "id": rid,
            "finish_reason": reason,
            "stop_reason": stop_reason,
            "usage": None if counted is None else _usage(counted),
            "timing": timing.summary(),
        }

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
                await self._send(event)
            if self.closing:
                return

    async def _send(self, event: dict[str, Any]) -> None:
        if event.get("type") == "error":  # every error event goes out here: count it
            self.generator.metrics.refused(event["code"])
        try:
            if self.binary:
                await self.ws.send_bytes(msgpack.packb(event, use_bin_type=True))
            else:
                await self.ws.send_text(json.dumps(event, ensure_ascii=False))
        except (TypeError, ValueError) as exc:  # unencodable (a bug): say so, go on
            logger.error("%s: an event could not be encoded: %s", self.prefix, exc)
            if event.get("type") != "error":
                rid = event.get("id")
                error = ApiError("engine_error", "an event could not be encoded")
                await self._send(error.event(rid if isinstance(rid, str) else None))


def _fit_field(message: dict[str, Any]) -> str | None:
    """The field to cut to the context: "messages" for a stateless chat that asks
    (`fit_history`), else None."""
    fit = message.get("fit_history", False)
    if not isinstance(fit, bool):
        raise invalid(f"fit_history must be a bool, got {repr(fit)[:40]}", "fit_history")
    if fit and message.get("messages") is None and message.get("session_id") is None:
        raise invalid("fit_history cuts chat history: it needs messages", "fit_history")
    return "messages" if fit else None


def _call_id(message: dict[str, Any]) -> dict[str, str]:
    """A control message's call id as its answer carries it ({} when it has none)."""
    return {} if message.get("id") is None else {"id": _request_id(message)}


def _session_of(turn) -> dict[str, Any]:
    return {} if turn is None else {"session_id": turn[0].session_id}


def _parse(frame: dict[str, Any]) -> dict[str, Any]:
    return as_object(_load(frame), "frame")


def _load(frame: dict[str, Any]) -> Any:
    if frame.get("bytes") is not None:
        return load_msgpack(frame["bytes"], "frame")
    return load_json(frame.get("text") or "", "frame")


def _id_of(frame: dict[str, Any]) -> str | None:
    """The frame's request id, if it has a readable one (for its error event)."""
    with contextlib.suppress(ApiError):
        value = _load(frame)
        rid = value.get("id") if isinstance(value, dict) else None
        if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN:
            with contextlib.suppress(ValueError):
                check_text("id", rid)
                return rid
    return None


def _request_id(message: dict[str, Any]) -> str:
    rid = message.get("id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_LEN:
        shown = repr(rid)[:60] if not isinstance(rid, list | dict) else type(rid).__name__
        raise invalid(f"id must be a string of 1 to {MAX_ID_LEN} characters, got {shown}", "id")
    return valid_text("id", rid)


def _check_params(body: dict[str, Any]) -> dict[str, Any]:
    allowed = {*SAMPLING_FIELDS, "max_tokens", "logprobs", "logit_bias", "structured_outputs"}
    only_keys(body, allowed, f"params (allowed: {sorted(allowed)})")
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
