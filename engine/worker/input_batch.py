"""Turns a step plan into the flattened model input: one `[num_tokens]` batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.worker_request import WorkerRequest

Row = ScheduledRequest[WorkerRequest]


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Flattened token indices whose logits score prompt tokens `targets` of `request_id`."""

    request_id: str
    token_indices: tuple[int, ...]
    targets: tuple[int, ...]


@dataclass(frozen=True)
class ModelInput:
    """Everything one forward pass needs, rows ordered decodes first."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    rows: tuple[Row, ...]  # row order of the batch
    sample_rows: tuple[Row, ...]  # rows that sample, in row order
    logits_indices: torch.Tensor  # [num_sample_rows] int64: each sampling row's last token
    prompt_logprob_spans: tuple[PromptLogprobSpan, ...]


def build_model_input(
    scheduled: Sequence[Row], block_size: int, device: str | torch.device
) -> ModelInput:
    rows = sorted(scheduled, key=lambda s: s.num_scheduled_tokens != 1)  # stable: decodes first
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    logits_indices: list[int] = []
    spans = []
    for row in rows:
        begin, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
        ids += row.request.token_ids(begin, end)
        positions += range(begin, end)
        table = row.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        if row.samples:
            logits_indices.append(len(ids) - 1)
        span = _prompt_logprob_span(row, starts[-1])
        if span is not None:
            spans.append(span)
        starts.append(len(ids))
    metadata = _metadata(rows, starts, slots, device)
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        rows=tuple(rows),
        sample_rows=tuple(r for r in rows if r.samples),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        prompt_logprob_spans=tuple(spans),
    )


def _metadata(rows, starts, slots, device) -> AttentionMetadata:
    seq_lens = [r.num_computed_tokens + r.num_scheduled_tokens for r in rows]
    width = max((len(r.block_table) for r in rows), default=0)
    tables = [list(r.block_table) + [0] * (width - len(r.block_table)) for r in rows]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device).view(len(rows), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=tuple(r.num_scheduled_tokens for r in rows),
        seq_lens_cpu=tuple(seq_lens),
        num_decodes=sum(1 for r in rows if r.num_scheduled_tokens == 1),
    )


def _prompt_logprob_span(row: Row, start: int) -> PromptLogprobSpan | None:
    """Positions p of this chunk with p + 1 still in the prompt and not yet scored."""
    request = row.request
    if request.params.prompt_logprobs is None:
        return None
    done = request.num_scored_prompt_tokens
    first = max(row.num_computed_tokens, done)
    last = min(row.num_computed_tokens + row.num_scheduled_tokens, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    offset = start - row.num_computed_tokens
    return PromptLogprobSpan(
        request.request_id,
        tuple(p + offset for p in range(first, last)),
        tuple(request.prompt_token_ids[first + 1 : last + 1]),
    )
