"""Decides, after each sampled token, whether a request is done and why."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stop_strings import find_stop


def length_limit_reached(
    params: SamplingParams, num_prompt_tokens: int, num_output_tokens: int, max_model_len: int
) -> bool:
    """max_tokens outputs, or the context full: the one length rule, shared by the stop
    checks and by the scheduler (which stops planning for a request at its limit)."""
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return True
    return num_prompt_tokens + num_output_tokens >= max_model_len


class StopChecker:
    """Stop rules in vLLM's order: EOS and stop_token_ids (after min_tokens), stop strings
    found in the newly detokenized text, then max_tokens and the context length."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

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

    def check_length(self, request: Request, num_outputs: int) -> bool:
        return length_limit_reached(
            request.params, request.num_prompt_tokens, num_outputs, self.max_model_len
        )

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
