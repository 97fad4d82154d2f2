"""msgpack codec for the frozen-dataclass messages of `engine.messages`.

Wire format of a frame: a msgpack array `[type_name, [field values in declared order]]`.
Nested dataclasses travel as arrays of their field values, tuples as arrays. Field order
is the wire format (append new fields at the end; `tests/actors/test_codec.py` pins it).

Each inbox builds one `InboxDecoder` over the message types it accepts; decoding checks
the frame shape, the type name, the field count and every field's type against the
dataclass annotations, and constructs the dataclass (running its own validation, e.g.
SamplingParams'). Anything else raises `DecodeError`. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable
from typing import Any

import msgpack


class DecodeError(ValueError):
    """A frame that is not a valid message for this inbox (the actor drops it and goes on)."""


def encode(message: Any) -> bytes:
    """One message -> one msgpack frame."""
    if not dataclasses.is_dataclass(message) or isinstance(message, type):
        raise TypeError(f"only message dataclasses can be encoded, got {type(message).__name__}")
    return msgpack.packb([type(message).__name__, _fields_of(message)], use_bin_type=True)


def _fields_of(obj: Any) -> list[Any]:
    return [_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_of(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class InboxDecoder:
    """Decodes frames into one of `message_types`, or raises DecodeError."""

    def __init__(self, message_types: Iterable[type]) -> None:
        self.types = {cls.__name__: cls for cls in message_types}

    def decode(self, frame: bytes) -> Any:
        try:
            raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
            raise DecodeError(f"not a msgpack frame ({type(exc).__name__}: {exc})") from exc
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)):
            raise DecodeError("a frame must be [type_name, [fields...]]")
        name, values = raw
        cls = self.types.get(name)
        if cls is None:
            raise DecodeError(
                f"message type {name!r} is not accepted here; accepted: {sorted(self.types)}"
            )
        return _build(cls, values, name)


def _build(cls: type, values: Any, path: str) -> Any:
    fields = dataclasses.fields(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        count = len(values) if isinstance(values, list) else type(values).__name__
        raise DecodeError(f"{path}: expected {len(fields)} fields, got {count}")
    hints = _hints(cls)
    kwargs = {
        f.name: _convert(hints[f.name], v, f"{path}.{f.name}")
        for f, v in zip(fields, values, strict=True)
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{path}: {exc}") from exc


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, v: Any, path: str) -> Any:  # noqa: C901 - one branch per type form
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # `X | None`: X's own error says which part is wrong
            return _convert(options[0], v, path)
        for option in options:
            try:
                return _convert(option, v, path)
            except DecodeError:
                continue
        raise DecodeError(f"{path}: {_show(v)} matches none of {tp}")
    if tp is type(None):
        if v is None:
            return None
    elif tp is bool:
        if isinstance(v, bool):
            return v
    elif tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    elif tp is float:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    elif tp is str or tp is bytes:
        if isinstance(v, tp):
            return v
    elif origin is typing.Literal:
        if v in args:
            return v
    elif origin in (tuple, list) and isinstance(v, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(v):
                raise DecodeError(f"{path}: expected {len(args)} items, got {len(v)}")
            return tuple(
                _convert(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v, strict=True))
            )
        items = [_convert(args[0], x, f"{path}[{i}]") for i, x in enumerate(v)]
        return tuple(items) if origin is tuple else items
    elif origin is dict and isinstance(v, dict):
        kt, vt = args
        return {
            _convert(kt, k, f"{path}.key"): _convert(vt, x, f"{path}[{k!r}]") for k, x in v.items()
        }
    elif dataclasses.is_dataclass(tp):
        return _build(tp, v, path)
    raise DecodeError(f"{path}: expected {getattr(tp, '__name__', tp)}, got {_show(v)}")


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
