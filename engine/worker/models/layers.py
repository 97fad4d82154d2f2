"""Building blocks shared by the model definitions."""

from __future__ import annotations

import json
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


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype once at the end
    (Gemma's and Qwen 3.5's RMSNorm; Llama's rounds before the weight). x: [..., size]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rope_parameters(hf_config) -> dict:
    """Rotary settings from a transformers 4.x (rope_theta/rope_scaling) or 5.x config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    merged.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    merged.setdefault("rope_type", merged.get("type", "default"))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):  # 4.x: beside
        if getattr(hf_config, key, None) is not None:
            merged.setdefault(key, getattr(hf_config, key))
    return merged


def _frequencies(
    rotary_dim: int, max_positions: int, params: dict
) -> list[tuple[torch.Tensor, float]]:
    """(inverse frequencies [rotary_dim // 2], cos/sin scale) per table: one, or for
    longrope two (the short factors', then the long factors')."""
    if params["rope_type"] == "longrope":
        return _longrope_frequencies(rotary_dim, max_positions, params)
    if params["rope_type"] == "yarn":
        return [_yarn_frequencies(rotary_dim, max_positions, params)]
    return [(_inv_freq(rotary_dim, params), 1.0)]


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
    raise ValueError(
        f"rope_type {kind!r} is not supported (default, linear, llama3, longrope, yarn)"
    )


def _yarn_frequencies(dim: int, max_positions: int, p: dict) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`: frequencies interpolated by `factor`
    below a ramp over dims [low, high] (from beta_fast and beta_slow rotations over the
    original length; `truncate` rounds them outwards), extrapolated above it; cos and
    sin scaled by `attention_factor` (by default 0.1 * mscale * ln(factor) + 1)."""
    base = float(p["rope_theta"])
    original = int(p.get("original_max_position_embeddings") or max_positions)
    factor = p.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp  # the share of the original frequency, per dim
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def _longrope_frequencies(
    rotary_dim: int, max_positions: int, p: dict
) -> list[tuple[torch.Tensor, float]]:
    """transformers' `_compute_longrope_parameters`: per-dimension factors divide the
    frequencies; cos and sin are scaled by `attention_factor` (by default
    sqrt(1 + ln(factor) / ln(original length)), factor = max_positions / original)."""
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_positions / original
    scale = p.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    base = float(p["rope_theta"])
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(p[key], dtype=torch.float32)
        tables.append((1.0 / (ext * base**shape), float(scale)))
    return tables


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
    applied by `ops` (the native ops rotate q and k in place).

    `partial_rotary_factor` in `params` turns only the first `rotary_dim` features of
    each head (by torch's ops; the rest pass through). Longrope keeps two tables, one
    above the other: rows [0, max_positions) with the short factors, then the long
    factors' (`rotary_table_rows` says which row a token reads).
    """

    def __init__(
        self, head_size: int, max_positions: int, params: dict, ops: LayerOps = TORCH_LAYER_OPS
    ) -> None:
        super().__init__()
        self.rotary_dim = int(head_size * float(params.get("partial_rotary_factor") or 1.0))
        self.max_positions, self.params = max_positions, params
        # The tables are built on first need (`share_rotary_tables` builds each distinct
        # one once for a whole model: built per layer, then shared, their copies' heap
        # stayed resident, 365 MiB for SmolLM2's 30 layers).
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [rows, rotary_dim]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.ops = ops if self.rotary_dim == head_size else TORCH_LAYER_OPS

    @property
    def recipe(self) -> str:
        """What the tables depend on: layers with one recipe have equal tables."""
        return json.dumps(
            [self.rotary_dim, self.max_positions, self.params], sort_keys=True, default=str
        )

    def build_tables(self) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [rows, rotary_dim]
        cos, sin = [], []
        device = self.cos.device
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        for inv, scale in _frequencies(self.rotary_dim, self.max_positions, self.params):
            freqs = torch.outer(positions, inv.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, rotary_dim]
            cos.append(emb.cos() * scale)  # transformers' attention scaling (1.0: exact)
            sin.append(emb.sin() * scale)
        return torch.cat(cos), torch.cat(sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, KVH, D]
        if self.cos.numel() == 0:  # a model built without share_rotary_tables
            self.cos, self.sin = self.build_tables()
        d = self.rotary_dim
        if d == q.shape[-1]:
            return self.ops.rotary(positions, q, k, self.cos, self.sin)
        q_rot, k_rot = self.ops.rotary(positions, q[..., :d], k[..., :d], self.cos, self.sin)
        return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)


def share_rotary_tables(model: nn.Module) -> None:
    """Builds each distinct rotary table of the model once and gives it to every layer
    of that recipe (an 8B Llama's 8k positions: 8 MiB per layer, 256 MiB over 32 layers
    if each kept its own)."""
    built: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            recipe = module.recipe
            if recipe not in built:
                built[recipe] = module.build_tables()
            module.cos, module.sin = built[recipe]


def rotary_table_rows(
    params: dict,
    max_positions: int,
    positions: torch.Tensor,  # [T]
    metadata: AttentionMetadata,
) -> torch.Tensor:  # [T]: the RotaryEmbedding table row each token reads
    """A token's position, or, with longrope, its position in the long factors' half
    (+ max_positions) when its sequence's context length this step (`seq_lens`)
    exceeds `original_max_position_embeddings`: transformers picks the factors by the
    current length (`max(position_ids) + 1` of each forward pass).

    Exact against transformers' `generate` for sequences that stay within the original
    length, and for prompts longer than it computed in one step. Not for a sequence
    that crosses it while decoding: `generate` then drops its cache and recomputes the
    whole sequence with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation),
    a recompute only the scheduler could order; here the keys cached before the crossing
    keep the short factors. Likewise a longer prompt prefilled in chunks (the chunks
    that end within the original length use the short factors).
    """
    if params["rope_type"] != "longrope":
        return positions
    query_lens = torch.diff(metadata.query_start_loc)  # [num_seqs]
    context = torch.repeat_interleave(
        metadata.seq_lens, query_lens, output_size=positions.shape[0]
    )  # [T]
    long = context > int(params["original_max_position_embeddings"])
    return positions + long.to(positions.dtype) * max_positions


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
        layer_index: int | None = None,
    ) -> None:
        """`layer_index`: the model layer this attention is in (which KV cache group's
        block tables it reads when the layout has several; required there)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.spec = spec if isinstance(spec, AttentionSpec) else AttentionSpec(scale=spec)
        backend.check_spec(self.spec)
        self.backend = backend
        self.layer_index = layer_index

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        sinks: torch.Tensor | None = None,  # [num_heads] when the spec has sinks
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        metadata = metadata.for_layer(self.layer_index)
        shards = metadata.context
        if shards is None:
            out = self.backend.forward(q, k, v, kv_cache, metadata, self.spec, sinks)
        else:  # every shard's new K/V written here, then this shard's queries attend
            key_cache, value_cache = kv_cache
            k, v = shards.gather(k), shards.gather(v)  # [T, num_kv_heads, head_size]
            self.backend.write(k, v, key_cache, value_cache, shards.slot_mapping)
            out = self.backend.attend(q, key_cache, value_cache, metadata, self.spec, sinks)
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
