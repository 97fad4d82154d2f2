"""Folds a request's streamed OutputDeltas into the one RequestOutput `LLM` returns."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.messages import LogprobRow, OutputDelta, RankedSequence
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class _Pending:
    """One request being assembled: its prompt, its outputs so far, its milestones."""

    output: RequestOutput
    keep_logprobs: bool  # False: rows only sampled to rank best_of's sequences
    scores: dict[int, RankedSequence] = field(default_factory=dict)  # beam search, by index


class OutputAssembler:
    """Contract: `open()` a request, `add()` each of its OutputDeltas in order; the
    RequestOutput comes back from the `add()` that finished its last output (or from a
    request-wide abort or error, which ends every open output with that reason).

    A completion's text and token ids are the concatenation of its deltas (a ranked
    output, best_of's or a beam's, arrives whole in one delta). Its logprobs are the
    rows as dicts keyed by token id; `cumulative_logprob` sums the chosen tokens' rows,
    or, for a beam, comes with its `RankedSequence` (`add_scores`), as does `beam_score`.
    """

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def open(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        keep_logprobs: bool = True,
    ) -> None:
        output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            outputs=[_completion(i, params, keep_logprobs) for i in range(params.n)],
            finished=False,
            metrics=RequestMetrics(time.time()),
        )
        self._pending[request_id] = _Pending(output, keep_logprobs)

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def scheduled(self, request_id: str) -> None:
        """The request's first step was planned now (its first time in a plan)."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.output.metrics.first_scheduled_time is None:
            pending.output.metrics.first_scheduled_time = time.time()

    def add_scores(self, ranked: tuple[RankedSequence, ...]) -> None:
        """A finished beam search's scores, before its outputs arrive as deltas."""
        for seq in ranked:
            pending = self._pending.get(seq.request_id)
            if pending is not None:
                pending.scores[seq.index] = seq

    def add(self, delta: OutputDelta) -> RequestOutput | None:
        pending = self._pending.get(delta.request_id)
        if pending is None:
            return None
        output, now = pending.output, time.time()
        if delta.token_ids and output.metrics.first_token_time is None:
            output.metrics.first_token_time = now
        if delta.prompt_logprobs and output.prompt_logprobs == [None]:  # once, any sequence
            output.prompt_logprobs += map(_as_dict, delta.prompt_logprobs)
        if delta.index < 0:  # request-wide: abort or error
            output.error = delta.error
            for c in output.outputs:
                c.finish_reason = c.finish_reason or delta.finish_reason
        else:
            self._extend(pending, output.outputs[delta.index], delta)
        if not all(c.finished for c in output.outputs):
            return None
        del self._pending[delta.request_id]
        output.finished = True
        output.metrics.finished_time = now
        return output

    @staticmethod
    def _extend(pending: _Pending, c: CompletionOutput, delta: OutputDelta) -> None:
        c.text += delta.text
        c.token_ids += delta.token_ids
        c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.kv_transfer_params is not None:
            pending.output.kv_transfer_params = delta.kv_transfer_params.to_dict()
        rows = delta.logprobs or ()
        if rows and c.cumulative_logprob is not None:
            c.cumulative_logprob += sum(row[0].logprob for row in rows)
        if c.logprobs is not None:
            c.logprobs += map(_as_dict, rows)
        seq = pending.scores.get(c.index)
        if seq is not None:
            c.cumulative_logprob, c.beam_score = seq.cumulative_logprob, seq.score


def _completion(index: int, params: SamplingParams, keep_logprobs: bool) -> CompletionOutput:
    sampled_logprobs = params.logprobs is not None and not params.use_beam_search
    return CompletionOutput(
        index=index,
        text="",
        token_ids=[],
        cumulative_logprob=0.0 if sampled_logprobs else None,
        logprobs=[] if sampled_logprobs and keep_logprobs else None,
    )


def _as_dict(row: LogprobRow) -> dict[int, Logprob]:
    """A wire row (chosen token first, then the top candidates) as vLLM's dict."""
    return {t.token_id: Logprob(t.logprob, t.rank, t.decoded_token) for t in row}
