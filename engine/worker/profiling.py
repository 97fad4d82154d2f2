"""A synthetic step plan for memory profiling (peak activation of a full step)."""

from __future__ import annotations

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.kv.block_count import cdiv
from engine.sampling_params import SamplingParams
from engine.worker.worker_request import WorkerRequest


def dummy_plan(
    num_tokens: int, max_model_len: int, block_size: int, num_groups: int = 1
) -> SchedulerOutput:
    """`num_tokens` prompt tokens split into sequences of at most max_model_len tokens,
    laid out on consecutive blocks from 0 (`num_groups` table entries per block: the
    hybrid layout's interleaved tables)."""
    scheduled, next_block, left, i = [], 0, num_tokens, 0
    while left > 0:
        n = min(left, max_model_len)
        blocks = cdiv(n, block_size) * num_groups
        params = SamplingParams(max_tokens=1)
        request = WorkerRequest(f"profile-{i}", [0] * n, params, frozenset(), [], 0)
        table = tuple(range(next_block, next_block + blocks))
        scheduled.append(ScheduledRequest(request, 0, n, table))
        next_block, left, i = next_block + blocks, left - n, i + 1
    return SchedulerOutput(0, tuple(scheduled), ())
