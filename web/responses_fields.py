"""OpenAI's Responses API request (`POST /v1/responses`) -> a chat completions body.

The server is stateless: a response is not stored, so `previous_response_id`, `store:
true` and what needs them are refused by name. What is served maps onto chat
completions, field by field:
- `input`: a string (one user turn) or a list of items: messages (`role` user, system,
  developer, assistant; `content` a string or `input_text` / `output_text` parts),
  `function_call` items (an assistant's calls) and `function_call_output` items (tool
  turns); `instructions`: a system turn first;
- `max_output_tokens` -> `max_completion_tokens`; `temperature`, `top_p`, `user`;
- `tools` (flat function tools: `{"type": "function", "name", "parameters", ...}`),
  `tool_choice` (`{"type": "function", "name"}` for a named one),
  `parallel_tool_calls`;
- `text.format` (`text`, `json_object`, `json_schema` with `name`, `schema`, `strict`)
  -> `response_format`.
Errors of the chat route come back under the Responses field names (`renamed`).
"""

from __future__ import annotations

import re
from typing import Any

from web.errors import ApiError, invalid
from web.openai_fields import FieldRule, Origin, Support

_O = Origin.OPENAI
_STATELESS = "this server keeps no responses"


def _rule(name: str, support: Support, why: str, **kw: Any) -> FieldRule:
    return FieldRule(name, _O, support, why, **kw)


def _refused(name: str, why: str, example: Any) -> FieldRule:
    return _rule(name, Support.REFUSED, why, refused_example=example)


def _some(name: str, values: str, accepts, why: str, good: Any, bad: Any) -> FieldRule:
    return FieldRule(name, _O, Support.SOME_VALUES, why, values, accepts, bad, good)


_S = Support.SUPPORTED
RESPONSES_RULES: dict[str, FieldRule] = {
    r.name: r
    for r in [
        _rule("model", _S, "must be the served model's name; another gets 404"),
        _rule(
            "input",
            _S,
            "a string, or message, `function_call` and `function_call_output` items with "
            "text content (`input_text`, `output_text` parts)",
        ),
        _rule("instructions", _S, "a system turn before the input"),
        _rule("max_output_tokens", _S, "as chat's max_completion_tokens"),
        _rule("temperature", _S, ">= 0; 0 is greedy"),
        _rule("top_p", _S, "in (0, 1]"),
        _rule("user", _S, "identifies the caller (logged), nothing else"),
        _rule("safety_identifier", _S, "as `user`"),
        _rule("tools", _S, "function tools only, as chat's tools (docs/tool_calling.md)"),
        _rule("tool_choice", _S, 'as chat\'s; a named one is `{"type": "function", "name"}`'),
        _rule("parallel_tool_calls", _S, "as chat's"),
        _rule(
            "text",
            _S,
            '`format` only: `{"type": "text"}`, `"json_object"`, or `"json_schema"` with '
            "`name`, `schema`, `strict` (enforced by a grammar)",
        ),
        _some("store", "`false`", lambda v: v is False, _STATELESS, False, True),
        _some(
            "background",
            "`false`",
            lambda v: v is False,
            "requests run in the foreground",
            False,
            True,
        ),
        _some(
            "include",
            "`[]`",
            lambda v: v == [],
            "there is nothing extra to include",
            [],
            ["reasoning.encrypted_content"],
        ),
        _some(
            "truncation",
            '`"disabled"`',
            lambda v: v == "disabled",
            "input is never truncated: shorten it",
            "disabled",
            "auto",
        ),
        _some(
            "service_tier",
            '`"auto"`, `"default"`',
            lambda v: v in ("auto", "default"),
            "there is one tier",
            "auto",
            "flex",
        ),
        _rule(
            "stream",
            _S,
            "server-sent Responses events: items added, text, reasoning and function-call "
            "argument deltas, items done, `response.completed`",
        ),
        _refused(
            "stream_options", "obfuscation is not implemented", {"include_obfuscation": False}
        ),
        _refused(
            "previous_response_id", _STATELESS + ": send the whole conversation in input", "resp_1"
        ),
        _refused("conversation", _STATELESS, "conv_1"),
        _refused("metadata", "only with store, and " + _STATELESS, {"k": "v"}),
        _refused("prompt", "no stored prompt templates", {"id": "pmpt_1"}),
        _refused("prompt_cache_key", "the prefix cache is shared by every request", "k"),
        _refused("prompt_cache_retention", "the prefix cache is shared by every request", "24h"),
        _refused("prompt_cache_options", "the prefix cache is shared by every request", {}),
        _refused(
            "reasoning", "reasoning effort cannot be set; see --reasoning-parser", {"effort": "low"}
        ),
        _refused("top_logprobs", "not built for /v1/responses: use chat's logprobs", 2),
        _refused("max_tool_calls", "use parallel_tool_calls: false for one call", 1),
        _refused("context_management", "the context is never compacted", [{"type": "compaction"}]),
        _refused("background_options", "requests run in the foreground", {}),
        _refused("moderation", "no moderation", {}),
        _refused("image", "this server serves a text-only model", {}),
        _refused("access_programs", "not supported", []),
    ]
}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body asks for (fields checked first)."""
    messages = _messages(body.get("input"))
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise invalid("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls", "service_tier"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("safety_identifier") is not None and "user" not in chat:
        chat["user"] = body["safety_identifier"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat["response_format"] = _format(body["text"])
    return chat


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _call(out, item, where)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise invalid(f"{where} must have a string call_id and output", where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise invalid(
                f"{where}.type {str(kind)[:40]!r} is not supported: input takes messages, "
                "function_call and function_call_output items",
                f"{where}.type",
            )
    return out


def _message(item: dict, where: str) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise invalid(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS):
                path = f"{where}.content[{j}]"
                raise invalid(f"{path} must be an input_text or output_text part (text only)", path)
            if not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content[{j}].text must be a string", f"{where}.content[{j}]"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(
            f"{where}.content must be a string or a list of text parts", f"{where}.content"
        )
    return {"role": role, "content": content}


def _call(out: list[dict[str, Any]], item: dict, where: str) -> None:
    """A function_call item joins the assistant turn before it (or starts one)."""
    fields = ("call_id", "name", "arguments")
    if not all(isinstance(item.get(k), str) for k in fields):
        raise invalid(f"{where} must have string call_id, name and arguments", where)
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
        out[-1]["tool_calls"].append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tools(value: Any) -> Any:
    if not isinstance(value, list):
        return value  # the chat route names the error
    tools = []
    for i, tool in enumerate(value):
        if not (isinstance(tool, dict) and tool.get("type") == "function"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(
                f"tools[{i}].type {str(kind)[:40]!r} is not supported: function tools only",
                f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(text: Any) -> dict[str, Any]:
    if not isinstance(text, dict) or set(text) - {"format"}:
        extra = sorted(set(text) - {"format"}) if isinstance(text, dict) else []
        name = f"text.{extra[0]}" if extra else "text"
        raise invalid(f"{name} is not supported: text takes format only", name)
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type must be text, json_object or json_schema", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


_RENAMES = (
    (re.compile(r"^max_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"^messages\b(\[\d+\])?(\.\w+)?"), "input"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
)


def renamed(err: ApiError) -> ApiError:
    """A chat route error under the Responses field it came from."""
    param = err.param
    for pattern, name in _RENAMES:
        if param and pattern.match(param):
            new = pattern.sub(name, param, count=1)
            err.message = err.message.replace(param, new, 1)
            err.param = new
            err.args = (err.message,)
            break
    return err
