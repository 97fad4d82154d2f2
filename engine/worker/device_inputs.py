"""`DeviceInputBatch`: a step's model input prepared on the device (GPU-native input
preparation), from buffers that persist across steps.

The host builder (`input_batch.build_model_input`) walks every token of a step in
Python. Here each request keeps a slot in two device buffers, its known tokens
(`tokens[slot, position]`) and its block table (`tables[slot, entry]`), and a step
sends only what changed since the last one: the tokens a slot does not hold yet (and
its newest, which a beam search may have replaced), the draft tokens it verifies, the
table entries that differ, and four numbers per row (slot, computed tokens, tokens
this step, where they start). One Triton launch (`cuda_ext.triton_kernels.input_prep`)
writes the input ids, positions and KV slot mappings; the block tables are a gather of
the rows' slots. Each slot also keeps its request's per-row sampling parameters
(`sampling_table`: written once, gathered per step) and, for a request with penalties,
its prompt's token mask and its output tokens' counts (`penalty_tensors`: the prompt
marked once, outputs counted as they come). The per-row parts (sampling rows, logit
indices, prompt logprob spans, logit biases, min-tokens masks, step seeds) stay on the
host: they are per row, not per token.

The result is the host builder's `ModelInput`, field for field (tests compare them on
random step sequences under Triton's interpreter); it needs the Triton kernels to run
(compiled on CUDA, or interpreted anywhere).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.kv.kv_cache_groups import KVCacheLayout
from engine.worker.attention.metadata import AttentionMetadata, GroupedAttentionMetadata
from engine.worker.input_batch import (
    ModelInput,
    Row,
    batch_metadata,
    batch_order,
    prompt_logprob_span,
)
from engine.worker.sampling_metadata import COLUMNS, param_columns

INITIAL_SLOTS = 64


class DeviceInputBatch:
    """Slots and buffers for requests of up to `max_model_len` tokens and
    `max_entries` table entries; `build(scheduled)` gives a step's `ModelInput`,
    `release(request_ids)` frees the slots of requests that ended."""

    def __init__(
        self,
        max_model_len: int,
        max_entries: int,
        block_size: int,
        device: str | torch.device,
        layout: KVCacheLayout | None = None,
    ) -> None:
        from cuda_ext.triton_kernels.input_prep import prepare_inputs
        from cuda_ext.triton_kernels.kernel import check_device

        self._prepare = prepare_inputs
        self.device = torch.device(device)
        try:
            check_device(self.device)
        except ValueError as exc:
            raise ValueError(f"input_preparation='device': {exc}") from None
        self.block_size = block_size
        self.layout = layout
        self.num_groups = layout.num_groups if layout is not None and layout.is_hybrid else 1
        self.max_model_len = max_model_len
        # [slots, max_model_len + 1]: one spare position for a last step's drafts' end
        self.tokens = torch.zeros(
            (INITIAL_SLOTS, max_model_len + 1), dtype=torch.int32, device=self.device
        )
        self.tables = torch.zeros(
            (INITIAL_SLOTS, max_entries), dtype=torch.int32, device=self.device
        )
        self._slot: dict[str, int] = {}
        self._free = list(range(INITIAL_SLOTS - 1, -1, -1))
        self._written = [0] * INITIAL_SLOTS  # real tokens each slot holds
        self._table = [[] for _ in range(INITIAL_SLOTS)]  # each slot's table, as written
        # [slots, len(COLUMNS)] float32: each slot's request's per-row sampling parameters
        self.params = torch.zeros((INITIAL_SLOTS, len(COLUMNS)), device=self.device)
        self._has_params = [False] * INITIAL_SLOTS
        # penalties' state, made when a penalized request first samples: [slots, V]
        self.output_counts: torch.Tensor | None = None  # int32: each output token's count
        self.prompt_mask: torch.Tensor | None = None  # bool: tokens of the prompt
        self._counted: list[list[int] | None] = [None] * INITIAL_SLOTS  # outputs counted

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            slot = self._slot.pop(request_id, None)
            if slot is not None:
                self._written[slot] = 0
                self._has_params[slot] = False
                self._counted[slot] = None
                self._free.append(slot)

    def build(self, scheduled: Sequence[Row], ordered: bool = False) -> ModelInput:
        rows = list(scheduled) if ordered else batch_order(scheduled)
        token_writes: tuple[list[int], list[int], list[int]] = ([], [], [])
        table_writes: tuple[list[int], list[int], list[int]] = ([], [], [])
        slots, computed, counts, starts = [], [], [], [0]
        logits_indices, num_drafts, spans = [], [], []
        for row in rows:
            slot = self._slot_of(row.request.request_id)
            drafts = row.request.draft_token_ids
            self._sync_tokens(slot, row.request, drafts, token_writes)
            self._sync_table(slot, row.block_table, table_writes)
            n = row.num_scheduled_tokens
            slots.append(slot)
            computed.append(row.num_computed_tokens)
            counts.append(n)
            end = starts[-1] + n
            if row.samples:
                d = len(drafts)
                logits_indices += range(end - 1 - d, end)
                num_drafts.append(d)
            span = prompt_logprob_span(row, starts[-1])
            if span is not None:
                spans.append(span)
            starts.append(end)
        self._upload(self.tokens, token_writes)
        self._upload(self.tables, table_writes)
        num_tokens = starts[-1]
        per_row = torch.tensor([slots, computed, counts, starts[:-1]], dtype=torch.int32)
        per_row = per_row.to(self.device, non_blocking=True)  # [4, R]
        input_ids, positions, slot_mapping = self._prepare(
            self.tokens,
            self.tables,
            *per_row,
            num_tokens=num_tokens,
            max_count=max(counts, default=0),
            block_size=self.block_size,
            num_groups=self.num_groups,
        )
        metadata = self._metadata(rows, slots, starts, slot_mapping)
        return ModelInput(
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            rows=tuple(rows),
            sample_rows=tuple(r for r in rows if r.samples),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            prompt_logprob_spans=tuple(spans),
            num_drafts=tuple(num_drafts) if any(num_drafts) else (),
        )

    def sampling_table(self, rows: Sequence[Row], vocab_size: int) -> torch.Tensor:
        """The sampling rows' per-row parameters ([B, len(COLUMNS)] float32, for
        `SamplingMetadata.from_rows`), gathered from the slots; a request's parameters
        go up once, when it first samples."""
        slots, new_slots, new_values = [], [], []
        for row in rows:
            slot = self._slot_of(row.request.request_id)
            if not self._has_params[slot]:
                self._has_params[slot] = True
                new_slots.append(slot)
                new_values.append(param_columns(row.request.params, vocab_size))
            slots.append(slot)
        if new_slots:
            values = torch.tensor(new_values, dtype=torch.float32).to(self.device)
            index = torch.tensor(new_slots, dtype=torch.int64).to(self.device)
            self.params.index_copy_(0, index, values)
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.params.index_select(0, index)  # [B, len(COLUMNS)]

    def penalty_tensors(
        self, rows: Sequence[Row], penalized: list[bool], vocab_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling rows' output counts ([B, V] int32) and prompt masks ([B, V]
        bool), zero for rows without penalties, from per-slot state: a penalized
        request's prompt is marked once and its outputs counted as they come (the
        newest counted again if it changed: a beam search may replace it)."""
        if self.output_counts is None:
            shape = (self.num_slots, vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        fresh: list[int] = []
        marks: tuple[list[int], list[int]] = ([], [])
        counts: tuple[list[int], list[int], list[int]] = ([], [], [])
        slots = []
        for row, penalty in zip(rows, penalized, strict=True):
            slot = self._slot_of(row.request.request_id)
            slots.append(slot)
            if penalty:
                self._count_outputs(slot, row.request, fresh, marks, counts)
        if fresh:  # a slot's earlier occupant may have left counts behind
            index = torch.tensor(fresh, dtype=torch.int64).to(self.device)
            self.output_counts.index_fill_(0, index, 0)
            self.prompt_mask.index_fill_(0, index, False)
        if marks[0]:
            at = torch.tensor(marks, dtype=torch.int64).to(self.device)
            self.prompt_mask[at[0], at[1]] = True
        if counts[0]:
            at = torch.tensor(counts, dtype=torch.int64).to(self.device)  # slot, token, +-1
            self.output_counts.index_put_((at[0], at[1]), at[2].int(), accumulate=True)
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        keep = torch.tensor(penalized, dtype=torch.bool).to(self.device)[:, None]  # [B, 1]
        out = torch.where(keep, self.output_counts.index_select(0, index), 0)
        prompt = self.prompt_mask.index_select(0, index) & keep
        return out, prompt  # [B, V], [B, V]

    def _count_outputs(self, slot: int, request, fresh, marks, counts) -> None:
        counted = self._counted[slot]
        if counted is None:  # first time: mark the prompt
            counted = self._counted[slot] = []
            fresh.append(slot)
            tokens = set(request.prompt_token_ids)
            marks[0].extend([slot] * len(tokens))
            marks[1].extend(tokens)
        outputs = request.output_token_ids
        n = len(counted)
        if n and n <= len(outputs) and counted[-1] != outputs[n - 1]:  # replaced
            counts[0].extend((slot, slot))
            counts[1].extend((counted[-1], outputs[n - 1]))
            counts[2].extend((-1, 1))
            counted[-1] = outputs[n - 1]
        new = outputs[n:]
        counts[0].extend([slot] * len(new))
        counts[1].extend(new)
        counts[2].extend([1] * len(new))
        counted.extend(new)

    # -- what changed ------------------------------------------------------------------
    def _slot_of(self, request_id: str) -> int:
        slot = self._slot.get(request_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slot[request_id] = self._free.pop()
        return slot

    def _grow(self) -> None:
        """Twice the slots (the old ones keep their contents)."""
        old = self.num_slots
        self.tokens, self.tables = _doubled(self.tokens), _doubled(self.tables)
        self._free += range(2 * old - 1, old - 1, -1)
        self._written += [0] * old
        self._table += [[] for _ in range(old)]
        self.params = _doubled(self.params)
        self._has_params += [False] * old
        self._counted += [None] * old
        if self.output_counts is not None:
            self.output_counts = _doubled(self.output_counts)
            self.prompt_mask = _doubled(self.prompt_mask)

    def _widen(self, entries: int) -> None:
        """Room for tables of `entries` entries (at least twice the old width)."""
        extra = max(entries, 2 * self.tables.shape[1]) - self.tables.shape[1]
        pad = torch.zeros((self.num_slots, extra), dtype=self.tables.dtype, device=self.device)
        self.tables = torch.cat([self.tables, pad], dim=1)

    def _sync_tokens(self, slot: int, request, drafts: list[int], writes) -> None:
        """The slot's known tokens from its newest on (a beam search may replace the
        newest), then the row's drafts after them."""
        known = request.num_tokens
        first = max(0, min(self._written[slot], known) - 1)
        new = request.token_ids(first, known) + list(drafts)
        writes[0].extend([slot] * len(new))
        writes[1].extend(range(first, first + len(new)))
        writes[2].extend(new)
        self._written[slot] = known

    def _sync_table(self, slot: int, table: Sequence[int], writes) -> None:
        """The table entries that differ from what the slot holds (a shorter table
        zeroes the rest: unused entries read 0, as the host builder pads)."""
        held = self._table[slot]
        if len(table) == len(held) and table == held:
            return
        if len(table) > self.tables.shape[1]:
            self._widen(len(table))
        first = len(held) if table[: len(held)] == held else _first_difference(table, held)
        tail = list(table[first:]) + [0] * max(0, len(held) - len(table))
        writes[0].extend([slot] * len(tail))
        writes[1].extend(range(first, first + len(tail)))
        writes[2].extend(tail)
        self._table[slot] = list(table)

    def _upload(self, buffer: torch.Tensor, writes) -> None:
        """`buffer[slots, index] = values` in one host-to-device copy and one scatter."""
        if not writes[0]:
            return
        packed = torch.tensor(writes, dtype=torch.int64).to(self.device, non_blocking=True)
        buffer[packed[0], packed[1]] = packed[2].to(buffer.dtype)

    # -- per batch -----------------------------------------------------------------
    def _metadata(
        self, rows, slots, starts, slot_mapping: torch.Tensor
    ) -> AttentionMetadata | GroupedAttentionMetadata:
        num_groups = self.num_groups
        width = max((len(r.block_table) for r in rows), default=0)
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        tables = self.tables.index_select(0, index)[:, :width].to(torch.int64)  # [R, width]
        if num_groups > 1:  # group g's table: entries g, g + G, ...
            grouped = tables.view(len(rows), width // num_groups, num_groups)
            group_tables = [grouped[:, :, g].contiguous() for g in range(num_groups)]
        else:
            group_tables = [tables]
        return batch_metadata(
            rows, starts, group_tables, list(slot_mapping), self.block_size, self.layout
        )


def _doubled(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` with as many zero rows again after its own."""
    return torch.cat([buffer, torch.zeros_like(buffer)])


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # up to the shorter
        if x != y:
            return i
    return min(len(a), len(b))
