"""Qwen 3.5 text models (transformers' Qwen3_5ForCausalLM, `qwen3_5_text` configs).

Llama-shaped pre-norm decoders with dense SwiGLU MLPs, whose token mixer is, per
`layer_types`, either a Gated DeltaNet ("linear_attention", gated_delta_net.py: its state
in the layer's KV cache pages) or gated full attention ("full_attention"):
- `q_proj` gives each head's query and, beside it, an output gate (per head [query |
  gate]); the attention output is multiplied by sigmoid(gate) before `o_proj`;
- per-head RMSNorm on queries and keys, then rotary on the first
  `partial_rotary_factor` of each head (transformers' multimodal rotary sections all see
  the same position for text, which is plain rotary);
- every RMSNorm (the layers', the final one, q/k) scales by (1 + weight), in float32,
  rounded once at the end (`ZeroCenteredNormOps`); the DeltaNet's gated norm does not.

Checkpoints name the DeltaNet `linear_attn` (`self_attn` here, the decoder layer's
mixer). Multimodal checkpoints (Qwen3_5ForConditionalGeneration) are refused by the
registry. Under tensor parallelism a DeltaNet splits its key heads, each with its value
heads, convolution channels and part of the state (gated_delta_net.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.spec import AttentionSpec
from engine.worker.models.gated_delta_net import GatedDeltaNet, is_linear_attention
from engine.worker.models.layer_ops import LayerOps, layer_ops_for
from engine.worker.models.layers import (
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
    zero_centered_rms_norm,
)
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    head_parts,
)


class ZeroCenteredNormOps(LayerOps):
    """`base`'s SiLU-and-mul and rotary; RMSNorms that scale by (1 + weight), normalized
    and scaled in float32 and rounded to x's dtype once (transformers' Qwen3_5RMSNorm),
    by torch's ops."""

    def __init__(self, base: LayerOps) -> None:
        self.base = base
        self.name = f"{base.name}, zero-centered norms"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return zero_centered_rms_norm(x, weight, eps)  # [..., size]

    def add_rms_norm(self, x, residual, weight, eps):
        residual = residual + x  # [num_tokens, hidden_size]
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.base.silu_and_mul(gate_up)

    def rotary(self, positions, query, key, cos, sin):
        return self.base.rotary(positions, query, key, cos, sin)


class Qwen3_5Attention(nn.Module):
    """Gated full attention of layer `index` (this rank's heads): fused q+gate/k/v
    projection, per-head q/k norms, partial rotary, paged attention, sigmoid gate,
    output projection."""

    def __init__(
        self, cfg, backend: AttentionBackend, ops: LayerOps, group: TensorParallelGroup, index: int
    ) -> None:
        super().__init__()
        self.head_size = cfg.head_dim
        q, k, v = head_parts(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, group)
        query_and_gate = Part(2 * q.full, 2 * q.start, 2 * q.size)  # per head [query | gate]
        self.num_heads, self.num_kv_heads = q.size // self.head_size, k.size // self.head_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (query_and_gate, k, v), bias, group, separate_in_checkpoint=True
        )
        self.o_proj = RowParallelLinear(q.full, cfg.hidden_size, bias, group)
        self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(
            self.head_size, cfg.max_position_embeddings, rope_parameters(cfg), ops
        )
        spec = AttentionSpec(scale=self.head_size**-0.5)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_size, spec, backend, layer_index=index
        )

    def forward(self, positions, hidden, kv_cache, metadata) -> torch.Tensor:
        t = hidden.shape[0]  # hidden: [T, hidden_size]
        query_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        query, gate = query_gate.view(t, self.num_heads, 2, self.head_size).unbind(2)
        q = self.q_norm(query)  # [T, heads, head_size]
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_size))
        v = v.reshape(t, self.num_kv_heads, self.head_size)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, metadata)  # [T, heads * head_size]
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))  # [T, hidden_size]


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen 3.5 text checkpoints (see the module docstring)."""

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        """`layer_ops`: the MLP's and rotary's ops (by default `backend`'s); the norms
        scale by (1 + weight) whatever they are."""
        ops = layer_ops if layer_ops is not None else layer_ops_for(backend)
        super().__init__(cfg, backend, group, ZeroCenteredNormOps(ops))

    def make_attention(
        self, cfg, backend: AttentionBackend, ops: LayerOps, group: TensorParallelGroup, index: int
    ) -> nn.Module:
        """Layer `index`'s token mixer: a Gated DeltaNet or gated full attention."""
        if is_linear_attention(cfg, index):
            return GatedDeltaNet(cfg, index, group, block_dim=backend.block_dim)
        return Qwen3_5Attention(cfg, backend, ops, group, index)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.replace(".linear_attn.", ".self_attn."))
