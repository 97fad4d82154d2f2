"""Prompt lookup (vLLM's `ngram` method): draft tokens copied from the sequence itself.

A sequence that repeats itself (code edits, summaries quoting their source, chat turns
restating the question) often continues an n-gram the way it continued before. The
proposer finds the most recent earlier occurrence of the sequence's last n tokens, for n
from `max_n` down to `min_n` (the longest match wins), and proposes the up to `k`
tokens that followed that occurrence. No model runs: a proposal costs one scan of the
sequence's token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """`propose(token_ids)` -> up to k draft token ids (empty: no n-gram recurs).

    Contract: min_n <= max_n, both >= 1, and k >= 1 (ValueError otherwise); the proposal
    is the continuation of the latest earlier occurrence of the longest recurring suffix
    of length in [min_n, max_n], cut at k tokens and at the end of the known tokens.
    """

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt_lookup_min must be in [1, prompt_lookup_max={max_n}]; got {min_n}"
            )
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1; got {k}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose_batch(self, requests, ks: Sequence[int], tables) -> list[list[int]]:
        """The `Proposer` call: each request's proposal, cut at its k."""
        return [
            self.propose(r.prompt_token_ids + r.output_token_ids)[:k]
            for r, k in zip(requests, ks, strict=True)
        ]

    def after_step(self, request) -> None:
        """Nothing to remember: every proposal scans the tokens afresh."""

    def block_bytes(self) -> int:
        return 0  # no KV cache

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _latest_earlier_match(tokens, n)
            if start is not None:
                follow = start + n  # the occurrence's next token
                return tokens[follow : follow + self.k].tolist()
        return []


def _latest_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Where the latest occurrence of tokens' last n ids starts, other than the suffix
    itself: None if there is none."""
    length = tokens.shape[0]
    suffix = tokens[length - n :]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L - n, n]
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else None
