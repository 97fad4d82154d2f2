"""Where Triton kernels can run: compiled on CUDA tensors, or interpreted anywhere.

Triton decides at import time whether `@triton.jit` compiles or interprets: with
`TRITON_INTERPRET=1` in the environment before `triton` is first imported, every kernel
(and Triton's own library functions) runs through its interpreter, on CPU tensors too
(numpy: slow, but the same indexing, masks, loops and reductions as the compiled
program). CI sets it (tests/conftest.py) to check the kernels without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True when this process's Triton kernels run through the interpreter."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(device: torch.device) -> None:
    """ValueError unless the kernels can run on `device`."""
    if device.type == "cuda" or interpreting():
        return
    raise ValueError(
        f"the Triton kernels run on CUDA tensors, not {device.type}: on the CPU set "
        "TRITON_INTERPRET=1 before starting (interpreted, slow: for checking the kernels)"
    )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
