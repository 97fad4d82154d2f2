"""Building blocks shared by the model definitions."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec
from engine.worker.models.layer_ops import TORCH_LAYER_OPS, LayerOps


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype (HF's), by
    `ops`; `forward_residual` first adds a sublayer's output into the residual stream."""

    def __init__(self, size: int, eps: float, ops: LayerOps = TORCH_LAYER_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] (native: [T, size])
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_residual(
        self,
        x: torch.Tensor,  # [num_tokens, size], a sublayer's output
        residual: torch.Tensor,  # [num_tokens, size]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(residual + x), residual + x)
        """May overwrite x and residual (the native ops do): use what it returns."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters(hf_config) -> dict:
    """Rotary settings from a transformers 4.x (rope_theta/rope_scaling) or 5.x config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    merged.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    merged.setdefault("rope_type", merged.get("type", "default"))
    return merged


def _inv_freq(head_size: int, params: dict) -> torch.Tensor:  # [head_size // 2]
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv, params)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = (
        float(p["factor"]),
        float(p["low_freq_factor"]),
        float(p["high_freq_factor"]),
    )
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table per position,
    applied by `ops` (the native ops rotate q and k in place)."""

    def __init__(
        self, head_size: int, max_positions: int, params: dict, ops: LayerOps = TORCH_LAYER_OPS
    ) -> None:
        super().__init__()
        inv = _inv_freq(head_size, params)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_size]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.ops = ops

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, KVH, D]
        return self.ops.rotary(positions, q, k, self.cos, self.sin)


class PagedAttention(nn.Module):
    """Attention of a layer's new tokens over the paged cache, through the chosen backend.

    `spec` is a float scale, or an `AttentionSpec` (sliding window, soft cap, sinks);
    with sinks, the caller passes this rank's `num_heads` sink logits to `forward` (the
    model's attention module owns them under the checkpoint's name). The backend is
    asked at construction whether it can do the spec (a start-up error if not).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        spec: float | AttentionSpec,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.spec = spec if isinstance(spec, AttentionSpec) else AttentionSpec(scale=spec)
        backend.check_spec(self.spec)
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] when the spec has sinks
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.spec, sinks)
        return out.reshape(q.shape[0], self.num_heads * self.head_size)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation an HF config names (`activation_function`), or a clear error."""
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation_function {name!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]
