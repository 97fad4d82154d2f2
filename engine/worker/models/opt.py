"""OPT: learned absolute positions (offset 2), LayerNorm blocks, separate q/k/v projections.

Switches read from the HF config: `do_layer_norm_before` (False: post-norm, as in
OPT-350m), `word_embed_proj_dim` (!= hidden_size: `project_in`/`project_out` around the
decoder), `enable_bias`, `layer_norm_elementwise_affine`, `activation_function`.

Tensor parallelism: q/k/v and fc1 are column-parallel, out_proj and fc2 row-parallel,
embed_tokens vocabulary-parallel; positions, norms and project_in/out are replicated.
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

# OPT's position table has two extra rows in front: position p reads row p + 2.
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    """q/k/v projections, paged multi-head attention, output projection."""

    def __init__(self, cfg, backend: AttentionBackend, group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        heads = cfg.num_attention_heads
        self.head_size = hidden // heads
        q, k, v = head_parts(heads, heads, self.head_size, group)
        self.num_heads = q.size // self.head_size  # this rank's
        self.q_proj = ColumnParallelLinear(hidden, (q,), bias, group)
        self.k_proj = ColumnParallelLinear(hidden, (k,), bias, group)
        self.v_proj = ColumnParallelLinear(hidden, (v,), bias, group)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, group)
        self.attn = PagedAttention(
            self.num_heads, self.num_heads, self.head_size, self.head_size**-0.5, backend
        )

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        shape = (hidden.shape[0], self.num_heads, self.head_size)  # hidden: [T, hidden_size]
        q = self.q_proj(hidden).view(shape)
        k = self.k_proj(hidden).view(shape)
        v = self.v_proj(hidden).view(shape)
        return self.out_proj(self.attn(q, k, v, kv_cache, metadata))  # [T, hidden_size]


class OPTDecoderLayer(nn.Module):
    """Residual attention and feed-forward, each normed before (pre-norm) or after it."""

    def __init__(self, cfg, backend: AttentionBackend, group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(getattr(cfg, "do_layer_norm_before", True))
        self.self_attn = OPTAttention(cfg, backend, group)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        ffn = Part.even(cfg.ffn_dim, group, "ffn_dim")
        self.fc1 = ColumnParallelLinear(hidden, (ffn,), bias, group)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, hidden, bias, group)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.act = activation_fn(getattr(cfg, "activation_function", "relu"))

    def forward(self, hidden, kv_cache, metadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.self_attn(h, kv_cache, metadata)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        h = self.final_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.fc2(self.act(self.fc1(h)))
        return hidden if self.pre_norm else self.final_layer_norm(hidden)


class OPTDecoder(nn.Module):
    """Embeddings (projected in if narrower), layers, final norm; owns `project_out`. On
    a pipeline stage (`pp`), its own layers between the stages' streams."""

    pp = NO_LINK

    def __init__(self, cfg, backend: AttentionBackend, group: TensorParallelGroup) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        embed_dim = getattr(cfg, "word_embed_proj_dim", None) or hidden
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, embed_dim, group)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if embed_dim != hidden else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if embed_dim != hidden else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(cfg, backend, group) for _ in range(cfg.num_hidden_layers)
        )
        final_norm = getattr(cfg, "do_layer_norm_before", True) and not getattr(
            cfg, "_remove_final_layer_norm", False
        )
        self.final_layer_norm = (
            nn.LayerNorm(hidden, elementwise_affine=affine) if final_norm else None
        )

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        if self.pp.receives:
            hidden = self.pp.receive(input_ids.shape[0])
        else:
            hidden = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
            if self.project_in is not None:
                hidden = self.project_in(hidden)  # [T, hidden_size]
            hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in present(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, metadata)
        if self.pp.sends:
            return self.pp.send(hidden)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden  # [T, hidden_size]; project_out runs in compute_logits


class OPTModel(nn.Module):
    """HF's `model.` level: holds the decoder."""

    def __init__(self, cfg, backend: AttentionBackend, group: TensorParallelGroup) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, backend, group)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, metadata)


class OPTForCausalLM(CausalLM):
    """OPT checkpoints (125m ... 66b, and post-norm 350m); the LM head is tied by default.

    `forward` returns `[T, hidden_size]`; where word_embed_proj_dim differs (OPT-350m),
    `compute_logits` applies `project_out` first, to the sampled rows only.
    """

    pipeline_layout = PipelineLayout(
        "model.decoder",
        "model.decoder.layers",
        ("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.project_in"),
        ("model.decoder.final_layer_norm", "model.decoder.project_out", "lm_head"),
    )

    def __init__(
        self, cfg, backend: AttentionBackend, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        group = group or TensorParallelGroup()
        self.model = OPTModel(cfg, backend, group)
        embed_dim = self.model.decoder.embed_tokens.weight.shape[1]
        tie = "model.decoder.embed_tokens" if getattr(cfg, "tie_word_embeddings", True) else None
        self.init_lm_head(embed_dim, cfg.vocab_size, tie, group)

    def backbone(self) -> nn.Module:
        return self.model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab_size]
        project_out = self.model.decoder.project_out
        if project_out is not None:
            hidden = project_out(hidden)  # [N, word_embed_proj_dim]
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """Some hub OPT checkpoints name tensors without `model.` (`decoder.layers.0...`)."""
        if name.startswith("decoder."):
            name = "model." + name
        return super().checkpoint_name(name)
