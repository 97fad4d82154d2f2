"""What a worker asks of a draft proposer: prompt lookup (engine/worker/speculative/
ngram_proposer.py) and a draft model (draft_model_proposer.py) answer the same calls;
trained heads (EAGLE, MTP) would too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.worker.worker_request import WorkerRequest


class Proposer(Protocol):
    """`propose_batch(requests, ks, tables)` -> for each request, up to ks[i] draft
    tokens to follow its known tokens (prompt then outputs), fewer or none when it has
    none; tables[i] is its block table, whose slots past its known tokens are reserved
    for the drafts (a proposer with a KV cache of its own may write there).
    `after_step(request)`: the step that verified the request's drafts is done (its
    known tokens and computed count are final). `block_bytes()`: what a KV cache of its
    own takes per block (0: none), allocated by `initialize_cache(num_blocks)` with the
    target's block count."""

    def propose_batch(
        self,
        requests: Sequence[WorkerRequest],
        ks: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> list[list[int]]: ...

    def after_step(self, request: WorkerRequest) -> None: ...

    def block_bytes(self) -> int: ...

    def initialize_cache(self, num_blocks: int) -> None: ...
