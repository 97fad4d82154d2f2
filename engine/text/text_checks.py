"""Text a request brings must survive the wire: valid Unicode (no lone UTF-16 surrogate,
which JSON's \\ud800 escapes can smuggle in), and ids of bounded length."""

from __future__ import annotations

import re

MAX_REQUEST_ID_CHARS = 256
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(name: str, text: str) -> None:
    """Raises ValueError naming `name` if `text` holds a lone surrogate."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ValueError(
            f"{name} holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at character "
            f"{bad.start()}; text must be valid Unicode"
        )


def check_request_id(request_id: object) -> None:
    """A request id is a string of 1 to MAX_REQUEST_ID_CHARS characters of valid Unicode."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        shown = repr(request_id)[:60]
        raise ValueError(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters, got {shown}"
        )
    check_text("request_id", request_id)
