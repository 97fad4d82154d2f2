"""A worker's replica of one request: what it needs to build each step's batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import KnownTokens
from engine.messages import NewRequestData
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.worker.grammar.backend import GrammarMatcher


@dataclass(eq=False)
class WorkerRequest(KnownTokens):
    """What a worker caches about a request between plans (the scheduler's `Request` is
    the authority). Built from the plan that first sends it (`of`), then kept in step
    by the plans' diffs and by the worker itself.

    Known tokens are the prompt followed by the outputs, including the tokens this
    worker sampled itself; the worker counts `num_computed_tokens` itself between diffs.
    `num_scored_prompt_tokens`: prompt positions whose logprobs were already sent (a
    request asking for prompt logprobs has them scored once, even if recomputed later).
    `grammar`: the matcher of a request with `params.structured_outputs`, on the rank
    that samples; it has accepted every output token (it survives preemption with them).
    `draft_token_ids`: the draft tokens its row verifies in the step being run (proposed
    by the worker, after the known tokens; cleared once the step's result is in).
    `remote_hidden`: the final hidden state at the prompt's last position that a prefill
    instance sent with the prompt's KV; the request's first step samples from it rather
    than computing that position (cleared once the step ran).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    num_scored_prompt_tokens: int = 0
    grammar: GrammarMatcher | None = None
    draft_token_ids: list[int] = field(default_factory=list)  # verified in this step
    num_draft_computed_tokens: int = 0  # known tokens a draft model's cache holds
    remote_hidden: torch.Tensor | None = None  # [hidden_size], for its next step only

    @classmethod
    def of(cls, new: NewRequestData, eos_token_ids: frozenset[int]) -> WorkerRequest:
        return cls(
            new.request_id,
            list(new.prompt_token_ids),
            new.params,
            eos_token_ids,
            list(new.output_token_ids),
            new.num_computed_tokens,
        )
