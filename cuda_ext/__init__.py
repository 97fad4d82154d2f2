"""Kernels for the paged KV cache, with pure-torch references.

`cuda_ext.reference` holds the oracle versions (always available, any device). Native
CUDA kernels, where built, live beside them behind wrappers with the same signatures.
"""

from cuda_ext.reference import paged_attention_reference, reshape_and_cache

__all__ = ["paged_attention_reference", "reshape_and_cache"]
