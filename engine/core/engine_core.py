"""The engine core: plans steps ahead of their results (the scheduler actor runs one; so
does the offline `LLM`, in-process: engine/in_process.py).

Every row that samples in a plan gets a placeholder output token at plan time, and the
plan's tokens count as computed at once; a later `StepResult` resolves the placeholders
in order and runs the token-level stop checks. So plan N+1 can be made before result N
arrives (the worker keeps its own sampled tokens), and whether one or two plans are in
flight is only a question of when the caller delivers results. A request that stops on
EOS or a stop token while its next plan is in flight costs one discarded token there;
limits (max_tokens, context) are known at plan time and cost nothing.

Beam search is the exception: the search, not the sampler, picks each beam's next token,
so a beam gets no placeholder and is planned again only once the result with every
beam's offers is in (a beam group computes every other step when planning ahead). The
builder then tells the worker the chosen token (`last_token_id`), and a forked beam goes
out as a new request with its parent's tokens.

The block tables are injected (any `BlockTables`). In-process (the offline `LLM`) they
are a plain `KVCacheManager` and a step is `schedule()` then `build_plan()`. Where a
block-manager actor holds the authoritative tables, the core plans on a `BlockLedger`,
a replica that knows every block id at once and logs its changes, and a step is
`schedule()`, `block_traffic()` sent to the block manager, and `build_plan()`. The plan
needs nothing from the block manager's `BlockOpsApplied`: it is an audit, checked
whenever it arrives (`on_block_ops_applied`), and one exchange is open at a time (its
answer is checked before the next `block_traffic()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

from engine.config import PreemptionMode, SchedulerConfig
from engine.core.beam_group import BeamGroup, beam_params, beam_search_for, top_offers
from engine.core.kv_handoff import handoff, remote_tokens
from engine.core.lookahead_policy import LookaheadPolicy
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence_group import SequenceGroup, sequence_params
from engine.core.stats import (
    EngineStats,
    MemoryReport,
    SharingSaving,
    SlotUtilization,
    SpecDecodeStats,
)
from engine.core.step_plan_builder import StepPlanBuilder
from engine.core.stop_checker import StopChecker
from engine.kv.block_ledger import BlockLedger
from engine.kv.block_tables import BlockTables
from engine.kv_transfer.config import KVTransferConfig
from engine.kv_transfer.params import KVTransferParams
from engine.messages import (
    AddRequest,
    ApplyBlockOps,
    BlockOpsApplied,
    LogprobRow,
    PrepareGrammar,
    RankedSequence,
    RequestFinish,
    RequestLogprobs,
    StepPlan,
    StepResult,
    TokenDeltas,
    sequence_id,
)
from engine.sampling_params import SamplingParams


class EngineCore:
    """Scheduler + block tables + plan diffs + token-level stop checks + the stats.

    `blocks`: the block tables to plan on (a `BlockLedger` when a block manager elsewhere
    holds the real ones; `engine/wiring.py` builds both ways)."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockTables,
        eos_token_ids: frozenset[int],
        preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
        attention_backend: str = "",
        memory: MemoryReport | None = None,
        lookahead: LookaheadPolicy | None = None,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        self.blocks = blocks
        self.attention_backend = attention_backend  # the workers' (reported in stats)
        self.memory = memory or MemoryReport()  # likewise
        self._ledger = blocks if isinstance(blocks, BlockLedger) else None
        self.scheduler = Scheduler(
            config, blocks, preemption_mode=preemption_mode, lookahead=lookahead
        )
        self.spec_decode = SpecDecodeStats()
        self.builder = StepPlanBuilder()
        self.stop_checker = StopChecker()
        self.eos_token_ids = eos_token_ids
        self._finished_ids: list[str] = []
        self._prompt_rows: dict[str, list[LogprobRow]] = {}  # until the first token goes out
        self._may_stop = set(eos_token_ids)  # every token that can end some request
        self._arrival = 0
        self._groups: dict[str, SequenceGroup] = {}  # n > 1 requests in flight
        self.num_steps = 0
        self.utilization = SlotUtilization()
        self.sharing = SharingSaving()
        self.kv_transfer = kv_transfer  # a producer answers with where its prompts' KV waits

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def prepare_grammar(self, prepare: PrepareGrammar) -> None:
        """A request being admitted will need `prepare.params`: the next plan asks the
        workers to start compiling it."""
        self.builder.prepare_grammar(prepare.params)

    def add_request(self, add: AddRequest) -> None:
        """Queues a request; one sampling several sequences (n, best_of) becomes a
        SequenceGroup whose sequences (ids from `sequence_id`) share the prompt's blocks
        (the tokenizer actor ranks best_of's)."""
        self._may_stop.update(add.params.stop_token_ids)
        params = add.params
        if params.use_beam_search:
            self._add_beam_search(add)
            return
        if params.num_sequences == 1:
            request = self._new_request(add.request_id, add.prompt_token_ids, params)
            self.scheduler.add_request(request)
            return
        group = SequenceGroup(add.request_id, params)
        for i in range(params.num_sequences):
            seq_id, seq_params = sequence_id(add.request_id, i), sequence_params(params, i)
            seq = self._new_request(seq_id, add.prompt_token_ids, seq_params)
            seq.group = group
            group.sequences.append(seq)
        self._groups[add.request_id] = group
        for seq in group.sequences:
            self.scheduler.add_request(seq)

    def _add_beam_search(self, add: AddRequest) -> None:
        """A beam search: its first beam is scheduled alone (the tokenizer actor has
        validated the search against this model's end tokens)."""
        num_prompt, max_len = len(add.prompt_token_ids), self.scheduler.config.max_model_len
        search = beam_search_for(add.params, num_prompt, max_len, self.eos_token_ids)
        group = BeamGroup(add.request_id, add.params, search)
        beam = beam_params(add.params, search.num_candidates)
        group.start(self._new_request(sequence_id(add.request_id, 0), add.prompt_token_ids, beam))
        self._groups[add.request_id] = group
        self.scheduler.add_request(group.leader)

    def _new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Request:
        self._arrival += 1
        return Request(
            request_id,
            list(prompt_token_ids),
            params,
            self._arrival,
            eos_token_ids=self.eos_token_ids,
            num_remote_tokens=remote_tokens(params, len(prompt_token_ids)),
        )

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Ends a request (every sequence of it) or one sequence (its own stop string)."""
        group = self._groups.pop(request_id, None)
        ids = [s.request_id for s in group.sequences] if group else [request_id]
        for seq_id in ids:
            self._prompt_rows.pop(seq_id, None)
            request = self.scheduler.finish_request(seq_id, status)
            if request is None:
                continue
            self._finished_ids.append(seq_id)
            if request.group is not None and request.group.is_finished:
                self._groups.pop(request.group.request_id, None)

    def fail(self, request_id: str) -> str | None:
        """Ends a request that failed (given its id or one of its sequences' ids): every
        sequence of it, its blocks freed. Returns the request's own id, None if unknown."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.group is not None:
            request_id = request.group.request_id
        elif request is None and request_id not in self._groups:
            return None
        self.abort(request_id, RequestStatus.FINISHED_ERROR)  # its blocks cache nothing
        return request_id

    def schedule(self) -> SchedulerOutput | None:
        """The next step, its tokens counted as computed (None: nothing to tell the
        workers until a result arrives). Its block changes are in the next
        `block_traffic()`. While prompts' KV is on its way (`scheduler.loading`) a step
        with nothing to run still goes out: its result says which loads ended."""
        output = self.scheduler.schedule()
        if output.is_empty and not (self._finished_ids or output.loads or self.scheduler.loading):
            return None
        self.scheduler.advance(output)
        if not output.is_empty:
            self.num_steps += 1
            self._record_usage()
        return output

    @property
    def has_block_traffic(self) -> bool:
        """There are block ops to send (never on local block tables: nobody to tell)."""
        ledger = self._ledger
        return ledger is not None and ledger.has_traffic

    def block_traffic(self) -> ApplyBlockOps | None:
        """The block ops since the last exchange, or None when there are none. Raises
        BlockLedgerError while the last exchange's answer is unchecked."""
        return self._ledger.take_traffic() if self.has_block_traffic else None

    def on_block_ops_applied(self, reply: BlockOpsApplied) -> None:
        """Checks the answer to the open exchange (BlockLedgerError if it disagrees)."""
        self._ledger.apply(reply)

    def _record_usage(self) -> None:
        """Once per step: token slots holding real tokens, and blocks saved by sharing."""
        blocks = self.blocks
        needed = blocks.needed_slots
        stored = sum(needed(r.num_computed_tokens) for r in self.scheduler.running)
        self.utilization.record(stored, blocks.num_allocated_slots())
        self.sharing.record(blocks.num_table_blocks(), blocks.num_used_blocks)

    def stats(self) -> EngineStats:
        """The one stats source (`LLM.stats()`, `AsyncEngine.stats()`, `/metrics`)."""
        blocks, scheduler = self.blocks, self.scheduler
        return EngineStats(
            num_blocks=blocks.num_blocks,
            num_used_blocks=blocks.num_blocks - blocks.num_free_blocks,
            num_free_blocks=blocks.num_free_blocks,
            kv_slot_utilization=self.utilization.last,
            mean_kv_slot_utilization=self.utilization.mean,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.loading),
            prefix_cache_queried_tokens=scheduler.prefix_stats.queried_tokens,
            prefix_cache_hit_tokens=scheduler.prefix_stats.hit_tokens,
            num_cached_blocks=blocks.num_cached_blocks,
            num_cache_evictions=blocks.num_cache_evictions,
            num_swaps=scheduler.num_swaps,
            num_swapped_blocks=blocks.num_swapped_blocks,
            num_prompt_tokens_computed=scheduler.num_prompt_tokens_computed,
            kv_transfer_loaded_tokens=scheduler.num_remote_tokens,
            kv_sharing_saving=self.sharing.last,
            mean_kv_sharing_saving=self.sharing.mean,
            attention_backend=self.attention_backend,
            num_swapped=len(scheduler.swapped),
            **dataclasses.asdict(self.memory),
            **self.spec_decode.as_fields(),
        )

    def check_integrity(self) -> None:
        """The scheduler's requests and the block tables agree (tests call it)."""
        self.scheduler.check_integrity()

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (later requests compute their prompts in full);
        returns how many cached blocks were dropped."""
        return self.blocks.reset_prefix_cache()

    def plan(
        self, exchange: Callable[[ApplyBlockOps], BlockOpsApplied] | None = None
    ) -> StepPlan | None:
        """schedule + block exchange + build_plan in one call: on local block tables
        (no exchange), or with a block manager within reach (`exchange=manager.apply`).
        The exchange also runs when there is no step, so frees of finished requests are
        never held back."""
        output = self.schedule()
        traffic = self.block_traffic()
        if traffic is not None:
            self.on_block_ops_applied(exchange(traffic))
        return None if output is None else self.build_plan(output)

    def build_plan(self, output: SchedulerOutput) -> StepPlan:
        """The worker message of `output` (its block ids are the ledger's own: it need
        not wait for the block manager's answer)."""
        message = self.builder.build(output, self._finished_ids)  # tables are live: resolved
        self._finished_ids = []
        return message

    def on_result(self, result: StepResult) -> TokenDeltas:
        """Resolves the step's placeholders; the tokens that count, column-wise. A
        sequence's accepted drafts (the columns after its first) go in right after the
        placeholder they extend, before those of steps still in flight; each token goes
        through the stop checks in order, so none is kept past a stop."""
        requests = self.scheduler.requests
        if result.loaded_ids:
            self.scheduler.on_loaded(result.loaded_ids)
        for scored in result.prompt_logprobs:
            if scored.request_id in requests:
                self._prompt_rows.setdefault(scored.request_id, []).extend(scored.rows)
        ids, tokens, finished, prompt, beams = [], [], [], [], []
        accepted: dict[str, int] = {}
        may_stop, prompt_rows = self._may_stop, self._prompt_rows
        run_id, k = None, 0  # the sequence whose columns are being read, and its last index
        for request_id, token in zip(result.sampled_ids, result.sampled_token_ids, strict=True):
            request = requests.get(request_id)
            if request_id == run_id:  # an accepted draft's successor
                if request is None:
                    continue  # it stopped at an earlier token of this step
                k += 1
                request.output_token_ids.insert(k, token)
                accepted[request_id] = accepted.get(request_id, 0) + 1
            elif request is None or not request.num_pending_outputs:
                run_id = None
                if request is not None and request.group and request.group.chooses_tokens:
                    beams.append(request)  # a beam offering its continuations
                continue  # else it ended while this step was in flight (its id may be reused)
            else:
                run_id = request_id
                outputs = request.output_token_ids  # the oldest placeholder takes the token:
                k = len(outputs) - request.num_pending_outputs
                outputs[k] = token
                request.num_pending_outputs -= 1
                if prompt_rows and request_id in prompt_rows:
                    prompt.append(RequestLogprobs(request_id, tuple(prompt_rows.pop(request_id))))
            ids.append(request_id)
            tokens.append(token)
            if token in may_stop or len(request.prompt_token_ids) + k + 1 >= request.max_num_tokens:
                finish = self._check_stop(request, token, k + 1)
                if finish is not None:
                    finished.append(finish)
        if result.drafts:
            self._record_drafts(result)
        self.scheduler.on_verified(result.step_id, accepted)
        ranked = self._advance_beams(beams, result, prompt) if beams else ()
        delivered = set(ids) if result.logprobs else ()
        logprobs = tuple(lp for lp in result.logprobs if lp.request_id in delivered)
        return TokenDeltas(
            step_id=result.step_id,
            request_ids=tuple(ids),
            token_ids=tuple(tokens),
            finished=tuple(finished),
            logprobs=logprobs,
            prompt_logprobs=tuple(prompt),
            ranked=ranked,
        )

    def _record_drafts(self, result: StepResult) -> None:
        for d in result.drafts:
            self.spec_decode.record(d.num_drafts, d.num_accepted)

    def _advance_beams(
        self, beams: list[Request], result: StepResult, prompt: list[RequestLogprobs]
    ) -> tuple[RankedSequence, ...]:
        """Collects the beams' offers; each group that has all of them takes a search
        step. Ended beams are dropped by the workers, continuing ones told their chosen
        token; a finished search's hypotheses (and prompt logprobs) go to the tokenizer."""
        rows = {lp.request_id: lp.rows[0] for lp in result.logprobs}
        ranked: list[RankedSequence] = []
        for beam in beams:
            group = beam.group
            if beam.request_id not in rows:
                continue  # no logprobs row: the worker did not sample it
            offers = top_offers(rows[beam.request_id], group.search.num_candidates)
            if not group.collect(beam, offers):
                continue
            leader = group.leader
            fork = partial(
                self._new_request, prompt_token_ids=leader.prompt_token_ids, params=leader.params
            )
            moves = group.advance(self.scheduler, fork)
            self._finished_ids += [b.request_id for b in moves.ended]
            for b, token in moves.continued:
                self.builder.choose(b.request_id, token)
            if group.is_finished:
                ranked += self._hypotheses(group, prompt)
        return tuple(ranked)

    def _hypotheses(self, group: BeamGroup, prompt: list[RequestLogprobs]) -> list[RankedSequence]:
        del self._groups[group.request_id]
        rows = self._prompt_rows.pop(group.leader.request_id, None)
        if rows is not None:
            prompt.append(RequestLogprobs(group.request_id, tuple(rows)))
        search = group.search
        return [
            RankedSequence(
                request_id=group.request_id,
                index=i,
                token_ids=h.token_ids,
                finish_reason=search.finish_reason(h),
                cumulative_logprob=h.logprob,
                score=h.score,
            )
            for i, h in enumerate(group.hypotheses)
        ]

    def _check_stop(self, request: Request, token: int, num_outputs: int) -> RequestFinish | None:
        """The full stop rules for output number `num_outputs` (`token`, just resolved);
        a request that stops loses the placeholders of steps that ran past it."""
        status, stop_reason = self.stop_checker.check_sampled(request, token, num_outputs)
        if status is None:
            return None
        del request.output_token_ids[num_outputs:]
        request.num_pending_outputs = 0
        answer = self._handoff(request)
        self.scheduler.finish_request(request.request_id, status)
        self._finished_ids.append(request.request_id)
        group = request.group
        if group is not None and group.is_finished:
            self._groups.pop(group.request_id, None)
        return RequestFinish(request.request_id, status.finish_reason, stop_reason, answer)

    def _handoff(self, request: Request) -> KVTransferParams | None:
        """A prefill instance's answer for `request` (engine/core/kv_handoff.py)."""
        if self.kv_transfer is None or request.params.kv_transfer_params is None:
            return None
        table = self.blocks.block_table(request.request_id)
        prompt = table[: self.blocks.blocks_for(request.num_prompt_tokens)]
        return handoff(request.params, request.request_id, prompt, self.kv_transfer)
