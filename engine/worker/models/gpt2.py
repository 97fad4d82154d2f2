"""GPT-2: learned absolute positions, pre-norm LayerNorm blocks, fused Conv1D q/k/v.

HF stores GPT-2's linear layers as `Conv1D`: the weight is `[in, out]` and `y = x @ W + b`,
so our layers keep that layout (`transposed=True`) and checkpoints load without
transposing. Tensor parallelism: c_attn (q, k, v concatenated in one checkpoint tensor)
and c_fc are column-parallel, the two c_proj row-parallel, wte vocabulary-parallel; the
position table and the LayerNorms are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.models.base import CausalLM
from engine.worker.models.layers import PagedAttention, activation_fn
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_parts,
)
from engine.worker.parallel.pipeline import NO_LINK, PipelineLayout, present


class GPT2Attention(nn.Module):
    """Fused q/k/v projection, paged multi-head attention, output projection."""

    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend, group) -> None:
        super().__init__()
        hidden = cfg.n_embd
        self.head_size = hidden // cfg.n_head
        scale = self.head_size**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        parts = head_parts(cfg.n_head, cfg.n_head, self.head_size, group)
        self.num_heads = parts[0].size // self.head_size  # this rank's
        self.c_attn = ColumnParallelLinear(hidden, parts, True, group, transposed=True)
        self.c_proj = RowParallelLinear(hidden, hidden, True, group, transposed=True)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_size, scale, backend)

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        t = hidden.shape[0]  # hidden: [T, hidden_size]
        q, k, v = self.c_attn.split(self.c_attn(hidden))
        shape = (t, self.num_heads, self.head_size)
        out = self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), kv_cache, metadata)
        return self.c_proj(out)  # [T, hidden_size]


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x)))."""

    def __init__(self, cfg, group: TensorParallelGroup) -> None:
        super().__init__()
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
        part = Part.even(inner, group, "n_inner")
        self.c_fc = ColumnParallelLinear(cfg.n_embd, (part,), True, group, transposed=True)
        self.c_proj = RowParallelLinear(inner, cfg.n_embd, True, group, transposed=True)
        self.act = activation_fn(getattr(cfg, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend, group) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.attn = GPT2Attention(cfg, layer_idx, backend, group)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.mlp = GPT2MLP(cfg, group)

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm (HF's `transformer.` prefix);
    on a pipeline stage (`pp`), its own blocks between the stages' streams."""

    pp = NO_LINK

    def __init__(self, cfg, backend: AttentionBackend, group: TensorParallelGroup) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, group)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i, backend, group) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        if self.pp.receives:
            hidden = self.pp.receive(input_ids.shape[0])
        else:
            hidden = self.wte(input_ids) + self.wpe(positions)  # [T, hidden_size]
        for block, kv_cache in present(self.h, kv_caches):
            hidden = block(hidden, kv_cache, metadata)
        return self.pp.send(hidden) if self.pp.sends else self.ln_f(hidden)


_BARE_PREFIXES = ("wte.", "wpe.", "h.", "ln_f.")


class GPT2LMHeadModel(CausalLM):
    """GPT-2 (and DistilGPT-2) checkpoints; the LM head is tied to `wte` unless the config
    says otherwise.

    `reorder_and_upcast_attn` only changes the rounding of HF's eager attention, not its
    math, so it is accepted and ignored; `scale_attn_by_inverse_layer_idx` is implemented.
    """

    # HF's causal-mask buffers; a leading dot so `c_attn.bias` is not mistaken for one.
    ignored_weight_suffixes = (".attn.bias", ".attn.masked_bias")
    pipeline_layout = PipelineLayout(
        "transformer",
        "transformer.h",
        ("transformer.wte", "transformer.wpe"),
        ("transformer.ln_f", "lm_head"),
    )

    def __init__(
        self, cfg, backend: AttentionBackend, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError(
                "GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported"
            )
        group = group or TensorParallelGroup()
        self.transformer = GPT2Model(cfg, backend, group)
        tie = "transformer.wte" if getattr(cfg, "tie_word_embeddings", True) else None
        self.init_lm_head(cfg.n_embd, cfg.vocab_size, tie, group)

    def backbone(self) -> nn.Module:
        return self.transformer

    def checkpoint_name(self, name: str) -> str | None:
        """Hub GPT-2 checkpoints name tensors without `transformer.` (e.g. `h.0.ln_1.weight`)."""
        if name.startswith(_BARE_PREFIXES):
            name = "transformer." + name
        return super().checkpoint_name(name)
