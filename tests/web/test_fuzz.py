"""Property-based fuzzing of the server's client-facing inputs (Hypothesis).

Targets: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, and the
/v1/stream WebSocket (`generate` frames as JSON text and as msgpack binary frames,
`session.open` with one turn, control frames and frames that are neither JSON nor
msgpack). Strategies live in
tests/web/fuzz_bodies.py.

The property, per example: the request ends within TIMEOUT_S (a timeout is a hang) with
either a result (HTTP 200 with its choices, an SSE stream ending in `data: [DONE]`, a WS
`done`) or an error whose `param` or message names a field of the request (HTTP 4xx in
OpenAI's shape, a WS `error` event). HTTP 5xx is never allowed (503 only as
`overloaded`); a WS `error` is never `engine_error`; the server never closes a WebSocket
except with 1009 for a frame over --max-message-bytes (the client then reconnects);
after an error the same connection still serves a valid `generate`; a session that
session.open handed out is gone after session.close. After each test function, /metrics
shows nothing queued, live, running or waiting, no KV block used, no session and no
WebSocket open, and /health is 200.

One server per module (replaced for the next test when a test leaves it dirty); one
WebSocket carries all of a test's examples, one frame at a time: each frame is followed by
a sync frame (a generate without a prompt, refused with an error event carrying its id)
that marks where that frame's synchronous replies end; a generate also waits for its own
done / error.

Examples per test: DEFAULT_EXAMPLES, or PAGEDSERVE_FUZZ_EXAMPLES for all of them (see
bench/fuzz.py for long runs); PAGEDSERVE_FUZZ_TIMEOUT sets the per-request timeout;
PAGEDSERVE_FUZZ_STATS names a JSON file that receives the outcomes per target.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.eventually import eventually_sync
from tests.web.conftest import RunningServer, start_server, stop_server
from tests.web.fuzz_bodies import (
    CHAT_VALID,
    COMPLETION_VALID,
    GENERATE_FRAME_KEYS,
    RESPONSES_FIELDS,
    RESPONSES_VALID,
    SESSION_OPEN_FIELDS,
    WS_GENERATE_FIELDS,
    WS_PARAM_FIELDS,
    WS_PARAMS_VALID,
    Deep,
    Raw,
    chat_bodies,
    completion_bodies,
    contains,
    control_frames,
    generate_frames,
    has_surrogate,
    responses_bodies,
    session_cases,
    to_json_text,
    to_msgpack_bytes,
    with_fresh,
)
from web.openai_routes import CHAT_FIELDS, COMPLETION_FIELDS
from web.ws_connection import GENERATE_KEYS

TIMEOUT_S = float(os.environ.get("PAGEDSERVE_FUZZ_TIMEOUT") or 10)
MAX_MESSAGE_BYTES = 256 * 1024
MAX_ID_LEN = 128  # the protocol's longest request id  # some fuzzed bodies (up to ~1 MiB) exceed it
SERVER_ARGS = [
    "--max-model-len",
    "128",
    # above 64 so that requests a hang leaves queued (a bug being shrunk) do not turn
    # every later example into `overloaded`
    "--max-queued-requests",
    "256",
    "--max-message-bytes",
    str(MAX_MESSAGE_BYTES),
    "--shutdown-grace",
    "1",
]
EXAMPLES_ENV = "PAGEDSERVE_FUZZ_EXAMPLES"
STATS_ENV = "PAGEDSERVE_FUZZ_STATS"
DEFAULT_EXAMPLES = {
    "test_completions_fuzz": 600,
    "test_chat_completions_fuzz": 500,
    "test_responses_fuzz": 300,
    "test_ws_generate_json": 600,
    "test_ws_generate_msgpack": 500,
    "test_ws_sessions": 300,
    "test_ws_control_frames": 500,
}
IDLE_GAUGES = (
    "pagedserve_num_requests_queued",
    "pagedserve_num_requests_live",
    "pagedserve_num_requests_running",
    "pagedserve_num_requests_waiting",
    "pagedserve_kv_blocks_used",
    "pagedserve_num_sessions",
    "pagedserve_num_ws_connections",
)
HTTP_ERROR_STATUSES = {400, 404, 413, 422, 503}  # 503 only as `overloaded`
WS_ERROR_CODES = {"invalid_request", "not_found", "overloaded"}
WS_TYPES_WITHOUT_REPLY = ("ping", "cancel", "session.close", "auth")  # ping: a pong
FINISH_REASONS = {"stop", "length"}
WS_FIELDS = frozenset(WS_GENERATE_FIELDS | SESSION_OPEN_FIELDS | {"token", "session"})
# What an error about a whole payload (not JSON / msgpack, not an object, too big, nested
# too deep) may say instead of naming a field.
_FRAME_WORD = re.compile(r"json|msgpack|utf-?8|object|frame|body|nest|deep|depth|recurs|byte", re.I)
_ids = itertools.count()


def fresh_id(tag: str = "r") -> str:
    """Unique in this test process (session ids are server-wide, request ids per socket)."""
    return f"~{tag}~{next(_ids)}"


def fuzz_settings(target: str) -> settings:
    examples = int(os.environ.get(EXAMPLES_ENV) or DEFAULT_EXAMPLES[target])
    return settings(
        max_examples=examples,
        deadline=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# -- outcomes --------------------------------------------------------------------------
STATS: dict[str, Counter] = {}
SLOWEST: dict[str, tuple[float, str]] = {}  # target -> (seconds, outcome) of its slowest


def record(target: str, outcome: str, seconds: float) -> None:
    STATS.setdefault(target, Counter())[outcome] += 1
    if seconds > SLOWEST.get(target, (0.0, ""))[0]:
        SLOWEST[target] = (round(seconds, 3), outcome)
    event(outcome)


def short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


@functools.cache
def _field_words(vocabulary: frozenset[str]) -> re.Pattern:
    names = "|".join(re.escape(n) for n in sorted(vocabulary, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{names})(?!\w)")


def names_a_field(message: Any, keys, whole_payload: bool, vocabulary: frozenset[str]) -> bool:
    """Whether an error message names a field of `vocabulary` (the route's) or one of the
    request's keys (an unknown key quoted as repr() shows it); `whole_payload`: the
    payload as a whole may be what is wrong (not an object, undecodable, too big, nested
    too deep)."""
    if not isinstance(message, str):
        return False
    if _field_words(vocabulary).search(message):
        return True
    if any(repr(k) in message for k in keys):
        return True
    return whole_payload and bool(_FRAME_WORD.search(message))


def _escaped(key: Any) -> str:
    """A key as the server's errors spell it (lone surrogates as \\udxxx escapes)."""
    return key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else ""


def param_names_a_field(param: Any, keys, vocabulary: frozenset[str]) -> bool:
    """`param` is a field of the route, or one of the request's keys (a key that JSON
    cannot carry as is, e.g. with a lone surrogate, may come back escaped)."""
    if not isinstance(param, str):
        return False
    head = re.split(r"[\[.]", param, maxsplit=1)[0]
    spellings = {v for k in keys for v in (k, repr(k), ascii(k), ascii(k)[1:-1], _escaped(k))}
    return param in vocabulary or head in vocabulary or param in spellings


# -- the server ------------------------------------------------------------------------
def read_metrics(server: RunningServer) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    reply = httpx.get(f"{server.http}/metrics", timeout=10)
    reply.raise_for_status()
    values = {}
    for line in reply.text.splitlines():
        name, _, rest = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            values[name] = float(rest.split()[0])
    return values


def idle_problems(server: RunningServer) -> list[str]:
    """What still holds resources (or is unhealthy); [] when the server is idle."""
    try:
        metrics = read_metrics(server)
        health = httpx.get(f"{server.http}/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        return [f"/metrics or /health unreachable: {exc!r}"]
    problems = [f"{n}={metrics.get(n)}" for n in IDLE_GAUGES if metrics.get(n) != 0]
    return problems + ([f"/health {health}"] if health != 200 else [])


def assert_idle(server: RunningServer) -> None:
    eventually_sync(
        lambda: not idle_problems(server),
        5,
        lambda: f"the server still holds resources: {idle_problems(server)}",
    )


class ServerSlot:
    """The module's server; a test that leaves it dirty (a bug found) gets it replaced,
    so the next test starts clean."""

    def __init__(self) -> None:
        self.server: RunningServer | None = None

    def get(self) -> RunningServer:
        if self.server is None:
            self.server = start_server(extra=SERVER_ARGS)
        return self.server

    def discard(self) -> None:
        if self.server is not None:
            stop_server(self.server)
            self.server = None


@pytest.fixture(scope="module")
def slot():
    s = ServerSlot()
    yield s
    s.discard()
    if path := os.environ.get(STATS_ENV):
        stats = {
            t: {"examples": sum(c.values()), "outcomes": dict(c), "slowest": SLOWEST.get(t)}
            for t, c in STATS.items()
        }
        Path(path).write_text(json.dumps(stats, indent=1, sort_keys=True))


@pytest.fixture
def server(slot):
    server = slot.get()
    yield server
    try:
        assert_idle(server)
    except AssertionError:  # the test found a bug (and says so): the next gets a clean server
        slot.discard()


# -- HTTP ------------------------------------------------------------------------------
class HttpTarget:
    """A route and a keep-alive client for it; after a failed example the client starts
    over, so a connection the server broke is not blamed on the next example."""

    def __init__(self, server: RunningServer, path: str, chat: bool) -> None:
        self.server, self.path, self.chat = server, path, chat
        self.responses = path == "/v1/responses"
        self.client = httpx.Client(timeout=httpx.Timeout(TIMEOUT_S))

    def __repr__(self) -> str:
        return f"HttpTarget({self.path!r})"

    def __enter__(self) -> HttpTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def reset(self) -> None:
        self.client.close()
        self.client = httpx.Client(timeout=httpx.Timeout(TIMEOUT_S))


@dataclass(frozen=True)
class HttpReply:
    status: int
    content_type: str
    body: bytes


def http_payload(body: Any) -> bytes:
    if isinstance(body, Raw):
        return body.data if isinstance(body.data, bytes) else body.data.encode("utf-8")
    return to_json_text(body).encode("ascii")


def post(target: HttpTarget, content: bytes) -> HttpReply:
    """POSTs and reads the whole reply (an SSE stream to its end) within TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    url = f"{target.server.http}{target.path}"
    headers = {"content-type": "application/json"}
    failure = None
    try:
        with target.client.stream("POST", url, content=content, headers=headers) as r:
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                assert time.monotonic() < deadline, f"hang: still streaming after {TIMEOUT_S} s"
            return HttpReply(r.status_code, r.headers.get("content-type", ""), bytes(data))
    except httpx.TimeoutException as exc:
        failure = f"hang: no reply within {TIMEOUT_S:g} s ({exc!r})"
    except httpx.TransportError as exc:
        failure = f"the server dropped the connection: {exc!r}"
    # Raised outside the handler: Hypothesis tells failures apart by their exception
    # chain too, and httpx's inner exceptions vary from run to run.
    raise AssertionError(failure)


def expected_choices(body: dict, chat: bool) -> int | None:
    """n x prompts, when the body says plainly."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if type(n) is not int:
        return None
    if chat:
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    ):
        return n
    if isinstance(prompt, list) and prompt:
        return n * len(prompt)
    return None


def parse_sse(data: bytes) -> list[dict]:
    events = [e for e in data.decode("utf-8").split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", f"SSE does not end with [DONE]: {data[-300:]}"
    chunks = []
    for e in events[:-1]:
        assert e.startswith("data: "), f"not an SSE data event: {e[:200]!r}"
        chunks.append(json.loads(e[len("data: ") :]))
    return chunks


def check_response_result(body: dict, reply: HttpReply) -> str:
    """/v1/responses: a Response object, or its events ending completed or incomplete."""
    if body.get("stream") is True:
        assert reply.content_type.startswith("text/event-stream"), reply.content_type
        frames = [e for e in reply.body.decode("utf-8").split("\n\n") if e.strip()]
        events = [json.loads(f.split("\ndata: ", 1)[1]) for f in frames]
        assert all(e["type"] != "error" for e in events), f"the stream failed: {events[-1]}"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        response = events[-1]["response"]
        assert events[-1]["type"] == f"response.{response['status']}", events[-1]["type"]
        return "200 stream"
    response = json.loads(reply.body)
    assert response["object"] == "response" and isinstance(response["output"], list), response
    assert response["status"] in ("completed", "incomplete"), response
    assert isinstance(response["usage"]["output_tokens"], int), response
    return "200"


def check_http_result(target: HttpTarget, body: Any, reply: HttpReply) -> str:
    assert isinstance(body, dict), f"HTTP 200 for a body that is not an object: {reply.body[:300]}"
    if target.responses:
        return check_response_result(body, reply)
    if body.get("stream") is True:
        assert reply.content_type.startswith("text/event-stream"), reply.content_type
        finished: dict[int, Any] = {}
        for chunk in parse_sse(reply.body):
            assert "error" not in chunk, f"the stream failed: {chunk['error']}"
            for choice in chunk["choices"]:
                if choice.get("finish_reason") is not None:
                    assert choice["index"] not in finished, f"choice finished twice: {chunk}"
                    finished[choice["index"]] = choice["finish_reason"]
        outcome = "200 stream"
    else:
        result = json.loads(reply.body)
        assert result["object"] == ("chat.completion" if target.chat else "text_completion")
        finished = {c["index"]: c["finish_reason"] for c in result["choices"]}
        assert len(finished) == len(result["choices"]), f"repeated choice index: {result}"
        for c in result["choices"]:
            text = c["message"]["content"] if target.chat else c["text"]
            assert isinstance(text, str), c
        assert isinstance(result["usage"]["completion_tokens"], int), result
        outcome = "200"
    assert set(finished.values()) <= FINISH_REASONS, f"finish reasons {finished}"
    want = expected_choices(body, target.chat)
    assert want is None or len(finished) == want, f"{len(finished)} choices finished, not {want}"
    return outcome


def check_http_error(target: HttpTarget, body: Any, content: bytes, reply: HttpReply) -> str:
    text = reply.body[:500]
    assert reply.status in HTTP_ERROR_STATUSES, f"HTTP {reply.status}: {text!r}"
    try:
        error = json.loads(reply.body).get("error")
    except (ValueError, AttributeError):
        error = None
    assert isinstance(error, dict) and isinstance(error.get("message"), str), (
        f"HTTP {reply.status} without an OpenAI error: {text!r}"
    )
    code = error.get("code")
    if reply.status == 503:
        assert code == "overloaded", f"HTTP 503 for client input: {error}"
        return "503 overloaded"
    try:
        view = json.loads(content.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        view = None
    keys = list(view) if isinstance(view, dict) else []
    whole = (
        not isinstance(view, dict)
        or len(content) > MAX_MESSAGE_BYTES
        or contains(body, lambda v: isinstance(v, Deep))
    )
    param = error.get("param")
    fields = frozenset(CHAT_FIELDS if target.chat else COMPLETION_FIELDS)
    if target.responses:
        fields = RESPONSES_FIELDS
    if param is not None:
        assert param_names_a_field(param, keys, fields), f"param {param!r} names no field: {error}"
    else:
        message = error["message"]
        assert names_a_field(message, keys, whole, fields), f"the error names no field: {error}"
    return f"{reply.status} {code}"


def check_http(target: HttpTarget, name: str, body: Any) -> None:
    content = http_payload(body)
    start = time.monotonic()
    try:
        reply = post(target, content)
        seconds = time.monotonic() - start
        if reply.status == 200:
            outcome = check_http_result(target, body, reply)
        else:
            outcome = check_http_error(target, body, content, reply)
    except BaseException:
        target.reset()
        raise
    record(name, outcome, seconds)


@fuzz_settings("test_completions_fuzz")
@given(body=completion_bodies())
def _fuzz_completions(target: HttpTarget, body: Any) -> None:
    check_http(target, "test_completions_fuzz", body)


@fuzz_settings("test_chat_completions_fuzz")
@given(body=chat_bodies())
def _fuzz_chat(target: HttpTarget, body: Any) -> None:
    check_http(target, "test_chat_completions_fuzz", body)


@fuzz_settings("test_responses_fuzz")
@given(body=responses_bodies())
def _fuzz_responses(target: HttpTarget, body: Any) -> None:
    check_http(target, "test_responses_fuzz", body)


def test_strategies_cover_every_field() -> None:
    """A field the routes learn must get valid values here too."""
    assert COMPLETION_FIELDS <= set(COMPLETION_VALID), COMPLETION_FIELDS - set(COMPLETION_VALID)
    assert CHAT_FIELDS <= set(CHAT_VALID), CHAT_FIELDS - set(CHAT_VALID)
    assert GENERATE_KEYS <= GENERATE_FRAME_KEYS, GENERATE_KEYS - GENERATE_FRAME_KEYS
    assert WS_PARAM_FIELDS <= set(WS_PARAMS_VALID)
    assert RESPONSES_FIELDS <= set(RESPONSES_VALID), RESPONSES_FIELDS - set(RESPONSES_VALID)


def test_completions_fuzz(server) -> None:
    with HttpTarget(server, "/v1/completions", chat=False) as target:
        _fuzz_completions(target)
    assert_idle(server)


def test_chat_completions_fuzz(server) -> None:
    with HttpTarget(server, "/v1/chat/completions", chat=True) as target:
        _fuzz_chat(target)
    assert_idle(server)


def test_responses_fuzz(server) -> None:
    with HttpTarget(server, "/v1/responses", chat=True) as target:
        _fuzz_responses(target)
    assert_idle(server)


# -- WebSocket ---------------------------------------------------------------------------
_UNDECODABLE, _TOO_DEEP = object(), object()


def server_view(payload: str | bytes) -> Any:
    """What a frame decodes to (JSON for text frames, msgpack for binary ones)."""
    try:
        if isinstance(payload, bytes):
            return msgpack.unpackb(payload, raw=False)
        return json.loads(payload)
    except RecursionError:
        return _TOO_DEEP
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return _UNDECODABLE


def valid_id(rid: Any) -> bool:
    """What the protocol accepts as a request id (a string of 1 to 128 characters that
    UTF-8 can carry)."""
    return isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN and not has_surrogate(rid)


@dataclass
class Expect:
    """What the server may answer to one frame."""

    kind: Any  # the frame's `type` when it decodes to an object, else None
    ids: tuple  # the ids its delta/done/error events may carry
    whole_payload: bool  # an error may be about the frame as a whole
    keys: list  # the frame's keys (and its params' keys)
    oversize: bool  # over --max-message-bytes: a 1009 close is allowed

    @property
    def needs_terminal(self) -> bool:
        """generate, and anything that is not a known type, must end with done/error."""
        return self.kind == "generate" or not (
            isinstance(self.kind, str) and self.kind in (*WS_TYPES_WITHOUT_REPLY, "session.open")
        )

    @classmethod
    def of(cls, frame: Any, payload: str | bytes) -> Expect:
        size = len(payload) if isinstance(payload, bytes) else len(payload.encode("utf-8"))
        view = server_view(payload)
        deep = view is _TOO_DEEP or contains(frame, lambda v: isinstance(v, Deep))
        if not isinstance(view, dict):
            return cls(None, (None,), True, [], size > MAX_MESSAGE_BYTES)
        rid = view.get("id") if isinstance(view.get("id"), str) else None
        keys = list(view) + (list(view["params"]) if isinstance(view.get("params"), dict) else [])
        # A deep frame may be refused as a whole (id None) or field by field; an invalid
        # id (too long, empty, a lone surrogate) need not be echoed.
        ids = (rid, None) if deep or not valid_id(rid) else (rid,)
        return cls(view.get("type"), ids, deep, keys, size > MAX_MESSAGE_BYTES)


@dataclass
class WsOutcome:
    terminal: dict | None = None  # the frame's done / error event
    session: dict | None = None
    pongs: int = 0
    deltas: int = 0
    closed: int | None = None  # 1009: the frame was too big; reconnected
    events: list = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.closed is not None:
            return f"closed {self.closed}"
        if self.terminal is not None:
            t = self.terminal
            return "done" if t["type"] == "done" else f"error {t.get('code')}"
        if self.session is not None:
            return "session"
        return "pong" if self.pongs else "no reply"


class WsPeer:
    """One client connection to /v1/stream, kept across examples (reopened after a 1009
    close or a failed example); `binary`: ask for msgpack replies."""

    def __init__(self, server: RunningServer, binary: bool) -> None:
        self.url = f"{server.ws}/v1/stream" + ("?encoding=msgpack" if binary else "")
        self.binary = binary
        self.ws: ClientConnection | None = None

    def __repr__(self) -> str:
        return f"WsPeer({'msgpack' if self.binary else 'json'} replies)"

    def __enter__(self) -> WsPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.reset()

    def connection(self) -> ClientConnection:
        if self.ws is None:
            # Entered as a context (websockets >= 17.1 wants that); reset() leaves it. No
            # keepalive pings: their thread draws from `random` while Hypothesis generates.
            ws = connect(
                self.url, open_timeout=TIMEOUT_S, close_timeout=5, max_size=None, ping_interval=None
            )
            self.ws = ws.__enter__()
        return self.ws

    def reset(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            try:
                ws.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - already broken; a new one comes next
                pass

    def recv(self, deadline: float) -> dict:
        message = self.connection().recv(timeout=max(0.0, deadline - time.monotonic()))
        if self.binary:
            assert isinstance(message, bytes), f"a text frame on a msgpack connection: {message}"
            event = msgpack.unpackb(message, raw=False, strict_map_key=False)
        else:
            assert isinstance(message, str), f"a binary frame on a JSON connection: {message}"
            event = json.loads(message)
        assert isinstance(event, dict) and "type" in event, f"not an event: {event!r}"
        return event

    def exchange(self, frame: Any, encoding: str = "json") -> WsOutcome:
        """Sends `frame` (a Raw payload, else encoded as `encoding`), then a sync frame;
        reads that frame's replies and checks them. A 1009 close of an oversize frame is
        the only close allowed (the next exchange reconnects)."""
        if isinstance(frame, Raw):
            payload = frame.data
        else:
            payload = to_msgpack_bytes(frame) if encoding == "msgpack" else to_json_text(frame)
        expect = Expect.of(frame, payload)
        out = WsOutcome()
        failure = None
        try:
            self._exchange(payload, expect, out)
        except ConnectionClosed as exc:
            self.reset()
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            reason = exc.rcvd.reason if exc.rcvd is not None else "no close frame"
            if expect.oversize and code == 1009:
                return WsOutcome(closed=1009)
            failure = (
                f"the server closed the WebSocket ({code} {reason!r}) after a frame of "
                f"{len(payload)} bytes (limit {MAX_MESSAGE_BYTES}); got {short(out.events)}"
            )
        except TimeoutError:
            self.reset()
            failure = f"hang: no final reply within {TIMEOUT_S:g} s; got {short(out.events)}"
        except BaseException:
            self.reset()
            raise
        if failure is not None:
            # Raised outside the handler: Hypothesis tells failures apart by their
            # exception chain too, and the websockets internals vary from run to run.
            raise AssertionError(failure)
        check_ws_reply(expect, out)
        return out

    def _exchange(self, payload: str | bytes, expect: Expect, out: WsOutcome) -> None:
        ws = self.connection()
        sync = fresh_id("sync")
        ws.send(payload)
        ws.send(json.dumps({"type": "generate", "id": sync}))  # refused: marks the end
        synced = False
        deadline = time.monotonic() + TIMEOUT_S
        while not (synced and (out.terminal is not None or not expect.needs_terminal)):
            event = self.recv(deadline)
            out.events.append(event)
            kind, rid = event["type"], event.get("id")
            if kind == "error" and rid == sync:
                assert event.get("code") == "invalid_request", event
                synced = True
            elif kind == "pong":
                assert expect.kind == "ping" and out.pongs == 0, f"unexpected pong: {out.events}"
                out.pongs += 1
            elif kind == "session":
                assert expect.kind == "session.open" and out.session is None, out.events
                out.session = event
            elif kind in ("delta", "done", "error"):
                assert rid in expect.ids, f"event for id {rid!r}, not {expect.ids}: {event}"
                assert out.terminal is None, f"an event after the final one: {out.events}"
                if kind == "delta":
                    assert expect.kind == "generate", f"a delta for a non-generate: {event}"
                    out.deltas += 1
                else:
                    out.terminal = event
            else:
                raise AssertionError(f"unexpected event {event}")

    def probe(self) -> None:
        """The connection still serves a valid generate."""
        rid = fresh_id("probe")
        out = self.exchange(
            {"type": "generate", "id": rid, "prompt": "hi", "params": {"max_tokens": 1}}
        )
        assert out.terminal is not None and out.terminal["type"] == "done", out.events

    def close_session(self, session_id: Any, encoding: str = "json") -> None:
        out = self.exchange({"type": "session.close", "session_id": session_id}, encoding)
        assert out.terminal is None, f"closing session {session_id!r}: {out.terminal}"


def check_ws_reply(expect: Expect, out: WsOutcome) -> None:
    if expect.kind == "ping" and not expect.whole_payload:
        # a pong, or (a key that is not a string: no frame's field) an error naming it
        assert out.pongs + (out.terminal is not None) == 1, f"a ping got: {out.events}"
    if expect.kind == "session.open":
        replies = (out.session is not None) + (out.terminal is not None)
        assert replies == 1, f"session.open got no session or error: {out.events}"
    if out.session is not None:
        assert isinstance(out.session.get("messages"), list), out.session
    event = out.terminal
    if event is None:
        return
    if event["type"] == "done":
        assert expect.kind == "generate", event
        assert event.get("finish_reason") in FINISH_REASONS, f"finish reason: {event}"
        assert isinstance(event.get("usage"), dict), event
        return
    code = event.get("code")
    assert code in WS_ERROR_CODES, f"error {code!r} for client input: {event}"
    if code != "overloaded":
        assert names_a_field(event.get("message"), expect.keys, expect.whole_payload, WS_FIELDS), (
            f"the error names no field: {event}"
        )


def check_ws_frame(peer: WsPeer, name: str, frame: Any, encoding: str) -> WsOutcome:
    """One fuzzed frame; sessions it opened are closed, and after an error or a close the
    connection must still serve a valid generate."""
    start = time.monotonic()
    out = peer.exchange(with_fresh(frame, fresh_id), encoding)
    record(name, out.label, time.monotonic() - start)
    if out.session is not None:
        peer.close_session(out.session.get("session_id"), encoding)
    if out.closed is not None or (out.terminal is not None and out.terminal["type"] == "error"):
        peer.probe()
    return out


@fuzz_settings("test_ws_generate_json")
@given(frame=generate_frames())
def _fuzz_ws_json(peer: WsPeer, frame: Any) -> None:
    check_ws_frame(peer, "test_ws_generate_json", frame, "json")


def test_ws_generate_json(server) -> None:
    with WsPeer(server, binary=False) as peer:
        _fuzz_ws_json(peer)
        peer.probe()
    assert_idle(server)


@fuzz_settings("test_ws_generate_msgpack")
@given(frame=generate_frames(binary=True), replies=st.sampled_from(["msgpack", "json"]))
def _fuzz_ws_msgpack(peers: dict[str, WsPeer], frame: Any, replies: str) -> None:
    """Binary msgpack frames, on a `?encoding=msgpack` connection or a plain one."""
    check_ws_frame(peers[replies], "test_ws_generate_msgpack", frame, "msgpack")


def on_both_encodings(server, fuzz: Callable[[dict[str, WsPeer]], None]) -> None:
    """Runs `fuzz` with a msgpack-replies peer and a JSON-replies peer; both must still
    serve afterwards, and the server must end idle."""
    with WsPeer(server, binary=True) as mp, WsPeer(server, binary=False) as plain:
        fuzz({"msgpack": mp, "json": plain})
        mp.probe()
        plain.probe()
    assert_idle(server)


def test_ws_generate_msgpack(server) -> None:
    on_both_encodings(server, _fuzz_ws_msgpack)


def _encoded(strategy: Callable[..., st.SearchStrategy]) -> st.SearchStrategy:
    """(encoding, value): JSON text frames or msgpack binary frames (with bytes values)."""
    return st.sampled_from(["json", "msgpack"]).flatmap(
        lambda enc: st.tuples(st.just(enc), strategy(binary=enc == "msgpack"))
    )


class SessionTarget:
    def __init__(self, server: RunningServer, peers: dict[str, WsPeer]) -> None:
        self.server, self.peers = server, peers

    def __repr__(self) -> str:
        return "SessionTarget()"

    def num_sessions(self) -> float:
        return read_metrics(self.server)["pagedserve_num_sessions"]


UNCLOSED_SESSIONS: set[str] = set()  # repr() of session ids that session.close left open


@fuzz_settings("test_ws_sessions")
@given(encoded=_encoded(session_cases))
def _fuzz_sessions(target: SessionTarget, encoded) -> None:
    """session.open; with a session back: one turn, then session.close, after which the
    session count is back where it was."""
    encoding, case = encoded
    peer = target.peers[encoding]
    before = target.num_sessions()
    frame = with_fresh(case.open_frame, lambda: fresh_id("s"))
    start = time.monotonic()
    out = peer.exchange(frame, encoding)
    if out.terminal is not None:
        peer.probe()
    if out.session is None:
        record("test_ws_sessions", out.label, time.monotonic() - start)
        return
    sid = out.session.get("session_id")
    asked = frame.get("session_id")
    if isinstance(asked, str) and asked:
        assert sid == asked, f"asked for session {asked!r}, got {sid!r}"
    if case.message is not None:
        turn = {"type": "generate", "id": fresh_id(), "session_id": sid}
        turn |= {"message": case.message, "params": {"max_tokens": case.max_tokens}}
        reply = peer.exchange(turn, encoding)
        record("test_ws_sessions", f"session, turn {reply.label}", time.monotonic() - start)
        if reply.closed is not None:  # the turn's frame was too big (1009); reconnected
            pass
        elif reply.terminal["type"] == "done":
            assert reply.terminal.get("session_id") == sid, reply.terminal
        else:
            peer.probe()
    else:
        record("test_ws_sessions", "session, no turn", time.monotonic() - start)
    peer.close_session(sid, encoding)
    if target.num_sessions() > before or repr(sid) in UNCLOSED_SESSIONS:
        # Remembered: a replay of this example reopens the same leftover session, so the
        # count alone would not fail again.
        UNCLOSED_SESSIONS.add(repr(sid))
        raise AssertionError(f"session {sid!r} is still open after session.close")


def test_ws_sessions(server) -> None:
    with WsPeer(server, binary=True) as mp, WsPeer(server, binary=False) as plain:
        _fuzz_sessions(SessionTarget(server, {"msgpack": mp, "json": plain}))
        mp.probe()
        plain.probe()
    assert_idle(server)


@fuzz_settings("test_ws_control_frames")
@given(encoded=_encoded(control_frames))
def _fuzz_control(peers: dict[str, WsPeer], encoded) -> None:
    """ping, cancel, session.close, auth, unknown types, non-objects, raw payloads."""
    encoding, frame = encoded
    check_ws_frame(peers[encoding], "test_ws_control_frames", frame, encoding)


def test_ws_control_frames(server) -> None:
    on_both_encodings(server, _fuzz_control)
