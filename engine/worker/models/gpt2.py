"""GPT-2: learned absolute positions, pre-norm LayerNorm blocks, fused Conv1D q/k/v.

HF stores GPT-2's linear layers as `Conv1D`: the weight is `[in, out]` and `y = x @ W + b`,
so our `Conv1D` keeps that layout and checkpoints load without transposing.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.models.base import CausalLM
from engine.worker.models.layers import PagedAttention, activation_fn


class Conv1D(nn.Module):
    """HF's GPT-2 linear layer: weight `[in_features, out_features]`, `y = x @ W + b`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    """Fused q/k/v projection, paged multi-head attention, output projection."""

    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = cfg.n_embd
        self.num_heads = cfg.n_head
        self.head_size = hidden // self.num_heads
        scale = self.head_size**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.c_attn = Conv1D(hidden, 3 * hidden)
        self.c_proj = Conv1D(hidden, hidden)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_size, scale, backend)

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        t = hidden.shape[0]  # hidden: [T, hidden_size]
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)
        shape = (t, self.num_heads, self.head_size)
        out = self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), kv_cache, metadata)
        return self.c_proj(out)  # [T, hidden_size]


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x)))."""

    def __init__(self, cfg) -> None:
        super().__init__()
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
        self.c_fc = Conv1D(cfg.n_embd, inner)
        self.c_proj = Conv1D(inner, cfg.n_embd)
        self.act = activation_fn(getattr(cfg, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.attn = GPT2Attention(cfg, layer_idx, backend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm (HF's `transformer.` prefix)."""

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i, backend) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)  # [T, hidden_size]
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            hidden = block(hidden, kv_cache, metadata)
        return self.ln_f(hidden)


_BARE_PREFIXES = ("wte.", "wpe.", "h.", "ln_f.")


class GPT2LMHeadModel(CausalLM):
    """GPT-2 (and DistilGPT-2) checkpoints; the LM head is tied to `wte` unless the config
    says otherwise.

    `reorder_and_upcast_attn` only changes the rounding of HF's eager attention, not its
    math, so it is accepted and ignored; `scale_attn_by_inverse_layer_idx` is implemented.
    """

    # HF's causal-mask buffers; a leading dot so `c_attn.bias` is not mistaken for one.
    ignored_weight_suffixes = (".attn.bias", ".attn.masked_bias")

    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__()
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError(
                "GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported"
            )
        self.transformer = GPT2Model(cfg, backend)
        tie = "transformer.wte" if getattr(cfg, "tie_word_embeddings", True) else None
        self.init_lm_head(cfg.n_embd, cfg.vocab_size, tie)

    def backbone(self) -> nn.Module:
        return self.transformer

    def checkpoint_name(self, name: str) -> str | None:
        """Hub GPT-2 checkpoints name tensors without `transformer.` (e.g. `h.0.ln_1.weight`)."""
        if name.startswith(_BARE_PREFIXES):
            name = "transformer." + name
        return super().checkpoint_name(name)
