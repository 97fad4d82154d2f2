"""Where a JSON object or array ends, found as its text streams in."""

from __future__ import annotations

import re

_OUTSIDE_STRING = re.compile(r'[\[\]{}"]')
_INSIDE_STRING = re.compile(r'["\\]')
_OPENER = {"}": "{", "]": "["}


class JsonSpan:
    """Follows one JSON object or array from its opening bracket to its closing one.

    `scan(text)` takes the span's whole text so far (`text[0]` is the opening bracket;
    each call passes the previous text extended) and looks only at chars not yet seen,
    so a stream costs O(length) overall. It returns None while the value is open, and
    the index just past the closing bracket once the brackets balance, or just past the
    first bracket that does not match (the text is then broken; a JSON parse of it fails
    and the caller treats it as text). Brackets inside strings, and escaped quotes, are
    skipped. It checks nothing else: parse the span to know it is JSON."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._in_string = False
        self._pos = 0

    def scan(self, text: str) -> int | None:
        pos = self._pos
        while True:
            pattern = _INSIDE_STRING if self._in_string else _OUTSIDE_STRING
            match = pattern.search(text, pos)
            if match is None:
                self._pos = len(text)
                return None
            char, pos = match.group(), match.end()
            if char == "\\":
                if pos == len(text):  # the escaped char has not arrived: look again later
                    self._pos = match.start()
                    return None
                pos += 1
            elif char == '"':
                self._in_string = not self._in_string
            elif char in "{[":
                self._stack.append(char)
            elif not self._stack or self._stack.pop() != _OPENER[char] or not self._stack:
                self._pos = pos
                return pos
