"""Tool calls in a model's output text, as vLLM's `--tool-call-parser` finds them.

Pick a format by name (`tool_parser("hermes")`, names in `ToolParserName`); its
`ToolParser` turns a whole output into `(content, tool_calls)` (`parse`) or follows a
stream of text deltas (`stream()` -> `ToolCallStream`). A call the text does not form
completely and correctly (unterminated, invalid JSON, no name) is never an error: its
text comes out as content, as generated, in both modes. Both modes give the same content
and calls for the same text, however the stream was cut.

Pure text logic: never imports torch (tests/engine/test_layout.py checks)."""

from engine.text.tool_parsers.call_ids import counting_call_ids, mistral_call_id, random_call_id
from engine.text.tool_parsers.registry import ToolParserName, tool_parser
from engine.text.tool_parsers.tool_call import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolStreamDelta,
)
from engine.text.tool_parsers.tool_call_stream import ToolCallStream
from engine.text.tool_parsers.tool_parser import ToolParser

__all__ = [
    "ParsedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolParserName",
    "ToolStreamDelta",
    "counting_call_ids",
    "mistral_call_id",
    "random_call_id",
    "tool_parser",
]
