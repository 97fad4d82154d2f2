"""Turns a step plan into the flattened model input: one `[num_tokens]` batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.worker.attention.metadata import AttentionMetadata, GroupedAttentionMetadata
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
    metadata: AttentionMetadata | GroupedAttentionMetadata
    rows: tuple[Row, ...]  # row order of the batch
    sample_rows: tuple[Row, ...]  # rows that sample, in row order
    # [sum over sample rows of num_drafts + 1] int64: each sampling row's last known
    # token, and after it each of the draft tokens it verifies
    logits_indices: torch.Tensor
    prompt_logprob_spans: tuple[PromptLogprobSpan, ...]
    num_drafts: tuple[int, ...] = ()  # per sample row: drafts it verifies (empty: none)


def batch_order(scheduled: Sequence[Row]) -> list[Row]:
    """The rows in the order a batch holds them: decodes first, otherwise as given."""
    return sorted(scheduled, key=lambda s: s.num_scheduled_tokens != 1)


def build_model_input(
    scheduled: Sequence[Row],
    block_size: int,
    device: str | torch.device,
    layout: KVCacheLayout | None = None,
    ordered: bool = False,
) -> ModelInput:
    """The flattened batch of `scheduled`. With a hybrid `layout` each table interleaves
    one table per KV cache group (entry `i * G + g`: group g's block i), and the batch
    carries every group's metadata. A row whose request holds `draft_token_ids` computes
    them after its known tokens (its `num_scheduled_tokens` counts them) and has a
    logit row for each. `ordered`: the rows are in batch order already (a shard of a
    step's rows, kept as given)."""
    num_groups = layout.num_groups if layout is not None and layout.is_hybrid else 1
    rows = list(scheduled) if ordered else batch_order(scheduled)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]  # per group
    starts = [0]
    logits_indices: list[int] = []
    num_drafts: list[int] = []
    spans = []
    for row in rows:
        begin, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
        drafts = getattr(row.request, "draft_token_ids", None)  # a worker's replica's
        if drafts:
            ids += row.request.token_ids(begin, end - len(drafts)) + drafts
        else:
            ids += row.request.token_ids(begin, end)
        positions += range(begin, end)
        table = row.block_table
        for g, group_slots in enumerate(slots):
            group_slots += [
                table[p // block_size * num_groups + g] * block_size + p % block_size
                for p in range(begin, end)
            ]
        if row.samples:
            d = len(drafts) if drafts else 0
            logits_indices += range(len(ids) - 1 - d, len(ids))
            num_drafts.append(d)
        span = prompt_logprob_span(row, starts[-1])
        if span is not None:
            spans.append(span)
        starts.append(len(ids))
    group_tables = _group_tables(rows, num_groups, device)
    slot_mappings = [torch.tensor(g, dtype=torch.int64, device=device) for g in slots]
    metadata = batch_metadata(rows, starts, group_tables, slot_mappings, block_size, layout)
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        rows=tuple(rows),
        sample_rows=tuple(r for r in rows if r.samples),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        prompt_logprob_spans=tuple(spans),
        num_drafts=tuple(num_drafts) if any(num_drafts) else (),
    )


def _group_tables(rows, num_groups: int, device) -> list[torch.Tensor]:
    """Each group's block tables, [R, width / G] int64, zero-padded (group g's table:
    entries g, g + G, ...; a fresh tensor: the kernels want stride 1)."""
    width = max((len(r.block_table) for r in rows), default=0)
    tables = [list(r.block_table) + [0] * (width - len(r.block_table)) for r in rows]
    return [
        torch.tensor(
            [t[g::num_groups] for t in tables] if num_groups > 1 else tables,
            dtype=torch.int64,
            device=device,
        ).view(len(rows), width // num_groups)
        for g in range(num_groups)
    ]


def batch_metadata(
    rows,
    starts: list[int],
    group_tables: Sequence[torch.Tensor],  # per group: [R, width / G] int64
    slot_mappings: Sequence[torch.Tensor],  # per group: [T] int64
    block_size: int,
    layout: KVCacheLayout | None,
) -> AttentionMetadata | GroupedAttentionMetadata:
    """A step's attention metadata: one per KV cache group, sharing the batch's offsets
    and lengths, grouped for a hybrid layout (either input builder's tables and slots)."""
    device = group_tables[0].device
    seq_lens = [r.num_computed_tokens + r.num_scheduled_tokens for r in rows]
    query_start_loc = torch.tensor(starts, dtype=torch.int64, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    per_group = tuple(
        AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=tuple(r.num_scheduled_tokens for r in rows),
            seq_lens_cpu=tuple(seq_lens),
            num_decodes=leading_decodes(rows),
            block_size=block_size,
        )
        for tables, slot_mapping in zip(group_tables, slot_mappings, strict=True)
    )
    if layout is not None and layout.is_hybrid:
        return GroupedAttentionMetadata(per_group, layout.group_of_layer)
    return per_group[0]


def leading_decodes(rows) -> int:
    """The rows of one token before the first longer one (in a batch's order, every
    decode; a shard's trailing one-token piece of a prompt runs as a prefill row)."""
    count = 0
    for row in rows:
        if row.num_scheduled_tokens != 1:
            break
        count += 1
    return count


def prompt_logprob_span(row: Row, start: int) -> PromptLogprobSpan | None:
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
