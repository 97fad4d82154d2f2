"""A tool-call format, ready to parse whole outputs or follow streams."""

from __future__ import annotations

from engine.text.tool_parsers.call_ids import CallIdFunction
from engine.text.tool_parsers.call_splitter import CallSplitter
from engine.text.tool_parsers.tool_call import ParsedToolCalls
from engine.text.tool_parsers.tool_call_stream import ToolCallStream


class ToolParser:
    """One `--tool-call-parser` format. Holds no per-output state: build one per server
    (`tool_parser(name)`), then call `parse` per finished output or `stream()` once per
    streamed output (each choice of a request needs its own stream).

    `call_id` names the calls (see `call_ids`); by default the format's own rule (random
    `call_xxx` ids; Mistral's nine letters and digits). `needs_special_tokens`: decode the
    output with `skip_special_tokens=False`, or the markers never reach the parser."""

    def __init__(
        self, splitter_class: type[CallSplitter], call_id: CallIdFunction | None = None
    ) -> None:
        self._splitter_class = splitter_class
        self._call_id = call_id or splitter_class.call_id
        self.needs_special_tokens = splitter_class.needs_special_tokens

    def stream(self) -> ToolCallStream:
        """A fresh stream for one output."""
        return ToolCallStream(self._splitter_class(), self._call_id)

    def parse(self, text: str) -> ParsedToolCalls:
        """`(content, tool_calls)` of a whole output: exactly what a stream fed the same
        text in any chunks would add up to. Never raises on any text."""
        stream = self.stream()
        stream.feed(text)
        stream.finish()
        return stream.result()
