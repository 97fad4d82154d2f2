"""Triton kernels for the paged KV cache: one program text for the GPU and for CI.

- `paged_attention`: one "unified" kernel for decode rows, prefill chunks and their mix
  over block tables (GQA, any block size, sliding window, soft cap, sinks), with an
  online softmax over tiles of the context (`attention.py`).
- `reshape_and_cache`, `copy_blocks`: writing a step's K/V through the slot mapping and
  copy-on-write block copies (`cache_ops.py`).

Each kernel is written once: Triton compiles it for CUDA tensors, or, with
`TRITON_INTERPRET=1` set before Triton is imported, runs it through its interpreter on
any tensors, which is how CI checks them without a GPU (`kernel.py`). The layouts are
the house ones of `cuda_ext.reference`, whose functions are these kernels' oracle.
"""

from cuda_ext.triton_kernels.attention import paged_attention
from cuda_ext.triton_kernels.cache_ops import copy_blocks, reshape_and_cache

__all__ = ["copy_blocks", "paged_attention", "reshape_and_cache"]
