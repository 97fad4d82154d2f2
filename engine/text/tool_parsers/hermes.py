"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(Hermes 2 Pro / 3, Qwen 2.5 and Qwen 3, SmolLM3)."""

from __future__ import annotations

from engine.text.tool_parsers.call_json import call_from_json
from engine.text.tool_parsers.call_splitter import CallSplitter, Piece, TextPiece
from engine.text.tool_parsers.marker_prefix import partial_marker_len

START = "<tool_call>"
END = "</tool_call>"


class HermesSplitter(CallSplitter):
    """Text outside blocks is content, wherever it stands (before, between, after).

    A block runs from `<tool_call>` to the first `</tool_call>`; its body must be one
    JSON call object (`call_json`). A block with any other body, and an unterminated
    block at the end of the output, is content, markers included. The first end marker
    closes the block even inside a JSON string (vLLM does the same)."""

    def __init__(self) -> None:
        self._buffer = ""  # outside: text not yet decided; inside: the body so far
        self._inside = False
        self._searched = 0  # inside: the body before this index holds no end marker

    def close(self) -> list[Piece]:
        pieces = self.push("")
        rest = START + self._buffer if self._inside else self._buffer
        self._buffer, self._inside = "", False
        return [*pieces, TextPiece(rest)] if rest else pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Decide what the buffer allows; True when a marker was passed (go again)."""
        return self._step_inside(pieces) if self._inside else self._step_outside(pieces)

    def _step_outside(self, pieces: list[Piece]) -> bool:
        start = self._buffer.find(START)
        if start < 0:  # all content, but for a possible start marker's prefix
            cut = len(self._buffer) - partial_marker_len(self._buffer, START)
            start_of_rest = cut
        else:
            cut, start_of_rest = start, start + len(START)
        if cut:
            pieces.append(TextPiece(self._buffer[:cut]))
        self._buffer = self._buffer[start_of_rest:]
        self._inside, self._searched = start >= 0, 0
        return self._inside

    def _step_inside(self, pieces: list[Piece]) -> bool:
        end = self._buffer.find(END, self._searched)
        if end < 0:
            self._searched = max(0, len(self._buffer) - len(END) + 1)
            return False
        body = self._buffer[:end]
        pieces.append(call_from_json(body) or TextPiece(START + body + END))
        self._buffer, self._inside = self._buffer[end + len(END) :], False
        return True
