"""How much of a text's end could be the start of a marker still to come: the rule a
streamer holds text back by (stop strings, tool-call and reasoning markers)."""

from __future__ import annotations


def pending_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest proper prefix of any of `markers` that `text` ends with.

    A streamer keeps that many chars back until later text shows whether a marker begins
    there. Only proper prefixes count: a whole marker in `text` is the caller's to find.
    """
    if not text:
        return 0
    last, longest = text[-1], 0
    for marker in markers:
        # Only prefixes ending in text's last char can match: jump between them.
        n = marker.rfind(last, 0, min(len(marker) - 1, len(text))) + 1
        while n > longest:
            if text.endswith(marker[:n]):
                longest = n
                break
            n = marker.rfind(last, 0, n - 1) + 1
    return longest
