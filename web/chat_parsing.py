"""How the server reads chat outputs: vLLM's `--enable-auto-tool-choice`,
`--tool-call-parser NAME` and `--reasoning-parser NAME` (frozen once built)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.text.reasoning_parser import ReasoningParser, reasoning_parser
from engine.text.tool_parsers import ToolParser, tool_parser


@dataclass(frozen=True)
class ChatParsing:
    """The output parsers a server was started with.

    `tool_call_parser` names the format of tool calls in free text (`hermes`,
    `llama3_json`, `mistral`); `enable_auto_tool_choice` lets requests use
    `tool_choice: "auto"` (which needs that parser, as in vLLM). `required` and a named
    function need no parser: a grammar writes the calls. `reasoning_parser` splits
    `<think>` reasoning off into `reasoning_content`. Unknown names are a ValueError
    naming the flag, at start-up."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of hermes, "
                "llama3_json, mistral): auto tool calls are parsed from the model's text"
            )
        self.tools()  # an unknown name fails here, naming the flag
        self.reasoning()

    def tools(self) -> ToolParser | None:
        """The tool-call parser, or None."""
        return None if self.tool_call_parser is None else tool_parser(self.tool_call_parser)

    def reasoning(self) -> ReasoningParser | None:
        """The reasoning parser, or None."""
        name = self.reasoning_parser
        return None if name is None else reasoning_parser(name)
