"""JSON schema rewrites around known xgrammar bugs, applied before compiling. Each
names its upstream issue: drop it once the pinned xgrammar has the fix."""

from __future__ import annotations

import json
from typing import Any

# keys whose value maps names to schemas, and keys whose value is data, not a schema
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_DATA_KEYS = {"default", "examples", "const", "enum"}
_OWN_PATTERN = {"pattern", "format", "enum", "const"}  # a string already constrained so


def bounded_strings_as_patterns(schema_text: str) -> str:
    """`schema_text` with each string schema bounded only by length (minLength,
    maxLength; no pattern, format, enum or const) bounded by the same pattern instead.

    xgrammar 0.2.x compiles a length-bounded string to a bare character class that
    admits raw control characters, which JSON forbids, so the output is not valid JSON
    (mlc-ai/xgrammar#800). Its `pattern` path matches JSON string characters, so
    `^[\\s\\S]{min,max}$` (length in code points, as maxLength counts) yields the same
    strings minus the invalid ones. Neither path emits escape sequences."""
    schema = json.loads(schema_text)
    fixed = _schema(schema)
    return schema_text if fixed == schema else json.dumps(fixed, separators=(",", ":"))


def _schema(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _schema(sub) for name, sub in value.items()}
        elif key in _DATA_KEYS:
            out[key] = value
        elif isinstance(value, list):
            out[key] = [_schema(item) for item in value]
        else:
            out[key] = _schema(value)
    return _length_as_pattern(out)


def _length_as_pattern(node: dict) -> dict:
    bounds = {"minLength", "maxLength"} & node.keys()
    if node.get("type") != "string" or not bounds or _OWN_PATTERN & node.keys():
        return node
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not _count(low) or not (high is None or (_count(high) and low <= high)):
        return node  # invalid bounds: xgrammar's own error names them
    pattern = f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"
    kept = {k: v for k, v in node.items() if k not in bounds}
    return kept | {"pattern": pattern}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
