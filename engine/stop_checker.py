"""Decides, after each sampled token, whether a request is done and why."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.stop_strings import find_stop


class StopChecker:
    """Stop rules in vLLM's order: EOS and stop_token_ids (after min_tokens), max_tokens,
    the context length, then stop strings found in the newly detokenized text."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def check(self, request: Request, new_text_len: int) -> RequestStatus | None:
        params = request.params
        token = request.output_token_ids[-1]
        past_min = request.num_output_tokens >= params.min_tokens
        if past_min and not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if past_min and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if past_min and params.stop and new_text_len:
            match = find_stop(
                request.output_text, new_text_len, params.stop, params.include_stop_str_in_output
            )
            if match is not None:
                request.output_text = request.output_text[: match.truncate_to]
                request.stop_reason = match.stop
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
