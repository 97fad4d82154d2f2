"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, its 1-based rank in the vocabulary and its text.

    `decoded_token` stays None until the tokenizer fills it in.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


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
    # a prefill instance's answer to do_remote_decode: where the prompt's KV waits
    kv_transfer_params: dict[str, Any] | None = None
