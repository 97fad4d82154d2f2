"""msgpack codec for the frozen-dataclass messages of `engine.messages`.

Wire format of a frame: a msgpack array `[type_name, [field values in declared order]]`.
Nested dataclasses travel as arrays of their field values, tuples as arrays. Field order
is the wire format (append new fields at the end; `tests/engine/test_codec.py` pins it).

Each inbox builds one `InboxDecoder` over the message types it accepts; decoding checks
the frame shape, the type name, the field count and every field's type against the
dataclass annotations, and constructs the dataclass (running its own validation, e.g.
SamplingParams'). Anything else raises `DecodeError`. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgpack


class DecodeError(ValueError):
    """A frame that is not a valid message for this inbox (the actor drops it and goes on).

    `request_id`: the request the frame was about, when its type carries one as its
    first field and that field reads as a string (the actor then fails that request)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(message: Any) -> bytes:
    """One message -> one msgpack frame."""
    if not dataclasses.is_dataclass(message) or isinstance(message, type):
        raise TypeError(f"only message dataclasses can be encoded, got {type(message).__name__}")
    body = [type(message).__name__, _as_array(message)]
    return msgpack.packb(body, use_bin_type=True, default=_as_array)


def _as_array(obj: Any) -> list[Any]:
    """msgpack's hook for what it can't pack itself: a dataclass becomes its field values
    (tuples, lists, dicts and scalars are packed natively, in C)."""
    names = _field_names(type(obj))
    if names is None:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    return [getattr(obj, n) for n in names]


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in dataclasses.fields(cls))


class InboxDecoder:
    """Decodes frames into one of `message_types`, or raises DecodeError."""

    def __init__(self, message_types: Iterable[type]) -> None:
        self.types = {cls.__name__: cls for cls in message_types}

    def decode(self, frame: bytes | Any) -> Any:
        if type(frame) is not bytes:  # a message object from an in-process queue
            if self.types.get(type(frame).__name__) is not type(frame):
                raise DecodeError(
                    f"message type {type(frame).__name__!r} is not accepted here; "
                    f"accepted: {sorted(self.types)}"
                )
            return frame
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
        try:
            return _converter(cls)(values)
        except _Mismatch as bad:
            raise DecodeError(f"{name}{bad.path}: {bad.reason}", _request_id(cls, values)) from None


def _request_id(cls: type, values: Any) -> str | None:
    """The request id at the head of a frame's fields, if its type starts with one."""
    names = _field_names(cls)
    if names and names[0] == "request_id" and type(values) is list and values:
        head = values[0]
        return head if type(head) is str else None
    return None


# ---------------------------------------------------------------- decoding
# Each annotation compiles once into a converter: value -> checked value, or _Mismatch.
# The path of a bad value is assembled only on the way out of an error.


class _Mismatch(Exception):
    def __init__(self, reason: str, path: str = "") -> None:
        self.reason, self.path = reason, path

    def under(self, prefix: str) -> _Mismatch:
        self.path = prefix + self.path
        return self


Converter = Callable[[Any], Any]


@functools.cache
def _converter(tp: Any) -> Converter:  # noqa: C901 - one branch per type form
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda v: v
    if origin in (typing.Union, types.UnionType):
        return _union(args)
    if tp is type(None):
        return _exact(lambda v: v is None, "None")
    if tp is bool:
        return _exact(lambda v: v is True or v is False, "bool")
    if tp is int:
        return _exact(lambda v: type(v) is int, "int")
    if tp is float:
        return _float
    if tp is str or tp is bytes:
        return _exact(lambda v: type(v) is tp, tp.__name__)
    if origin is typing.Literal:
        return _exact(lambda v: v in args, f"one of {args}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp)
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return _fixed_tuple(args)
        return _sequence(args[0], origin)
    if origin is dict:
        return _dict(*args)
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp)
    raise TypeError(f"the codec cannot decode {tp}")


def _exact(test: Callable[[Any], bool], what: str) -> Converter:
    def convert(v: Any) -> Any:
        if test(v):
            return v
        raise _Mismatch(f"expected {what}, got {_show(v)}")

    return convert


def _enum(cls: type[enum.Enum]) -> Converter:
    """An enum travels as its value (a StrEnum packs as its string)."""
    values = {m.value: m for m in cls}

    def convert(v: Any) -> Any:
        try:
            return values[v]
        except (KeyError, TypeError):
            raise _Mismatch(f"expected one of {sorted(values)}, got {_show(v)}") from None

    return convert


def _float(v: Any) -> float:
    if type(v) is float or type(v) is int:
        return float(v)
    raise _Mismatch(f"expected float, got {_show(v)}")


def _union(args: tuple[Any, ...]) -> Converter:
    options = [a for a in args if a is not type(None)]
    none_ok = len(options) < len(args)
    if len(options) == 1:  # `X | None`: X's own error says which part is wrong
        only = _converter(options[0])
        return lambda v: None if v is None and none_ok else only(v)
    converters = [_converter(a) for a in options]
    what = " | ".join(getattr(a, "__name__", str(a)) for a in args)

    def convert(v: Any) -> Any:
        if v is None and none_ok:
            return None
        for c in converters:
            try:
                return c(v)
            except _Mismatch:
                continue
        raise _Mismatch(f"{_show(v)} matches none of {what}")

    return convert


def _sequence(item_type: Any, origin: type) -> Converter:
    item = _converter(item_type)
    fast = {int: int, str: str}.get(item_type)  # scalar items: checked at C speed

    def convert(v: Any) -> Any:
        if type(v) is not list:
            raise _Mismatch(f"expected a list, got {_show(v)}")
        if fast is not None and (not v or set(map(type, v)) == {fast}):
            return tuple(v) if origin is tuple else v
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except _Mismatch as bad:
                raise bad.under(f"[{i}]") from None
        return tuple(out) if origin is tuple else out

    return convert


def _fixed_tuple(args: tuple[Any, ...]) -> Converter:
    items = [_converter(a) for a in args]

    def convert(v: Any) -> tuple:
        if type(v) is not list:
            raise _Mismatch(f"expected a list, got {_show(v)}")
        if len(v) != len(items):
            raise _Mismatch(f"expected {len(items)} items, got {len(v)}")
        out = []
        for i, (c, x) in enumerate(zip(items, v, strict=True)):
            try:
                out.append(c(x))
            except _Mismatch as bad:
                raise bad.under(f"[{i}]") from None
        return tuple(out)

    return convert


def _dict(key_type: Any, value_type: Any) -> Converter:
    key, value = _converter(key_type), _converter(value_type)

    def convert(v: Any) -> dict:
        if type(v) is not dict:
            raise _Mismatch(f"expected a map, got {_show(v)}")
        out = {}
        for k, x in v.items():
            try:
                out[key(k)] = value(x)
            except _Mismatch as bad:
                raise bad.under(f"[{k!r}]") from None
        return out

    return convert


def _dataclass(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _converter(hints[f.name])) for f in dataclasses.fields(cls)]
    n = len(fields)
    by_name = any(f.kw_only for f in dataclasses.fields(cls))  # built by keyword only
    names = [name for name, _ in fields]

    def convert(v: Any) -> Any:
        if type(v) is not list or len(v) != n:
            count = len(v) if type(v) is list else type(v).__name__
            raise _Mismatch(f"expected {n} fields, got {count}")
        values = []
        for (name, c), x in zip(fields, v, strict=True):
            try:
                values.append(c(x))
            except _Mismatch as bad:
                raise bad.under(f".{name}") from None
        try:
            return cls(**dict(zip(names, values, strict=True))) if by_name else cls(*values)
        except (TypeError, ValueError) as exc:  # the dataclass's own validation
            raise _Mismatch(str(exc)) from None

    return convert


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
