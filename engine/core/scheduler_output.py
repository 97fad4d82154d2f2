"""What one step's plan says: which requests compute how many tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

RequestT = TypeVar("RequestT")  # the scheduler's `Request`, or a worker's `WorkerRequest`


class ScheduledRequest(NamedTuple, Generic[RequestT]):  # built 256 times a step, cheaply
    """`request` computes `num_scheduled_tokens` tokens from `num_computed_tokens` on;
    `block_table` holds at least `num_computed_tokens + num_scheduled_tokens +
    num_lookahead_tokens` slots (plus the lookahead of the request's steps in flight).
    The scheduler's rows carry its `Request`s; a worker rebuilds the rows of a plan
    around its own replicas (engine/worker/worker_request.py).

    `block_table` is the request's live table, not a copy (copying every table every
    step costs O(context) per request): read it before the next `schedule()`."""

    request: RequestT
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: Sequence[int]
    num_lookahead_tokens: int = 0  # draft tokens its worker may verify after them

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens and samples one more
        (a worker's row verifying drafts reaches past them)."""
        return self.num_computed_tokens + self.num_scheduled_tokens >= self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of step `step_id`. Before its forward pass: `swap_out` ((device block,
    CPU block) pairs), then `swap_in` ((CPU block, device block)), then `block_copies`
    (copy-on-write, (src, dst) device blocks). `rewritten_tables`: (request id, block
    index) of each table whose blocks from that index on a copy-on-write replaced.
    `loads`: requests admitted to wait for their prompt's KV from a prefill instance
    (their tables hold the prompt; nothing is computed for them in this step)."""

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    rewritten_tables: tuple[tuple[str, int], ...] = ()
    loads: tuple[ScheduledRequest, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
