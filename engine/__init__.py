"""pagedserve's engine: pure logic and model code (no sockets, no event loops)."""

from engine.config import EngineArgs, EngineConfig
from engine.llm import LLM
from engine.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.stats import EngineStats

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
]
