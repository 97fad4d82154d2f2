"""Soak and fault script for `pagedserve serve` (not a test; not run in CI).

    python bench/soak.py --quick --out /tmp/soak_quick.json      # 300 requests, ~2 min
    python bench/soak.py --out bench/results/soak.json           # 5000 requests

It starts its own server (stories260K from ../shared by default) and checks, in order:

1. Main phase: `--requests` requests (a seeded random mix of the kinds in KINDS, at most
   `--concurrency` in flight) over WebSocket (JSON and msgpack, multiplexed on reused
   connections), SSE and plain HTTP: requests run to the end, cancelled, disconnected
   mid-stream, abandoned by a non-streaming client, oversize frames and bodies, malformed
   frames and bodies, multi-turn chat sessions. Each request has a client-side deadline
   (`--deadline`): no terminal answer in time (done / error event, HTTP response, SSE
   [DONE] or error chunk, a close code) is a HANG. Per kind: results (completed as
   expected), errors (the expected error answers), unexpected answers (with examples) and
   hangs. Server and worker RSS are sampled every `--sample-interval` seconds.
2. Leaks: once every request is answered and the client's sockets are closed, the
   /metrics gauges in LEAK_GAUGES (KV blocks used, running / waiting / queued / live
   requests, sessions, WebSocket connections) must all be back to 0 within `--settle` s.
3. Disconnect probes: a few long requests per way of leaving (WebSocket cancel and
   disconnect, SSE disconnect, a non-streaming HTTP client giving up); after the client
   left, the server must stop decoding them (running and live requests at 0 within
   PROBE_RELEASE_S, no request of them finishing with "length").
4. Fault phase (`--kill-worker`, on by default): long WebSocket, SSE and plain HTTP
   requests are streaming when the worker process gets SIGKILL. Every one must end with
   an error (WS `error` event or a documented close code, SSE error chunk or end of
   stream, HTTP 5xx) within FAULT_ANSWER_S; /health must then say 503, and new requests
   must be refused with an error at once.
5. Shutdown: SIGTERM; the server must exit within SHUTDOWN_S and leave no worker behind.

Pass criteria (exit status 0 only if all hold): no hangs, no unexpected answers, every
leak gauge back to 0 (so no leaked KV blocks), every disconnect probe released, and the
fault phase and shutdown as above. The JSON report (bench/report.py's write_report) and
a PNG (RSS of server and worker, requests in flight, the kill) go to `--out`; a short
summary goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import write_report  # noqa: E402

from web.launch import ServerProcess  # noqa: E402

SHARED = REPO.parent / "shared"
DEFAULT_MODEL = SHARED / "models" / "stories260K"
ALPACA = SHARED / "data" / "alpaca_data_first1727.json"
LEAK_GAUGES = (
    "pagedserve_kv_blocks_used",
    "pagedserve_num_requests_running",
    "pagedserve_num_requests_waiting",
    "pagedserve_num_requests_queued",
    "pagedserve_num_requests_live",
    "pagedserve_num_sessions",
    "pagedserve_num_ws_connections",
)
GEN_TOKENS = "pagedserve_generation_tokens_total"
BUSY_GAUGES = ("pagedserve_num_requests_running", "pagedserve_num_requests_live")
FINISHED_LENGTH = 'pagedserve_requests_total{finish_reason="length"}'
DOCUMENTED_CLOSES = {1001: "going away", 1008: "bad key", 1009: "too big", 4008: "slow reader"}
PROBE_RELEASE_S = 1.0  # a request whose client left must be gone from the server by then
PROBE_WAIT_S = 30.0  # how long a probe watches for that
FAULT_ANSWER_S = 10.0  # every request in flight at the kill must be answered by then
SHUTDOWN_S = 30.0  # SIGTERM to exit
EXAMPLES_PER_KIND = 5
STORY_OPENINGS = (
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park",
    "One day, a big bird",
    "Tom had a red ball. He",
    "The sun was shining and",
    "There was a girl named Sue who",
    "Mom said",
    "The cat sat on the mat and",
    "In a small town there lived a",
)
SYSTEMS = ("You tell short stories.", "Answer kindly.", "You are a friendly bear.")

RESULT, ERROR, UNEXPECTED, HANG = "result", "error", "unexpected", "hang"


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# -- outcomes and tallies -------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How one request ended: RESULT (completed as expected), ERROR (the expected error
    answer), UNEXPECTED or HANG; `note` says which way (counted per kind)."""

    status: str
    note: str = ""


def ok(note: str = "") -> Outcome:
    return Outcome(RESULT, note)


def expected_error(note: str = "") -> Outcome:
    return Outcome(ERROR, note)


def unexpected(note: str) -> Outcome:
    return Outcome(UNEXPECTED, note)


@dataclass
class Tally:
    """Counts of one request kind."""

    results: int = 0
    errors: int = 0
    unexpected: int = 0
    hangs: int = 0
    notes: collections.Counter = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)  # distinct unexpected answers, hangs
    _seen: set = field(default_factory=set, repr=False)

    def add(self, outcome: Outcome, label: str, variant: str = "") -> None:
        attr = {RESULT: "results", ERROR: "errors", UNEXPECTED: "unexpected", HANG: "hangs"}
        setattr(self, attr[outcome.status], getattr(self, attr[outcome.status]) + 1)
        if outcome.status in (RESULT, ERROR):
            self.notes[outcome.note or outcome.status] += 1
            return
        key = (variant, outcome.status, outcome.note[:60])
        if key not in self._seen and len(self.examples) < EXAMPLES_PER_KIND:
            self._seen.add(key)
            self.examples.append(f"{label}: {outcome.status}: {outcome.note}"[:300])

    @property
    def total(self) -> int:
        return self.results + self.errors + self.unexpected + self.hangs

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return out | {"total": self.total, "notes": dict(self.notes.most_common())}


# -- WebSocket client -----------------------------------------------------------------
@dataclass(frozen=True)
class Closed:
    """Put in a request's queue when its connection closed (code 1006: no close frame)."""

    code: int | None
    reason: str


ALL = object()  # subscription key of a connection whose events all go to one reader


class WsConn:
    """One client WebSocket; a reader task routes each event to the queue subscribed
    under its request id (a `session` event: its session id; id-less events: None), or,
    with `catch_all`, every event to the queue under ALL."""

    def __init__(self, ws, binary: bool, catch_all: bool) -> None:
        self.ws, self.binary, self.catch_all = ws, binary, catch_all
        self.queues: dict[Any, asyncio.Queue] = {}
        self.closed: Closed | None = None
        self.closed_by_us = False
        self.strays: list[dict] = []  # events nobody was waiting for
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, binary: bool, catch_all: bool = False) -> WsConn:
        url += "?encoding=msgpack" if binary else ""
        ws = await connect(url, compression=None, max_size=None, ping_interval=None)
        return cls(ws, binary, catch_all)

    def subscribe(self, key: Any) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[key] = queue
        if self.closed is not None:
            queue.put_nowait(self.closed)
        return queue

    def unsubscribe(self, key: Any) -> None:
        self.queues.pop(key, None)

    async def send(self, message: dict | str | bytes) -> None:
        if isinstance(message, dict):
            message = msgpack.packb(message) if self.binary else json.dumps(message)
        await self.ws.send(message)

    def cancel_later(self, rid: str) -> None:
        """Tells the server a request is abandoned (a client past its deadline)."""
        if self.closed is None:
            asyncio.get_running_loop().create_task(_quietly(self.send(cancel_message(rid))))

    async def close(self) -> None:
        self.closed_by_us = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.reader, 5)

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                event = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
                self._route(event)
        except ConnectionClosed:
            pass
        finally:
            code = self.ws.close_code if self.ws.close_code is not None else 1006
            self.closed = Closed(code, self.ws.close_reason or "")
            for queue in self.queues.values():
                queue.put_nowait(self.closed)

    def _route(self, event: dict) -> None:
        key = ALL if self.catch_all else event.get("id")
        if key is None and event.get("type") == "session":
            key = event.get("session_id")
        queue = self.queues.get(key)
        if queue is not None:
            queue.put_nowait(event)
        elif len(self.strays) < 100:
            self.strays.append(event)


async def _quietly(awaitable: Awaitable) -> None:
    with contextlib.suppress(Exception):
        await awaitable


def cancel_message(rid: str) -> dict:
    return {"type": "cancel", "id": rid}


class WsPool:
    """`size` long-lived connections, handed out round-robin (many requests share one);
    a connection the server closed is replaced, and its close code counted."""

    def __init__(self, url: str, binary: bool, size: int) -> None:
        self.url, self.binary = url, binary
        self.slots: list[WsConn | None] = [None] * size
        self.locks = [asyncio.Lock() for _ in range(size)]
        self.turn = itertools.count()
        self.server_closes: collections.Counter = collections.Counter()
        self.strays: list[dict] = []

    async def get(self) -> WsConn:
        i = next(self.turn) % len(self.slots)
        async with self.locks[i]:
            conn = self.slots[i]
            if conn is None or conn.closed is not None:
                if conn is not None:
                    self._retire(conn)
                conn = self.slots[i] = await WsConn.open(self.url, self.binary)
        return conn

    def _retire(self, conn: WsConn) -> None:
        if not conn.closed_by_us:
            self.server_closes[f"{conn.closed.code} {conn.closed.reason}".strip()] += 1
        self.strays += conn.strays

    async def close(self) -> None:
        for conn in filter(None, self.slots):
            await conn.close()
            self._retire(conn)
        self.slots = [None] * len(self.slots)


class CheckoutPool:
    """Connections lent to one request at a time (malformed frames): one that answered
    as it should goes back for the next request, any other is closed."""

    def __init__(self, url: str, binary: bool) -> None:
        self.url, self.binary = url, binary
        self.idle: list[WsConn] = []
        self.reused = 0

    async def get(self) -> WsConn:
        while self.idle:
            conn = self.idle.pop()
            if conn.closed is None:
                self.reused += 1
                return conn
        return await WsConn.open(self.url, self.binary, catch_all=True)

    async def put(self, conn: WsConn, healthy: bool) -> None:
        if healthy and conn.closed is None:
            self.idle.append(conn)
        else:
            await conn.close()

    async def close(self) -> None:
        for conn in self.idle:
            await conn.close()
        self.idle = []


async def ws_run(
    conn: WsConn, message: dict, on_delta: Callable[[dict], Awaitable[None]] | None = None
) -> tuple[dict | Closed, list[dict]]:
    """Sends one generate and reads its events to the end: (done / error / Closed,
    deltas). A request cut short by the deadline is cancelled on the server."""
    rid = message["id"]
    queue = conn.subscribe(rid)
    try:
        await conn.send(message)
        deltas: list[dict] = []
        while True:
            event = await queue.get()
            if isinstance(event, Closed) or event.get("type") in ("done", "error"):
                return event, deltas
            if event.get("type") == "delta":
                deltas.append(event)
                if on_delta is not None:
                    await on_delta(event)
    except asyncio.CancelledError:
        conn.cancel_later(rid)
        raise
    finally:
        conn.unsubscribe(rid)


async def next_answer(queue: asyncio.Queue) -> dict | Closed:
    """The next event that is not a delta (or the close)."""
    while True:
        event = await queue.get()
        if isinstance(event, Closed) or event.get("type") != "delta":
            return event


def describe(event: dict | Closed) -> str:
    if isinstance(event, Closed):
        return f"connection closed {event.code} {event.reason}".strip()
    if event.get("type") == "error":
        return f"error {event.get('code')}: {event.get('message')}"
    if event.get("type") == "done":
        return f"done, finish_reason {event.get('finish_reason')}"
    return f"{event.get('type')} event"


def check_done(event: dict | Closed, deltas: list[dict], max_tokens: int) -> Outcome:
    """A generate that must complete: `done` with stop/length, as many tokens in the
    deltas as its usage says, and no more than max_tokens."""
    if isinstance(event, Closed) or event.get("type") != "done":
        return unexpected(describe(event))
    if event.get("finish_reason") not in ("stop", "length"):
        return unexpected(describe(event))
    got = sum(len(d.get("token_ids", ())) for d in deltas)
    usage = (event.get("usage") or {}).get("completion_tokens")
    if usage != got or got > max_tokens:
        return unexpected(f"deltas carried {got} tokens, usage says {usage}, max {max_tokens}")
    return ok(event["finish_reason"])


# -- the run's shared state -----------------------------------------------------------
@dataclass
class Ctx:
    """What every request kind needs: URLs, clients, pools, prompts, settings."""

    args: argparse.Namespace
    base_url: str
    prompts: list[str]
    http: httpx.AsyncClient
    pools: dict[bool, WsPool]  # by binary
    bad_pools: dict[bool, CheckoutPool]  # by binary
    ids: itertools.count = field(default_factory=itertools.count)
    in_flight: int = 0
    answered: int = 0

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http", "ws", 1) + "/v1/stream"

    def new_id(self) -> str:
        return f"s{next(self.ids)}"


def ws_params(rng: random.Random, long: bool | int = False) -> dict:
    """Sampling fields of one request: short outputs (4..64 tokens), or `long` ones that
    outlast a cancel or disconnect (ignore_eos); some seeded, some nucleus-sampled."""
    if long is True:
        params = {"max_tokens": rng.randint(64, 256), "ignore_eos": True}
    elif long:  # a token count: the probes and the fault phase
        params = {"max_tokens": long, "ignore_eos": True}
    else:
        params = {"max_tokens": rng.randint(4, 64)}
    params["temperature"] = rng.choice((0.0, 0.7, 1.0))
    if rng.random() < 0.4:
        params["seed"] = rng.randrange(1 << 20)
    if rng.random() < 0.3:
        params["top_p"] = 0.9
    return params


def ws_generate_message(ctx: Ctx, rng: random.Random, long: bool | int = False) -> dict:
    message = {"type": "generate", "id": ctx.new_id(), "params": ws_params(rng, long)}
    if rng.random() < 0.25:
        message["messages"] = [{"role": "user", "content": rng.choice(ctx.prompts)}]
    else:
        message["prompt"] = rng.choice(ctx.prompts)
    return message


def http_body(
    ctx: Ctx, rng: random.Random, chat: bool, stream: bool, long: bool | int = False
) -> dict:
    body = ws_params(rng, long)
    if not long and rng.random() < 0.2:
        body["n"] = 2
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(ctx.prompts)}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    else:
        body["prompt"] = rng.choice(ctx.prompts)
    if stream:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    return body


def route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


# -- request kinds: WebSocket ---------------------------------------------------------
async def ws_generate(ctx: Ctx, rng: random.Random, binary: bool) -> Outcome:
    conn = await ctx.pools[binary].get()
    message = ws_generate_message(ctx, rng)
    event, deltas = await ws_run(conn, message)
    return check_done(event, deltas, message["params"]["max_tokens"])


async def ws_json(ctx: Ctx, rng: random.Random) -> Outcome:
    return await ws_generate(ctx, rng, binary=False)


async def ws_msgpack(ctx: Ctx, rng: random.Random) -> Outcome:
    return await ws_generate(ctx, rng, binary=True)


async def ws_cancel(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """Cancel after the first delta: the stream must end with `done`, "abort"."""
    conn = await ctx.pools[rng.random() < 0.5].get()
    message = ws_generate_message(ctx, rng, long)
    sent = False

    async def cancel(delta: dict) -> None:
        nonlocal sent
        if not sent:
            sent = True
            await conn.send(cancel_message(message["id"]))

    event, _ = await ws_run(conn, message, cancel)
    if isinstance(event, dict) and event.get("type") == "done":
        if event.get("finish_reason") == "abort":
            return ok("aborted")
        if event.get("finish_reason") in ("stop", "length"):
            return ok("finished before the cancel")
    return unexpected(describe(event))


async def ws_disconnect(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """Close the socket after the first delta (a connection of its own)."""
    conn = await WsConn.open(ctx.ws_url, binary=rng.random() < 0.3)
    try:
        message = ws_generate_message(ctx, rng, long)
        queue = conn.subscribe(message["id"])
        await conn.send(message)
        first = await queue.get()
        if isinstance(first, dict) and first.get("type") == "delta":
            await conn.close()
            return ok(f"closed after the first delta ({conn.closed.code if conn.closed else '?'})")
        if isinstance(first, dict) and first.get("type") == "done":
            return ok("finished before the disconnect")
        return unexpected(describe(first))
    finally:
        await conn.close()


async def ws_session(ctx: Ctx, rng: random.Random) -> Outcome:
    """session.open, 2..4 turns, session.close, then a turn on the closed session (it
    must be refused with not_found)."""
    conn = await ctx.pools[False].get()
    sid = f"soak-{ctx.new_id()}-{rng.randrange(1 << 30)}"
    queue = conn.subscribe(sid)
    try:
        await conn.send({"type": "session.open", "session_id": sid, "system": rng.choice(SYSTEMS)})
        opened = await next_answer(queue)
        if isinstance(opened, Closed) or opened.get("type") != "session":
            return unexpected(f"session.open: {describe(opened)}")
    finally:
        conn.unsubscribe(sid)
    turns, closed = rng.randint(2, 4), False
    try:
        for turn in range(turns):
            outcome = await session_turn(ctx, rng, conn, sid)
            if outcome.status != RESULT:
                return Outcome(outcome.status, f"turn {turn + 1}: {outcome.note}")
        await conn.send({"type": "session.close", "session_id": sid})
        closed = True
    finally:
        if not closed and conn.closed is None:  # a client closes what it opened
            await _quietly(conn.send({"type": "session.close", "session_id": sid}))
    event, _ = await ws_run(conn, turn_message(ctx, rng, sid))
    if isinstance(event, dict) and event.get("type") == "error":
        if event.get("code") == "not_found":
            return ok(f"{turns} turns, closed")
    return unexpected(f"a turn after session.close got {describe(event)}")


def turn_message(ctx: Ctx, rng: random.Random, sid: str) -> dict:
    return {
        "type": "generate",
        "id": ctx.new_id(),
        "session_id": sid,
        "message": rng.choice(ctx.prompts),
        "params": ws_params(rng),
    }


async def session_turn(ctx: Ctx, rng: random.Random, conn: WsConn, sid: str) -> Outcome:
    message = turn_message(ctx, rng, sid)
    event, deltas = await ws_run(conn, message)
    outcome = check_done(event, deltas, message["params"]["max_tokens"])
    if outcome.status == RESULT and event.get("session_id") != sid:
        return unexpected(f"done carries session_id {event.get('session_id')!r}")
    return outcome


async def ws_oversize(ctx: Ctx, rng: random.Random) -> Outcome:
    """A frame over --max-message-bytes: the server must close with 1009."""
    binary = rng.random() < 0.5
    conn = await WsConn.open(ctx.ws_url, binary, catch_all=True)
    try:
        queue = conn.subscribe(ALL)
        pad = "a" * (ctx.args.max_message_bytes + rng.randint(1, 4096))
        await conn.send({"type": "generate", "id": "big", "prompt": pad})
        answer = await next_answer(queue)
        if isinstance(answer, Closed) and answer.code == 1009:
            return expected_error("closed 1009")
        return unexpected(describe(answer))
    finally:
        await conn.close()


# -- malformed WebSocket frames -------------------------------------------------------
@dataclass(frozen=True)
class BadFrame:
    """A malformed WebSocket message and the error it must get: `code`, and a message
    naming `field` (when set). `frame` is text, bytes (msgpack), or a function of rng."""

    name: str
    frame: str | bytes | Callable[[random.Random], bytes]
    field: str | None = None
    code: str = "invalid_request"


def _gen(params: dict | None = None, **fields: Any) -> str:
    message = {"type": "generate", "id": "bad", "prompt": "Hi"} | fields
    if params is not None:
        message["params"] = params
    return json.dumps({k: v for k, v in message.items() if v is not None})


def _garbage(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


BAD_FRAMES = (
    BadFrame("invalid_json", '{"type": "generate", "id": '),
    BadFrame("empty_text", ""),
    BadFrame("not_an_object", "[1, 2, 3]"),
    BadFrame("deeply_nested_json", "[" * 20000 + "]" * 20000),
    BadFrame("msgpack_garbage", _garbage),
    BadFrame("msgpack_not_an_object", msgpack.packb([1, 2, 3])),
    BadFrame("unknown_type", json.dumps({"type": "fly"}), "type"),
    BadFrame("missing_type", json.dumps({"id": "x"}), "type"),
    BadFrame("unknown_field", _gen(colour="red"), "colour"),
    BadFrame("unknown_param", _gen({"temprature": 0.5}), "temprature"),
    BadFrame("n_on_websocket", _gen({"n": 2}), "n"),
    BadFrame("params_not_object", _gen([1]), "params"),
    BadFrame("temperature_negative", _gen({"temperature": -1}), "temperature"),
    BadFrame(
        "temperature_nan",
        _gen().replace('"Hi"', '"Hi", "params": {"temperature": NaN}'),
        "temperature",
    ),
    BadFrame("top_p_above_1", _gen({"top_p": 1.5}), "top_p"),
    BadFrame("top_k_negative", _gen({"top_k": -5}), "top_k"),
    BadFrame("max_tokens_zero", _gen({"max_tokens": 0}), "max_tokens"),
    BadFrame("max_tokens_string", _gen({"max_tokens": "ten"}), "max_tokens"),
    BadFrame("max_tokens_2_pow_70", _gen({"max_tokens": 2**70}), "max_tokens"),
    BadFrame("min_tokens_above_max", _gen({"min_tokens": 50, "max_tokens": 10}), "min_tokens"),
    BadFrame("seed_float", _gen({"seed": 1.5}), "seed"),
    BadFrame("seed_2_pow_80", _gen({"seed": 2**80}), "seed"),
    BadFrame("logprobs_1000", _gen({"logprobs": 1000}), "logprobs"),
    BadFrame("stop_int", _gen({"stop": 5}), "stop"),
    BadFrame("stop_token_ids_strings", _gen({"stop_token_ids": ["a"]}), "stop_token_ids"),
    BadFrame("logit_bias_bad_key", _gen({"logit_bias": {"x": 1}}), "logit_bias"),
    BadFrame("logit_bias_out_of_vocab", _gen({"logit_bias": {"99999": 1}}), "logit_bias"),
    BadFrame("prompt_not_string", _gen(prompt=5), "prompt"),
    BadFrame("two_prompts", _gen(messages=[{"role": "user", "content": "x"}])),
    BadFrame("no_prompt", json.dumps({"type": "generate", "id": "bad"})),
    BadFrame("empty_prompt_token_ids", _gen(prompt=None, prompt_token_ids=[]), "prompt"),
    BadFrame("token_id_out_of_vocab", _gen(prompt=None, prompt_token_ids=[1, 99999]), "prompt"),
    BadFrame("prompt_too_long", _gen(prompt=None, prompt_token_ids=[5] * 600), "prompt"),
    BadFrame("empty_messages", _gen(prompt=None, messages=[]), "messages"),
    BadFrame("message_no_content", _gen(prompt=None, messages=[{"role": "user"}]), "messages"),
    BadFrame(
        "message_bad_role", _gen(prompt=None, messages=[{"role": "x", "content": "y"}]), "messages"
    ),
    BadFrame("id_too_long", _gen(id="x" * 200), "id"),
    BadFrame("id_not_string", _gen(id=5), "id"),
    BadFrame("unknown_session", _gen(prompt=None, session_id="no", message="hi"), code="not_found"),
)


def names_field(message: str | None, param: str | None, name: str | None) -> bool:
    return name is None or param == name or name in (message or "")


def judge_ws_error(answer: dict | Closed, bad: BadFrame) -> Outcome:
    if isinstance(answer, Closed) or answer.get("type") != "error":
        return unexpected(f"{bad.name}: {describe(answer)}")
    if answer.get("code") != bad.code:
        return unexpected(f"{bad.name}: code {answer.get('code')}, expected {bad.code}")
    if not names_field(answer.get("message"), None, bad.field):
        return unexpected(f"{bad.name}: error does not name {bad.field}: {answer.get('message')}")
    return expected_error(bad.name)


async def ws_malformed(ctx: Ctx, rng: random.Random, variant: int = 0) -> Outcome:
    """Malformed frame BAD_FRAMES[variant]: an `error` event naming the field, then the
    connection must still answer a ping (connections are reused across these requests)."""
    bad = BAD_FRAMES[variant]
    frame = bad.frame(rng) if callable(bad.frame) else bad.frame
    pool = ctx.bad_pools[isinstance(frame, bytes)]
    conn = await pool.get()
    queue = conn.subscribe(ALL)
    healthy = False
    try:
        await conn.send(frame)
        outcome = judge_ws_error(await next_answer(queue), bad)
        if outcome.status == ERROR:
            await conn.send({"type": "ping"})
            pong = await next_answer(queue)
            healthy = isinstance(pong, dict) and pong.get("type") == "pong"
            if not healthy:
                outcome = unexpected(f"{bad.name}: after the error, a ping got {describe(pong)}")
        return outcome
    finally:
        conn.unsubscribe(ALL)
        await pool.put(conn, healthy)


# -- request kinds: HTTP --------------------------------------------------------------
async def read_sse(response: httpx.Response, leave_after_first: bool = False) -> dict:
    """Reads an SSE stream: {"done": saw [DONE], "error": the error chunk or None,
    "finished": choice indices with a finish_reason, "chunks": n, "left": bool}."""
    state: dict[str, Any] = {"done": False, "error": None, "finished": set(), "chunks": 0}
    state["left"] = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            state["done"] = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            state["error"] = chunk["error"]
            continue
        state["chunks"] += 1
        for choice in chunk.get("choices", ()):
            if choice.get("finish_reason") is not None:
                state["finished"].add(choice.get("index"))
        if leave_after_first and not state["finished"]:
            state["left"] = True
            break
    return state


async def sse_stream(ctx: Ctx, rng: random.Random) -> Outcome:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True)
    async with ctx.http.stream("POST", ctx.base_url + route(chat), json=body) as response:
        if response.status_code != 200:
            return unexpected(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        state = await read_sse(response)
    n = body.get("n", 1)
    if state["error"] is not None:
        return unexpected(f"error chunk: {state['error']}")
    if not state["done"]:
        return unexpected("stream ended without [DONE]")
    if state["finished"] != set(range(n)):
        return unexpected(f"choices finished: {sorted(state['finished'])} of n={n}")
    return ok("chat" if chat else "completions")


async def sse_disconnect(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True, long=long)
    async with ctx.http.stream("POST", ctx.base_url + route(chat), json=body) as response:
        if response.status_code != 200:
            return unexpected(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        state = await read_sse(response, leave_after_first=True)
    if state["left"]:
        return ok("left after the first chunk")
    if state["error"] is not None:
        return unexpected(f"error chunk: {state['error']}")
    return ok("finished before the disconnect")


def check_completion(response: httpx.Response, n: int) -> Outcome:
    if response.status_code != 200:
        return unexpected(f"HTTP {response.status_code}: {response.text[:200]}")
    choices = response.json().get("choices", [])
    reasons = [c.get("finish_reason") for c in choices]
    if len(choices) != n or any(r not in ("stop", "length") for r in reasons):
        return unexpected(f"{len(choices)} choices (n={n}), finish reasons {reasons}")
    return ok("n=2" if n == 2 else "n=1")


async def http_plain(ctx: Ctx, rng: random.Random) -> Outcome:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False)
    response = await ctx.http.post(ctx.base_url + route(chat), json=body)
    return check_completion(response, body.get("n", 1))


async def http_abandon(ctx: Ctx, rng: random.Random, long: bool | int = True) -> Outcome:
    """A non-streaming client that gives up mid-request (its connection closes)."""
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False, long=long)
    give_up = rng.uniform(0.05, 0.5) if long is True else 0.3
    try:
        async with asyncio.timeout(give_up):
            response = await ctx.http.post(ctx.base_url + route(chat), json=body)
    except TimeoutError:
        return ok("gave up")
    outcome = check_completion(response, body.get("n", 1))
    return ok("answered before the give-up") if outcome.status == RESULT else outcome


async def http_oversize(ctx: Ctx, rng: random.Random) -> Outcome:
    """A body over --max-message-bytes: HTTP 400."""
    pad = "a" * (ctx.args.max_message_bytes + rng.randint(1, 4096))
    async with httpx.AsyncClient(timeout=None) as client:  # not the shared keep-alive pool
        response = await client.post(ctx.base_url + "/v1/completions", json={"prompt": pad})
    if response.status_code == 400:
        return expected_error("HTTP 400")
    return unexpected(f"HTTP {response.status_code}: {response.text[:200]}")


@dataclass(frozen=True)
class BadBody:
    """A malformed HTTP body and the answer it must get: `status`, naming `field`."""

    name: str
    body: bytes | dict
    field: str | None = None
    status: int = 400
    chat: bool = False


_NAN_BODY = b'{"prompt": "Hi", "temperature": NaN}'
BAD_BODIES = (
    BadBody("invalid_json", b'{"prompt": "Hi", '),
    BadBody("empty_body", b""),
    BadBody("not_an_object", b"[1, 2]"),
    BadBody("not_utf8", b'\xff\xfe{"prompt": "Hi"}'),
    BadBody("deeply_nested_json", b"[" * 20000 + b"]" * 20000),
    BadBody("unknown_field", {"prompt": "Hi", "colour": "red"}, "colour"),
    BadBody("temperature_negative", {"prompt": "Hi", "temperature": -1}, "temperature"),
    BadBody("temperature_nan", _NAN_BODY, "temperature"),
    BadBody("top_p_2", {"prompt": "Hi", "top_p": 2}, "top_p"),
    BadBody("max_tokens_negative", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    BadBody("max_tokens_2_pow_70", {"prompt": "Hi", "max_tokens": 2**70}, "max_tokens"),
    BadBody("seed_2_pow_80", {"prompt": "Hi", "seed": 2**80}, "seed"),
    BadBody("n_0", {"prompt": "Hi", "n": 0}, "n"),
    BadBody("n_17", {"prompt": "Hi", "n": 17}, "n"),
    BadBody("best_of_below_n", {"prompt": "Hi", "n": 2, "best_of": 1}, "best_of"),
    BadBody("stream_string", {"prompt": "Hi", "stream": "yes"}, "stream"),
    BadBody("stream_options_string", {"prompt": "Hi", "stream_options": "x"}, "stream_options"),
    BadBody("presence_penalty_5", {"prompt": "Hi", "presence_penalty": 5}, "presence_penalty"),
    BadBody("logit_bias_bad_key", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
    BadBody("stop_token_ids_strings", {"prompt": "Hi", "stop_token_ids": ["a"]}, "stop_token_ids"),
    BadBody("echo", {"prompt": "Hi", "echo": True}, "echo"),
    BadBody("prompt_int", {"prompt": 5}, "prompt"),
    BadBody("prompt_empty_list", {"prompt": []}, "prompt"),
    BadBody("token_id_out_of_vocab", {"prompt": [1, 99999]}, "prompt"),
    BadBody("prompt_too_long", {"prompt": [5] * 600}, "prompt"),
    BadBody("unknown_model", {"prompt": "Hi", "model": "nope"}, "model", 404),
    BadBody("empty_messages", {"messages": []}, "messages", chat=True),
    BadBody("content_int", {"messages": [{"role": "user", "content": 5}]}, "messages", chat=True),
    BadBody(
        "top_logprobs_alone",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
        chat=True,
    ),
)


async def http_malformed(ctx: Ctx, rng: random.Random, variant: int = 0) -> Outcome:
    """Malformed body BAD_BODIES[variant]: HTTP 400 (404 for an unknown model) naming
    the field."""
    bad = BAD_BODIES[variant]
    raw = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=None) as client:  # not the shared keep-alive pool
        response = await client.post(ctx.base_url + route(bad.chat), content=raw, headers=headers)
    if response.status_code != bad.status:
        return unexpected(f"{bad.name}: HTTP {response.status_code}: {response.text[:160]}")
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return unexpected(f"{bad.name}: HTTP {response.status_code}, not an OpenAI error body")
    if not names_field(error.get("message"), error.get("param"), bad.field):
        return unexpected(f"{bad.name}: error does not name {bad.field}: {error.get('message')}")
    return expected_error(bad.name)


# -- the mix --------------------------------------------------------------------------
KINDS: dict[str, tuple[float, Callable[[Ctx, random.Random], Awaitable[Outcome]]]] = {
    "ws_json": (14, ws_json),
    "ws_msgpack": (8, ws_msgpack),
    "ws_cancel": (6, ws_cancel),
    "ws_disconnect": (5, ws_disconnect),
    "ws_session": (6, ws_session),
    "ws_oversize": (2, ws_oversize),
    "ws_malformed": (6, ws_malformed),
    "sse_stream": (10, sse_stream),
    "sse_disconnect": (5, sse_disconnect),
    "http_plain": (10, http_plain),
    "http_abandon": (5, http_abandon),
    "http_oversize": (2, http_oversize),
    "http_malformed": (6, http_malformed),
}
MALFORMED = {"ws_malformed": BAD_FRAMES, "http_malformed": BAD_BODIES}  # kind -> variants
QUICK_MALFORMED_WEIGHTS = {"ws_malformed": 14, "http_malformed": 10}  # ~each variant once


def parse_weights(text: str | None) -> dict[str, float]:
    weights = {kind: w for kind, (w, _) in KINDS.items()}
    for item in filter(None, (text or "").split(",")):
        kind, _, value = item.partition("=")
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        weights[kind] = float(value)
    return weights


@dataclass(frozen=True)
class Planned:
    """Request `index` of the run: its kind, and for a malformed kind the variant."""

    index: int
    kind: str
    variant: int | None = None

    @property
    def label(self) -> str:
        if self.variant is None:
            return f"#{self.index}"
        return f"#{self.index} {MALFORMED[self.kind][self.variant].name}"


def plan(n: int, weights: dict[str, float], seed: int) -> list[Planned]:
    """`n` kinds drawn by weight; the malformed kinds go through their variants in turn
    (in a seeded order), so every variant is sent once before any is sent twice."""
    rng = random.Random(seed)
    kinds = [k for k, w in weights.items() if w > 0]
    orders = {k: rng.sample(range(len(v)), len(v)) for k, v in MALFORMED.items()}
    seen: collections.Counter = collections.Counter()
    out = []
    for i, kind in enumerate(rng.choices(kinds, [weights[k] for k in kinds], k=n)):
        variant = None
        if kind in MALFORMED:
            variant = orders[kind][seen[kind] % len(orders[kind])]
            seen[kind] += 1
        out.append(Planned(i, kind, variant))
    return out


async def run_one(ctx: Ctx, kind: str, rng: random.Random, deadline: float, **kw: Any) -> Outcome:
    """One request under the deadline: no answer in time is a HANG; a client-side
    exception (refused connection, a reset) is UNEXPECTED."""
    ctx.in_flight += 1
    try:
        async with asyncio.timeout(deadline) as cm:
            return await KINDS[kind][1](ctx, rng, **kw)
    except TimeoutError:
        if cm.expired():
            return Outcome(HANG, f"no answer in {deadline:g} s")
        return unexpected("client TimeoutError")
    except Exception as exc:  # noqa: BLE001 - recorded per request
        return unexpected(f"client {type(exc).__name__}: {exc}")
    finally:
        ctx.in_flight -= 1
        ctx.answered += 1


async def run_requests(
    ctx: Ctx, requests: list[Planned], tallies: dict[str, Tally], variants: dict
) -> None:
    """Runs the planned requests with at most --concurrency in flight."""
    items = iter(requests)

    async def worker() -> None:
        for r in items:
            rng = random.Random(f"{ctx.args.seed}:{r.index}")
            kw = {} if r.variant is None else {"variant": r.variant}
            outcome = await run_one(ctx, r.kind, rng, ctx.args.deadline, **kw)
            name = "" if r.variant is None else MALFORMED[r.kind][r.variant].name
            tallies[r.kind].add(outcome, r.label, name)
            if name:
                variants[r.kind][name][outcome.status] += 1

    await asyncio.gather(*(worker() for _ in range(ctx.args.concurrency)))


# -- server-side observations ---------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


async def scrape(ctx: Ctx) -> dict[str, float] | None:
    try:
        response = await ctx.http.get(ctx.base_url + "/metrics", timeout=3.0)
        return parse_metrics(response.text)
    except httpx.HTTPError:
        return None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid`."""
    out = {}
    for child in children(pid):
        with contextlib.suppress(OSError):
            out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        out |= descendants(child)
    return out


def worker_pid(server_pid: int) -> int | None:
    found = [p for p, cmd in descendants(server_pid).items() if "actors.worker_actor" in cmd]
    return found[0] if found else None


def still_alive(procs: dict[int, str]) -> list[str]:
    """The processes of `procs` still running (same pid and command line; zombies are
    reported as such)."""
    alive = []
    for pid, cmd in procs.items():
        try:
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if now == cmd:
            alive.append(f"{pid} ({cmd[:60]})" + (" zombie" if state == "Z" else ""))
        elif state == "Z" and not now:
            alive.append(f"{pid} zombie")
    return alive


class Sampler:
    """Every `interval` s: RSS of server and worker, requests in flight (client) and
    running (server); a progress line every 10 s."""

    def __init__(self, ctx: Ctx, server_pid: int, total: int, interval: float) -> None:
        self.ctx, self.server_pid, self.total, self.interval = ctx, server_pid, total, interval
        self.worker_pid = worker_pid(server_pid)
        self.t0 = time.monotonic()
        self.phase = "warm-up"
        self.samples: list[dict] = []
        self.marks: dict[str, float] = {}
        self.hangs_and_unexpected = lambda: (0, 0)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    async def run(self) -> None:
        last_log = 0.0
        while True:
            self.samples.append(await self.sample())
            if self.phase in ("warm-up", "main") and time.monotonic() - last_log >= 10:
                last_log = time.monotonic()
                hangs, unexp = self.hangs_and_unexpected()
                log(
                    f"{self.ctx.answered}/{self.total} answered, {self.ctx.in_flight} in "
                    f"flight, hangs {hangs}, unexpected {unexp}, server RSS "
                    f"{self.samples[-1]['server_rss_mib']} MiB, worker "
                    f"{self.samples[-1]['worker_rss_mib']} MiB"
                )
            await asyncio.sleep(self.interval)

    async def sample(self) -> dict:
        metrics = await scrape(self.ctx) or {}
        return {
            "t": self.now(),
            "phase": self.phase,
            "in_flight": self.ctx.in_flight,
            "answered": self.ctx.answered,
            "server_rss_mib": rss_mib(self.server_pid),
            "worker_rss_mib": rss_mib(self.worker_pid),
            "running": metrics.get("pagedserve_num_requests_running"),
            "waiting": metrics.get("pagedserve_num_requests_waiting"),
            "kv_blocks_used": metrics.get("pagedserve_kv_blocks_used"),
        }

    def rss(self) -> dict:
        return {"server_mib": rss_mib(self.server_pid), "worker_mib": rss_mib(self.worker_pid)}


async def check_leaks(ctx: Ctx, settle: float) -> dict:
    """Polls /metrics until every LEAK_GAUGES gauge is 0 or `settle` s pass."""
    start = time.monotonic()
    first = last = None
    while True:
        metrics = await scrape(ctx) or {}
        last = {g: metrics.get(g) for g in LEAK_GAUGES}
        first = first or last
        if all(v == 0 for v in last.values()):
            return {"first_seen": first, "final": last, "zero_after_s": since(start), "leaked": {}}
        if time.monotonic() - start > settle:
            leaked = {g: v for g, v in last.items() if v != 0}
            return {"first_seen": first, "final": last, "zero_after_s": None, "leaked": leaked}
        await asyncio.sleep(0.25)


def since(t: float) -> float:
    return round(time.monotonic() - t, 3)


# -- disconnect probes ----------------------------------------------------------------
PROBES = ("ws_cancel", "ws_disconnect", "sse_disconnect", "http_abandon")


async def probe(ctx: Ctx, kind: str, k: int) -> dict:
    """`k` long requests of `kind` (the client leaves early): the server must drop them
    (running and live requests back to where they were before the probe) within
    PROBE_RELEASE_S, and none may run on to "length"
    (pagedserve_requests_total{finish_reason="length"} unchanged)."""
    before = await scrape(ctx) or {}
    base = [before.get(g, 0) for g in BUSY_GAUGES]
    rngs = [random.Random(f"{ctx.args.seed}:probe:{kind}:{i}") for i in range(k)]
    outcomes = await asyncio.gather(
        *(run_one(ctx, kind, rng, ctx.args.deadline, long=ctx.args.long_tokens) for rng in rngs)
    )
    left, at_left = time.monotonic(), await scrape(ctx) or {}
    released, now = None, at_left
    while time.monotonic() - left < PROBE_WAIT_S:
        now = await scrape(ctx) or {}
        if all(now.get(g, math.inf) <= b for g, b in zip(BUSY_GAUGES, base, strict=True)):
            released = since(left)
            break
        await asyncio.sleep(0.05)
    ran_to_length = now.get(FINISHED_LENGTH, 0) - before.get(FINISHED_LENGTH, 0)
    result = {
        "kind": kind,
        "requests": k,
        "max_tokens": ctx.args.long_tokens,
        "client": collections.Counter(f"{o.status}: {o.note}" for o in outcomes),
        "baseline": dict(zip(BUSY_GAUGES, base, strict=True)),
        "released_after_s": released,
        "tokens_generated_after_leaving": now.get(GEN_TOKENS, 0) - at_left.get(GEN_TOKENS, 0),
        "ran_to_length": ran_to_length,
    }
    result["passed"] = (
        released is not None and released <= PROBE_RELEASE_S and ran_to_length == 0
    ) and all(o.status == RESULT for o in outcomes)
    return result


# -- fault phase ----------------------------------------------------------------------
@dataclass
class FaultAnswer:
    protocol: str
    status: str  # "error" (as it should), "finished" (ended before the kill), "unexpected"
    detail: str
    at: float | None = None  # time.monotonic() of the answer


async def fault_ws(ctx: Ctx, conn: WsConn, rng: random.Random, started: asyncio.Event):
    message = ws_generate_message(ctx, rng, ctx.args.long_tokens)

    async def first(delta: dict) -> None:
        started.set()

    event, _ = await ws_run(conn, message, first)
    at = time.monotonic()
    if isinstance(event, Closed):
        status = "error" if event.code in DOCUMENTED_CLOSES else "unexpected"
        return FaultAnswer("ws", status, describe(event), at)
    if event.get("type") == "error":
        return FaultAnswer("ws", "error", describe(event), at)
    if event.get("finish_reason") in ("stop", "length"):
        return FaultAnswer("ws", "finished", describe(event), at)
    return FaultAnswer("ws", "unexpected", describe(event), at)


async def fault_sse(ctx: Ctx, rng: random.Random, started: asyncio.Event) -> FaultAnswer:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=True, long=ctx.args.long_tokens)
    try:
        async with ctx.http.stream("POST", ctx.base_url + route(chat), json=body) as response:
            if response.status_code >= 500:
                return FaultAnswer("sse", "error", f"HTTP {response.status_code}", time.monotonic())
            if response.status_code != 200:
                detail = f"HTTP {response.status_code}"
                return FaultAnswer("sse", "unexpected", detail, time.monotonic())
            started.set()
            state = await read_sse(response)
    except httpx.HTTPError as exc:  # the stream was cut: an end of stream
        return FaultAnswer("sse", "error", f"stream cut: {type(exc).__name__}", time.monotonic())
    at = time.monotonic()
    if state["error"] is not None:
        return FaultAnswer("sse", "error", f"error chunk: {state['error'].get('message')}", at)
    if state["done"] and state["finished"]:
        return FaultAnswer("sse", "finished", "[DONE] after finish_reason", at)
    if not state["done"]:
        return FaultAnswer("sse", "error", "stream ended without [DONE]", at)
    return FaultAnswer("sse", "unexpected", "[DONE] with neither error nor finish_reason", at)


async def fault_http(ctx: Ctx, rng: random.Random) -> FaultAnswer:
    chat = rng.random() < 0.5
    body = http_body(ctx, rng, chat, stream=False, long=ctx.args.long_tokens)
    try:
        response = await ctx.http.post(ctx.base_url + route(chat), json=body)
    except httpx.HTTPError as exc:
        return FaultAnswer("http", "unexpected", f"{type(exc).__name__}: {exc}", time.monotonic())
    at = time.monotonic()
    if response.status_code >= 500:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return FaultAnswer("http", "unexpected", f"HTTP {response.status_code}, no JSON", at)
        return FaultAnswer("http", "error", f"HTTP {response.status_code}: {message[:80]}", at)
    if response.status_code == 200:
        return FaultAnswer("http", "finished", "HTTP 200", at)
    return FaultAnswer("http", "unexpected", f"HTTP {response.status_code}", at)


async def fault_batch(ctx: Ctx, sampler: Sampler, server_pid: int) -> dict:
    """Long requests in flight, then SIGKILL to the worker: each must end in an error
    within FAULT_ANSWER_S."""
    a = ctx.args
    conns = [await WsConn.open(ctx.ws_url, binary=i % 2 == 1) for i in range(2)]
    rng = random.Random(f"{a.seed}:fault")
    started = [asyncio.Event() for _ in range(a.fault_ws + a.fault_sse)]
    tasks = [
        asyncio.create_task(fault_ws(ctx, conns[i % 2], random.Random(rng.random()), started[i]))
        for i in range(a.fault_ws)
    ]
    tasks += [
        asyncio.create_task(fault_sse(ctx, random.Random(rng.random()), started[a.fault_ws + i]))
        for i in range(a.fault_sse)
    ]
    tasks += [
        asyncio.create_task(fault_http(ctx, random.Random(rng.random())))
        for _ in range(a.fault_http)
    ]
    ctx.in_flight += len(tasks)
    for task in tasks:
        task.add_done_callback(lambda _: setattr(ctx, "in_flight", ctx.in_flight - 1))
    streaming = await wait_streaming(started)
    metrics = await scrape(ctx) or {}
    pid = worker_pid(server_pid)
    if pid is None:
        for task in tasks:
            task.cancel()
        return {"error": "no worker process found"}
    sampler.samples.append(await sampler.sample())  # the batch lasts less than a sample
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    sampler.mark("kill")
    log(f"killed worker {pid} with {streaming} requests streaming")
    done, pending = await asyncio.wait(tasks, timeout=FAULT_ANSWER_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    answers = [t.result() if not t.exception() else _crashed(t) for t in done]
    out = summarize_fault(answers, len(pending), killed)
    out |= {
        "worker_pid": pid,
        "streaming_at_kill": streaming,
        "running_at_kill": metrics.get("pagedserve_num_requests_running"),
        "waiting_at_kill": metrics.get("pagedserve_num_requests_waiting"),
    }
    for conn in conns:
        await conn.close()
    return out


async def wait_streaming(started: list[asyncio.Event]) -> int:
    """Waits for the first stream's first delta (10 s at most), then for the others (1 s
    at most: with more requests than max_num_seqs some are still waiting); returns how
    many are streaming."""
    waiters = [asyncio.ensure_future(e.wait()) for e in started]
    try:
        await asyncio.wait(waiters, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait(waiters, timeout=1)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return sum(e.is_set() for e in started)


def _crashed(task: asyncio.Task) -> FaultAnswer:
    exc = task.exception()
    return FaultAnswer("?", "unexpected", f"client {type(exc).__name__}: {exc}", time.monotonic())


def summarize_fault(answers: list[FaultAnswer], hangs: int, killed: float) -> dict:
    by = collections.Counter(f"{a.protocol} {a.status}: {a.detail[:70]}" for a in answers)
    times = [a.at - killed for a in answers if a.at is not None and a.status != "finished"]
    return {
        "in_flight": len(answers) + hangs,
        "errors": sum(a.status == "error" for a in answers),
        "finished_before_kill": sum(a.status == "finished" for a in answers),
        "unexpected": sum(a.status == "unexpected" for a in answers),
        "hangs": hangs,
        "last_answer_after_s": round(max(times), 3) if times else None,
        "answers": dict(by.most_common()),
    }


async def after_kill(ctx: Ctx) -> dict:
    """/health must say 503; new requests of each protocol must be refused promptly."""
    start, health = time.monotonic(), None
    while time.monotonic() - start < FAULT_ANSWER_S:
        with contextlib.suppress(httpx.HTTPError):
            response = await ctx.http.get(ctx.base_url + "/health", timeout=2.0)
            health = {"status": response.status_code, "body": response.text[:200]}
            if response.status_code == 503:
                break
        await asyncio.sleep(0.1)
    health = (health or {}) | {"after_s": since(start)}
    refusals = {}
    for name, call in (("ws", refuse_ws), ("sse", refuse_sse), ("http", refuse_http)):
        t = time.monotonic()
        try:
            async with asyncio.timeout(5.0):
                answer = await call(ctx)
        except TimeoutError:
            answer = "HANG (no answer in 5 s)"
        except Exception as exc:  # noqa: BLE001 - recorded
            answer = f"client {type(exc).__name__}: {exc}"
        refusals[name] = {"answer": answer[:200], "after_s": since(t)}
    return {"health": health, "new_requests": refusals}


async def refuse_ws(ctx: Ctx) -> str:
    conn = await WsConn.open(ctx.ws_url, binary=False)
    try:
        message = ws_generate_message(ctx, random.Random(0))
        event, _ = await ws_run(conn, message)
        return describe(event)
    finally:
        await conn.close()


async def refuse_sse(ctx: Ctx) -> str:
    body = http_body(ctx, random.Random(0), chat=False, stream=True)
    async with ctx.http.stream("POST", ctx.base_url + "/v1/completions", json=body) as response:
        text = (await response.aread()).decode(errors="replace")
        return f"HTTP {response.status_code}: {text[:150]}"


async def refuse_http(ctx: Ctx) -> str:
    body = http_body(ctx, random.Random(0), chat=True, stream=False)
    response = await ctx.http.post(ctx.base_url + "/v1/chat/completions", json=body)
    return f"HTTP {response.status_code}: {response.text[:150]}"


def refused_ok(answer: str) -> bool:
    return answer.startswith("error ") or bool(re.match(r"HTTP 5\d\d", answer))


def shutdown(server: ServerProcess, procs: dict[int, str]) -> dict:
    """SIGTERM; the server must exit within SHUTDOWN_S and leave no worker behind."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
        code = None
        server.proc.kill()
        server.proc.wait()
    exit_s = since(start)
    time.sleep(0.5)
    left = still_alive(procs)
    for pid in procs:  # only the processes this script started (the server's children)
        if any(entry.startswith(f"{pid} ") for entry in left):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return {"exit_code": code, "exit_after_s": exit_s, "processes_left": left}


# -- phases ---------------------------------------------------------------------------
async def soak(args: argparse.Namespace, server: ServerProcess) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        ws_url = server.url.replace("http", "ws", 1) + "/v1/stream"
        ctx = Ctx(
            args,
            server.url,
            load_prompts(),
            http,
            {b: WsPool(ws_url, b, args.ws_connections) for b in (False, True)},
            {b: CheckoutPool(ws_url, b) for b in (False, True)},
        )
        return await phases(ctx, server)


@dataclass
class Client:
    """The client side's record: tallies per kind and per malformed variant."""

    tallies: dict[str, Tally] = field(default_factory=lambda: {k: Tally() for k in KINDS})
    variants: dict = field(
        default_factory=lambda: {k: collections.defaultdict(collections.Counter) for k in MALFORMED}
    )

    def counts(self) -> tuple[int, int]:
        """(hangs, unexpected) so far."""
        t = self.tallies.values()
        return sum(x.hangs for x in t), sum(x.unexpected for x in t)


async def phases(ctx: Ctx, server: ServerProcess) -> dict:
    """Main load, leak check, disconnect probes, fault phase, shutdown (module doc)."""
    client = Client()
    sampler = Sampler(ctx, server.proc.pid, ctx.args.requests, ctx.args.sample_interval)
    sampler.hangs_and_unexpected = client.counts
    sampling = asyncio.create_task(sampler.run())
    report: dict[str, Any] = {"worker_pid": sampler.worker_pid}
    try:
        report |= await main_phase(ctx, sampler, client)
        report |= await after_load(ctx, sampler)
        procs = descendants(server.proc.pid)
        if ctx.args.kill_worker:
            sampler.phase = "fault"
            report["fault"] = await fault_batch(ctx, sampler, server.proc.pid)
            report["fault"] |= await after_kill(ctx)
        sampler.phase = "shutdown"
        sampler.mark("sigterm")
        report["shutdown"] = await asyncio.to_thread(shutdown, server, procs)
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
    report["samples"], report["marks"] = sampler.samples, sampler.marks
    return report | client_record(ctx, client)


async def main_phase(ctx: Ctx, sampler: Sampler, client: Client) -> dict:
    """Warm-up (then the RSS baseline), the main load until every request is answered
    (or past its deadline), then RSS again."""
    a = ctx.args
    requests = plan(a.requests, a.weights, a.seed)
    warm = min(a.warmup, a.requests)
    await run_requests(ctx, requests[:warm], client.tallies, client.variants)
    rss_start = sampler.rss()
    sampler.phase = "main"
    sampler.mark("main")
    log(f"warm-up done ({warm} requests); RSS {rss_start}")
    await run_requests(ctx, requests[warm:], client.tallies, client.variants)
    sampler.mark("drained")
    return {
        "rss_start": rss_start,
        "rss_end": sampler.rss(),
        "main_s": round(sampler.marks["drained"] - sampler.marks["main"], 3),
    }


async def after_load(ctx: Ctx, sampler: Sampler) -> dict:
    """The leak check (client sockets closed first), then the disconnect probes and the
    leak check again."""
    sampler.phase = "leak check"
    await close_pools(ctx)
    leaks = await check_leaks(ctx, ctx.args.settle)
    log(f"leak check: {leaks['final']}")
    sampler.phase = "probes"
    sampler.mark("probes")
    probes = [await probe(ctx, kind, ctx.args.probe_requests) for kind in PROBES]
    await close_pools(ctx)
    return {
        "leaks": leaks,
        "probes": probes,
        "leaks_after_probes": await check_leaks(ctx, ctx.args.settle),
    }


def client_record(ctx: Ctx, client: Client) -> dict:
    return {
        "tallies": {k: t.as_dict() for k, t in client.tallies.items() if t.total},
        "malformed_variants": {
            kind: {name: dict(c) for name, c in sorted(v.items())}
            for kind, v in client.variants.items()
        },
        "ws_pool_closes_by_server": {
            ("msgpack" if b else "json"): dict(p.server_closes) for b, p in ctx.pools.items()
        },
        "ws_stray_events": [e for p in ctx.pools.values() for e in p.strays][:10],
        "malformed_connections_reused": sum(p.reused for p in ctx.bad_pools.values()),
    }


async def close_pools(ctx: Ctx) -> None:
    for pool in (*ctx.pools.values(), *ctx.bad_pools.values()):
        await pool.close()


def load_prompts() -> list[str]:
    prompts = list(STORY_OPENINGS)
    with contextlib.suppress(OSError, ValueError):
        records = json.loads(ALPACA.read_text())
        prompts += [r["instruction"] for r in records if len(r["instruction"]) <= 120][:300]
    return prompts


# -- verdict and report ---------------------------------------------------------------
def verdict(r: dict) -> list[str]:
    """Why the run failed (empty: it passed)."""
    t = r["tallies"].values()
    failures = []
    hangs, unexp = sum(x["hangs"] for x in t), sum(x["unexpected"] for x in t)
    if hangs:
        failures.append(f"{hangs} request(s) hung")
    if unexp:
        failures.append(f"{unexp} unexpected answer(s)")
    closes = sum(sum(c.values()) for c in r["ws_pool_closes_by_server"].values())
    if closes:
        failures.append(f"{closes} pooled WebSocket(s) closed by the server")
    for name in ("leaks", "leaks_after_probes"):
        if r.get(name, {}).get("leaked"):
            failures.append(f"{name}: gauges not back to 0: {r[name]['leaked']}")
    failures += [
        f"probe {p['kind']}: released after {p['released_after_s']} s, "
        f"{p['tokens_generated_after_leaving']:.0f} tokens after leaving, "
        f"{p['ran_to_length']:.0f} ran to length"
        for p in r.get("probes", ())
        if not p["passed"]
    ]
    failures += fault_failures(r.get("fault"))
    s = r.get("shutdown", {})
    if s.get("exit_code") is None or s.get("exit_after_s", 0) > SHUTDOWN_S:
        failures.append(f"server did not exit within {SHUTDOWN_S:g} s of SIGTERM")
    if s.get("processes_left"):
        failures.append(f"processes left after shutdown: {s['processes_left']}")
    return failures


def fault_failures(f: dict | None) -> list[str]:
    if f is None:
        return []
    if "error" in f:
        return [f"fault phase: {f['error']}"]
    out = []
    if f["hangs"] or f["unexpected"]:
        out.append(f"fault phase: {f['hangs']} hang(s), {f['unexpected']} unexpected answer(s)")
    if f["health"].get("status") != 503:
        out.append(f"fault phase: /health said {f['health'].get('status')} after the kill")
    for name, r in f["new_requests"].items():
        if not refused_ok(r["answer"]) or r["after_s"] > 2.0:
            out.append(
                f"fault phase: new {name} request: {r['answer'][:80]} after {r['after_s']} s"
            )
    return out


def growth(r: dict) -> dict:
    """RSS growth from the baseline to the end of the main phase, in %, and its slope in
    MiB per 1000 requests over the second half of the load (past the warm-up's jump;
    samples with at least half --concurrency in flight)."""
    start, end = r.get("rss_start") or {}, r.get("rss_end") or {}
    out = {}
    for key in ("server_mib", "worker_mib"):
        if start.get(key) and end.get(key):
            out[key.replace("_mib", "_pct")] = round(100 * (end[key] / start[key] - 1), 1)
    busy = r["config"]["concurrency"] / 2
    loaded = [x for x in r["samples"] if x["phase"] == "main" and x["in_flight"] >= busy]
    late = loaded[len(loaded) // 2 :]
    for key in ("server_mib", "worker_mib"):
        points = [(x["answered"], x[key.replace("_mib", "_rss_mib")]) for x in late]
        slope = fit_slope([p for p in points if p[1] is not None])
        if slope is not None:
            out[key.replace("_mib", "_mib_per_1k_requests")] = round(1000 * slope, 3)
    return out


def fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None for fewer than 5 points or no spread."""
    if len(points) < 5:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / var


def server_log_summary(path: Path) -> dict:
    lines = path.read_text(errors="replace").splitlines()
    exceptions = collections.Counter(
        line.strip()[:160]
        for line in lines
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b(: |$)", line.strip())
    )
    return {
        "path": str(path),
        "error_lines": sum(line.startswith("ERROR") for line in lines),
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
        "exceptions": dict(exceptions.most_common(12)),
    }


def human_summary(report: dict) -> str:
    out = [f"soak: {'PASSED' if report['passed'] else 'FAILED'} in {report['duration_s']} s"]
    out.append(f"{'kind':<16}{'total':>7}{'result':>8}{'error':>7}{'unexp':>7}{'hang':>6}")
    for kind, t in report["tallies"].items():
        out.append(
            f"{kind:<16}{t['total']:>7}{t['results']:>8}{t['errors']:>7}"
            f"{t['unexpected']:>7}{t['hangs']:>6}"
        )
        out += [f"    {e}" for e in t["examples"][:3]]
    out.append(f"leaks after drain: {report['leaks']['final']}")
    out.append(f"leaks after probes: {report['leaks_after_probes']['final']}")
    out.append(f"RSS start {report['rss_start']}, end {report['rss_end']}, growth {report['rss']}")
    for p in report.get("probes", ()):
        out.append(
            f"probe {p['kind']:<15} {'ok  ' if p['passed'] else 'FAIL'} released after "
            f"{p['released_after_s']} s, {p['tokens_generated_after_leaving']:.0f} tokens "
            f"after leaving, {p['ran_to_length']:.0f} ran to length"
        )
    if f := report.get("fault"):
        out.append(
            f"fault: {f.get('in_flight')} in flight, {f.get('errors')} errors, "
            f"{f.get('finished_before_kill')} finished, {f.get('unexpected')} unexpected, "
            f"{f.get('hangs')} hangs, last answer {f.get('last_answer_after_s')} s after the "
            f"kill; /health {f.get('health', {}).get('status')}"
        )
        for name, r in f.get("new_requests", {}).items():
            out.append(f"    new {name}: {r['answer'][:90]} ({r['after_s']} s)")
    out.append(f"shutdown: {report['shutdown']}")
    out += [f"FAIL: {x}" for x in report["failures"]]
    return "\n".join(out)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["samples"]
    t = [x["t"] for x in s]

    def col(key: str) -> list[float]:
        return [math.nan if x[key] is None else x[key] for x in s]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    top.plot(t, col("server_rss_mib"), label="server RSS")
    top.plot(t, col("worker_rss_mib"), label="worker RSS")
    top.set_ylabel("RSS (MiB)")
    bottom.plot(t, col("in_flight"), label="in flight (client)", lw=1)
    bottom.plot(t, col("running"), label="running (server)", lw=1, alpha=0.7)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("time (s)")
    styles = {"drained": "tab:green", "probes": "tab:purple", "kill": "tab:red", "sigterm": "k"}
    for ax in (top, bottom):
        for name, at in report["marks"].items():
            ax.axvline(at, color=styles.get(name, "tab:gray"), ls="--", lw=1, label=name)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, None)
    top.legend(fontsize=8, loc="lower right")
    bottom.legend(fontsize=8, loc="upper right")
    c = report["config"]
    fig.suptitle(
        f"pagedserve soak: {c['requests']} requests, concurrency {c['concurrency']}, "
        f"{Path(c['model']).name}; {'PASSED' if report['passed'] else 'FAILED'} "
        f"({len(report['failures'])} failure(s))",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------
def kv_cache_bytes(model: Path, max_num_seqs: int, block_size: int) -> int:
    """Enough blocks for `max_num_seqs` sequences at full context (no preemption)."""
    from engine.config import EngineArgs
    from engine.kv_cache import block_bytes

    config = EngineArgs(model=str(model), skip_tokenizer_init=True).build().model
    blocks_per_seq = -(-config.max_model_len // block_size)
    return block_bytes(config, block_size) * blocks_per_seq * max_num_seqs


def server_args(a: argparse.Namespace) -> list[str]:
    kv = a.kv_cache_memory or kv_cache_bytes(Path(a.model), a.max_num_seqs, 16)
    return [
        "--model",
        str(a.model),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--kv-cache-memory",
        str(kv),
        "--max-message-bytes",
        str(a.max_message_bytes),
        *shlex.split(a.server_args),
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="JSON report path (a PNG is written beside it)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="300 requests, malformed kinds weighted up to send each variant about once",
    )
    p.add_argument("--requests", type=int, default=None, help="default 5000 (300 with --quick)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=100, help="requests before the RSS baseline")
    p.add_argument(
        "--weights",
        type=parse_weights,
        default=parse_weights(None),
        help="kind=weight,... overriding the defaults (" + ", ".join(KINDS) + ")",
    )
    p.add_argument("--ws-connections", type=int, default=4, help="pooled sockets per encoding")
    p.add_argument("--settle", type=float, default=5.0, help="seconds for gauges to reach 0")
    p.add_argument("--sample-interval", type=float, default=1.0)
    p.add_argument("--probe-requests", type=int, default=4, help="per disconnect probe")
    p.add_argument("--long-tokens", type=int, default=448, help="probes and fault requests")
    p.add_argument(
        "--kill-worker",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fault phase: SIGKILL the worker under load (default: on)",
    )
    p.add_argument("--fault-ws", type=int, default=16)
    p.add_argument("--fault-sse", type=int, default=8)
    p.add_argument("--fault-http", type=int, default=8)
    s = p.add_argument_group("server")
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: no preempt)")
    s.add_argument("--max-message-bytes", type=int, default=65536)
    s.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the server")
    s.add_argument("--server-args", default="", help="more `pagedserve serve` flags, quoted")
    s.add_argument("--server-log", default=None, help="default: a file in the temp dir")
    a = p.parse_args(argv)
    a.requests = a.requests or (300 if a.quick else 5000)
    if a.quick:
        a.warmup = min(a.warmup, 30)
        a.weights = a.weights | QUICK_MALFORMED_WEIGHTS
    if a.requests < 1 or a.concurrency < 1 or a.ws_connections < 1:
        p.error("--requests, --concurrency and --ws-connections must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not Path(a.model, "config.json").is_file():
        print(f"error: {a.model}/config.json not found (--model)", file=sys.stderr)
        return 2
    log_path = Path(a.server_log or tempfile.mkstemp(prefix="pagedserve-soak-", suffix=".log")[1])
    threads = str(a.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    start = time.monotonic()
    with log_path.open("wb") as log_file:
        server = ServerProcess(server_args(a), env=env, log=log_file)
        log(f"starting server: {shlex.join(server.cmd)} (log: {log_path})")
        server.start(timeout=300)
        try:
            report = asyncio.run(soak(a, server))
        finally:
            server.stop()
    config = {k: v for k, v in vars(a).items()} | {"model": str(a.model)}
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "config": config,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "server": {"command": shlex.join(server.cmd), "pid": server.proc.pid},
        "duration_s": since(start),
        **report,
        "server_log": server_log_summary(log_path),
    }
    report["rss"] = growth(report)
    report["failures"] = verdict(report)
    report["passed"] = not report["failures"]
    write_report(report, a.out, lambda png: plot(report, png))
    print(human_summary(report), file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
