"""What the tool-call parsers return: whole calls, and the pieces a stream sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    """One complete function call, in OpenAI's terms.

    `arguments` is JSON text of an object (OpenAI's `function.arguments` is a string),
    re-serialized from what the model wrote: `json.dumps(value, ensure_ascii=False)`, so
    key order and non-ASCII text are kept, whitespace is normalized."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The entry of a chat completion message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ParsedToolCalls(NamedTuple):
    """A whole output split: `content` is the text outside the calls (None when there
    are calls and no such text), `tool_calls` the calls in the order written."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of a streamed chunk's `delta.tool_calls`, OpenAI's shape.

    The first delta of a call carries `id` and `name` (and `arguments == ""`); the
    following ones only `arguments` fragments. The fragments of one `index` concatenate
    to the final `ToolCall.arguments`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The dict to put in `choices[i].delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolStreamDelta:
    """What one stream step gives the client: `content` text that is certainly not part
    of a call, and call deltas in order. Both may be empty (nothing to send yet).

    The relative order of content and calls within one step is not kept: OpenAI keeps a
    message's content and its tool calls apart anyway."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)
