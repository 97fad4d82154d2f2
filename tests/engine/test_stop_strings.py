"""Stop strings: earliest match, spans across deltas, include flag, hold-back."""

from __future__ import annotations

import random

import pytest

from engine.text.stop_strings import StopMatch, find_stop, hold_back


def test_no_stops_or_no_new_text() -> None:
    assert find_stop("hello", 5, (), False) is None
    assert find_stop("hello", 0, ("hello",), False) is None
    assert find_stop("hello", 5, ("",), False) is None
    assert find_stop("hello", 5, ("bye",), False) is None


@pytest.mark.parametrize(("include", "cut"), [(False, 6), (True, 10)])
def test_include_flag_sets_the_cut(include: bool, cut: int) -> None:
    match = find_stop("hello STOP world", 16, ("STOP",), include)
    assert match == StopMatch("STOP", cut)
    assert "hello STOP world"[:cut] == ("hello STOP" if include else "hello ")


def test_stop_spanning_old_and_new_text() -> None:
    # "ST" arrived in an earlier delta, "OP!" is new.
    assert find_stop("abc STOP!", 3, ("STOP",), False) == StopMatch("STOP", 4)
    assert find_stop("abc STOP!", 3, ("STOP",), True) == StopMatch("STOP", 8)


def test_match_wholly_before_the_search_window_is_not_seen() -> None:
    text = "xx STOP " + "y" * 20
    assert find_stop(text, 5, ("STOP",), False) is None


def test_earliest_match_wins_whatever_the_stop_order() -> None:
    text = "one two three"
    for stops in [("three", "two"), ("two", "three")]:
        assert find_stop(text, len(text), stops, False) == StopMatch("two", 4)


def test_ties_and_overlaps_follow_the_first_to_complete() -> None:
    # "bc" completes before "abcd" does, as it would if text came one char at a time.
    assert find_stop("xabcd", 5, ("abcd", "bc"), False) == StopMatch("bc", 2)
    # Same end: the one that starts first (longer) wins.
    assert find_stop("xabc", 4, ("bc", "abc"), True) == StopMatch("abc", 4)
    assert find_stop("xabc", 4, ("bc", "abc"), False) == StopMatch("abc", 1)


def test_chunking_does_not_change_the_answer() -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 30)))
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in "xy")
        include = rng.random() < 0.5
        whole = find_stop(text, len(text), stops, include)
        found, end = None, 0
        while found is None and end < len(text):
            start, end = end, min(len(text), end + rng.randint(1, 5))
            found = find_stop(text[:end], end - start, stops, include)
        assert found == whole, (text, stops)


def test_hold_back_counts_a_possible_stop_start() -> None:
    stops = ("STOP", "<|end|>")
    assert hold_back("hello", stops) == 0
    assert hold_back("hello S", stops) == 1
    assert hold_back("hello ST", stops) == 2
    assert hold_back("hello STO", stops) == 3
    assert hold_back("hello <|en", stops) == 4
    assert hold_back("hello STOP", stops) == 0  # a whole stop is find_stop's business
    assert hold_back("", stops) == 0
    assert hold_back("S", ()) == 0


def test_hold_back_takes_the_longest_candidate() -> None:
    assert hold_back("xaba", ("abab", "ax")) == 3  # "aba" may become "abab"
    assert hold_back("ab", ("abc", "b")) == 2
