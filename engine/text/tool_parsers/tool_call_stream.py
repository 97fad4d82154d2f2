"""One output's tool calls, followed delta by delta."""

from __future__ import annotations

from engine.text.tool_parsers.call_ids import CallIdFunction
from engine.text.tool_parsers.call_splitter import CallPiece, CallSplitter, Piece
from engine.text.tool_parsers.tool_call import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolStreamDelta,
)


class ToolCallStream:
    """Feeds one output's text deltas through a format's `CallSplitter` and says, per
    delta, what the client may be sent.

    Contract:
    - `feed(delta)` returns a `ToolStreamDelta`: content that is certainly not part of a
      call (a possible marker prefix is held until decided), and the deltas of calls
      completed by this text. `finish()` at the end of the output returns the rest;
      calling it again returns an empty delta; `feed` after it raises RuntimeError.
    - A call is sent once it is complete and well formed, never before: a first delta
      with its `id`, `name` and `arguments=""`, then one with the whole `arguments`. No
      fragment ever has to be taken back, because a call that turns out malformed comes
      out as content (the cost: a call's arguments are not streamed while generated).
    - Whitespace-only text next to a call (the newlines between `</tool_call>` blocks, a
      newline before the first) is dropped; other text is content verbatim.
    - `result()` (after `finish`) is what the whole-text mode returns for the same text:
      the content and calls the deltas added up to, whatever the chunking.
    """

    def __init__(self, splitter: CallSplitter, call_id: CallIdFunction) -> None:
        self._splitter = splitter
        self._call_id = call_id
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._spaces = ""  # whitespace held: it is dropped if a call follows it
        self._segment_has_text = False  # non-space content since the last call
        self._finished = False

    def feed(self, delta: str) -> ToolStreamDelta:
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish(); start a new stream()")
        return self._emit(self._splitter.push(delta))

    def finish(self) -> ToolStreamDelta:
        if self._finished:
            return ToolStreamDelta()
        self._finished = True
        out = self._emit(self._splitter.close())
        if self._spaces and not self._calls:  # an all-whitespace output stays as it was
            self._content.append(self._spaces)
            out = ToolStreamDelta(out.content + self._spaces, out.tool_calls)
            self._spaces = ""
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._calls)

    def result(self) -> ParsedToolCalls:
        """The content and calls of the whole output (call after `finish`)."""
        content = "".join(self._content)
        return ParsedToolCalls(None if self._calls and not content else content, self.tool_calls)

    def _emit(self, pieces: list[Piece]) -> ToolStreamDelta:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, CallPiece):
                deltas.extend(self._add_call(piece))
            else:
                content.append(self._visible(piece.text))
        text = "".join(content)
        if text:
            self._content.append(text)
        return ToolStreamDelta(text, tuple(deltas))

    def _add_call(self, piece: CallPiece) -> tuple[ToolCallDelta, ToolCallDelta]:
        index = len(self._calls)
        call = ToolCall(self._call_id(index), piece.name, piece.arguments)
        self._calls.append(call)
        self._spaces, self._segment_has_text = "", False
        return (
            ToolCallDelta(index, id=call.id, name=call.name),
            ToolCallDelta(index, arguments=call.arguments),
        )

    def _visible(self, text: str) -> str:
        """The part of `text` that may be sent now, after the whitespace rule."""
        if self._segment_has_text or (text and not text.isspace()):
            text, self._spaces = self._spaces + text, ""
            self._segment_has_text = True
            return text
        self._spaces += text
        return ""
