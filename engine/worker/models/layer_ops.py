"""The elementwise ops of a Llama decoder layer, as torch ops or fused native kernels.

A model takes one `LayerOps` at construction and hands it to its norms, rotary and MLP.
`layer_ops_for(backend)` picks it from the attention backend the worker chose: the
native CPU kernels' fused versions when that backend runs them (the CPU default for
float32 and bfloat16), torch's everywhere else. Both compute `cuda_ext.reference`'s math
(Hugging Face's op for op); the native ones write in place, so callers treat the tensors
they pass in as consumed and use what comes back.

Why fused: torch runs RMSNorm as ~8 ops and rotary as ~12, each a pass over the batch
and, past 32k elements, a start of the thread pool; fused, the engine's decode step is
1.04-1.17x faster (float32 and bfloat16, batch 1-64, the 58M and a SmolLM2-shaped model;
docs/performance.md, "Fused layer ops").
"""

from __future__ import annotations

import logging

import torch

from cuda_ext import reference
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.native import NativeCpuBackend

logger = logging.getLogger(__name__)


class LayerOps:
    """Torch's ops (`cuda_ext.reference`): any device, any dtype; inputs left alone."""

    name = "torch"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size], a sublayer's output
        residual: torch.Tensor,  # [num_tokens, hidden_size]
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(residual + x), residual + x)
        return reference.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * d] -> [T, d]
        return reference.silu_and_mul(gate_up)

    def rotary(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        cos: torch.Tensor,  # [max_positions, head_size]
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated (query, key)
        return reference.rotary_embedding(positions, query, key, cos, sin)


class NativeLayerOps(LayerOps):
    """The fused native CPU kernels: float32 or bfloat16 rows on the CPU. add_rms_norm
    overwrites x and residual, rotary its query and key.

    `ops`: a loaded NativeCpuOps (checked wrappers) or its `unchecked` kernels (what
    `layer_ops_for` passes: the model builds the arguments right, and the Python checks
    would cost more than the kernels at small batches).
    """

    name = "native"

    def __init__(self, ops) -> None:
        self.ops = ops

    def rms_norm(self, x, weight, eps):
        out = torch.empty_like(x)  # [num_tokens, hidden_size]
        self.ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        self.ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)  # [num_tokens, d]
        self.ops.silu_and_mul(out, gate_up)
        return out

    def rotary(self, positions, query, key, cos, sin):
        self.ops.rotary_embedding(positions, query, key, cos, sin)
        return query, key


TORCH_LAYER_OPS = LayerOps()  # stateless: one instance serves every model


def layer_ops_for(backend: AttentionBackend) -> LayerOps:
    """The fused native ops where `backend` runs the native CPU kernels (it holds their
    loaded NativeCpuOps), torch's ops for every other backend (SDPA, reference, CUDA)."""
    if isinstance(backend, NativeCpuBackend):
        from cuda_ext.native_cpu import NativeCpuOps  # loaded already: the backend has it

        if isinstance(backend.ops, NativeCpuOps):
            logger.info("layer ops: native (fused RMSNorm, residual add, rotary, SiLU-and-mul)")
            return NativeLayerOps(backend.ops.unchecked)
    return TORCH_LAYER_OPS
