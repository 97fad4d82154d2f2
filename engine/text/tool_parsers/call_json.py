"""The JSON of a tool call: parsing it leniently, checking it strictly enough.

One rule for every format: a call is an object with a non-empty string `name` and at
most one of `arguments` / `parameters` (Llama 3 writes `parameters`). The arguments are
an object, JSON text of an object (some models quote them), or absent / null (no
arguments: `{}`). Anything else is not a call, and its text stays content."""

from __future__ import annotations

import json
from typing import Any

from engine.text.tool_parsers.call_splitter import CallPiece

ARGUMENT_KEYS = ("arguments", "parameters")


class _NotJson(ValueError):
    """A constant JSON does not allow (NaN, Infinity) was found."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


def load_json(text: str) -> tuple[bool, Any]:
    """`(True, value)` when `text` is one JSON value (whitespace around it allowed),
    else `(False, None)`. Raw control characters inside strings are accepted (models
    write raw newlines in code arguments); NaN and Infinity are not, as JSON has none."""
    try:
        return True, json.loads(text, strict=False, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False, None


def arguments_text(value: Any) -> str | None:
    """The arguments as JSON text of an object, or None when `value` is not arguments."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        ok, value = load_json(value)
        if not ok:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(value: Any) -> CallPiece | None:
    """The call a decoded `{"name": ..., "arguments": ...}` object makes, or None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    keys = [key for key in ARGUMENT_KEYS if key in value]
    if len(keys) > 1:
        return None
    arguments = arguments_text(value[keys[0]] if keys else None)
    return None if arguments is None else CallPiece(name, arguments)


def call_from_json(text: str) -> CallPiece | None:
    """The call that JSON text of one object makes, or None."""
    ok, value = load_json(text)
    return call_from_object(value) if ok else None
