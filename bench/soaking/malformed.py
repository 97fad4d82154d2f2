"""Malformed WebSocket frames (BAD_FRAMES) and HTTP bodies (BAD_BODIES), the error each
must get, and the two request kinds that send them in turn."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .conn import ALL, Closed, describe, next_answer
from .context import Ctx
from .http_kinds import post_alone
from .outcome import ERROR, Outcome, expected_error, unexpected


@dataclass(frozen=True)
class BadFrame:
    """A malformed WebSocket message and the error it must get: `code`, and a message
    naming `field` (when set). `frame` is text, bytes (msgpack), or a function of rng."""

    name: str
    frame: str | bytes | Callable[[random.Random], bytes]
    field: str | None = None
    code: str = "invalid_request"


def _gen(params: dict | None = None, **fields: Any) -> str:
    """A generate frame (JSON text): fields over the defaults, a field set to None left
    out."""
    message = {"type": "generate", "id": "bad", "prompt": "Hi"} | fields
    if params is not None:
        message["params"] = params
    return json.dumps({k: v for k, v in message.items() if v is not None})


def garbage(rng: random.Random) -> bytes:
    """1..64 random bytes: not msgpack, or not an object."""
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


BAD_FRAMES = (
    BadFrame("invalid_json", '{"type": "generate", "id": '),
    BadFrame("empty_text", ""),
    BadFrame("not_an_object", "[1, 2, 3]"),
    BadFrame("deeply_nested_json", "[" * 20000 + "]" * 20000),
    BadFrame("msgpack_garbage", garbage),
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
    """Whether an error names the field `name` (in its param or its message)."""
    return name is None or param == name or name in (message or "")


def judge_ws_error(answer: dict | Closed, bad: BadFrame) -> Outcome:
    """The answer to `bad` must be an `error` event with its code, naming its field."""
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
    BadBody("echo_string", {"prompt": "Hi", "echo": "yes"}, "echo"),
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
    response = await post_alone(ctx.completions_url(bad.chat), content=raw, headers=headers)
    if response.status_code != bad.status:
        return unexpected(f"{bad.name}: HTTP {response.status_code}: {response.text[:160]}")
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return unexpected(f"{bad.name}: HTTP {response.status_code}, not an OpenAI error body")
    if not names_field(error.get("message"), error.get("param"), bad.field):
        return unexpected(f"{bad.name}: error does not name {bad.field}: {error.get('message')}")
    return expected_error(bad.name)
