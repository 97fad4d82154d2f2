"""`torch.compile` of a model's forward pass (`compile_model=True`; off by default).

Dynamo traces everything but attention: each layer's attention backend is wrapped in an
`OpaqueBackend` whose `forward` dynamo never enters, so the graph breaks there cleanly
and the compiled pieces guard only on tensor shapes (the token count is dynamic), not on
the step's metadata (which would recompile on every new batch). Inductor fuses what lies
between the matmuls (norms, rotary, SiLU-mul, residual adds); on CPU that measured no
faster than eager (docs/performance.md), hence the default.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.attention.backend import AttentionBackend
from engine.worker.models.layers import PagedAttention


class OpaqueBackend:
    """The same attention backend, run eagerly inside a compiled model: `forward` is
    `torch.compiler.disable`d; every other attribute is the wrapped backend's. A batch
    padded past the step's tokens (piecewise CUDA graphs run at fixed sizes) attends
    with its real tokens only; its padding rows get zeros."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.forward = torch.compiler.disable(self._forward)

    def _forward(self, query, key, value, kv_cache, metadata, spec, sinks=None):
        num_rows, num_tokens = query.shape[0], metadata.num_tokens  # [S], [T]
        if num_rows == num_tokens:
            return self.backend.forward(query, key, value, kv_cache, metadata, spec, sinks)
        real = (query[:num_tokens], key[:num_tokens], value[:num_tokens])
        out = self.backend.forward(*real, kv_cache, metadata, spec, sinks)
        padded = out.new_zeros((num_rows, *out.shape[1:]))
        padded[:num_tokens] = out
        return padded

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def wrap_attention_backends(model: nn.Module) -> None:
    """Every attention layer of `model` calls its backend through an `OpaqueBackend`."""
    for module in model.modules():
        if isinstance(module, PagedAttention) and not isinstance(module.backend, OpaqueBackend):
            module.backend = OpaqueBackend(module.backend)


def compile_model(model: nn.Module) -> None:
    """Route `model.forward` through `torch.compile(dynamic=True)`, in place; the first
    call at each new shape class compiles (seconds to a minute)."""
    wrap_attention_backends(model)
    model.forward = torch.compile(model.forward, dynamic=True)
