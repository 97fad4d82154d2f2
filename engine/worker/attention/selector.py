"""Chooses the attention backend once, at start-up, and says why."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cuda_ext.kv_quant import KVRowCode
from engine.worker.attention.backend import AttentionBackend, ReferenceBackend
from engine.worker.attention.backend_race import AttentionShape, decode_ms
from engine.worker.attention.native import NativeCpuBackend, NativeCudaBackend
from engine.worker.attention.sdpa import SdpaBackend

logger = logging.getLogger(__name__)
NAMES = ("auto", "native", "triton", "sdpa", "reference")


@dataclass(frozen=True)
class BackendChoice:
    """The backend a worker runs and why it was chosen (logged, in stats and /v1/info)."""

    backend: AttentionBackend
    reason: str


def select_backend(
    name: str = "auto",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    features: frozenset[str] = frozenset(),
    block_size: int | None = None,
    kv_code: KVRowCode | None = None,
    shape: AttentionShape | None = None,
) -> BackendChoice:
    """'auto': the native kernels where they load and do every attention feature the
    model uses (`features`: sliding window, soft cap, sinks) and the cache's dtype
    (`kv_code`: an 8-bit cache, which the CUDA kernels cannot read), else torch's SDPA;
    on CUDA, where the Triton kernels run too, whichever of the two attends a decode
    step of the model's attention `shape` faster. 'native' and 'triton' insist on their
    kernels (an error with the reason if they cannot run, or naming the feature, the
    block size or the cache dtype they lack); 'sdpa' and 'reference' are the torch
    backends (both read 8-bit caches)."""
    if name not in NAMES:
        raise ValueError(f"attention_backend must be one of {list(NAMES)}, got {name!r}")
    if name == "triton":
        choice = _triton(device, kv_code)
        if choice.backend is None:
            raise ValueError(f"attention_backend='triton' cannot run: {choice.reason}")
        return _chosen(choice)
    if name in ("auto", "native"):
        choice = _native(device, dtype, block_size, kv_code)
        lacking = sorted(features & choice.backend.unsupported_features) if choice.backend else []
        if lacking:
            choice = BackendChoice(None, f"the native kernels cannot do {' or '.join(lacking)}")
        if name == "auto" and str(device).startswith("cuda"):
            choice = _faster_on_cuda(choice, _triton(device, kv_code), shape, block_size, dtype)
        if choice.backend is not None:
            return _chosen(choice)
        if name == "native":
            raise ValueError(f"attention_backend='native' cannot run: {choice.reason}")
        reason = f"auto: {choice.reason}; using torch SDPA"
        return _chosen(BackendChoice(SdpaBackend(kv_code), reason))
    backend = SdpaBackend(kv_code) if name == "sdpa" else ReferenceBackend(kv_code)
    return _chosen(BackendChoice(backend, f"attention_backend={name!r} was asked for"))


def _native(
    device: str, dtype: torch.dtype, block_size: int | None, kv_code: KVRowCode | None
) -> BackendChoice:
    if str(device).startswith("cuda"):
        if kv_code is not None:
            wanted = kv_code.name.lower()
            return BackendChoice(
                None, f"the CUDA kernels read float caches, not kv_cache_dtype={wanted!r}"
            )
        return _native_cuda(block_size)
    if not str(device).startswith("cpu"):
        return BackendChoice(None, f"no native kernels for device {device!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        return BackendChoice(None, f"the native CPU kernels take float32 and bfloat16, not {dtype}")
    try:
        from cuda_ext.native_cpu import NativeCpuOps
    except ImportError as exc:  # a checkout without the kernels' sources
        return BackendChoice(None, f"the native kernels are not in this install ({exc})")
    ops = NativeCpuOps.load()
    _, reason = NativeCpuOps.available()
    if ops is None:
        return BackendChoice(None, reason)
    return BackendChoice(NativeCpuBackend(ops, kv_code), reason)


def _native_cuda(block_size: int | None) -> BackendChoice:
    from cuda_ext.native_cuda import (
        DECODE_BLOCK_SIZES,
        cuda_unavailable_reason,
        load_cuda_kernels,
    )

    if block_size is not None and block_size not in DECODE_BLOCK_SIZES:
        sizes = ", ".join(map(str, DECODE_BLOCK_SIZES))
        return BackendChoice(
            None, f"the CUDA kernels take blocks of {sizes} tokens, not block_size={block_size}"
        )

    kernels = load_cuda_kernels()
    if kernels is None:
        return BackendChoice(None, f"CUDA kernels unavailable: {cuda_unavailable_reason()}")
    return BackendChoice(NativeCudaBackend(kernels), "native CUDA kernels loaded")


def _triton(device: str, kv_code: KVRowCode | None) -> BackendChoice:
    """The Triton backend, or why it cannot run here."""
    if kv_code is not None:
        wanted = kv_code.name.lower()
        return BackendChoice(None, f"the Triton kernels read float caches, not {wanted!r}")
    try:
        from cuda_ext.triton_kernels.kernel import interpreting
    except ImportError as exc:
        return BackendChoice(None, f"triton is not installed ({exc})")
    if str(device).startswith("cuda"):
        return BackendChoice(_triton_backend(), "Triton kernels, compiled for CUDA")
    if interpreting():
        return BackendChoice(_triton_backend(), "Triton kernels under TRITON_INTERPRET=1 (slow)")
    return BackendChoice(
        None,
        f"the Triton kernels run on CUDA, not {device!r} (set TRITON_INTERPRET=1 to run "
        "them interpreted on the CPU, slowly, for checking)",
    )


def _triton_backend() -> AttentionBackend:
    from engine.worker.attention.triton_backend import TritonBackend

    return TritonBackend()


def _faster_on_cuda(
    native: BackendChoice,
    triton: BackendChoice,
    shape: AttentionShape | None,
    block_size: int | None,
    dtype: torch.dtype,
) -> BackendChoice:
    """Of the native CUDA and the Triton kernels, the one that can run, or, both
    running, the faster on a decode step of `shape` (the native ones if either race
    fails: a kernel that does not compile here loses)."""
    if triton.backend is None or shape is None or block_size is None:
        return native
    if native.backend is None:
        return BackendChoice(triton.backend, f"auto: {native.reason}; {triton.reason}")
    try:
        native_ms = decode_ms(native.backend, shape, block_size, dtype)
        triton_ms = decode_ms(triton.backend, shape, block_size, dtype)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to compile loses the race
        return BackendChoice(native.backend, f"{native.reason}; Triton's race failed: {exc}")
    winner = triton if triton_ms < native_ms else native
    timed = f"decode step {native_ms:.3f} ms native, {triton_ms:.3f} ms Triton"
    return BackendChoice(winner.backend, f"auto: {winner.reason} ({timed})")


def _chosen(choice: BackendChoice) -> BackendChoice:
    logger.info("attention backend: %s (%s)", choice.backend.name, choice.reason)
    return choice
