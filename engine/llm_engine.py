"""The synchronous engine: add requests, step, collect finished outputs."""

from __future__ import annotations

import itertools
import logging
import time

from engine.beam_group import BeamGroup, beam_params, beam_search_for
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.logprobs import Logprob
from engine.model_runner import ModelRunner, StepResult
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.request_validation import RequestLimits, validate_request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence_group import SequenceGroup, sequence_id, sequence_params
from engine.stats import EngineStats, SharingSaving, SlotUtilization
from engine.stop_checker import StopChecker
from engine.stop_strings import find_stop
from engine.text_checks import check_text
from engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

PromptInput = str | list[int]


class LLMEngine:
    """One scheduler, one model runner, one tokenizer. `step()` = schedule, run, update.

    Requests are validated in `add_request` before any state changes, so a bad request
    raises there and never disturbs those in flight.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            source = config.tokenizer or config.model.model_dir
            self.tokenizer = Tokenizer(load_tokenizer(source))
        self.runner = ModelRunner(
            config.model,
            config.cache,
            config.device,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
        )
        num_blocks, num_cpu_blocks = self.runner.num_blocks(), self.runner.num_cpu_blocks()
        self.runner.initialize_cache(num_blocks, num_cpu_blocks)
        cache = config.cache
        kv = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, 0, num_cpu_blocks
        )
        self.scheduler = Scheduler(config.scheduler, kv, preemption_mode=cache.preemption_mode)
        model = config.model
        self.limits = RequestLimits(
            model.vocab_size,
            model.max_model_len,
            model.eos_token_ids,
            self.tokenizer is not None,
            num_blocks,
            cache.block_size,
            config.scheduler.max_num_seqs,
        )
        self.stop_checker = StopChecker()
        self.utilization = SlotUtilization()
        self.sharing = SharingSaving()
        self.num_steps = 0
        self._arrivals = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}  # multi-sequence requests in flight

    # -- requests ------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None
    ) -> Request:
        """Queues a request; one sampling several sequences (`n`, `best_of`) becomes a
        SequenceGroup whose sequences share the prompt's blocks. Returns the (first)
        sequence's Request."""
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._validate(request_id, token_ids, params)
        if params.use_beam_search:
            return self._add_beam_search(request_id, text, token_ids, params)
        if params.num_sequences == 1:
            request = self._new_request(request_id, text, token_ids, params)
            self.scheduler.add_request(request)
            return request
        group = SequenceGroup(request_id, params)
        for i in range(params.num_sequences):
            child = sequence_params(params, i)
            seq = self._new_request(sequence_id(request_id, i), text, token_ids, child)
            seq.group = group
            group.sequences.append(seq)
        self._groups[request_id] = group
        for seq in group.sequences:
            self.scheduler.add_request(seq)
        return group.leader

    def _add_beam_search(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams
    ) -> Request:
        model = self.config.model
        search = beam_search_for(params, len(token_ids), model.max_model_len, model.eos_token_ids)
        beam = beam_params(params, search.num_candidates)
        group = BeamGroup(request_id, params, search)
        leader = self._new_request(sequence_id(request_id, 0), text, token_ids, beam)
        leader.logprobs = None  # the search keeps the scores
        group.start(leader)
        self._groups[request_id] = group
        self.scheduler.add_request(group.leader)
        return group.leader

    def _new_request(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams
    ) -> Request:
        request = Request(
            request_id,
            text,
            token_ids,
            params,
            next(self._arrivals),
            eos_token_ids=self.config.model.eos_token_ids,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if params.logprobs is not None:
            request.logprobs = []
        if params.stop and self.tokenizer is not None:
            request.detokenizer = self._detokenizer(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self._groups.get(request_id)
        if group is not None:
            for seq in group.sequences:
                self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_ABORTED)
            return self._finish_group(group)
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return None if request is None else self._finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
        return self._update(plan, result)

    def _update(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        self.scheduler.advance(plan)
        self.num_steps += 1
        self._record_utilization()
        self._store_prompt_logprobs(result)
        self._store_logprobs(result)
        finished = []
        now = time.time()
        offers = None  # beam offers, read from the logprobs only when a beam ran
        for item in plan.scheduled:
            request = item.request
            request.metrics.first_scheduled_time = request.metrics.first_scheduled_time or now
            token = result.sampled.get(request.request_id)
            if token is None:
                continue
            group = request.group
            if isinstance(group, BeamGroup):
                offers = offers if offers is not None else _top_candidates(result)
                if group.collect(request, offers[request.request_id]):
                    finished += self._advance_beams(group)
                continue
            status = self._append_token(request, token, now)
            if status is None:
                continue
            self.scheduler.finish_request(request.request_id, status)
            if request.group is None:
                finished.append(self._finish(request))
            elif request.group.is_finished:
                finished.append(self._finish_group(request.group))
        return finished

    def _append_token(self, request: Request, token: int, now: float) -> RequestStatus | None:
        request.output_token_ids.append(token)
        request.metrics.first_token_time = request.metrics.first_token_time or now
        delta = ""
        if request.detokenizer is not None:
            delta = request.detokenizer.append([token])
            request.output_text += delta
        return self.stop_checker.check(request, len(delta))

    # -- outputs -------------------------------------------------------------------
    def _advance_beams(self, group: BeamGroup) -> list[RequestOutput]:
        leader = group.leader

        def new_beam(request_id: str) -> Request:
            prompt, ids, params = leader.prompt, leader.prompt_token_ids, leader.params
            beam = self._new_request(request_id, prompt, ids, params)
            beam.logprobs = None  # the search keeps the scores
            return beam

        group.advance(self.scheduler, new_beam)
        if not group.is_finished:
            return []
        del self._groups[group.request_id]
        completions = []
        for i, h in enumerate(group.hypotheses):
            seq = new_beam(sequence_id(group.request_id, 0))
            seq.output_token_ids = list(h.token_ids)
            stopped = group.search.finish_reason(h) == "stop"
            seq.status = RequestStatus.FINISHED_LENGTH
            if stopped:
                seq.status = RequestStatus.FINISHED_STOPPED
            seq.cumulative_logprob = seq_logprob = h.logprob
            completion = self._completion(seq, i)
            completion.cumulative_logprob = seq_logprob
            completion.beam_score = h.score
            completions.append(completion)
        return [self._output(group.request_id, leader, completions)]

    def _finish(self, request: Request) -> RequestOutput:
        return self._output(request.request_id, request, [self._completion(request, 0)])

    def _finish_group(self, group: SequenceGroup) -> RequestOutput:
        """All sequences of `group` ended: one output with n completions."""
        del self._groups[group.request_id]
        completions = [self._completion(s, i) for i, s in enumerate(group.results())]
        if group.params.logprobs is None:  # sampled only to rank best_of sequences
            for c in completions:
                c.logprobs = None
        return self._output(group.request_id, group.leader, completions)

    def _completion(self, request: Request, index: int) -> CompletionOutput:
        request.metrics.finished_time = time.time()
        if request.detokenizer is None and self.tokenizer is not None:
            # Decoded with the prompt's last tokens as context, as streaming does, so a
            # first token's leading space is kept ("Once upon a time" + " there was").
            request.detokenizer = self._detokenizer(request)
            request.output_text = request.detokenizer.append(request.output_token_ids)
        if request.detokenizer is not None and not isinstance(request.stop_reason, str):
            self._flush_text(request)
        return CompletionOutput(
            index=index,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _output(
        self, request_id: str, first: Request, completions: list[CompletionOutput]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=True,
            metrics=first.metrics,
            error=first.error,
        )

    def _flush_text(self, request: Request) -> None:
        """Text the detokenizer held back (e.g. a partial character) ends the output."""
        delta = request.detokenizer.flush()
        request.output_text += delta
        match = find_stop(
            request.output_text,
            len(delta),
            request.params.stop,
            request.params.include_stop_str_in_output,
        )
        if delta and match is not None:
            request.output_text = request.output_text[: match.truncate_to]
            request.stop_reason = match.stop

    def _store_logprobs(self, result: StepResult) -> None:
        for request, row, lp in result.sample_logprob_dicts(self.scheduler.requests):
            if request.logprobs is not None:
                request.logprobs.append(self._decode_logprobs(row))
                request.cumulative_logprob += lp

    def _store_prompt_logprobs(self, result: StepResult) -> None:
        for request, rows in result.prompt_logprob_dicts(self.scheduler.requests):
            request.prompt_logprobs.extend(self._decode_logprobs(r) for r in rows)

    def _decode_logprobs(self, row: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return row
        return {
            tid: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([tid], False))
            for tid, lp in row.items()
        }

    # -- helpers -------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the tokenizer is disabled; pass token ids")
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids (ints)")

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        ids = [request_id]
        if params.num_sequences > 1:
            ids += [sequence_id(request_id, i) for i in range(params.num_sequences)]
        for rid in ids:
            if rid in self.scheduler.requests or rid in self._groups:
                raise ValueError(f"request_id {rid!r} is already in flight")
        validate_request(token_ids, params, self.limits)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=request.params.skip_special_tokens,
            spaces_between_special_tokens=request.params.spaces_between_special_tokens,
        )

    def _record_utilization(self) -> None:
        kv = self.scheduler.kv_cache
        stored = sum(r.num_computed_tokens for r in self.scheduler.running)
        self.utilization.record(stored, kv.num_allocated_slots())
        self.sharing.record(kv.num_table_blocks(), kv.pool.num_used)

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv_cache
        return EngineStats(
            num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_slot_utilization=self.utilization.last,
            mean_kv_slot_utilization=self.utilization.mean,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prefix_cache_queried_tokens=self.scheduler.prefix_stats.queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_stats.hit_tokens,
            num_cached_blocks=kv.pool.num_cached,
            num_cache_evictions=kv.pool.num_evictions,
            num_swaps=self.scheduler.num_swaps,
            num_swapped_blocks=kv.num_swapped_blocks,
            kv_sharing_saving=self.sharing.last,
            mean_kv_sharing_saving=self.sharing.mean,
        )

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (later requests compute their prompts in full);
        returns how many cached blocks were dropped."""
        return self.scheduler.kv_cache.reset_prefix_cache()


def _top_candidates(result: StepResult) -> dict[str, list[tuple[int, float]]]:
    """Each logprobs row's top (token, logprob) pairs, best first (beam offers)."""
    if result.logprobs is None:
        return {}
    ids = result.logprobs.topk_ids.tolist()
    lps = result.logprobs.topk_logprobs.tolist()
    return {
        rid: list(zip(ids[i], lps[i], strict=True)) for i, rid in enumerate(result.logprob_rows)
    }
