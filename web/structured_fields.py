"""A request body's structured-outputs fields -> one `StructuredOutputsParams`.

Three spellings of one constraint, as vLLM takes them:
- vLLM's `structured_outputs` object (the fields of StructuredOutputsParams);
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type":
  "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema",
  "description"?, "strict"?}}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request sets at most one constraint; two fields that each set one are a 400 naming
both. `structured_outputs` holding only options (`disable_any_whitespace`,
`disable_additional_properties`) adds them to the constraint another field sets, as
vLLM does. Every error names the field as the client spelled it: `respell` turns the
engine's `structured_outputs.<field>` (its own errors, and the grammar compiler's,
which come back later) into that spelling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from web.errors import ApiError, invalid

ENGINE_FIELD = "structured_outputs"
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
OPTIONS = frozenset({"disable_any_whitespace", "disable_additional_properties"})
SOURCES = (ENGINE_FIELD, "response_format", *GUIDED)  # the fields that may set a constraint
_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))
_SCHEMA_KEYS = frozenset({"name", "schema", "description", "strict"})
_RESPONSE_FORMAT_TYPES = "'text', 'json_object' or 'json_schema'"


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint `body` sets (None: none), with the options of its
    `structured_outputs`. Raises a 400 naming the field at fault: a malformed value, or
    two fields that each set a constraint."""
    constraints, options = _constraints(body)
    if not constraints:
        return None
    if len(constraints) > 1:
        named = list(constraints)
        raise invalid(
            f"{' and '.join(named)} each set a structured-outputs constraint; a request "
            f"takes one (send one of {', '.join(SOURCES)})",
            named[1],
        )
    [(source, fields)] = constraints.items()
    try:
        return StructuredOutputsParams.from_dict({**fields, **options})
    except (StructuredOutputsError, TypeError, ValueError) as exc:
        message = str(exc)
        if not message.startswith(ENGINE_FIELD):
            message = f"{ENGINE_FIELD}: {message}"
        raise respell(invalid(message, _engine_param(message)), body) from None


def respell(err: ApiError, body: Any) -> ApiError:
    """`err` with a `structured_outputs[.<field>]` param (and the message's leading
    mention of it) renamed to the field `body` set the constraint with; other errors,
    and bodies that spelled it `structured_outputs`, as they are. Never raises."""
    param = err.param
    if param is None or not (param == ENGINE_FIELD or param.startswith(ENGINE_FIELD + ".")):
        return err
    spelled = _spelling(_source(body)).get(param)
    if spelled is not None:
        err.param = spelled
        err.message = err.message.replace(param, spelled, 1)
        err.args = (err.message,)
    return err


def _constraints(body: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """{the body field that sets a constraint: its StructuredOutputsParams fields} and
    the options of `structured_outputs`."""
    constraints: dict[str, dict[str, Any]] = {}
    options: dict[str, Any] = {}
    native = body.get(ENGINE_FIELD)
    if native is not None:
        native = _engine_object(native)
        options = {k: v for k, v in native.items() if k in OPTIONS}
        fields = {k: v for k, v in native.items() if k not in OPTIONS and _is_set(v)}
        if fields:  # options alone ride on another field's constraint
            constraints[ENGINE_FIELD] = fields
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        constraints["response_format"] = response_format
    for name, field in GUIDED.items():
        if body.get(name) is not None:
            constraints[name] = {field: body[name]}
    if native is not None and not constraints:
        constraints[ENGINE_FIELD] = {}  # refused: it constrains nothing by itself
    return constraints, options


def _engine_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{ENGINE_FIELD} must be an object, got {type(value).__name__}", ENGINE_FIELD)
    unknown = sorted((k for k in value if k not in _PARAMS_FIELDS), key=repr)
    if unknown:
        key = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        supported = ", ".join(sorted(_PARAMS_FIELDS))
        where = f"{ENGINE_FIELD}.{key}"
        raise invalid(f"{where} is not supported (the fields: {supported})", where)
    return value


def _response_format(value: Any) -> dict[str, Any] | None:
    """The StructuredOutputsParams fields of OpenAI's `response_format` (None: text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(
            f"response_format must be an object with a type ({_RESPONSE_FORMAT_TYPES})",
            "response_format",
        )
    kind = value.get("type")
    if kind == "text":
        _only(value, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(value, {"type"}, "response_format")
        return {"json_object": True}
    if kind == "json_schema":
        _only(value, {"type", "json_schema"}, "response_format")
        return {"json": _json_schema(value.get("json_schema"))}
    if kind == "structural_tag":
        raise invalid(
            "response_format.type 'structural_tag' is not supported: send the tag as "
            "structured_outputs.structural_tag",
            "response_format.type",
        )
    raise invalid(
        f"response_format.type must be {_RESPONSE_FORMAT_TYPES}, got {_short(kind)}",
        "response_format.type",
    )


def _json_schema(spec: Any) -> Any:
    """The schema of `response_format.json_schema`. `name` and `description` label it
    (they do not reach the model, as in vLLM); `strict` may be either bool: the schema
    is always enforced, which is what `strict: true` asks."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with a name and a schema", where)
    _only(spec, _SCHEMA_KEYS, where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise invalid(f"{where}.{key} must be a {kind.__name__}", f"{where}.{key}")
    if not isinstance(spec.get("schema"), dict):
        shown = "missing" if spec.get("schema") is None else type(spec["schema"]).__name__
        raise invalid(
            f"{where}.schema must be a JSON schema object, got {shown}", f"{where}.schema"
        )
    return spec["schema"]


def _only(value: dict[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted((k for k in value if k not in allowed), key=repr)
    if unknown:
        key = unknown[0] if isinstance(unknown[0], str) else repr(unknown[0])
        kind = f" with type {value['type']!r}" if "type" in value else ""
        raise invalid(
            f"{where}.{key} is not supported{kind} (takes {', '.join(sorted(allowed))})",
            f"{where}.{key}",
        )


def _source(body: Any) -> str | None:
    """The field that sets `body`'s constraint (the first, if several do)."""
    if not isinstance(body, dict):
        return None
    for name in SOURCES:
        value = body.get(name)
        if name == "response_format":
            if isinstance(value, dict) and value.get("type") != "text":
                return name
        elif name == ENGINE_FIELD:
            if isinstance(value, dict) and any(
                k not in OPTIONS and _is_set(v) for k, v in value.items()
            ):
                return name
        elif value is not None:
            return name
    return ENGINE_FIELD


def _spelling(source: str | None) -> dict[str, str]:
    """The engine's field names -> the body's, when `source` set the constraint."""
    if source == "response_format":
        schema = "response_format.json_schema.schema"
        return {
            ENGINE_FIELD: "response_format",
            f"{ENGINE_FIELD}.json": schema,
            f"{ENGINE_FIELD}.json_object": "response_format",
        }
    if source in GUIDED:
        return {ENGINE_FIELD: source, f"{ENGINE_FIELD}.{GUIDED[source]}": source}
    return {}


def _engine_param(message: str) -> str:
    """`structured_outputs` or `structured_outputs.<field>`, as the message starts."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.split(".", 1)[0] == ENGINE_FIELD else ENGINE_FIELD


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
