"""Worker side of the protocol: cached per-request state + a ModelRunner.

Torch-free itself (the simulator's model-free workers run the same protocol): only the
builders below import the torch modules (model runner, KV cache sizing), when called."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.stats import summed_by_position
from engine.core.stop_checker import max_num_tokens
from engine.engine_args import EngineArgs
from engine.errors import describe
from engine.messages import (
    CachedRequestData,
    DraftCount,
    LogprobRow,
    NewRequestData,
    RequestFailed,
    RequestLogprobs,
    StepPlan,
    StepResult,
    TokenLogprob,
    WorkerReady,
)
from engine.worker.model_output import LogprobDict, ModelOutput
from engine.worker.parallel.table_digest import block_table_digest
from engine.worker.worker_request import WorkerRequest

if TYPE_CHECKING:
    from engine.worker.grammar.backend import GrammarMatcher
    from engine.worker.grammar.matchers import GrammarMatchers
    from engine.worker.kv_transfer_steps import KVTransferSteps
    from engine.worker.model_runner import ModelRunner
    from engine.worker.speculative.proposer import Proposer


class Worker:
    """Applies each StepPlan's diffs to its cached requests and runs the step.

    The worker keeps a `WorkerRequest` replica of every running request, with the
    tokens it sampled itself, so a plan never carries sampled tokens back. Contract: a
    request id is new in exactly one plan, cached afterwards, and dropped when it
    appears in `finished_ids`.

    The failure rule, per request: a diff that cannot be applied fails its request; a
    step whose model run raises fails every request it scheduled (under tensor
    parallelism it propagates: one rank cannot fail a step alone). A failed request is
    forgotten, named in `StepResult.failed`, and its rows in plans already on their way
    are skipped until a plan lists it as finished. A step that also moved blocks (copies,
    swaps) cannot be tied to its requests: its exception propagates (the engine stops).

    Structured outputs: with `grammars` (the rank that samples), a request with
    `params.structured_outputs` gets its matcher when it is added (a constraint that
    does not compile fails it), and each token it samples advances the matcher before
    the next plan runs; a token the grammar refuses fails the request.

    Speculative decoding: with a `proposer`, a row the plan gives a lookahead of k gets
    up to k draft tokens proposed from the request's known tokens, as many as its table
    has slots for and its length limit allows; its row computes them after its one
    token and samples at each, and the verifier's accepted drafts and the token after
    them are appended in order. The worker places every row by its own computed count
    (which the scheduler, planning ahead of results, only bounds from below).
    """

    def __init__(
        self,
        runner: ModelRunner | None,
        worker_id: int = 0,
        grammars: GrammarMatchers | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.grammars = grammars
        self.proposer = proposer
        self.eos_token_ids = runner.model_config.eos_token_ids if runner else frozenset()
        self.requests: dict[str, WorkerRequest] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.failed: set[str] = set()  # forgotten after a failure, until finished
        self._table_groups = runner.num_table_groups if runner else 1
        self._block_size = runner.cache_config.block_size if runner else 1
        self.num_rank_checks = 0  # steps whose block tables all ranks compared
        # prefill/decode disaggregation: saves and loads prompts' KV (None: neither)
        self.kv_transfer: KVTransferSteps | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        failures: dict[str, str] = {}
        self._apply(plan, failures)
        if self._is_rank_of_group:
            self._check_ranks_agree(plan.step_id)
        copies = tuple(zip(plan.copy_src, plan.copy_dst, strict=True))
        swap_out = tuple(zip(plan.swap_out_src, plan.swap_out_dst, strict=True))
        swap_in = tuple(zip(plan.swap_in_src, plan.swap_in_dst, strict=True))
        runnable = self._runnable(plan, failures)
        transfer = self.kv_transfer is not None
        loaded = self._transfer(plan, bool(runnable), failures) if transfer else ()
        if not runnable:  # a plan may only carry finished ids (and block moves, loads)
            if self.runner is not None:
                self.runner.move_blocks(
                    SchedulerOutput(plan.step_id, (), (), copies, swap_out, swap_in)
                )
            empty = StepResult.empty(plan.step_id, self.worker_id)
            return self._result(empty, failures, loaded)
        if plan.num_lookahead_tokens and self.proposer is not None:
            ks = dict(zip(plan.scheduled_ids, plan.num_lookahead_tokens, strict=True))
            self._propose_all([(rid, ks[rid]) for rid, _ in runnable if ks[rid]])
        scheduled = tuple(
            ScheduledRequest(
                self.requests[rid],
                self.requests[rid].num_computed_tokens,
                n + len(self.requests[rid].draft_token_ids),
                self.block_tables[rid],
            )
            for rid, n in runnable
        )
        step = SchedulerOutput(plan.step_id, scheduled, (), copies, swap_out, swap_in)
        try:
            result = self._sample(step, failures)
        except Exception as exc:
            if copies or swap_out or swap_in or self._is_rank_of_group:
                raise  # a group's rank cannot fail alone: the ranks' caches would differ
            self._forget([rid for rid, _ in runnable], describe(exc), failures)
            empty = StepResult.empty(plan.step_id, self.worker_id)
            return self._result(empty, failures, loaded)
        return self._result(result, failures, loaded)

    def _transfer(self, plan: StepPlan, busy: bool, failures: dict[str, str]) -> tuple[str, ...]:
        """Starts the plan's loads (in the background) and collects the loads that
        ended: the ids whose KV arrived; those that failed are failed. With no step to
        run (`busy` False) it first waits a little for a load to end."""
        for request_id in plan.load_ids:
            if request_id in self.requests:
                request = self.requests[request_id]
                self.kv_transfer.start(request, self.block_tables[request_id])
        loaded, errors = self.kv_transfer.poll(wait=not busy)
        for request_id, error in errors.items():
            self._forget([request_id], error, failures)
        return tuple(rid for rid in loaded if rid in self.requests)

    def expert_load(self) -> tuple[int, ...]:
        """Each expert's assignments so far, summed over the MoE layers (empty: no experts)."""
        return summed_by_position(self.runner.expert_load() if self.runner is not None else [])

    @property
    def _is_rank_of_group(self) -> bool:
        return self.runner is not None and self.runner.group.has_peers

    def _check_ranks_agree(self, step_id: int) -> None:
        """Every tensor-parallel rank applied the same plans, so each holds the same
        block tables; a rank that does not (a bug, or a diff only it could not apply)
        would write K/V where the others do not: RuntimeError, the group goes down."""
        digests = self.runner.group.all_gather_int(block_table_digest(self.block_tables))
        self.num_rank_checks += 1
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"tensor-parallel ranks disagree on the block tables at step {step_id} "
                f"(digests {digests})"
            )

    def _runnable(self, plan: StepPlan, failures: dict[str, str]) -> list[tuple[str, int]]:
        """The plan's rows to run: failed requests skipped, unknown ones failed."""
        runnable = []
        for rid, n in zip(plan.scheduled_ids, plan.num_scheduled_tokens, strict=True):
            if rid in self.failed:
                continue
            if rid not in self.requests:
                self._forget([rid], f"request {rid!r} was scheduled before it was sent", failures)
                continue
            runnable.append((rid, n))
        return runnable

    def _propose_all(self, rows: list[tuple[str, int]]) -> None:
        """Draft tokens for the rows the plan gave a lookahead (up to its k; fewer where
        a table or a length limit has no room), kept on their requests for this step."""
        wanted = [(rid, min(k, self._room(rid))) for rid, k in rows]
        wanted = [(rid, k) for rid, k in wanted if k > 0 and self.requests[rid].grammar is None]
        if not wanted:
            return
        requests = [self.requests[rid] for rid, _ in wanted]
        tables = [self.block_tables[rid] for rid, _ in wanted]
        drafts = self.proposer.propose_batch(requests, [k for _, k in wanted], tables)
        for request, (_, k), proposal in zip(requests, wanted, drafts, strict=True):
            request.draft_token_ids = proposal[:k]

    def _room(self, request_id: str) -> int:
        """Drafts `request_id`'s row may verify: slots its table has past its known
        tokens, and outputs its length limit allows after the row's one token."""
        request, runner = self.requests[request_id], self.runner
        slots = len(self.block_tables[request_id]) // runner.num_table_groups
        limit = max_num_tokens(request.params, request.num_prompt_tokens, runner.max_model_len)
        return min(
            slots * runner.cache_config.block_size - request.num_tokens,
            limit - request.num_tokens - 1,
        )

    def _sample(self, step: SchedulerOutput, failures: dict[str, str]) -> StepResult:
        """Runs the step, advances the requests it ran, and reports what they sampled."""
        try:
            result = self._run(step)
        finally:
            for item in step.scheduled:  # both are for this step only
                request = item.request
                if request.draft_token_ids:
                    request.draft_token_ids = []
                if request.remote_hidden is not None:
                    request.remote_hidden = None
        if self.kv_transfer is not None and result.prompt_hidden:
            tables = ((s.request, s.block_table) for s in step.scheduled)
            self.kv_transfer.save(tables, result.prompt_hidden)
        verified = result.verified
        for item in step.scheduled:
            request = item.request
            v = verified.get(request.request_id) if verified else None
            if v is None:
                request.num_computed_tokens += item.num_scheduled_tokens
            else:  # its one token and the drafts accepted; the rest are overwritten later
                request.num_computed_tokens += 1 + len(v.accepted)
                request.output_token_ids += v.accepted
                self.proposer.after_step(request)
        refused = []
        for request_id, token in result.sampled.items():
            request = self.requests[request_id]
            request.output_token_ids.append(token)
            if request.grammar is not None and not _advance(request.grammar, token):
                refused.append(request_id)
        if refused:
            result = self._drop_refused(result, refused, failures)
        return StepResult.sampled(
            step.step_id,
            self.worker_id,
            result.sampled,
            tuple(self._logprobs(result)),
            tuple(self._prompt_logprobs(result)),
            {rid: v.accepted for rid, v in verified.items()} if verified else None,
            tuple(DraftCount(rid, v.num_drafts, len(v.accepted)) for rid, v in verified.items()),
        )

    def _drop_refused(
        self, result: ModelOutput, refused: list[str], failures: dict[str, str]
    ) -> ModelOutput:
        """Fails the requests whose grammar refused the token they sampled (only a
        row whose every token was masked samples one), and drops their tokens."""
        for request_id in refused:
            token = result.sampled[request_id]
            error = f"the grammar (structured_outputs) refused sampled token {token}"
            self._forget([request_id], error, failures)
        sampled = {r: t for r, t in result.sampled.items() if r not in refused}
        logprobs = {r: row for r, row in result.logprobs.items() if r not in refused}
        prompt = {r: rows for r, rows in result.prompt_logprobs.items() if r not in refused}
        return ModelOutput(sampled, logprobs, prompt, result.verified)

    @staticmethod
    def _result(
        result: StepResult, failures: dict[str, str], loaded: tuple[str, ...] = ()
    ) -> StepResult:
        if not failures and not loaded:
            return result
        failed = tuple(RequestFailed(rid, error) for rid, error in failures.items())
        return dataclasses.replace(result, failed=failed, loaded_ids=loaded)

    def _forget(self, request_ids: list[str], error: str, failures: dict[str, str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.block_tables.pop(request_id, None)
            self.failed.add(request_id)
            failures.setdefault(request_id, error)
        if self.runner is not None:
            self.runner.release_requests(request_ids)

    def _run(self, step: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(step)

    def _logprobs(self, result: ModelOutput) -> Iterator[RequestLogprobs]:
        """Sampled-token logprobs of the requests that asked for them (a row per token:
        accepted drafts first)."""
        verified = result.verified
        for request_id, row in result.logprobs.items():
            v = verified.get(request_id) if verified else None
            rows = (row,) if v is None else (*v.logprobs, row)
            yield RequestLogprobs(request_id, tuple(_wire_row(r) for r in rows))

    def _prompt_logprobs(self, result: ModelOutput) -> Iterator[RequestLogprobs]:
        for request_id, rows in result.prompt_logprobs.items():
            request = self.requests[request_id]
            request.num_scored_prompt_tokens += len(rows)  # once, even if recomputed later
            yield RequestLogprobs(request_id, tuple(_wire_row(r) for r in rows))

    def _apply(self, plan: StepPlan, failures: dict[str, str]) -> None:
        if self.grammars is not None:
            for params in plan.grammars:  # needed soon: compiled while this step runs
                self.grammars.prepare(params)
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
            self.block_tables.pop(request_id, None)
            self.failed.discard(request_id)
        if self.runner is not None and plan.finished_ids:
            self.runner.release_requests(plan.finished_ids)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(plan.finished_ids)
        diffs = [(new.request_id, self._add, new) for new in plan.new_requests]
        diffs += [(cached.request_id, self._update, cached) for cached in plan.cached_requests]
        for request_id, apply, diff in diffs:
            if request_id in self.failed:
                continue
            try:
                apply(diff)
            except Exception as exc:  # noqa: BLE001 - the failure rule: this request only
                self._forget([request_id], describe(exc), failures)

    def _add(self, new: NewRequestData) -> None:
        request = WorkerRequest.of(new, self.eos_token_ids)
        constraint = new.params.structured_outputs
        if constraint is not None and self.grammars is not None:
            request.grammar = self.grammars.matcher(constraint, request.output_token_ids)
        self.requests[new.request_id] = request
        self.block_tables[new.request_id] = list(new.block_ids)

    def _update(self, cached: CachedRequestData) -> None:
        table = self.block_tables[cached.request_id]
        if cached.resumed_from_preemption:
            table.clear()
        elif cached.first_block_index >= 0:
            del table[cached.first_block_index :]
        table.extend(cached.new_block_ids)
        request = self.requests[cached.request_id]
        if cached.first_block_index >= 0:  # copies replaced blocks: a draft cache lacks them
            first = cached.first_block_index // self._table_groups * self._block_size
            request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, first)
        if cached.resumed_from_preemption:
            request.num_computed_tokens = cached.num_computed_tokens
            request.num_draft_computed_tokens = 0  # its blocks' draft KV did not move
        else:
            _check_in_step(request, cached.num_computed_tokens, cached.num_lookahead_tokens)
        if cached.last_token_id is not None:
            request.output_token_ids[-1] = cached.last_token_id
            if request.grammar is not None:
                request.grammar.rollback(1)
                _advance(request.grammar, cached.last_token_id)


class NullWorker(Worker):
    """A worker without a model, for control-plane benchmarks and tests: the same plan
    protocol and per-request cache, but every sampling row "samples" `token_id` at once."""

    def __init__(self, worker_id: int = 0, token_id: int = 0) -> None:
        super().__init__(None, worker_id)
        self.token_id = token_id

    def _run(self, step: SchedulerOutput) -> ModelOutput:
        sampled = {s.request.request_id: self.token_id for s in step.scheduled if s.samples}
        return ModelOutput(sampled)


def _advance(grammar: GrammarMatcher, token: int) -> bool:
    """Accepts `token`; a terminated grammar ignores it (a token planned one step past
    the sequence's end, which the engine throws away). False: the grammar refused it."""
    return grammar.is_terminated or grammar.accept(token)


def _check_in_step(request: WorkerRequest, num_computed_tokens: int, lookahead: int) -> None:
    """The worker counts computed tokens itself between diffs; a diff must agree, up to
    the drafts the worker may have accepted in steps the plan was made ahead of."""
    have = request.num_computed_tokens
    if not num_computed_tokens <= have <= num_computed_tokens + lookahead:
        raise RuntimeError(
            f"{request.request_id}: the plan says {num_computed_tokens} computed tokens "
            f"(and {lookahead} draft slots in flight), the worker counted {have}"
        )


def _wire_row(row: LogprobDict) -> LogprobRow:
    return tuple(TokenLogprob(t, lp.logprob, lp.rank, None) for t, lp in row.items())


def build_worker(
    args: EngineArgs, worker_id: int = 0, config: EngineConfig | None = None, rank: int = 0
) -> tuple[Worker, WorkerReady]:
    """Loads the model, sizes and allocates the KV cache; returns the ready message
    (`config`: `args.build()`, when the caller has built it already). Under tensor
    parallelism this process is rank `rank`: it joins the group first (every rank must
    call this), loads its slices, and the ranks agree on the block count."""
    from engine.worker.kv_cache import cache_dtype_name  # torch: only a real worker
    from engine.worker.model_runner import ModelRunner
    from engine.worker.parallel.group import join_group

    config = config or args.build()
    group = join_group(config.parallel, config.device.device, rank)
    grammars = _grammar_matchers(config) if group.is_first else None  # the rank that samples
    runner = ModelRunner(
        config.model,
        config.cache,
        config.device,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
        group,
        grammars,
    )
    proposer = _proposer(config)
    draft_bytes = proposer.block_bytes() if proposer is not None else 0
    num_blocks, num_cpu_blocks = runner.num_blocks(draft_bytes), runner.num_cpu_blocks()
    runner.initialize_cache(num_blocks, num_cpu_blocks)
    if proposer is not None:
        proposer.initialize_cache(num_blocks)
    ready = WorkerReady(
        worker_id=worker_id,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        max_model_len=config.model.max_model_len,
        vocab_size=config.model.vocab_size,
        num_cpu_blocks=num_cpu_blocks,
        attention_backend=runner.backend.name,
        attention_backend_reason=runner.backend_reason,
        weights_bytes=runner.weights_bytes(),
        kv_cache_bytes=runner.kv_cache_bytes(),
        kv_cache_dtype=cache_dtype_name(config.model, config.cache.cache_dtype),
        quantization=config.model.quantization.value,
    )
    return Worker(runner, worker_id, grammars, proposer), ready


def _proposer(config: EngineConfig) -> Proposer | None:
    """The draft proposer `config.speculative` names (None: no speculative decoding)."""
    spec = config.speculative
    if spec is None:
        return None
    if config.draft_model is not None:
        from engine.worker.speculative.draft_model_proposer import DraftModelProposer

        return DraftModelProposer(config.draft_model, config.cache, config.device)
    from engine.worker.speculative.ngram_proposer import NgramProposer

    k = spec.num_speculative_tokens
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, k)


def _grammar_matchers(config: EngineConfig) -> GrammarMatchers:
    """Matchers whose backend loads the engine's tokenizer on the first structured request."""
    from engine.wiring import load_engine_tokenizer
    from engine.worker.grammar.backend import build_backend
    from engine.worker.grammar.matchers import GrammarMatchers

    def make_backend():
        m = config.model
        return build_backend(load_engine_tokenizer(config), m.vocab_size, m.eos_token_ids)

    return GrammarMatchers(make_backend, config.grammar_cache_size)


def build_null_worker(args: EngineArgs, worker_id: int = 0) -> tuple[NullWorker, WorkerReady]:
    """A NullWorker announcing the blocks `args.kv_cache_memory` would hold for this model
    (read from config.json only; no weights are loaded)."""
    from engine.worker.kv_cache import DEFAULT_CPU_KV_CACHE_MEMORY, num_blocks_for  # torch

    config = args.build()
    budget = config.cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
    m = config.model
    ready = WorkerReady(
        worker_id=worker_id,
        num_blocks=num_blocks_for(
            m,
            config.cache,
            budget,
            config.parallel.tensor_parallel_size,
            config.scheduler.max_num_batched_tokens,
        ),
        block_size=config.cache.block_size,
        max_model_len=m.max_model_len,
        vocab_size=m.vocab_size,
        attention_backend="none",
        attention_backend_reason="a null worker runs no model",
    )
    return NullWorker(worker_id), ready
