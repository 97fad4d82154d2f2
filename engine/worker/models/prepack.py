"""Chooses the linear layers' GEMM once, after loading, and packs their weights for it.

'auto' packs every linear layer's weight for oneDNN (`cuda_ext.packed_gemm`) on a CPU
whose oneDNN has kernels for the model's dtype, else keeps torch's plain linear;
'onednn' insists (an error saying why it cannot run); 'torch' keeps the plain weights.
A packed layer drops its plain weight unless another module reads the same storage
(a tied embedding), so the model holds each weight once. Layers that compute in GGUF
blocks (`QuantizedWeight`, set while loading) are left as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from cuda_ext.packed_gemm import packed_gemm_support
from engine.worker.parallel.layers import PACKABLE_LAYERS, prepack_layer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearKernelChoice:
    """The GEMM the linear layers run ('onednn' or 'torch'), why, and what was packed."""

    name: str
    reason: str
    num_packed: int = 0
    packed_bytes: int = 0


def prepack_linears(
    model: nn.Module, kernel: str, device: str, compiled: bool = False
) -> LinearKernelChoice:
    """Packs `model`'s linear layers for the kernel `kernel` resolves to (see module doc).
    A model that goes through torch.compile (`compiled`) keeps torch's linear: inductor
    cannot trace the opaque packed weights, and packs for its own kernels."""
    if kernel == "torch":
        return _chosen(LinearKernelChoice("torch", "linear_kernel='torch' was asked for"))
    why_not = _why_not_onednn(model, device, compiled)
    if why_not is not None:
        if kernel == "onednn":
            raise ValueError(f"linear_kernel='onednn' cannot run: {why_not}")
        return _chosen(LinearKernelChoice("torch", f"auto: {why_not}; using torch's linear"))
    shared = _storage_readers(model)
    layers = [m for m in model.modules() if isinstance(m, PACKABLE_LAYERS) and m.packed is None]
    packed_bytes = 0
    with torch.no_grad():
        for layer in layers:
            keep_plain = shared[layer.weight.data_ptr()] > 1
            packed_bytes += prepack_layer(layer, keep_plain).nbytes
    reason = (
        f"linear_kernel={kernel!r}: {len(layers)} weights ({packed_bytes / 2**20:.1f} MiB) "
        "prepacked once for oneDNN's blocked GEMM"
    )
    return _chosen(LinearKernelChoice("onednn", reason, len(layers), packed_bytes))


def _why_not_onednn(model: nn.Module, device: str, compiled: bool) -> str | None:
    if compiled:
        return "the model goes through torch.compile (compile_model=True)"
    if torch.device(device).type != "cpu":
        return f"oneDNN packing is for CPUs, the model runs on {device}"
    dtype = next(model.parameters()).dtype
    return packed_gemm_support(dtype)


def _storage_readers(model: nn.Module) -> dict[int, int]:
    """data_ptr -> how many (module, parameter name) pairs hold it (2+ when tied)."""
    counts: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            counts[param.data_ptr()] = counts.get(param.data_ptr(), 0) + 1
    return counts


def _chosen(choice: LinearKernelChoice) -> LinearKernelChoice:
    logger.info("linear kernel: %s (%s)", choice.name, choice.reason)
    return choice
