"""Decides, after each sampled token, whether a request is done and why."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stop_strings import find_stop


def max_num_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens (prompt + outputs) a request may reach: max_tokens outputs, or the
    context full. The one length rule, shared by the stop checks and by the scheduler
    (which stops planning for a request at its limit)."""
    if params.max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + params.max_tokens, max_model_len)


class StopChecker:
    """Stop rules in vLLM's order: EOS and stop_token_ids (after min_tokens), stop strings
    found in the newly detokenized text, then max_tokens and the context length (as
    `Request.max_num_tokens`, which the scheduler sets from `max_num_tokens()`)."""

    def check(self, request: Request, new_text_len: int) -> RequestStatus | None:
        """For the last output token of `request` (sets `stop_reason`, trims the text)."""
        num_outputs = request.num_output_tokens
        status, reason = self.check_token(request, request.output_token_ids[-1], num_outputs)
        if status is None and self._stop_string(request, new_text_len):
            status, reason = RequestStatus.FINISHED_STOPPED, request.stop_reason
        if status is None and self.check_length(request, num_outputs):
            status = RequestStatus.FINISHED_LENGTH
        request.stop_reason = reason
        return status

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

    @staticmethod
    def _stop_string(request: Request, new_text_len: int) -> bool:
        params = request.params
        if not (params.stop and new_text_len and request.num_output_tokens >= params.min_tokens):
            return False
        match = find_stop(
            request.output_text, new_text_len, params.stop, params.include_stop_str_in_output
        )
        if match is None:
            return False
        request.output_text = request.output_text[: match.truncate_to]
        request.stop_reason = match.stop
        return True
