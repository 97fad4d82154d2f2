"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import PromptLogprobs, SampleLogprobs
from engine.request import RequestMetrics


@dataclass
class CompletionOutput:
    """One output sequence of a request (index 0 unless n > 1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None (running)
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    beam_score: float | None = None  # beam search: cumulative_logprob / length ** penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs so far (`finished` once every output ended)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = field(default=0)
