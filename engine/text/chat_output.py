"""A chat choice's output text split into reasoning, content and tool calls, whole
(`ChatOutputFormat.parse`) or delta by delta (`ChatOutputFormat.stream()`), for every
`tool_choice` mode.

Pure text logic: never imports torch (tests/engine/test_layout.py checks)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from engine.text.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningStream
from engine.text.tool_parsers.call_ids import CallIdFunction, random_call_id
from engine.text.tool_parsers.forced_calls import CallArrayStream, NamedCallStream
from engine.text.tool_parsers.tool_call import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolStreamDelta,
)
from engine.text.tool_parsers.tool_call_stream import ToolCallStream
from engine.text.tool_parsers.tool_parser import ToolParser


class ToolChoiceMode(StrEnum):
    """How a request's tool calls are found in its output."""

    NONE = "none"  # no tool calls: all text is content
    AUTO = "auto"  # free text parsed by a ToolParser (--tool-call-parser); calls come whole
    REQUIRED = "required"  # grammar: [{"name": "<fn>", "parameters": {...}}, ...], >= 1
    NAMED = "named"  # grammar: exactly the named function's arguments (a JSON object)


@dataclass(frozen=True)
class ChatDelta:
    """What one stream step gives the client; any part may be empty (nothing to send).
    The relative order of the parts within one step is not kept: OpenAI's delta keeps
    reasoning, content and tool calls apart anyway."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatReply(NamedTuple):
    """A whole output split, OpenAI's message shape. `reasoning_content` is None when
    the output has no reasoning part (or no reasoning parser is used); `content` is None
    when there are tool calls and no other text, or when reasoning took everything."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]


class _ContentOnly:
    """The tool stream of mode NONE: every delta is content, as it came."""

    def __init__(self) -> None:
        self._content: list[str] = []

    def feed(self, delta: str) -> ToolStreamDelta:
        self._content.append(delta)
        return ToolStreamDelta(delta)

    def finish(self) -> ToolStreamDelta:
        return ToolStreamDelta()

    def result(self) -> ParsedToolCalls:
        return ParsedToolCalls("".join(self._content), [])


ToolStream = ToolCallStream | NamedCallStream | CallArrayStream | _ContentOnly


class ChatOutputStream:
    """One choice's output, fed in text deltas.

    Contract:
    - The reasoning stream (if any) splits each delta first; its content part is what
      the tool stream sees. Without either, a delta comes out as content, unchanged.
    - `feed(delta)` returns what that text decides (text that may still turn out to be
      a marker is held back, never sent and then taken back); `finish()` at the end of
      the output returns the rest; again, an empty delta; `feed` after it raises
      RuntimeError.
    - `result()` (after `finish`) is what the deltas added up to, whatever the chunking:
      reasoning and content concatenated, each index's argument fragments concatenated.
    """

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._finished = False

    def feed(self, delta: str) -> ChatDelta:
        if self._finished:
            raise RuntimeError("ChatOutputStream.feed after finish(); start a new stream()")
        split = self._reasoning.feed(delta) if self._reasoning else ReasoningDelta(content=delta)
        tools = self._tools.feed(split.content)
        return ChatDelta(split.reasoning, tools.content, tools.tool_calls)

    def finish(self) -> ChatDelta:
        if self._finished:
            return ChatDelta()
        self._finished = True
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        fed, rest = self._tools.feed(split.content), self._tools.finish()
        return ChatDelta(
            split.reasoning, fed.content + rest.content, fed.tool_calls + rest.tool_calls
        )

    def result(self) -> ChatReply:
        """The split of the whole output (call after `finish`)."""
        if not self._finished:
            raise RuntimeError("ChatOutputStream.result before finish()")
        reasoning = self._reasoning.result().reasoning_content if self._reasoning else None
        content, calls = self._tools.result()
        if content == "" and reasoning is not None:
            content = None  # reasoning took everything
        return ChatReply(reasoning, content, calls)


class ChatOutputFormat:
    """How one request's choices are split; built once per request, it hands out one
    stream per choice and holds no per-output state.

    - NONE: all text after the reasoning is content.
    - AUTO: `tool_parser` (required) finds calls in the text after the reasoning; they
      come out whole (`ToolCallStream`), named by the parser's own call ids (build the
      parser with `tool_parser(name, call_id)` to choose them); `call_id` is not used.
    - REQUIRED / NAMED (`function_name` required): the grammar forces the output's shape
      (`forced_calls`), and the arguments stream as they are generated. The grammar
      constrains the whole output from its first token, so there is no room for
      reasoning: `reasoning` is not applied in these modes. Calls are named by
      `call_id` (default `random_call_id`; pass `mistral_call_id` for Mistral models).

    `reasoning` splits off the reasoning first (`in_reasoning` is passed to its
    `stream()`: where an output without `<think>` starts); `tool_parser` is ignored
    outside AUTO, `function_name` outside NAMED. A missing required part raises
    ValueError."""

    def __init__(
        self,
        *,
        tool_mode: ToolChoiceMode = ToolChoiceMode.NONE,
        tool_parser: ToolParser | None = None,
        function_name: str | None = None,
        reasoning: ReasoningParser | None = None,
        in_reasoning: bool | None = None,
        call_id: CallIdFunction | None = None,
    ) -> None:
        self.tool_mode = ToolChoiceMode(tool_mode)
        if self.tool_mode is ToolChoiceMode.AUTO and tool_parser is None:
            raise ValueError(
                'tool_choice "auto" needs a tool-call parser; start the server with '
                "--tool-call-parser"
            )
        if self.tool_mode is ToolChoiceMode.NAMED and not function_name:
            raise ValueError("a named tool_choice needs the function's name")
        self._tool_parser = tool_parser
        self._function_name = function_name or ""
        forced = self.tool_mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
        self._reasoning = None if forced else reasoning
        self._in_reasoning = in_reasoning
        self._call_id = call_id or random_call_id

    def stream(self) -> ChatOutputStream:
        """A fresh stream for one output."""
        reasoning = self._reasoning.stream(self._in_reasoning) if self._reasoning else None
        return ChatOutputStream(reasoning, self._tool_stream())

    def parse(self, text: str) -> ChatReply:
        """The split of a whole output: exactly what a stream fed the same text in any
        chunks adds up to. Never raises on any text."""
        stream = self.stream()
        stream.feed(text)
        stream.finish()
        return stream.result()

    def _tool_stream(self) -> ToolStream:
        mode = self.tool_mode
        if mode is ToolChoiceMode.AUTO:
            assert self._tool_parser is not None
            return self._tool_parser.stream()
        if mode is ToolChoiceMode.NAMED:
            return NamedCallStream(self._function_name, self._call_id)
        if mode is ToolChoiceMode.REQUIRED:
            return CallArrayStream(self._call_id)
        return _ContentOnly()
