"""Can this model be split over N tensor-parallel ranks? Asked once, up front.

The model class itself answers: it is built on torch's `meta` device (no memory, no
weights) as rank 0 of N, and its layers raise the same ValueError they would raise on
a real rank ("num_attention_heads (6) does not split evenly over
tensor_parallel_size=4"). So the front end refuses a bad `tensor_parallel_size` before
any worker starts, with the rule stated in exactly one place: the layers.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.worker.attention.backend import ReferenceBackend
from engine.worker.models.registry import resolve_model_class
from engine.worker.parallel.group import TensorParallelGroup


def check_shardable(model: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError naming the config field that `tensor_parallel_size` cannot split."""
    if tensor_parallel_size == 1:
        return
    cls = resolve_model_class(model.architecture)
    group = TensorParallelGroup(0, tensor_parallel_size)
    try:
        with torch.device("meta"):  # the reference backend does every attention feature
            cls(model.hf_config, ReferenceBackend(), group)
    except ValueError as exc:
        raise ValueError(f"{model.architecture} cannot be split: {exc}") from None
