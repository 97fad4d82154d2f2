"""How much of a text's end could be the start of a marker (`<tool_call>`, `</think>`)."""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with.

    A streaming parser keeps that many chars back until later text shows whether the
    marker begins there; a whole marker in `text` is the caller's to find. (The same rule
    as stop strings' hold-back, kept apart because the layout test pins stop-string
    matching to the text processor.)"""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def is_marker_prefix(text: str, marker: str) -> bool:
    """Whether `text` is a proper, non-empty prefix of `marker` (the marker may follow)."""
    return 0 < len(text) < len(marker) and marker.startswith(text)
