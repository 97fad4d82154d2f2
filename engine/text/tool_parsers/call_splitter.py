"""The contract each tool-call format implements: cut text into content and calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from engine.text.tool_parsers.call_ids import CallIdFunction, random_call_id


@dataclass(frozen=True)
class TextPiece:
    """Text the format has decided is not (part of) a well-formed call."""

    text: str


@dataclass(frozen=True)
class CallPiece:
    """A complete, well-formed call: `arguments` is JSON text of an object."""

    name: str
    arguments: str


Piece = TextPiece | CallPiece


class CallSplitter(ABC):
    """One output's text, fed in deltas, cut into `TextPiece`s and `CallPiece`s.

    Contract:
    - `push(text)` returns the pieces that `text` decides, in order; text that may still
      turn out to be a call (a possible start marker's prefix, an open call) is kept
      until later text or `close()` decides it. `close()` decides everything left: a
      call that is not complete and well formed by then is text, as generated.
    - Chunking never matters: the pieces' texts concatenated and the calls in order are
      the same however the output was cut into `push` calls (a decision is only taken
      when no later text could change it).
    - Never raises on any text. One splitter per output; not reusable after `close()`.
    """

    call_id: ClassVar[CallIdFunction] = staticmethod(random_call_id)
    """The format's default call-id function."""

    needs_special_tokens: ClassVar[bool] = False
    """Whether the markers are special tokens that a detokenizer skipping special tokens
    would drop (the request must then decode with `skip_special_tokens=False`)."""

    _buffer: str  # each format's held text, not decided yet

    def push(self, text: str) -> list[Piece]:
        """Add the next delta; return what it decides."""
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    @abstractmethod
    def _step(self, pieces: list[Piece]) -> bool:
        """Decide the next piece of the held text into `pieces`; False when the held
        text decides nothing more until later text comes."""

    @abstractmethod
    def close(self) -> list[Piece]:
        """The output ended: decide everything still held."""
