"""What a request's tool choice does to its sampling: the grammar `required` and a
named function write the reply with, the special tokens `auto`'s parser must see, and
the errors of that grammar named after the tools that made it."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.sampling_params import SamplingParams
from engine.text.chat_output import ToolChoiceMode
from web.chat_parsing import ChatParsing
from web.errors import ApiError, invalid
from web.structured_fields import ENGINE_FIELD
from web.tool_fields import ToolRequest


def with_tool_choice(
    params: SamplingParams, tools: ToolRequest | None, parsing: ChatParsing, body: dict[str, Any]
) -> SamplingParams:
    """`params` as the tool choice needs them; a 400 naming the field for a combination
    that cannot be honoured (a structured output beside a choice that needs the reply's
    text: either a grammar of its own, or free text to find calls in)."""
    if tools is None or tools.mode is ToolChoiceMode.NONE:
        return params
    if params.structured_outputs is not None:
        raise invalid(
            f"tool_choice {_named(tools)} cannot be combined with a structured output "
            "(response_format, structured_outputs, guided_*): "
            + (
                "the calls are written by a grammar of their own"
                if tools.mode is not ToolChoiceMode.AUTO
                else "a constraint leaves no free text to find calls in"
            ),
            "tool_choice",
        )
    constraint = tools.constraint()
    if constraint is not None:
        return dataclasses.replace(params, structured_outputs=constraint)
    parser = parsing.tools()
    if parser is not None and parser.needs_special_tokens:
        if body.get("skip_special_tokens") is True:
            raise invalid(
                f"skip_special_tokens=true hides the markers --tool-call-parser "
                f"{parsing.tool_call_parser} finds calls by; leave it unset with tool_choice "
                '"auto"',
                "skip_special_tokens",
            )
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def _named(tools: ToolRequest) -> str:
    return repr(tools.function) if tools.mode is ToolChoiceMode.NAMED else f'"{tools.mode}"'


def respell_tools(err: ApiError, body: Any) -> ApiError:
    """A grammar error of a tool choice's own (it names `structured_outputs...`, a field
    this body did not send) renamed to `tools`: a function's `parameters` schema did
    not compile. Other errors as they are; never raises."""
    param = err.param
    if not (isinstance(body, dict) and body.get("tools") and param):
        return err
    if param.startswith(ENGINE_FIELD) and body.get(ENGINE_FIELD) is None:
        err.param = "tools"
        err.message = err.message.replace(param, "tools (a function's parameters schema)", 1)
        err.args = (err.message,)
    return err
