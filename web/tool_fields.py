"""A chat body's `tools`, `tool_choice` and `parallel_tool_calls` -> one `ToolRequest`.

OpenAI's shapes, as vLLM serves them:
- `tools`: function tools, `{"type": "function", "function": {"name", "description"?,
  "parameters"? (a JSON schema of an object), "strict"?}}`, names unique;
- `tool_choice`: `"none"` (the model answers in text), `"auto"` (it may call tools: the
  calls are parsed from its text by `--tool-call-parser`, which `--enable-auto-tool-choice`
  turns on), `"required"` (it calls at least one), or `{"type": "function", "function":
  {"name"}}` (it calls that one). Unset: `"auto"` with tools, as OpenAI's default.
- `parallel_tool_calls`: `false` holds `required` to one call (a named function is always
  one); under `"auto"` only a grammar could hold the model to it, so `false` is refused
  there rather than ignored.

`required` and a named function are enforced by a grammar (`ToolRequest.constraint`):
the arguments match each function's `parameters` schema by construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.structured_outputs import StructuredOutputsParams
from engine.text.chat_output import ToolChoiceMode
from web.chat_parsing import ChatParsing
from web.errors import invalid

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_EMPTY_OBJECT = {"type": "object", "properties": {}}
_CHOICE_VALUES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as the route serves them: the tools (for the chat
    template), how calls are made (`mode`), the function a named choice forces, and
    whether several calls may come at once."""

    tools: list[dict]
    mode: ToolChoiceMode
    function: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar `required` and a named choice need (None for none and auto)."""
        if self.mode is ToolChoiceMode.NAMED:  # compact: arguments are data, not prose
            schema = self._parameters(self.function)
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        if self.mode is not ToolChoiceMode.REQUIRED:
            return None
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": self._calls()}}
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls, disable_any_whitespace=True)

    def _calls(self) -> list[dict]:
        """One schema per function: `{"name": <it>, "parameters": <its arguments>}`,
        name first (the stream reads it before the arguments)."""
        return [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": self._parameters(name)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in self._names()
        ]

    def _names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _parameters(self, name: str | None) -> dict:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or _EMPTY_OBJECT


def tool_request(body: dict[str, Any], parsing: ChatParsing) -> ToolRequest | None:
    """The body's tools and choice (None: no tools, so nothing to call); a 400 naming
    the field at fault otherwise."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = _parallel(body.get("parallel_tool_calls"))
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools: send the functions in tools", "tool_choice")
        return None
    mode, function = _choice(choice, tools)
    if mode is ToolChoiceMode.AUTO and not parsing.enable_auto_tool_choice:
        raise invalid(
            'tool_choice "auto" (the default with tools) needs a server started with '
            "--enable-auto-tool-choice --tool-call-parser NAME; this one can serve "
            'tool_choice "required", "none" or a named function',
            "tool_choice",
        )
    if mode is ToolChoiceMode.AUTO and parallel is False:
        raise invalid(
            'parallel_tool_calls=false needs tool_choice "required" or a named function: '
            'under "auto" the calls are parsed from free text, and nothing holds the model '
            "to one",
            "parallel_tool_calls",
        )
    return ToolRequest(tools, mode, function, parallel is not False)


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        name = _tool(tool, f"tools[{i}]")
        if name in names:
            raise invalid(f"tools[{i}].function.name {name!r} is given twice", f"tools[{i}]")
        names.add(name)
    return value


def _tool(tool: Any, where: str) -> str:
    """Checks one function tool; returns its name."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    _only(tool, _TOOL_KEYS, where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object with a name", f"{where}.function")
    _only(function, _FUNCTION_KEYS, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}"[
                :200
            ],
            f"{where}.function.name",
        )
    if not isinstance(function.get("description", ""), str):
        raise invalid(f"{where}.function.description must be a string", f"{where}.function")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(
            f"{where}.function.parameters must be a JSON schema object",
            f"{where}.function.parameters",
        )
    if not isinstance(function.get("strict", False), bool):
        raise invalid(f"{where}.function.strict must be a bool", f"{where}.function.strict")
    return name


def _only(value: dict, allowed: frozenset[str], where: str) -> None:
    extra = sorted(set(value) - allowed, key=repr)
    if extra:
        raise invalid(
            f"{where}.{extra[0]} is not a field of a function tool", f"{where}.{extra[0]}"
        )


def _choice(choice: Any, tools: list[dict]) -> tuple[ToolChoiceMode, str | None]:
    if choice is None or choice == "auto":
        return ToolChoiceMode.AUTO, None
    if choice == "none":
        return ToolChoiceMode.NONE, None
    if choice == "required":
        return ToolChoiceMode.REQUIRED, None
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if not (named and isinstance(choice.get("function"), dict)):
        raise invalid(f"tool_choice must be {_CHOICE_VALUES}", "tool_choice")
    name = choice["function"].get("name")
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise invalid(
            f"tool_choice.function.name {str(name)[:80]!r} is none of the tools "
            f"({', '.join(known)[:300]})",
            "tool_choice.function.name",
        )
    return ToolChoiceMode.NAMED, name


def _parallel(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise invalid(
            f"parallel_tool_calls must be a bool, got {value!r}"[:200], "parallel_tool_calls"
        )
    return value
