"""Can this model be split over N tensor-parallel ranks, or into N pipeline stages? Asked
once, up front.

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


def check_stageable(model: ModelConfig, pipeline_parallel_size: int) -> None:
    """ValueError naming why the model cannot run as `pipeline_parallel_size` stages: a
    class without a pipeline layout, a KV layout of several groups (sliding-window or
    linear-attention layers share cache tensors across the layers), or fewer layers
    than stages."""
    if pipeline_parallel_size == 1:
        return
    cls = resolve_model_class(model.architecture)
    problem = None
    if cls.pipeline_layout is None:
        problem = "its model class has no pipeline stages"
    elif model.kv_cache_layout.is_hybrid:
        problem = (
            "its layers fall into several KV cache groups (sliding windows or linear attention)"
        )
    elif model.num_layers < pipeline_parallel_size:
        problem = f"it has {model.num_layers} layers, fewer than the stages"
    if problem is not None:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size}: {model.architecture} cannot be "
            f"split into stages: {problem}"
        )


def check_context_parallel(model: ModelConfig, context_parallel_size: int) -> None:
    """ValueError naming why the model's steps cannot be split over ranks by tokens: a
    KV layout of several groups or linear-attention layers (their state runs token by
    token through one rank)."""
    if context_parallel_size > 1 and model.kv_cache_layout.is_hybrid:
        raise ValueError(
            f"context_parallel_size={context_parallel_size}: {model.architecture}'s layers fall "
            "into several KV cache groups (sliding windows or linear attention)"
        )
