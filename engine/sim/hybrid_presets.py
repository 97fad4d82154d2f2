"""Hybrid models at the paper's scale for the simulator: layer kinds, KV bytes and a
GPU's memory, and the KV cache each allocator gets from the same bytes.

Shapes are the public configs': GPT-OSS-120B (36 layers alternating a 128-token window
and full attention, 8 KV heads of 64, MoE with 5.1B of 117B parameters active, MXFP4
weights of about 63 GB) and Gemma-3-27B (62 layers, five 1,024-token-window layers to
one global, 16 KV heads of 128, 27B bf16 parameters), each on one H100-80GB with
`gpu_memory_utilization` 0.9 and 2 GB of activations, K/V in bf16.

Allocators (`KVAllocator`): `hybrid` (one pool, pages of `layers_per_group` layers,
windows let go), `static` (the same groups, each on a fixed equal share of pages) and
`no-window` (every layer keeps every token: one group, pages of all layers; kernels
still read only the window, so steps cost the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine.kv.kv_cache_groups import KVCacheLayout
from engine.sim.cost_model import CostModel

H100_BANDWIDTH = 3.35e12  # bytes/s, H100 SXM HBM3
H100_BF16_FLOPS = 989e12
GPU_MEMORY = 80e9
UTILIZATION = 0.9
ACTIVATIONS = 2e9


class KVAllocator(StrEnum):
    """How a hybrid model's KV memory is managed (the closed set the bench compares)."""

    HYBRID = "hybrid"
    STATIC = "static"
    NO_WINDOW = "no-window"


@dataclass(frozen=True)
class HybridPreset:
    """One hybrid model on one GPU: its per-layer windows, the bytes one layer's K and V
    take per token, and its step cost (`cost.kv_bytes_per_token` covers all layers)."""

    name: str
    windows: tuple[int | None, ...]
    layer_token_bytes: int
    cost: CostModel

    @property
    def kv_budget_bytes(self) -> float:
        return GPU_MEMORY * UTILIZATION - self.cost.weight_bytes - ACTIVATIONS

    def layout(self, allocator: KVAllocator) -> KVCacheLayout | None:
        """The KV cache groups the allocator manages (None: one full-attention group)."""
        if allocator is KVAllocator.NO_WINDOW:
            return None
        return KVCacheLayout.from_windows(self.windows)

    def page_bytes(self, allocator: KVAllocator, block_size: int) -> int:
        layout = self.layout(allocator)
        layers = len(self.windows) if layout is None else layout.layers_per_group
        return layers * self.layer_token_bytes * block_size

    def num_blocks(self, allocator: KVAllocator, block_size: int) -> int:
        """Pages the KV budget holds for this allocator (less the hybrid null page)."""
        pages = int(self.kv_budget_bytes // self.page_bytes(allocator, block_size))
        return pages - (0 if allocator is KVAllocator.NO_WINDOW else 1)


def _preset(name, layers, windows, kv_heads, head, params, active, weight_bytes, hidden):
    layer_token_bytes = 2 * kv_heads * head * 2  # K and V, bf16
    cost = CostModel(
        name=name,
        num_params=active,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=layers * layer_token_bytes,
        num_layers=layers,
        hidden_size=hidden,
        num_gpus=1,
        memory_bandwidth=H100_BANDWIDTH,
        peak_flops=H100_BF16_FLOPS,
        num_kv_slots=1,  # unused: HybridPreset.num_blocks sizes each allocator's cache
    )
    return HybridPreset(name, windows, layer_token_bytes, cost)


HYBRID_PRESETS = {
    "gpt-oss-120b-h100": _preset(
        "GPT-OSS-120B, 1x H100-80GB",
        36,
        tuple(128 if i % 2 == 0 else None for i in range(36)),
        8,
        64,
        117e9,
        5.1e9,
        63e9,
        2880,
    ),
    "gemma-3-27b-h100": _preset(
        "Gemma-3-27B, 1x H100-80GB",
        62,
        tuple(None if i % 6 == 5 else 1024 for i in range(62)),
        16,
        128,
        27e9,
        27e9,
        54.8e9,
        5376,
    ),
}
