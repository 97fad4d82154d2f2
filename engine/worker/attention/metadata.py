"""Per-step attention metadata, passed explicitly to every attention call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.worker.parallel.context import ContextShards


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one flattened batch to the attention backend.

    Rows are sequences; each contributes `query_lens[i]` consecutive tokens to the
    flattened `[num_tokens, ...]` batch. Decode rows (query length 1) come first:
    rows `[0, num_decodes)` are decodes, the rest are prefill chunks.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int64, context length including this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V goes
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    num_decodes: int
    block_size: int = 0  # tokens per page (0: not given; linear-attention layers need it)
    # a context-parallel step: this rank's queries are one shard of the step's tokens,
    # whose K/V every layer gathers from all shards first (engine/worker/parallel/context.py)
    context: ContextShards | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    def for_layer(self, layer: int | None) -> AttentionMetadata:
        """The metadata model layer `layer` attends with: this, for every layer."""
        return self


@dataclass(frozen=True)
class GroupedAttentionMetadata:
    """One step's attention metadata per KV cache group (a hybrid layout): the groups
    share the batch (query offsets, context lengths) but each has its own block tables
    and slot mapping. Layer l attends with `groups[group_of_layer[l]]`."""

    groups: tuple[AttentionMetadata, ...]
    group_of_layer: tuple[int, ...]

    def for_layer(self, layer: int | None) -> AttentionMetadata:
        if layer is None:
            raise ValueError(
                "this model's attention layers do not know their layer index, which a "
                "KV cache with several groups (sliding-window layers) needs"
            )
        return self.groups[self.group_of_layer[layer]]

    @property
    def query_start_loc(self) -> torch.Tensor:  # [num_seqs + 1], the same in every group
        return self.groups[0].query_start_loc

    @property
    def seq_lens(self) -> torch.Tensor:  # [num_seqs], the same in every group
        return self.groups[0].seq_lens
