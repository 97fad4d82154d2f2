"""Attention over the paged KV cache: one entry point, several backends."""

from engine.worker.attention.backend import AttentionBackend, ReferenceBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.sdpa import SdpaBackend
from engine.worker.attention.selector import select_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ReferenceBackend",
    "SdpaBackend",
    "select_backend",
]
