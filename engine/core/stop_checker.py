"""Decides, after each sampled token, whether a request is done and why (token rules;
stop strings are text, matched where text is made: engine/text/text_processor.py)."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def max_num_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens (prompt + outputs) a request may reach: max_tokens outputs, or the
    context full. The one length rule, shared by the stop checks and by the scheduler
    (which stops planning for a request at its limit)."""
    if params.max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + params.max_tokens, max_model_len)


class StopChecker:
    """The token-level stop rules in vLLM's order: EOS and stop_token_ids (after
    min_tokens), then max_tokens and the context length (as `Request.max_num_tokens`,
    which the scheduler sets from `max_num_tokens()`)."""

    def check_token(
        self, request: Request, token: int, num_outputs: int
    ) -> tuple[RequestStatus | None, int | None]:
        """EOS or a stop token as output number `num_outputs`: (status, stop_reason)."""
        params = request.params
        if num_outputs < params.min_tokens:
            return None, None
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        return None, None

    def check_sampled(
        self, request: Request, token: int, num_outputs: int
    ) -> tuple[RequestStatus | None, int | None]:
        """The token rules, then the length rule, for output number `num_outputs`."""
        status, reason = self.check_token(request, token, num_outputs)
        if status is None and self.check_length(request, num_outputs):
            status = RequestStatus.FINISHED_LENGTH
        return status, reason

    def check_length(self, request: Request, num_outputs: int) -> bool:
        return len(request.prompt_token_ids) + num_outputs >= request.max_num_tokens
