"""What a worker asks of a draft proposer (prompt lookup now; a draft model or trained
heads would answer the same call)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """`propose(token_ids)` -> draft tokens to follow `token_ids` (a sequence's known
    tokens: prompt then outputs), at most the proposer's own k; empty when it has none.
    The worker cuts the proposal to the row's lookahead and room."""

    def propose(self, token_ids: Sequence[int]) -> list[int]: ...
