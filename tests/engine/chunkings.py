"""Ways to cut a streamed text into deltas, for parsers that must not care how."""

from __future__ import annotations

import random


def cuttings(text: str, seeds: int = 12, max_size: int = 9) -> list[list[str]]:
    """The whole text, one char at a time, and `seeds` seeded random cuts of 1 to
    `max_size` chars."""
    cuts = [[text], list(text)]
    for seed in range(seeds):
        rng, pieces, at = random.Random(seed), [], 0
        while at < len(text):
            size = rng.randint(1, max_size)
            pieces.append(text[at : at + size])
            at += size
        cuts.append(pieces)
    return cuts
