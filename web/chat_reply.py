"""A chat choice's text in OpenAI's shape: the `message` of a whole reply, the `delta`
of a stream chunk, and the finish reason, from the split `ChatOutputFormat` makes
(reasoning, content, tool calls)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.text.chat_output import ChatDelta, ChatOutputFormat, ChatReply, ToolChoiceMode
from web.chat_parsing import ChatParsing
from web.tool_fields import ToolRequest


@dataclass(frozen=True)
class ChatReplyShape:
    """Per request: how its choices' text becomes messages and deltas.

    `format` splits the text; `show_reasoning`: a reasoning parser is applied and the
    client wants it (`include_reasoning`), so messages carry `reasoning_content`.
    `plain`: nothing is split (no tools, no reasoning parser), so every delta is sent as
    it came, content and all, as before tools existed."""

    format: ChatOutputFormat
    show_reasoning: bool = False
    plain: bool = True

    @classmethod
    def of(
        cls,
        tools: ToolRequest | None,
        parsing: ChatParsing,
        *,
        include_reasoning: bool,
        constrained: bool,
    ) -> ChatReplyShape:
        """`constrained`: a structured-outputs grammar writes the whole output, so there
        is no reasoning to find (the reasoning parser is not applied)."""
        mode = ToolChoiceMode.NONE if tools is None else tools.mode
        reasoning = None if constrained else parsing.reasoning()
        fmt = ChatOutputFormat(
            tool_mode=mode,
            tool_parser=parsing.tools() if mode is ToolChoiceMode.AUTO else None,
            function_name=None if tools is None else tools.function,
            reasoning=reasoning,
        )
        plain = mode is ToolChoiceMode.NONE and reasoning is None
        return cls(fmt, reasoning is not None and include_reasoning, plain)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole reply's `message`, and whether it calls tools."""
        reply: ChatReply = self.format.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.show_reasoning:
            message["reasoning_content"] = reply.reasoning_content
        if reply.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
        return message, bool(reply.tool_calls)

    def delta(self, parts: ChatDelta) -> dict[str, Any]:
        """A chunk's `delta` (without `role`): content unless the step only calls tools,
        reasoning when shown, tool-call deltas in OpenAI's shape."""
        delta: dict[str, Any] = {}
        if parts.content or not parts.tool_calls:
            delta["content"] = parts.content
        if self.show_reasoning and parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts.tool_calls:
            delta["tool_calls"] = [d.to_openai() for d in parts.tool_calls]
        return delta


def finish_reason(engine_reason: str | None, calls_tools: bool) -> str | None:
    """OpenAI's `"tool_calls"` for a choice that ended by itself having called tools;
    the engine's reason otherwise (a cut by length stays `"length"`: its last call's
    arguments may be incomplete)."""
    return "tool_calls" if calls_tools and engine_reason == "stop" else engine_reason


def merged(first: ChatDelta, second: ChatDelta) -> ChatDelta:
    """Two steps' parts as one (a final delta and what `finish` flushes)."""
    return ChatDelta(
        first.reasoning + second.reasoning,
        first.content + second.content,
        first.tool_calls + second.tool_calls,
    )
