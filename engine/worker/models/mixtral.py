"""The sparse mixture-of-experts Llama family: Mixtral and Qwen3-MoE.

Llama layers (Qwen3's with per-head q/k norms) whose feed-forward block is a router
(`gate`, a replicated linear) and a `FusedMoE` over the experts: Mixtral on every layer
(softmax, top-k, renormalised), Qwen3-MoE on the layers `decoder_sparse_step` picks and
`mlp_only_layers` does not (softmax, top-k, renormalised with `norm_topk_prob`), a dense
Llama MLP on the others; a family built on Qwen3-MoE may add a shared expert beside
the routed ones (`shared_expert`: Qwen3-Next). Checkpoints store each expert's projections
apart (`experts.{e}.w1/w3/w2`, `experts.{e}.gate_proj/up_proj/down_proj`); Mixtral's blocks
are named `block_sparse_moe` on disk (`mlp` in transformers 5's modules).

Tensor parallelism: attention as in Llama; every expert is sliced along its
intermediate dim, the router replicated (FusedMoE's docstring).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.models.fused_moe import (
    Activation,
    ExpertsLayout,
    FusedMoE,
    Routing,
    per_expert_params,
)
from engine.worker.models.layer_ops import LayerOps
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import Part


class SparseMoeBlock(nn.Module):
    """Router `gate` (hidden -> expert logits, no bias) and the experts: [T, H] -> [T, H].
    With a `shared_expert` (an MLP every token goes through), its output weighted by
    sigmoid(`shared_expert_gate`(x)) (hidden -> 1, no bias) is added to the experts'."""

    def __init__(
        self,
        cfg,
        intermediate: Part,
        routing: Routing,
        activation: Activation,
        group: TensorParallelGroup,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        num_experts = _num_experts(cfg)
        self.gate = nn.Linear(cfg.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate=intermediate,
            routing=routing,
            activation=activation,
            layout=ExpertsLayout.PER_EXPERT,
            group=group,
        )
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> same
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is None:
            return out
        weight = torch.sigmoid(self.shared_expert_gate(hidden))  # [T, 1]
        return out + weight * self.shared_expert(hidden)


def _num_experts(cfg) -> int:
    return int(getattr(cfg, "num_local_experts", None) or cfg.num_experts)


def _check_activation(cfg) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")


class SparseLlamaForCausalLM(LlamaForCausalLM):
    """Llama layers with sparse MoE blocks (`make_mlp` of each family picks them);
    checkpoints name expert e's projections `experts.{e}.<expert_names>` (gate, up,
    down)."""

    expert_names: tuple[str, str, str]

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        _check_activation(cfg)
        super().__init__(cfg, backend, group, layer_ops)
        self.stacked_params = {  # the experts' first: Llama's `.gate_proj.` is in their names
            **per_expert_params(_num_experts(cfg), *self.expert_names),
            **LlamaForCausalLM.stacked_params,
        }


class MixtralForCausalLM(SparseLlamaForCausalLM):
    """Mixtral 8x7B / 8x22B: Llama attention (within `sliding_window` when the config
    sets one) and a sparse MoE block on every layer."""

    expert_names = ("w1", "w3", "w2")

    def make_mlp(self, cfg, ops: LayerOps, group: TensorParallelGroup, index: int) -> nn.Module:
        part = Part.even(cfg.intermediate_size, group, "intermediate_size")
        return SparseMoeBlock(cfg, part, Routing.SOFTMAX_TOPK_RENORMALIZE, ops.silu_and_mul, group)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))


class Qwen3MoeForCausalLM(SparseLlamaForCausalLM):
    """Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention (q/k norms) and a sparse MoE block
    on the layers `decoder_sparse_step` picks, bar `mlp_only_layers` (a dense MLP)."""

    qk_norm = True
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def make_mlp(self, cfg, ops: LayerOps, group: TensorParallelGroup, index: int) -> nn.Module:
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        sparse = (
            index not in (getattr(cfg, "mlp_only_layers", None) or [])
            and _num_experts(cfg) > 0
            and (index + 1) % step == 0
        )
        if not sparse:
            return super().make_mlp(cfg, ops, group, index)
        part = Part.even(cfg.moe_intermediate_size, group, "moe_intermediate_size")
        norm = bool(getattr(cfg, "norm_topk_prob", False))
        routing = Routing.SOFTMAX_TOPK_RENORMALIZE if norm else Routing.SOFTMAX_TOPK
        shared = self.shared_expert(cfg, ops, group)
        return SparseMoeBlock(cfg, part, routing, ops.silu_and_mul, group, shared)

    def shared_expert(self, cfg, ops: LayerOps, group: TensorParallelGroup) -> nn.Module | None:
        """A sparse layer's shared expert, [T, hidden] -> [T, hidden] (none here)."""
        return None
