"""Qwen3-Next (transformers' Qwen3NextForCausalLM, `qwen3_next` configs).

Qwen 3.5's layers (qwen3_5.py: Gated DeltaNet or gated full attention per `layer_types`,
zero-centered norms, partial rotary) with Qwen3-MoE's feed-forward blocks (mixtral.py:
sparse on the layers `decoder_sparse_step` picks bar `mlp_only_layers`, softmax top-k
renormalised with `norm_topk_prob`), each sparse block with a shared expert (a SwiGLU MLP
of `shared_expert_intermediate_size`) weighted by sigmoid(`shared_expert_gate`).

The DeltaNet's input projections are fused in the checkpoint, their rows grouped by key
head: `in_proj_qkvz` holds, for each key head, its q, its k, its value heads' v, their z;
`in_proj_ba` for each key head its value heads' b, then their a (transformers'
`fix_query_key_value_ordering`). Loading permutes those rows into Qwen 3.5's separate
`in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b`, `in_proj_a`, so the layer
runs unchanged. The multi-token-prediction head (`mtp.*`) is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.models.layer_ops import LayerOps
from engine.worker.models.llama import LlamaMLP
from engine.worker.models.mixtral import Qwen3MoeForCausalLM
from engine.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from engine.worker.parallel.group import TensorParallelGroup

MTP_PREFIX = "mtp."  # the multi-token-prediction head's tensors


class FusedProjections(NamedTuple):
    """How Qwen3-Next's fused DeltaNet input projections group their rows (per key head),
    and their split into Qwen 3.5's separate projections."""

    key_heads: int
    values_per_key: int  # value heads per key head
    head_k_dim: int
    head_v_dim: int

    @classmethod
    def of(cls, cfg) -> FusedProjections:
        per_key = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        return cls(
            cfg.linear_num_key_heads, per_key, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        )

    def split_qkvz(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`in_proj_qkvz` [key heads * (2 dk + 2 r dv), H] -> (`in_proj_qkv` [2 * key_dim +
        value_dim, H]: every q, every k, every v; `in_proj_z` [value_dim, H])."""
        dk, values = self.head_k_dim, self.values_per_key * self.head_v_dim
        grouped = weight.reshape(self.key_heads, 2 * dk + 2 * values, -1)  # [key heads, rows, H]
        q, k, v, z = grouped.split([dk, dk, values, values], dim=1)
        rows = (x.reshape(-1, weight.shape[-1]) for x in (q, k, v))
        return torch.cat(list(rows)), z.reshape(-1, weight.shape[-1])

    def split_ba(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`in_proj_ba` [key heads * 2 r, H] -> (`in_proj_b`, `in_proj_a`), [value heads, H]
        each."""
        grouped = weight.reshape(self.key_heads, 2 * self.values_per_key, -1)
        b, a = grouped.split(self.values_per_key, dim=1)  # [key heads, r, H] each
        return b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])

    def unfused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` with each fused tensor replaced by the separate projections' ones."""
        for name, tensor in weights:
            if name.endswith(".in_proj_qkvz.weight"):
                stem = name.removesuffix("qkvz.weight")
                qkv, z = self.split_qkvz(tensor)
                yield stem + "qkv.weight", qkv
                yield stem + "z.weight", z
            elif name.endswith(".in_proj_ba.weight"):
                stem = name.removesuffix("ba.weight")
                b, a = self.split_ba(tensor)
                yield stem + "b.weight", b
                yield stem + "a.weight", a
            else:
                yield name, tensor


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM, Qwen3MoeForCausalLM):
    """Qwen3-Next checkpoints (see the module docstring): attention, DeltaNet and norms
    from Qwen 3.5, sparse blocks from Qwen3-MoE plus a shared expert."""

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        super().__init__(cfg, backend, group, layer_ops)
        self.fused_projections = FusedProjections.of(cfg)

    def shared_expert(self, cfg, ops: LayerOps, group: TensorParallelGroup) -> nn.Module:
        return LlamaMLP(cfg, ops, group, cfg.shared_expert_intermediate_size)

    def checkpoint_name(self, name: str) -> str | None:
        return None if name.startswith(MTP_PREFIX) else super().checkpoint_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.fused_projections.unfused(weights))
