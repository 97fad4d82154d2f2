"""A request's state as the scheduler and the engine core see it (a worker keeps its
own replica: engine/worker/worker_request.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token id planned ahead of the result that resolves it


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


class KnownTokens:
    """A sequence's known tokens: its prompt followed by its outputs. For the classes
    that keep a sequence (the scheduler's `Request`, a worker's `WorkerRequest`): they
    set `prompt_token_ids` and `output_token_ids`."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]

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
        """Known tokens `start`..`end`."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]


@dataclass(eq=False)
class Request(KnownTokens):
    """One client call: its prompt, its sampled tokens and how much KV is computed.

        Known tokens are the prompt followed by the outputs. Each step the scheduler lets
        `num_computed_tokens` catch up with `num_tokens`; a step that reaches the end of the
        known tokens samples one more, and its row gets a `PLACEHOLDER` output at once (the
        engine core plans ahead of results) that the step's result resolves;
        `num_pending_outputs` counts the unresolved ones. With speculative decoding a decoding
    row also reserves slots for the draft tokens its worker verifies in the same step; the
    result resolves the placeholder into the accepted drafts and the token after them, and
    `num_lookahead_tokens` counts the slots of steps still in flight (the table holds
    `num_computed_tokens + num_lookahead_tokens`). `arrival_index` orders requests
        (FCFS, preemption). A request sampling several sequences is a `SequenceGroup` of
        such requests.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    max_num_tokens: int | None = None  # prompt + outputs it may reach (Scheduler sets it)
    num_pending_outputs: int = 0  # trailing output ids that are placeholders (one step ahead)
    # KV slots reserved past num_computed_tokens for draft tokens of steps in flight
    num_lookahead_tokens: int = 0
    group: RequestGroup | None = None  # set when this is one sequence of several
    # tokens of its prompt a prefill instance computed, whose KV its first step loads
    # (prefill/decode disaggregation); 0 once admitted, or for a prompt computed here
    num_remote_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
