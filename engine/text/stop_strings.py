"""Stop strings: find the first stop in freshly streamed text, and how much to hold back."""

from __future__ import annotations

from dataclasses import dataclass

from engine.text.pending_prefix import pending_prefix_len


@dataclass(frozen=True)
class StopMatch:
    """The stop string that ended a sequence and where to cut its output text.

    `truncate_to` is the output text length to keep: the text before the stop string, or
    through its end when `include_stop_str_in_output` was set.
    """

    stop: str
    truncate_to: int


def find_stop(
    text: str, new_text_len: int, stops: tuple[str, ...], include_stop_str_in_output: bool
) -> StopMatch | None:
    """Find the earliest stop string in `text`, looking only where new text can matter.

    `text` is the whole output so far; only its last `new_text_len` chars are new. A stop
    may span old and new text, so the search starts `max_stop_len - 1` chars before the
    new text (old text alone was checked by earlier calls). Earliest means the match
    that ends first, so the answer does not depend on how text was split into deltas
    (fed one char at a time, that stop would have completed first); on a tie, the one
    that starts first (the longer stop). Empty stop strings never match.
    """
    stops = tuple(s for s in stops if s)
    if not stops or new_text_len <= 0:
        return None
    max_stop_len = max(len(s) for s in stops)
    start = max(0, len(text) - new_text_len - max_stop_len + 1)
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or (index + len(stop), index) < best[:2]):
            best = (index + len(stop), index, stop)
    if best is None:
        return None
    end, index, stop = best
    return StopMatch(stop, end if include_stop_str_in_output else index)


def hold_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing chars of `text` could be the start of a stop string (kept back
    until later text decides; a whole stop in `text` is `find_stop`'s business)."""
    return pending_prefix_len(text, stops)
