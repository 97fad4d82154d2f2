"""Kernels for the paged KV cache, with pure-torch references.

`cuda_ext.reference` holds the oracle versions (always available, any device). Native
CUDA kernels, where built, live beside them behind wrappers with the same signatures.
Importing the package imports no torch (`cuda_ext.build`'s cache directory is read by
the server's command line before anything heavy): the references load on first use.
"""

__all__ = ["paged_attention_reference", "reshape_and_cache"]


def __getattr__(name: str):
    if name in __all__:
        from cuda_ext import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'cuda_ext' has no attribute {name!r}")
