"""The Llama family: Llama 2/3 (and TinyStories), Mistral, Qwen2, Qwen3.

They differ only in small switches read from the HF config: biases on q/k/v (Qwen2),
per-head RMSNorm on q and k (Qwen3), explicit head_dim, tied embeddings. Families built
on these layers pick each layer's attention and feed-forward block (`make_attention`,
`make_mlp`: mixtral.py, gpt_oss.py).

Tensor parallelism (`group`): q/k/v and gate/up are column-parallel (each rank holds its
query heads, its key/value heads or a copy of one, its slice of the MLP), o_proj and
down_proj row-parallel (all-reduced), the embedding and LM head vocabulary-parallel;
norms are replicated.

Layers pass (hidden, residual) along: each one adds the previous sublayer's output into
the residual stream inside its pre-norm (`RMSNorm.forward_residual`), which the native
layer ops (`layer_ops.py`) fuse into one pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.config import layer_sliding_window
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.spec import AttentionSpec
from engine.worker.models.base import CausalLM
from engine.worker.models.layer_ops import LayerOps, layer_ops_for
from engine.worker.models.layers import (
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    rope_parameters,
)
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_parts,
)
from engine.worker.parallel.pipeline import NO_LINK, PipelineLayout, present


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, rotary, paged attention, output projection (this rank's
    heads: `num_heads`, `num_kv_heads` are per rank). Layer `index` attends within the
    config's sliding window where it has one (`layer_sliding_window`)."""

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        ops: LayerOps,
        group: TensorParallelGroup,
        qkv_bias: bool,
        qk_norm: bool,
        index: int = 0,
    ) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        parts = head_parts(total_heads, total_kv_heads, self.head_size, group)
        self.num_heads = parts[0].size // self.head_size
        self.num_kv_heads = parts[1].size // self.head_size
        hidden = cfg.hidden_size
        bias = qkv_bias or bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            hidden, parts, bias, group, separate_in_checkpoint=True
        )
        out_bias = bool(getattr(cfg, "attention_bias", False))
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, out_bias, group)
        if qk_norm:  # over [T, heads, head_size]: torch's ops (the native ones take rows)
            self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = RotaryEmbedding(
            self.head_size, cfg.max_position_embeddings, rope_parameters(cfg), ops
        )
        spec = self.attention_spec(cfg, index)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_size, spec, backend, layer_index=index
        )

    def attention_spec(self, cfg, index: int) -> AttentionSpec:
        """How layer `index` attends (a subclass adds features, e.g. GPT-OSS's sinks)."""
        return AttentionSpec(
            scale=self.head_size**-0.5, sliding_window=layer_sliding_window(cfg, index)
        )

    def forward(self, positions, hidden, kv_cache, metadata) -> torch.Tensor:
        q, k, v = self.project(positions, hidden)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))  # [T, hidden_size]

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, heads, D] and keys [T, kv_heads, D], values [T, kv_heads, D]."""
        t = hidden.shape[0]  # hidden: [T, hidden_size]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(t, self.num_heads, self.head_size)
        k = k.reshape(t, self.num_kv_heads, self.head_size)
        v = v.reshape(t, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul;
    `intermediate_size` wide (default: the config's)."""

    def __init__(
        self,
        cfg,
        ops: LayerOps,
        group: TensorParallelGroup,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        part = Part.even(inter, group, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, (part, part), bias, group, separate_in_checkpoint=True
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, group)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> same
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate_size / world]
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP.

    Takes the previous layer's output and the residual stream (None before the first
    layer, where the embedding is the stream) and returns the MLP's output and the
    stream; the next norm adds the two. `self_attn` and `mlp` come built (the model
    class picks them per layer: `make_attention`, `make_mlp`).
    """

    def __init__(self, cfg, ops: LayerOps, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden_size]
        residual: torch.Tensor | None,  # [T, hidden_size]
        kv_cache,
        metadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual), [T, hidden_size] each
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix). On a pipeline stage
    (`pp`) it runs its own layers between the previous stage's stream and the next's."""

    pp = NO_LINK

    def __init__(self, cfg, ops: LayerOps, group, layers: Iterable[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        if self.pp.receives:  # the residual stream so far: the next norm's input
            hidden, residual = self.pp.receive(input_ids.shape[0]), None
        else:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden_size]
        for layer, kv_cache in present(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        if self.pp.sends:
            return self.pp.send(hidden if residual is None else hidden + residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.forward_residual(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 and TinyStories checkpoints."""

    qkv_bias = False
    qk_norm = False
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }
    pipeline_layout = PipelineLayout(
        "model", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")
    )

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        """`group`: this rank's place (None: one device). `layer_ops`: the norms',
        rotary's and MLP's ops; by default the ones that go with `backend`
        (`layer_ops_for`)."""
        super().__init__()
        group = group or TensorParallelGroup()
        ops = layer_ops if layer_ops is not None else layer_ops_for(backend)
        layers = (
            LlamaDecoderLayer(
                cfg,
                ops,
                self.make_attention(cfg, backend, ops, group, i),
                self.make_mlp(cfg, ops, group, i),
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.model = LlamaModel(cfg, ops, group, layers)
        tie = "model.embed_tokens" if getattr(cfg, "tie_word_embeddings", False) else None
        self.init_lm_head(cfg.hidden_size, cfg.vocab_size, tie, group)

    def make_attention(
        self, cfg, backend: AttentionBackend, ops: LayerOps, group: TensorParallelGroup, index: int
    ) -> nn.Module:
        """Layer `index`'s attention: `forward(positions, hidden, kv_cache, metadata)`."""
        return LlamaAttention(cfg, backend, ops, group, self.qkv_bias, self.qk_norm, index)

    def make_mlp(self, cfg, ops: LayerOps, group: TensorParallelGroup, index: int) -> nn.Module:
        """Layer `index`'s feed-forward block, [T, hidden] -> [T, hidden] (the MoE
        families put a sparse block on some or all layers)."""
        return LlamaMLP(cfg, ops, group)

    def backbone(self) -> nn.Module:
        return self.model


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layers, every one attending within `sliding_window` when set."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5: Llama layers with biases on the q/k/v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama layers with per-head RMSNorm on queries and keys before rotary."""

    qk_norm = True
