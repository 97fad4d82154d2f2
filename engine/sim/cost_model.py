"""`CostModel`: how long one model step takes on a GPU setup, from named parameters.

A step reads every weight once and each scheduled request's KV cache once, and does
2 FLOPs per parameter per token it computes (attention's own FLOPs are counted in the
KV read, which bounds them at these batch sizes). It is limited by whichever takes
longer, memory or compute, plus a fixed per-step overhead (kernel launches, sampling,
the scheduler's host work), and with tensor parallelism two all-reduces per layer:

    step_s = overhead_s + max(bytes / bandwidth, flops / peak_flops) + allreduce_s
             + swapped KV bytes / pcie_bandwidth

Presets follow the paper's Table 1 (OPT-13B on one A100-40GB with 15.7K KV slots,
OPT-66B on 4, OPT-175B on 8 A100-80GB) and its LLaMA-13B runs. Without a measured GPU
run (there has been none yet), their overheads are the presets' guesses, named as such;
`calibrated` fits the overhead and the efficiency to measured step times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

A100_BANDWIDTH = 1.555e12  # bytes/s, A100-40GB HBM2 (80GB: 2.0e12)
A100_80_BANDWIDTH = 2.0e12
A100_FP16_FLOPS = 312e12  # dense fp16 tensor-core peak


@dataclass(frozen=True)
class StepShape:
    """What a step does: tokens computed (prefill chunks and decodes), the KV tokens its
    attention reads (each scheduled request's context), and the KV tokens it moves
    between GPU and CPU memory (swap out and in, over PCIe, before it computes)."""

    num_tokens: int
    num_context_tokens: int
    num_swapped_tokens: int = 0


@dataclass(frozen=True)
class CostModel:
    """One model on one GPU setup (see the module doc). Bytes and FLOP/s are per setup
    (all its GPUs together); `efficiency` is the share of peak bandwidth and FLOP/s a
    step achieves; `num_kv_slots` is the KV cache's size in tokens."""

    name: str
    num_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    num_layers: int
    hidden_size: int
    num_gpus: int
    memory_bandwidth: float
    peak_flops: float
    num_kv_slots: int
    overhead_s: float = 0.002
    efficiency: float = 0.8
    allreduce_s_per_layer: float = 0.0  # tensor parallelism: per layer, two reductions
    pcie_bandwidth: float = 25e9  # bytes/s each GPU swaps at (PCIe 4.0 x16, achieved)

    def __post_init__(self) -> None:
        for name in ("num_params", "weight_bytes", "memory_bandwidth", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if self.num_kv_slots < 1:
            raise ValueError(f"num_kv_slots must be >= 1, got {self.num_kv_slots}")

    def step_seconds(self, step: StepShape) -> float:
        """The simulated duration of one step."""
        moved = self.weight_bytes + step.num_context_tokens * self.kv_bytes_per_token
        memory_s = moved / (self.memory_bandwidth * self.efficiency)
        compute_s = 2 * self.num_params * step.num_tokens / (self.peak_flops * self.efficiency)
        reduce_s = 2 * self.num_layers * self.allreduce_s_per_layer if self.num_gpus > 1 else 0
        swap_bytes = step.num_swapped_tokens * self.kv_bytes_per_token
        swap_s = swap_bytes / (self.pcie_bandwidth * self.num_gpus)
        return self.overhead_s + max(memory_s, compute_s) + reduce_s + swap_s

    def num_blocks(self, block_size: int) -> int:
        """The KV cache's blocks of `block_size` tokens."""
        return self.num_kv_slots // block_size

    def calibrated(self, measured: list[tuple[StepShape, float]]) -> CostModel:
        """This model with `overhead_s` and `efficiency` fitted (least squares on the
        memory-bound form) to measured (step, seconds) pairs from a real run."""
        if len(measured) < 2:
            raise ValueError("calibration needs at least two measured steps")
        per_token = self.kv_bytes_per_token
        xs = [self.weight_bytes + s.num_context_tokens * per_token for s, _ in measured]
        ys = [t for _, t in measured]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:
            raise ValueError("calibration needs steps that read different amounts of KV cache")
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        overhead = max(0.0, my - slope * mx)
        efficiency = min(1.0, 1 / (slope * self.memory_bandwidth)) if slope > 0 else 1.0
        return dataclasses.replace(self, overhead_s=overhead, efficiency=efficiency)


def _opt(name: str, params: float, layers: int, hidden: int, gpus: int, bw: float, slots: int):
    return CostModel(
        name=name,
        num_params=params,
        weight_bytes=2 * params,  # fp16
        kv_bytes_per_token=2 * layers * hidden * 2,  # K and V, fp16
        num_layers=layers,
        hidden_size=hidden,
        num_gpus=gpus,
        memory_bandwidth=bw * gpus,
        peak_flops=A100_FP16_FLOPS * gpus,
        num_kv_slots=slots,
        allreduce_s_per_layer=15e-6 if gpus > 1 else 0.0,
    )


PRESETS: dict[str, CostModel] = {
    "opt-13b-a100": _opt("OPT-13B, 1x A100-40GB", 13e9, 40, 5120, 1, A100_BANDWIDTH, 15_700),
    "opt-66b-4xa100": _opt("OPT-66B, 4x A100-40GB", 66e9, 64, 9216, 4, A100_BANDWIDTH, 9_700),
    "opt-175b-8xa100-80gb": _opt(
        "OPT-175B, 8x A100-80GB", 175e9, 96, 12288, 8, A100_80_BANDWIDTH, 60_100
    ),
    "llama-13b-a100": _opt("LLaMA-13B, 1x A100-40GB", 13e9, 40, 5120, 1, A100_BANDWIDTH, 15_700),
}


def preset(name: str) -> CostModel:
    """A preset by name; ValueError listing them for an unknown one."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}") from None
