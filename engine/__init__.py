"""pagedserve's engine: pure logic and model code (no sockets, no event loops).

The API is importable from here (`from engine import LLM, SamplingParams`); its names
load on first use, so importing a torch-free part (engine.core, engine.kv, engine.text,
engine.messages, engine.sim) never pulls torch in."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_API = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "EngineArgs": "engine.engine_args",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.core.stats",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "SamplingParamsError": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "EngineStats",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.stats import EngineStats
    from engine.engine_args import EngineArgs
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sampling_params import SamplingParams, SamplingParamsError
    from engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
