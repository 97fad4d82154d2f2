"""`mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects, or
(tokenizer v11 and later) `[TOOL_CALLS]name[ARGS]{...}`, once per call."""

from __future__ import annotations

import re
from enum import Enum, auto
from typing import ClassVar

from engine.text.tool_parsers.call_ids import CallIdFunction, mistral_call_id
from engine.text.tool_parsers.call_json import arguments_text, call_from_object, load_json
from engine.text.tool_parsers.call_splitter import CallPiece, CallSplitter, Piece, TextPiece
from engine.text.tool_parsers.json_span import JsonSpan
from engine.text.tool_parsers.marker_prefix import is_marker_prefix, partial_marker_len

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_SPACE = re.compile(r"\s*")


class _State(Enum):
    """Where the splitter stands; every state but OUTSIDE holds a block from MARKER."""

    OUTSIDE = auto()  # content, looking for MARKER
    LEAD = auto()  # after MARKER: a list (`[`) or a name follows
    NAME = auto()  # reading `name`, up to `[ARGS]` or `{`
    JSON = auto()  # an open JSON list (list form) or arguments object (named form)


class MistralSplitter(CallSplitter):
    """Text outside blocks is content. A block starts at `[TOOL_CALLS]`; whitespace
    after markers is allowed.

    - List form: `[TOOL_CALLS] [{...}, ...]`. The whole list is one decision: every
      element a well-formed call (`call_json`) and at least one, or the block, through
      its closing bracket, is content.
    - Named form: `[TOOL_CALLS]name[ARGS]{...}`; `[ARGS]` may be missing (a tokenizer
      that drops it), so `name{...}` also works, as in vLLM. The name is letters,
      digits, `_`, `.`, `-`; the arguments one JSON object. Any other text ends the
      block there, and the block so far is content.
    An unfinished block at the end of the output is content.

    Mistral's markers are special tokens: decode with `skip_special_tokens=False`.
    Call ids default to nine letters and digits, the only shape Mistral's templates take
    back."""

    call_id: ClassVar[CallIdFunction] = staticmethod(mistral_call_id)
    needs_special_tokens: ClassVar[bool] = True

    def __init__(self) -> None:
        self._buffer = ""  # OUTSIDE: undecided text; else the block from its MARKER
        self._state = _State.OUTSIDE
        self._name = ""  # the named form's name, once read
        self._span = JsonSpan()
        self._span_start = 0

    def close(self) -> list[Piece]:
        pieces = self.push("")
        if self._buffer:
            pieces.append(TextPiece(self._buffer))
        self._buffer, self._state = "", _State.OUTSIDE
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Decide what the buffer allows; True when the state changed (go again)."""
        if self._state is _State.OUTSIDE:
            return self._step_outside(pieces)
        if self._state is _State.LEAD:
            return self._step_lead()
        if self._state is _State.NAME:
            return self._step_name(pieces)
        return self._step_json(pieces)

    def _step_outside(self, pieces: list[Piece]) -> bool:
        start = self._buffer.find(MARKER)
        cut = start if start >= 0 else len(self._buffer) - partial_marker_len(self._buffer, MARKER)
        if cut:
            pieces.append(TextPiece(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
        if start < 0:
            return False
        self._state = _State.LEAD
        return True

    def _step_lead(self) -> bool:
        at = _SPACE.match(self._buffer, len(MARKER)).end()
        if at == len(self._buffer):
            return False
        if self._buffer[at] == "[":
            self._open_json(at)
        else:
            self._state, self._span_start = _State.NAME, at
        return True

    def _step_name(self, pieces: list[Piece]) -> bool:
        name_end = _NAME.match(self._buffer, self._span_start).end()
        rest = self._buffer[name_end:]
        if not rest or is_marker_prefix(rest, ARGS):
            return False  # the name, or the [ARGS] after it, may go on
        at = name_end + len(ARGS) if rest.startswith(ARGS) else name_end
        at = _SPACE.match(self._buffer, at).end()
        if at == len(self._buffer):
            return False
        if name_end == self._span_start or self._buffer[at] != "{":
            return self._give_up(pieces, at)
        self._name = self._buffer[self._span_start : name_end]
        self._open_json(at)
        return True

    def _step_json(self, pieces: list[Piece]) -> bool:
        end = self._span.scan(self._buffer[self._span_start :])
        if end is None:
            return False
        end += self._span_start
        found = self._calls(self._buffer[self._span_start : end])
        if not found:
            return self._give_up(pieces, end)
        pieces.extend(found)
        self._buffer, self._state, self._name = self._buffer[end:], _State.OUTSIDE, ""
        return True

    def _calls(self, text: str) -> list[CallPiece]:
        """The calls a finished JSON span makes, or [] when it makes none validly."""
        ok, value = load_json(text)
        if not ok:
            return []
        if self._name:
            arguments = arguments_text(value) if isinstance(value, dict) else None
            return [] if arguments is None else [CallPiece(self._name, arguments)]
        calls = [call_from_object(v) for v in value] if isinstance(value, list) else []
        return calls if calls and all(calls) else []

    def _open_json(self, at: int) -> None:
        self._state, self._span, self._span_start = _State.JSON, JsonSpan(), at

    def _give_up(self, pieces: list[Piece], end: int) -> bool:
        """The block so far, through `buffer[:end]`, is content; look for the next."""
        pieces.append(TextPiece(self._buffer[:end]))
        self._buffer, self._state, self._name = self._buffer[end:], _State.OUTSIDE, ""
        return True
