"""The native CPU kernels for the test modules that exercise them."""

from __future__ import annotations

import pytest

from cuda_ext.build import load_cpu_ops
from cuda_ext.native_cpu import NativeCpuOps


def native_cpu_ops_or_skip() -> NativeCpuOps:
    """The built kernels; called at a test module's import, it skips that whole module,
    with the loader's reason, where they cannot be built."""
    loaded = load_cpu_ops()
    if not loaded.ok:
        pytest.skip(f"native CPU kernels unavailable: {loaded.reason}", allow_module_level=True)
    return NativeCpuOps(loaded.module)
