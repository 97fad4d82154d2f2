"""Phi-3 (mini, medium, 3.5-mini, 4-mini): Llama layers with three differences.

- The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`:
  the loader hands each fused tensor to the column-parallel layer whole, and every rank
  keeps its rows of each part (`CausalLM.load_weights`).
- `sliding_window` applies to every layer (the mini-4k config has 2047).
- Rotary may be partial (`partial_rotary_factor`, Phi-4-mini) and, in the 128k
  variants, longrope (old configs' "su"): per-dimension short or long factors and a
  cos/sin scale. transformers picks the factors by the sequence's current length, so
  this model does the same per sequence and step (`rotary_table_rows`): exact for
  sequences within `original_max_position_embeddings` and for longer prompts computed
  in one step; a sequence that crosses that length while decoding differs, because
  transformers then recomputes its whole cache with the long factors (a recompute this
  engine's scheduler does not order). vLLM instead picks once for every sequence, by
  max_model_len, which differs from transformers for short sequences of long models.
"""

from __future__ import annotations

import torch

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.models.layer_ops import LayerOps
from engine.worker.models.layers import rope_parameters, rotary_table_rows
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.parallel.group import TensorParallelGroup

ROPE_TYPES = ("default", "longrope")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 checkpoints (`Phi3ForCausalLM`); see the module docstring."""

    stacked_params = {}  # the checkpoint's qkv_proj and gate_up_proj are ours as they are

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        rope = rope_parameters(cfg)  # transformers reads old configs' "su" as longrope
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"Phi3ForCausalLM: rope type {rope['rope_type']!r} is not supported; "
                f"Phi-3 uses one of {ROPE_TYPES}"
            )
        super().__init__(cfg, backend, group, layer_ops)
        self.rope = rope
        self.max_positions = int(cfg.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        rows = rotary_table_rows(self.rope, self.max_positions, positions, metadata)
        return self.model(input_ids, rows, kv_caches, metadata)
