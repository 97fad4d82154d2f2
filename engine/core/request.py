"""A request's state as the scheduler and the engine see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.outputs import PromptLogprobs
    from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle, in order: every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3  # preempted with its blocks copied out to the CPU swap space
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class RequestGroup(Protocol):
    """What a sequence sees of the request it belongs to (a `SequenceGroup` or a
    `BeamGroup`): declared here so groups import requests, never the reverse."""

    request_id: str
    held: list[Request]  # sequences not yet given to the scheduler
    preempt_together: bool  # its running sequences are preempted as one unit
    chooses_tokens: bool  # the group, not sampling, picks each next token

    @property
    def leader(self) -> Request: ...

    @property
    def is_finished(self) -> bool: ...


@dataclass(eq=False)
class Request:
    """One client call: its prompt, its sampled tokens and how much KV is computed.

    Known tokens are the prompt followed by the outputs. Each step the scheduler lets
    `num_computed_tokens` catch up with `num_tokens`; a step that reaches the end of the
    known tokens samples one more. `arrival_index` orders requests (FCFS, preemption).
    A request sampling several sequences is a `SequenceGroup` of such requests.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    prompt_logprobs: PromptLogprobs | None = None
    num_preemptions: int = 0
    max_num_tokens: int | None = None  # prompt + outputs it may reach (Scheduler sets it)
    num_pending_outputs: int = 0  # trailing output ids that are placeholders (one step ahead)
    group: RequestGroup | None = None  # set when this is one sequence of several

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
