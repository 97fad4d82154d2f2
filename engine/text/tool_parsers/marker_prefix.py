"""How much of a text's end could be the start of a marker (`<tool_call>`, `</think>`)."""

from __future__ import annotations

from engine.text.pending_prefix import pending_prefix_len


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with (a
    streaming parser keeps that many chars back until later text decides)."""
    return pending_prefix_len(text, (marker,))


def is_marker_prefix(text: str, marker: str) -> bool:
    """Whether `text` is a proper, non-empty prefix of `marker` (the marker may follow)."""
    return 0 < len(text) < len(marker) and marker.startswith(text)
