"""Prompt lookup (engine/worker/speculative/ngram_proposer.py): the longest recurring
suffix's latest earlier occurrence, its continuation cut at k and at the known tokens."""

from __future__ import annotations

import random

import pytest

from engine.worker.speculative.ngram_proposer import NgramProposer

pytestmark = pytest.mark.timeout(30)


def test_proposes_what_followed_the_suffix_last_time() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, k=3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert proposer.propose(tokens) == [8, 9, 1]  # "5 6 7" recurs: what followed it


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    proposer = NgramProposer(min_n=1, max_n=3, k=2)
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3]
    assert proposer.propose(tokens) == [40, 41]  # "1 2 3" (n=3), not the later "3" (n=1)


def test_the_latest_occurrence_of_equal_length_wins() -> None:
    proposer = NgramProposer(min_n=2, max_n=2, k=2)
    tokens = [7, 8, 1, 1, 7, 8, 2, 2, 7, 8]
    assert proposer.propose(tokens) == [2, 2]


def test_nothing_when_no_ngram_recurs_or_it_is_too_short() -> None:
    assert NgramProposer(min_n=1, max_n=4, k=5).propose([1, 2, 3, 4]) == []
    assert NgramProposer(min_n=2, max_n=4, k=5).propose([1, 2, 3, 1]) == []  # only n=1 recurs
    assert NgramProposer(min_n=1, max_n=4, k=5).propose([3]) == []
    assert NgramProposer(min_n=1, max_n=4, k=5).propose([]) == []


def test_the_proposal_stops_at_the_known_tokens() -> None:
    proposer = NgramProposer(min_n=1, max_n=2, k=8)
    assert proposer.propose([4, 4, 4]) == [4]  # "4 4" at 0 is followed by one known token
    assert proposer.propose([1, 2, 9, 1, 2]) == [9, 1, 2]


def test_against_a_plain_search_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert NgramProposer(lo, hi, k).propose(tokens) == plain_search(tokens, lo, hi, k)


def plain_search(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_refuses_bad_settings_by_name() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(min_n=3, max_n=2, k=1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(min_n=0, max_n=2, k=1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(min_n=1, max_n=2, k=0)
