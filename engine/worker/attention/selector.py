"""Chooses the attention backend once, at start-up."""

from __future__ import annotations

from engine.worker.attention.backend import AttentionBackend, ReferenceBackend
from engine.worker.attention.sdpa import SdpaBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceBackend,
    "sdpa": SdpaBackend,
}


def select_backend(name: str = "auto") -> AttentionBackend:
    """'auto' picks the fastest backend available (SDPA on CPU and CUDA for now)."""
    if name == "auto":
        name = "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {['auto', *_BACKENDS]}, got {name!r}")
    return _BACKENDS[name]()
