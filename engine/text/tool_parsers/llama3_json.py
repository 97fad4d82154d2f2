"""`llama3_json`: Llama 3.x's JSON tool calls, `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

from enum import Enum, auto

from engine.text.tool_parsers.call_json import call_from_json
from engine.text.tool_parsers.call_splitter import CallSplitter, Piece, TextPiece
from engine.text.tool_parsers.json_span import JsonSpan
from engine.text.tool_parsers.marker_prefix import is_marker_prefix

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class _Lead(Enum):
    """What the text before a possible call object says."""

    WAIT = auto()  # blank, or a prefix of the lead-in: later text decides
    CALL = auto()  # a lead-in, then `{`: a call object starts
    TEXT = auto()  # anything else: no (further) call


class Llama3JsonSplitter(CallSplitter):
    """The output is calls only if it opens with one: optional whitespace, optional
    `<|python_tag|>`, then `{` (as vLLM's streaming parser decides; its whole-text mode
    also finds a JSON object after other text, which a stream cannot take back).

    Each call is one JSON object (`call_json`: `parameters` or `arguments`). After a
    call may come another, led by `;` (or by whitespace alone; vLLM needs the `;`),
    optionally `<|python_tag|>` again. From the first thing that is not a well-formed
    call on, the rest of the output is content, as generated: an output that does not
    open with a call is all content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._calls_seen = 0
        self._span: JsonSpan | None = None  # set while a call object is open
        self._span_start = 0  # the object's first char in the buffer
        self._text_only = False  # no more calls: everything is content

    def push(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while not self._text_only and self._step(pieces):
            pass
        if self._text_only and self._buffer:
            pieces.append(TextPiece(self._buffer))
            self._buffer = ""
        return pieces

    def close(self) -> list[Piece]:
        pieces = self.push("")
        rest = self._buffer
        if self._calls_seen and self._span is None and rest.strip() == SEPARATOR:
            rest = ""  # a `;` after the last call belongs to the call list
        if rest:
            pieces.append(TextPiece(rest))
        self._buffer, self._text_only = "", True
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Decide what the buffer allows; True when a call was completed (go again)."""
        if self._span is None:
            lead, start = _lead_in(self._buffer, first=self._calls_seen == 0)
            if lead is _Lead.TEXT:
                self._text_only = True
            if lead is not _Lead.CALL:
                return False
            self._span, self._span_start = JsonSpan(), start
        end = self._span.scan(self._buffer[self._span_start :])
        if end is None:
            return False
        call = call_from_json(self._buffer[self._span_start : self._span_start + end])
        self._span = None
        if call is None:
            self._text_only = True
            return False
        pieces.append(call)
        self._calls_seen += 1
        self._buffer = self._buffer[self._span_start + end :]
        return True


def _lead_in(text: str, first: bool) -> tuple[_Lead, int]:
    """Whether `text` opens with a call's lead-in, and where its object starts:
    whitespace, (after a call) an optional `;` and whitespace, an optional python tag
    and whitespace, then `{`."""
    i = _skip_space(text, 0)
    if not first and text.startswith(SEPARATOR, i):
        i = _skip_space(text, i + len(SEPARATOR))
    if text.startswith(PYTHON_TAG, i):
        i = _skip_space(text, i + len(PYTHON_TAG))
    if i == len(text) or is_marker_prefix(text[i:], PYTHON_TAG):
        return _Lead.WAIT, i
    return (_Lead.CALL if text[i] == "{" else _Lead.TEXT), i


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
