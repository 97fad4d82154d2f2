"""What a request's output must match (structured outputs), with vLLM's names and shape:
`SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`.

Pure data, checked once: exactly one constraint is set, each within size limits, JSON
texts parse. Whether a schema, regex or grammar compiles needs the grammar backend and
the vocabulary (engine/worker/grammar/); its errors name the same fields."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_SPEC_CHARS = 65_536  # a schema, regex, grammar or structural tag, as text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class StructuredOutputsError(ValueError):
    """A structured-outputs constraint is malformed; the message names the field."""


class ConstraintKind(StrEnum):
    """Which one constraint a request sets (the field of `StructuredOutputsParams`)."""

    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF, as llama.cpp and xgrammar read it)
    STRUCTURAL_TAG = "structural_tag"  # free text with tagged JSON parts (JSON text)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema: a dict, or its JSON text), `regex`,
    `choice` (a list of strings), `grammar` (EBNF), `json_object` (True: any JSON
    object) or `structural_tag` (JSON text) is set. `disable_any_whitespace`: JSON
    without optional whitespace; `disable_additional_properties`: a schema's objects
    take no properties beyond those it names.

    Normalized on construction: `json` and `structural_tag` are compact JSON text, keys
    kept in their order (a schema's property order is the order the output follows, so
    schemas differing only in key order are two constraints); `choice` a tuple. Invalid
    input raises `StructuredOutputsError` naming the field as `structured_outputs.<field>`."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_fields = [kind for kind in ConstraintKind if _is_set(getattr(self, kind.value))]
        if len(set_fields) != 1:
            named = ", ".join(k.value for k in set_fields) or "none"
            _fail("", f"must set exactly one of {', '.join(ConstraintKind)} (got {named})")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "must be a bool")
        object.__setattr__(self, "json", _json_text("json", self.json, (dict, bool)))
        object.__setattr__(
            self, "structural_tag", _json_text("structural_tag", self.structural_tag, (dict,))
        )
        object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            _check_spec_text(name, getattr(self, name))
        if self.json_object not in (None, True):
            _fail("json_object", "must be true when set")

    @property
    def kind(self) -> ConstraintKind:
        return next(k for k in ConstraintKind if _is_set(getattr(self, k.value)))

    @classmethod
    def from_dict(cls, value: Any, field: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's object (vLLM's `structured_outputs`); unknown keys and
        non-objects are refused naming `field`."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputsError(f"{field} must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - _FIELD_NAMES)
        if unknown:
            supported = ", ".join(sorted(_FIELD_NAMES))
            raise StructuredOutputsError(f"{field}.{unknown[0]} is not supported ({supported})")
        return cls(**value)


_FIELD_NAMES = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


_JSON_NAMES = {dict: "object", bool: "boolean"}


def _fail(name: str, rule: str) -> None:
    field = f"structured_outputs.{name}" if name else "structured_outputs"
    raise StructuredOutputsError(f"{field} {rule}")


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _json_text(name: str, value: Any, kinds: tuple[type, ...]) -> str | None:
    """`value` (a parsed JSON value or its text) as compact JSON text, keys in order."""
    if value is None:
        return None
    parsed = value
    if isinstance(value, str):
        _check_spec_text(name, value)
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            _fail(name, f"is not valid JSON: {exc}")
    if not isinstance(parsed, kinds):
        _fail(name, "must be a JSON " + " or ".join(_JSON_NAMES[k] for k in kinds))
    try:
        text = json.dumps(parsed, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        _fail(name, f"is not JSON-serializable: {exc}")
    _check_spec_text(name, text)
    return text


def _choices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not 0 < len(value) <= MAX_CHOICES:
        _fail("choice", f"must be a list of 1 to {MAX_CHOICES} strings")
    for item in value:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_CHOICE_CHARS:
            _fail("choice", f"must hold strings of 1 to {MAX_CHOICE_CHARS} characters")
    return tuple(value)


def _check_spec_text(name: str, text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, str) or not 0 < len(text) <= MAX_SPEC_CHARS:
        _fail(name, f"must be a non-empty string of at most {MAX_SPEC_CHARS} characters")
