"""The Gemma 2 and Gemma 3 (text) families.

Llama-shaped decoders with Gemma's own pieces, all read from the HF config:
- RMSNorm scales by (1 + weight), in float32, rounded once at the end (`GemmaRMSNorm`);
- the embedding is multiplied by sqrt(hidden_size) rounded to the model's dtype;
- four norms per layer ("sandwich"): before and after attention, before and after the MLP,
  each sublayer's normed output added to the residual stream;
- a GeGLU MLP (`hidden_activation`: gelu with the tanh approximation);
- scores scaled by `query_pre_attn_scalar ** -0.5`; sliding-window and full-attention
  layers alternate (`layer_types`, `layer_sliding_window`);
- tied embeddings; logits soft-capped when `final_logit_softcapping` is set.

Gemma 2 soft-caps the attention scores (`attn_logit_softcapping`). Gemma 3 does not
(transformers ignores that field for it), normalizes queries and keys per head, and
gives each layer type its own rotary: transformers 5 nests `rope_parameters` by layer
type; older configs give local layers `rope_local_base_freq` and global ones
`rope_theta` with `rope_scaling`. One rotary table per layer type, shared by its layers.

Tensor parallelism as in llama.py: q/k/v and gate/up column-parallel, o_proj and
down_proj row-parallel, embedding and LM head vocabulary-parallel, norms replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import layer_sliding_window
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.spec import AttentionSpec
from engine.worker.models.base import CausalLM
from engine.worker.models.layer_ops import LayerOps, layer_ops_for
from engine.worker.models.layers import (
    PagedAttention,
    RotaryEmbedding,
    activation_fn,
    rope_parameters,
    zero_centered_rms_norm,
)
from engine.worker.models.llama import LlamaForCausalLM
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_parts,
)
from engine.worker.parallel.pipeline import NO_LINK, PipelineLayout, present


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and rounded to x's dtype at the end
    (transformers' Gemma2RMSNorm/Gemma3RMSNorm; Llama's rounds before the weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return zero_centered_rms_norm(x, self.weight, self.eps)


def layer_rope_parameters(cfg, layer_type: str) -> dict:
    """The rotary settings of one layer type (see the module docstring)."""
    nested = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(nested.get(layer_type), dict):  # transformers 5, Gemma 3
        params = dict(nested[layer_type])
        params.setdefault("rope_type", params.get("type", "default"))
        return params
    if layer_type == "sliding_attention" and hasattr(cfg, "rope_local_base_freq"):
        return {"rope_type": "default", "rope_theta": float(cfg.rope_local_base_freq)}
    return rope_parameters(cfg)


class GemmaAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norms, rotary (`rotary`: the one of
    this layer's type), paged attention within the layer's window, soft-capped scores
    when `soft_cap` is set, output projection. Heads are this rank's."""

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup,
        index: int,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        soft_cap: float | None,
    ) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        parts = head_parts(total_heads, total_kv_heads, self.head_size, group)
        self.num_heads = parts[0].size // self.head_size
        self.num_kv_heads = parts[1].size // self.head_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, parts, bias, group, separate_in_checkpoint=True
        )
        self.o_proj = RowParallelLinear(total_heads * self.head_size, cfg.hidden_size, bias, group)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_size, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_size, cfg.rms_norm_eps)
        self.rotary_emb = rotary
        spec = AttentionSpec(
            scale=cfg.query_pre_attn_scalar**-0.5,
            sliding_window=layer_sliding_window(cfg, index),
            logit_soft_cap=soft_cap,
        )
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_size, spec, backend, layer_index=index
        )

    def forward(self, positions, hidden, kv_cache, metadata) -> torch.Tensor:
        t = hidden.shape[0]  # hidden: [T, hidden_size]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(t, self.num_heads, self.head_size)
        k = k.reshape(t, self.num_kv_heads, self.head_size)
        v = v.reshape(t, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))  # [T, hidden_size]


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg, group: TensorParallelGroup) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        part = Part.even(inter, group, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, (part, part), False, group, separate_in_checkpoint=True
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, group)
        self.act = activation_fn(getattr(cfg, "hidden_activation", None) or cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> same
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm residual block: x + post_norm(attn(norm(x))), then the same with
    the MLP. Takes and returns the residual stream [T, hidden_size]."""

    def __init__(self, cfg, backend, group, index: int, rotary, qk_norm, soft_cap) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, backend, group, index, rotary, qk_norm, soft_cap)
        self.mlp = GemmaMLP(cfg, group)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions, hidden, kv_cache, metadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers, final norm (HF's `model.` prefix); on a
    pipeline stage (`pp`), its own layers between the stages' streams."""

    pp = NO_LINK

    def __init__(
        self, cfg, backend, ops: LayerOps, group, qk_norm: bool, soft_cap: float | None
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        # float32 first, then the model's dtype: transformers' rounding (sqrt(3072) -> 55.5
        # in bfloat16), not a direct rounding of the float64 value.
        normalizer = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("normalizer", normalizer, persistent=False)
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        types = list(cfg.layer_types)
        rotary = {
            kind: RotaryEmbedding(
                head_size, cfg.max_position_embeddings, layer_rope_parameters(cfg, kind), ops
            )
            for kind in dict.fromkeys(types)
        }
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, backend, group, i, rotary[kind], qk_norm, soft_cap)
            for i, kind in enumerate(types[: cfg.num_hidden_layers])
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        if self.pp.receives:
            hidden = self.pp.receive(input_ids.shape[0])
        else:
            hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
            hidden = hidden * self.normalizer.to(hidden.dtype)
        for layer, kv_cache in present(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, metadata)
        return self.pp.send(hidden) if self.pp.sends else self.norm(hidden)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: soft-capped attention scores and logits."""

    stacked_params = LlamaForCausalLM.stacked_params  # q/k/v and gate/up stored apart
    qk_norm = False
    caps_attention = True  # whether `attn_logit_softcapping` applies
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
        """`group`: this rank's place (None: one device). `layer_ops`: rotary's ops; by
        default the ones that go with `backend` (the norms and MLP use torch's)."""
        super().__init__()
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(
                f"{type(self).__name__}: use_bidirectional_attention=True (an embedding "
                "model) is not supported; pagedserve serves causal language models"
            )
        group = group or TensorParallelGroup()
        ops = layer_ops if layer_ops is not None else layer_ops_for(backend)
        soft_cap = getattr(cfg, "attn_logit_softcapping", None) if self.caps_attention else None
        self.model = GemmaModel(cfg, backend, ops, group, self.qk_norm, soft_cap or None)
        self.final_soft_cap = getattr(cfg, "final_logit_softcapping", None) or None
        tie = "model.embed_tokens" if getattr(cfg, "tie_word_embeddings", True) else None
        self.init_lm_head(cfg.hidden_size, cfg.vocab_size, tie, group)

    def backbone(self) -> nn.Module:
        return self.model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size]
        logits = self.lm_head(hidden)  # capped in the model's dtype, as transformers does
        cap = self.final_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text models (transformers' Gemma3ForCausalLM, `gemma3_text` configs):
    per-head q/k norms, a rotary per layer type, no attention soft cap."""

    qk_norm = True
    caps_attention = False
