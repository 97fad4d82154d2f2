"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): Llama-shaped layers with four differences.

- Attention has biases (`attention_bias`), learned per-head sink logits
  (`self_attn.sinks`, each rank keeping its heads'), and alternates sliding-window and
  full layers (`layer_types`); rotary is YaRN (`layers.py`, cos/sin scaled).
- The feed-forward block is a router with a bias (`mlp.router`) and a `FusedMoE` whose
  experts have biases and the clamped SwiGLU (`clamped_swiglu`); a token's weights are
  the softmax over its top-k logits.
- The checkpoint stores the experts stacked, gate and up interleaved
  (`ExpertsLayout.STACKED_INTERLEAVED`).
- Released checkpoints store the experts in MXFP4 (`*_blocks` e2m1 pairs, `*_scales`
  e8m0 per 32 values): they are dequantized at load (`dequantize_mxfp4`), so the model
  runs in the engine's dtype; other quantization methods are refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.spec import AttentionSpec
from engine.worker.models.fused_moe import ExpertsLayout, FusedMoE, Routing, clamped_swiglu
from engine.worker.models.layer_ops import LayerOps
from engine.worker.models.llama import LlamaAttention, LlamaForCausalLM
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import Part, check_shape

# e2m1: the 16 values of a 4-bit code (sign, 2 exponent bits, 1 mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


class GptOssAttention(LlamaAttention):
    """Llama attention with biases, YaRN rotary, the layer's window, and `sinks`: the
    sink logits of this rank's query heads [num_heads]."""

    def __init__(self, cfg, backend, ops: LayerOps, group: TensorParallelGroup, index: int):
        super().__init__(cfg, backend, ops, group, qkv_bias=False, qk_norm=False, index=index)
        self.total_heads = cfg.num_attention_heads
        self.first_head = group.shard(self.total_heads, "num_attention_heads")[0]
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def attention_spec(self, cfg, index: int) -> AttentionSpec:
        return dataclasses.replace(super().attention_spec(cfg, index), has_sinks=True)

    def forward(self, positions, hidden, kv_cache, metadata) -> torch.Tensor:
        q, k, v = self.project(positions, hidden)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata, self.sinks))

    def load(self, name: str, tensor: torch.Tensor, part: int | None) -> None:
        """`sinks` [total heads]: this rank's heads' (its other weights are its layers')."""
        check_shape(tensor, (self.total_heads,))
        with torch.no_grad():
            self.sinks.copy_(tensor.narrow(0, self.first_head, self.num_heads))


class GptOssMLP(nn.Module):
    """Router (`router`, with a bias) and the experts: [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg, group: TensorParallelGroup) -> None:
        super().__init__()
        num_experts = cfg.num_local_experts
        self.router = nn.Linear(cfg.hidden_size, num_experts, bias=True)
        self.experts = FusedMoE(
            num_experts=num_experts,
            top_k=cfg.num_experts_per_tok,
            hidden_size=cfg.hidden_size,
            intermediate=Part.even(cfg.intermediate_size, group, "intermediate_size"),
            routing=Routing.TOPK_SOFTMAX,
            activation=functools.partial(
                clamped_swiglu, alpha=float(cfg.swiglu_alpha), limit=float(cfg.swiglu_limit)
            ),
            layout=ExpertsLayout.STACKED_INTERLEAVED,
            group=group,
            bias=True,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden_size] -> same
        return self.experts(hidden, self.router(hidden))


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS checkpoints, unquantized or with MXFP4 experts (see the module docstring)."""

    def __init__(
        self,
        cfg,
        backend: AttentionBackend,
        group: TensorParallelGroup | None = None,
        layer_ops: LayerOps | None = None,
    ) -> None:
        method = _quant_method(cfg)
        if method not in (None, "mxfp4"):
            raise ValueError(
                f"GptOssForCausalLM: this checkpoint's weights are quantized ({method!r}); "
                "pagedserve cannot load quantized weights (only GPT-OSS's MXFP4 experts, "
                "which it dequantizes at load): use an unquantized or MXFP4 checkpoint"
            )
        super().__init__(cfg, backend, group, layer_ops)

    def make_attention(self, cfg, backend, ops: LayerOps, group, index: int) -> nn.Module:
        return GptOssAttention(cfg, backend, ops, group, index)

    def make_mlp(self, cfg, ops: LayerOps, group: TensorParallelGroup, index: int) -> nn.Module:
        return GptOssMLP(cfg, group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(dequantized_experts(weights))


def _quant_method(cfg) -> str | None:
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return str(getattr(method, "value", method))


def dequantized_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, each MXFP4 pair `X_blocks` [E, rows, G, 16] and
    `X_scales` [E, rows, G] replaced by `X` [E, G * 32, rows] (transformers' layout of
    gate_up_proj and down_proj) once both have been read."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        stem, _, kind = name.rpartition("_")
        if kind not in ("blocks", "scales"):
            yield name, tensor
            continue
        other = pending.pop(f"{stem}_{'scales' if kind == 'blocks' else 'blocks'}", None)
        if other is None:
            pending[name] = tensor
            continue
        blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
        yield stem, dequantize_mxfp4(blocks, scales).transpose(1, 2)
    if pending:
        raise ValueError(f"checkpoint has MXFP4 blocks or scales without their pair: {pending}")


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [E, rows, G, 16] uint8: two e2m1 codes a byte, low nibble first
    scales: torch.Tensor,  # [E, rows, G] uint8: e8m0 exponents (bias 127), one per 32 values
    dtype: torch.dtype = torch.bfloat16,  # holds every value exactly
) -> torch.Tensor:  # [E, rows, G * 32]
    """MXFP4 (OCP microscaling) to `dtype`, one expert at a time (bounded scratch)."""
    *lead, groups, width = blocks.shape
    if tuple(scales.shape) != (*lead, groups):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not fit blocks {blocks.shape}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*lead, groups, 2 * width, dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        codes = blocks[e].to(torch.int32)
        out[e, ..., 0::2] = lut[codes & 0x0F]
        out[e, ..., 1::2] = lut[codes >> 4]
        torch.ldexp(out[e], scales[e].to(torch.int32).unsqueeze(-1) - 127, out=out[e])
    return out.reshape(*lead, groups * 2 * width)
