"""Client frames and bodies -> plain dicts, or an `invalid_request` naming what is wrong.

JSON text (HTTP bodies, WebSocket text frames) and msgpack (WebSocket binary frames)
alike: valid encoding, an object at the top, and nesting no deeper than MAX_DEPTH (a
deeply nested value would otherwise blow the parser's or a later repr's stack).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
from starlette.requests import Request

from web.errors import invalid

MAX_DEPTH = 32  # the deepest legitimate request (chat content parts) nests 5 levels
BODY_TIMEOUT_S = 30.0  # a request body (at most --max-message-bytes) must arrive by then


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object, refused as soon as it is known to exceed `limit` bytes
    (by its Content-Length, or while it streams in): never read whole first. A body that
    trickles in slower than BODY_TIMEOUT_S is refused too."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        message = f"request body is {int(declared):,} bytes; the limit is {limit:,}"
        raise invalid(message, close=True)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    message = f"request body is over the limit of {limit:,} bytes"
                    raise invalid(message, close=True)
                chunks.append(chunk)
    except TimeoutError:
        message = f"request body did not arrive within {BODY_TIMEOUT_S:g} s"
        raise invalid(message, close=True) from None
    return parse_json(b"".join(chunks), "request body")


def parse_json(raw: bytes | str, what: str) -> dict[str, Any]:
    """`what` names the input in errors ("request body", "frame")."""
    return as_object(load_json(raw, what), what)


def load_json(raw: bytes | str, what: str) -> Any:
    """The decoded value, whatever it is (`as_object` checks it is a request)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise invalid(f"{what} is not valid UTF-8: {exc}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise invalid(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    return value


def load_msgpack(raw: bytes, what: str) -> Any:
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except msgpack.StackError:
        raise invalid(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise invalid(f"{what} is not valid msgpack: {exc}") from None
    return value


def as_object(value: Any, what: str) -> dict[str, Any]:
    """`value` if it is an object of string keys nested at most MAX_DEPTH levels."""
    if not isinstance(value, dict):
        raise invalid(f"{what} must be an object, got {type(value).__name__}")
    bad_key = next((k for k in value if not isinstance(k, str)), None)
    if bad_key is not None:
        raise invalid(f"{what} has a non-string key {repr(bad_key)[:40]}; keys are field names")
    for key, item in value.items():
        depth = _depth(item)
        if depth >= MAX_DEPTH:
            raise invalid(f"{key} is nested {depth}+ levels deep; at most {MAX_DEPTH}", key)
    return value


def _depth(value: Any) -> int:
    """How deep containers nest in `value` (0 for a scalar), counted up to MAX_DEPTH."""
    level, frontier = 0, [value]
    while frontier and level < MAX_DEPTH:
        nested = []
        for v in frontier:
            if isinstance(v, dict):
                nested += v.values()
            elif isinstance(v, list | tuple):
                nested += v
        if not any(isinstance(v, dict | list | tuple) for v in frontier):
            break
        frontier, level = nested, level + 1
    return level
