"""Attention over the paged KV cache: one entry point, several backends."""

from engine.attention.backend import AttentionBackend, ReferenceBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.sdpa import SdpaBackend
from engine.attention.selector import select_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ReferenceBackend",
    "SdpaBackend",
    "select_backend",
]
