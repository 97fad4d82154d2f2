"""The tool-call formats by name: vLLM's `--tool-call-parser` names."""

from __future__ import annotations

from enum import StrEnum

from engine.text.tool_parsers.call_ids import CallIdFunction
from engine.text.tool_parsers.call_splitter import CallSplitter
from engine.text.tool_parsers.hermes import HermesSplitter
from engine.text.tool_parsers.llama3_json import Llama3JsonSplitter
from engine.text.tool_parsers.mistral import MistralSplitter
from engine.text.tool_parsers.tool_parser import ToolParser


class ToolParserName(StrEnum):
    """A tool-call format, named as vLLM names it."""

    HERMES = "hermes"  # <tool_call>{...}</tool_call>: Hermes, Qwen 2.5 / 3, SmolLM3
    LLAMA3_JSON = "llama3_json"  # {"name", "parameters"}; ...: Llama 3.1 / 3.2 / 3.3
    MISTRAL = "mistral"  # [TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...}


_SPLITTERS: dict[ToolParserName, type[CallSplitter]] = {
    ToolParserName.HERMES: HermesSplitter,
    ToolParserName.LLAMA3_JSON: Llama3JsonSplitter,
    ToolParserName.MISTRAL: MistralSplitter,
}


def tool_parser(name: str, call_id: CallIdFunction | None = None) -> ToolParser:
    """The parser for `name` (a `ToolParserName` or its string). An unknown name raises
    ValueError naming the choices. `call_id`: see `ToolParser`."""
    try:
        key = ToolParserName(name)
    except ValueError:
        choices = ", ".join(ToolParserName)
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {choices} (--tool-call-parser)"
        ) from None
    return ToolParser(_SPLITTERS[key], call_id)
