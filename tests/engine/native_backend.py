"""The native CPU attention backend for the engine tests that exercise it."""

from __future__ import annotations

import pytest

from cuda_ext.native_cpu import NativeCpuOps
from engine.worker.attention.native import NativeCpuBackend


def native_backend() -> NativeCpuBackend:
    """The native CPU attention backend (Llama models built on it take the fused native
    layer ops), or a skip with the loader's reason."""
    ops = NativeCpuOps.load()
    if ops is None:
        pytest.skip(f"native CPU kernels unavailable: {NativeCpuOps.available()[1]}")
    return NativeCpuBackend(ops)
