"""The scheduler: one rule, computed tokens catch up with known tokens."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from engine.config import PreemptionMode, SchedulerConfig
from engine.core.lookahead_policy import LookaheadPolicy
from engine.core.policies import LatestArrivalFirst, PreemptionPolicy
from engine.core.request import PLACEHOLDER, Request, RequestStatus
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.stats import PrefixCacheStats
from engine.core.stop_checker import max_num_tokens
from engine.kv.block_tables import BlockTables


class Scheduler:
    """Plans each step under a token budget and a sequence cap, FCFS.

    Running requests are served first, in arrival order; then waiting requests are
    admitted in order until the budget, the sequence cap or the free blocks run out
    (the first that does not fit blocks the rest, so preempted requests, which wait at
    the front, are re-admitted before anything new). When a running request cannot get
    its blocks, the preemption policy picks a victim whose blocks are all freed; it is
    recomputed later from its known tokens.

    With prefix caching (`kv_cache.enable_prefix_caching`), an admitted request starts
    with the cached blocks its known tokens match, counted as computed. Full prompt
    blocks are registered in the prefix cache as soon as a plan computes them (later
    steps run after that one), full output blocks when the request's blocks are freed
    (finish or preemption), up to its last resolved token: the hot path pays nothing
    per sampled token. Requests asking for prompt logprobs compute their whole prompt.

    With `preemption_mode="swap"` a victim's blocks are copied to the CPU swap space
    instead (when it has room; else the victim is recomputed), and swapped requests come
    back, oldest first, before any waiting request is admitted.

    A request whose prompt a prefill instance computed (`num_remote_tokens`) is
    admitted into `loading` with blocks for its whole prompt and computes nothing: the
    plan's `loads` tell its worker to fetch the KV, in the background, while other
    requests' steps go on. Once a result says the KV arrived (`on_loaded`) it runs,
    with all but its prompt's last token computed; a load that fails fails the request.

    With speculative decoding (`lookahead`), a decoding row also gets the lookahead its
    policy gives it: k slots for draft tokens its worker proposes and verifies in the
    same step, from the token budget and the block table (never by preempting another
    sequence). The plan counts one token computed, as without drafts; the result
    (`on_verified`) adds the drafts accepted, releases the step's reservation and trims
    the table, so a table holds `num_computed_tokens + num_lookahead_tokens` slots and at
    most one lookahead more. Planning ahead of results, the next step's slots are
    reserved past every step in flight; the worker, which knows what it accepted,
    places the tokens.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: BlockTables,
        preemption: PreemptionPolicy | None = None,
        preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
        lookahead: LookaheadPolicy | None = None,
    ) -> None:
        self.config = config
        self.lookahead = lookahead
        self.kv_cache = kv_cache
        self.preemption = preemption or LatestArrivalFirst()
        self.swapping = preemption_mode == PreemptionMode.SWAP
        self.waiting: deque[Request] = deque()
        self.swapped: list[Request] = []  # by arrival_index: swapped back in first come first
        self.running: list[Request] = []  # sorted by arrival_index
        self.loading: dict[str, Request] = {}  # waiting for their prompt's KV to arrive
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_remote_tokens = 0  # prompt tokens loaded from prefill instances
        self.num_prompt_tokens_computed = 0  # prompt tokens planned to be computed here
        self.prefix_stats = PrefixCacheStats()
        self._step_id = 0
        self._copies: list[tuple[int, int]] = []  # this step's copy-on-write copies
        self._rewritten: list[tuple[str, int]] = []  # (request, first block) they replaced
        self._swap_out: list[tuple[int, int]] = []  # this step's (device, CPU) copies
        self._swap_in: list[tuple[int, int]] = []  # this step's (CPU, device) copies
        self._cow_pending: set[str] = set()  # forked sequences: copy before writing
        self._lookahead_steps: dict[int, dict[str, int]] = {}  # step -> {request: its k}
        self._trimmed: dict[str, int] = {}  # request -> first table entry a trim dropped
        self._loads: list[ScheduledRequest] = []  # this step's admissions into `loading`

    # -- queue ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.max_num_tokens = max_num_tokens(
            request.params, request.num_prompt_tokens, self.config.max_model_len
        )
        self.requests[request.request_id] = request
        group = request.group
        if group is not None and request is not group.leader:
            group.held.append(request)  # joins once the leader's prompt is computed
            return
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length, abort, error) and frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif self.loading.pop(request_id, None) is not None:
            request.status = status
            self.kv_cache.free(request_id)  # its KV never arrived: nothing to cache
            return request
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        elif request.group is not None and request in request.group.held:
            request.group.held.remove(request)
        request.status = status
        self._free_blocks(request)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- planning ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._copies, self._swap_out, self._swap_in, self._rewritten = [], [], [], []
        self._loads = []
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        grow, cow = self.kv_cache.grow, self._cow_pending
        slide = self.kv_cache.slide if self.kv_cache.has_windows else None
        running = RequestStatus.RUNNING
        lookahead, num_running = self.lookahead, len(self.running)
        for request in list(self.running):  # the hot loop: one pass, no helper calls
            if request.status != running:
                continue  # preempted earlier in this loop
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            computed = request.num_computed_tokens
            if num_tokens >= request.max_num_tokens or num_tokens == computed:
                continue  # awaits its last result, or a beam awaiting its siblings
            if cow and request.request_id in cow and not self._copy_on_write(request):
                preempted += self._preempt_unit(request)
                continue
            n = min(num_tokens - computed, budget)
            k = 0
            if lookahead is not None and computed + 1 == num_tokens and budget > 1:
                k = min(lookahead.lookahead(request, num_running), budget - 1)
            if slide is not None:
                slide(request.request_id, computed)
            need = computed + n + k + request.num_lookahead_tokens
            table = grow(request.request_id, need)
            if table is None and k:  # drafts never preempt anyone: none this step
                need, k = need - k, 0
                table = grow(request.request_id, need)
            if table is None:
                table = self._preempt_until_fits(request, need, preempted)
                if table is None:
                    continue  # it was the victim itself
            scheduled.append(ScheduledRequest(request, computed, n, table, k))
            budget -= n + k
            if budget == 0:
                break
        if preempted:  # a group's earlier members may have been planned before it went
            scheduled = [s for s in scheduled if s.request.status == running]
        else:
            resumed = self._swap_in_swapped(budget)
            budget -= sum(r.num_scheduled_tokens for r in resumed)
            scheduled += resumed
            if not self.swapped:
                scheduled += self._admit_waiting(budget)
        if self._trimmed:
            self._note_trimmed(scheduled)
        self._step_id += 1
        return SchedulerOutput(
            self._step_id,
            tuple(scheduled),
            tuple(preempted),
            tuple(self._copies),
            tuple(self._swap_out),
            tuple(self._swap_in),
            tuple(self._rewritten),
            tuple(self._loads),
        )

    def _swap_in_swapped(self, budget: int) -> list[ScheduledRequest]:
        """Swapped requests back onto device blocks, oldest first, while blocks, the
        token budget and the sequence cap allow; the swapped beams of a one-unit group
        come back together (some back and the rest stuck would hold blocks idle)."""
        resumed = []
        kv = self.kv_cache
        slack = self.lookahead.k if self.lookahead else 0  # a table's spare draft slots
        while self.swapped and budget > 0:
            unit = self._swap_unit(self.swapped[0])
            # Blocks for what comes back and the chunk it computes next (not the rest of
            # a prompt: windowed and recurrent groups hold only a chunk and their window).
            blocks = sum(
                kv.blocks_for(
                    min(r.num_tokens, r.num_computed_tokens + budget)
                    + r.num_lookahead_tokens
                    + slack,
                    r.num_computed_tokens,
                )
                for r in unit
            )
            if (
                blocks > kv.num_free_blocks
                or len(self.running) + len(unit) > self.config.max_num_seqs
            ):
                break
            for request in unit:
                computed = request.num_computed_tokens
                n = min(request.num_tokens - computed, budget)
                kv.slide(request.request_id, computed)  # in the swap space: less to copy
                self._swap_in += kv.swap_in(request.request_id)
                table = kv.grow(request.request_id, computed + n + request.num_lookahead_tokens)
                self.swapped.remove(request)
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=lambda r: r.arrival_index)
                if n:  # 0: a beam awaiting its siblings' offers, or the budget ran out
                    resumed.append(ScheduledRequest(request, computed, n, table))
                    budget -= n
        return resumed

    def _swap_unit(self, request: Request) -> list[Request]:
        """`request`, with the other swapped sequences of its group if it runs as one."""
        group = request.group
        if group is None or not group.preempt_together:
            return [request]
        return [r for r in self.swapped if r.group is group]

    def _preempt_until_fits(
        self, request: Request, num_tokens: int, preempted: list[str]
    ) -> list[int] | None:
        """Preempts victims until `request`'s table holds `num_tokens`; None if the
        request itself had to go."""
        while True:
            victim = self.preemption.choose_victim(self.running)
            preempted += self._preempt_unit(victim)
            if request.status != RequestStatus.RUNNING:
                return None
            table = self.kv_cache.grow(request.request_id, num_tokens)
            if table is not None:
                return table

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        admitted = []
        seats = self.config.max_num_seqs
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < seats:
            request = self.waiting[0]
            if self._at_limit(request) or not self._group_fits(request):
                break  # FCFS keeps the rest waiting
            if request.num_remote_tokens and not request.num_computed_tokens:
                if not self._admit_loading(request):
                    break
                continue
            forked = self._fork_from_leader(request)
            if forked is None:
                break  # no blocks for its copy of the prompt's last block
            computed = forked or self._match_prefix(request)
            n = min(request.num_tokens - computed, budget)
            self.kv_cache.slide(request.request_id, computed)
            table = self.kv_cache.grow(request.request_id, computed + n)
            if table is None:
                self.kv_cache.free(request.request_id)  # gives the prefix hits back
                break
            self.waiting.popleft()
            if self.kv_cache.enable_prefix_caching and not forked:
                self.prefix_stats.record(request.num_tokens, computed)
            request.num_computed_tokens = computed
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_index)
            admitted.append(ScheduledRequest(request, computed, n, table))
            budget -= n
        return admitted

    def _admit_loading(self, request: Request) -> bool:
        """Blocks for the whole prompt of a request whose KV a prefill instance holds;
        it waits in `loading` until the KV is here (False: no blocks for it yet)."""
        table = self.kv_cache.grow(request.request_id, request.num_prompt_tokens)
        if table is None:
            return False
        self.waiting.popleft()
        self.num_remote_tokens += request.num_remote_tokens
        request.num_computed_tokens = request.num_remote_tokens
        self.loading[request.request_id] = request
        self._loads.append(ScheduledRequest(request, request.num_computed_tokens, 0, table))
        return True

    def on_loaded(self, request_ids: Iterable[str]) -> None:
        """The prompts' KV of these loading requests arrived: they run from the next
        plan on (ids no longer loading, ended meanwhile, are ignored)."""
        for request_id in request_ids:
            request = self.loading.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=lambda r: r.arrival_index)

    def add_fork(self, request: Request, parent: Request) -> None:
        """Starts `request` running on all of `parent`'s blocks (a beam forking): both
        copy the shared block they write next before writing it. A parent preempted or
        swapped out meanwhile (its offer was in flight while planning ahead) has no
        device blocks to share: the fork then waits at the front, to be recomputed and
        admitted with its group."""
        request.max_num_tokens = parent.max_num_tokens
        self.requests[request.request_id] = request
        if parent.status != RequestStatus.RUNNING:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self.waiting.appendleft(request)
            return
        request.num_computed_tokens = parent.num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.kv_cache.fork(parent.request_id, request.request_id)
        bisect.insort(self.running, request, key=lambda r: r.arrival_index)
        self._cow_pending.update((request.request_id, parent.request_id))

    def _copy_on_write(self, request: Request) -> bool:
        """Private copies of the shared blocks the next write touches; False when blocks
        ran out (the caller preempts)."""
        start = request.num_computed_tokens
        copies = self.kv_cache.copy_on_write(request.request_id, start)
        if copies is None:
            return False
        self._cow_pending.discard(request.request_id)
        if copies:
            self._copies += copies
            kv = self.kv_cache
            self._rewritten.append((request.request_id, start // kv.block_size * kv.num_groups))
        return True

    def _fork_from_leader(self, request: Request) -> int | None:
        """A new follower of a running leader shares the leader's prompt blocks and
        gets a private copy of the block holding the prompt's last token (which it
        recomputes to sample its first token); returns its computed tokens (0: not a
        fork, None: no block for the copy)."""
        group = request.group
        if (
            group is None
            or request is group.leader
            or request.num_tokens > request.num_prompt_tokens
        ):
            return 0
        leader, num_prompt = group.leader, request.num_prompt_tokens
        if request.num_computed_tokens or leader.status != RequestStatus.RUNNING:
            return 0
        if leader.num_computed_tokens < num_prompt:
            return 0
        if not self.kv_cache.sees_context(leader.request_id, num_prompt - 1):
            return 0  # its window moved past the prompt's end: computed afresh instead
        self.kv_cache.fork(leader.request_id, request.request_id, num_prompt)
        copies = self.kv_cache.copy_on_write(request.request_id, num_prompt - 1)
        if copies is None:
            self.kv_cache.free(request.request_id)
            return None
        self._copies += copies
        return num_prompt - 1

    def _match_prefix(self, request: Request) -> int:
        """Tokens of `request` already in cached blocks (0 without prefix caching)."""
        if (
            request.num_computed_tokens
            or not self.kv_cache.enable_prefix_caching
            or request.params.prompt_logprobs is not None
        ):
            return request.num_computed_tokens
        tokens = request.token_ids(0, request.num_tokens)
        return self.kv_cache.match_prefix(request.request_id, tokens)

    def _at_limit(self, request: Request) -> bool:
        """Known tokens (sampled or still pending) already reach the length limit:
        computing more would only make a token that is thrown away."""
        return request.num_tokens >= request.max_num_tokens

    def _free_blocks(self, request: Request) -> None:
        """Frees the request's blocks, first caching the full ones of known tokens (not
        those of a request that failed: a failed step or KV load may have left them
        unwritten); the lookahead of its steps in flight goes with them (their results
        still count the tokens they accepted as known, not as computed)."""
        self._cow_pending.discard(request.request_id)
        if request.num_lookahead_tokens or self._trimmed:
            self._drop_lookahead(request)
        if self.kv_cache.enable_prefix_caching and request.status != RequestStatus.FINISHED_ERROR:
            known = request.num_tokens - request.num_pending_outputs
            computed = min(request.num_computed_tokens, known)
            self.kv_cache.cache_computed(request.request_id, request.token_ids, computed)
        self.kv_cache.free(request.request_id)

    def _preempt_unit(self, request: Request) -> list[str]:
        """Preempts `request`, and with it every running sequence of its group when the
        group runs as one unit (beam search); returns the ids preempted."""
        group = request.group
        unit = [request]
        if group is not None and group.preempt_together:
            unit += [s for s in group.sequences if s is not request and s in self.running]
        for r in unit:
            self._preempt(r)
        return [r.request_id for r in unit]

    def _group_fits(self, request: Request) -> bool:
        """A waiting sequence of a one-unit group is admitted only when all of the
        group's waiting sequences fit (blocks and the sequence cap) at once, with the
        blocks each holds at most while it computes its tokens, chunk by chunk (windowed
        and recurrent groups hold a chunk's and their window's)."""
        group = request.group
        if group is None or not group.preempt_together:
            return True
        members = [r for r in self.waiting if r.group is group]
        chunk = self.config.max_num_batched_tokens
        blocks = sum(self.kv_cache.peak_blocks(r.num_tokens, chunk) for r in members)
        seats = self.config.max_num_seqs - len(self.running)
        return blocks <= self.kv_cache.num_free_blocks and len(members) <= seats

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        unfilled = self._cancel_copies(request)
        if self.swapping:
            copies = self.kv_cache.swap_out(request.request_id)
            if copies is not None:  # else the swap space is full: recompute it
                copies = [(unfilled.get(block, block), cpu) for block, cpu in copies]
                self._cow_pending.discard(request.request_id)  # its copies are private
                self._swap_out += copies
                request.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, request, key=lambda r: r.arrival_index)
                self.num_swaps += 1
                return
        self._free_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_remote_tokens = 0  # recomputed here: the prefill instance's KV is gone
        self.waiting.appendleft(request)

    def _cancel_copies(self, request: Request) -> dict[int, int]:
        """Drops this step's copy-on-write copies into `request`'s blocks (it is being
        preempted: the blocks go back to the pool, maybe to be reused in this very step);
        returns them as {destination: source}. Swap-outs run before copies, so one of
        an unfilled block must read its source instead."""
        if not self._copies:
            return {}
        table = set(self.kv_cache.block_table(request.request_id))
        unfilled = {dst: src for src, dst in self._copies if dst in table}
        if unfilled:
            self._copies = [(src, dst) for src, dst in self._copies if dst not in unfilled]
        return unfilled

    def _count_prompt_tokens(self, request: Request, computed: int, n: int, k: int) -> None:
        """Prompt tokens this step computes (or, for a transferred prompt's first step,
        takes from the prefill instance: its last token's KV and hidden state came with
        the load, so nothing is computed); a prompt computed here enters the prefix
        cache at once, a transferred one once it finishes (the load may fail)."""
        prompt_tokens = min(n, len(request.prompt_token_ids) - computed)
        if request.num_remote_tokens:
            if n == 1 and not k:  # the worker samples it from the sent hidden state
                self.num_remote_tokens += 1
            else:
                self.num_prompt_tokens_computed += prompt_tokens
            request.num_remote_tokens = 0  # after a preemption: computed here
            return
        self.num_prompt_tokens_computed += prompt_tokens
        self._prompt_computed(request, computed + n)

    # -- results -------------------------------------------------------------------
    def advance(self, plan: SchedulerOutput) -> None:
        """Marks the plan's tokens as computed at once (planning ahead): every row that
        samples also gets a `PLACEHOLDER` as its next output, for the result to fill in
        (except a beam's: its group chooses the token). A row's lookahead stays reserved
        until the step's result (`on_verified`)."""
        running = RequestStatus.RUNNING
        for request, computed, n, _, k in plan.scheduled:
            if request.status == running:
                request.num_computed_tokens = computed + n
                if computed < len(request.prompt_token_ids):
                    self._count_prompt_tokens(request, computed, n, k)
                if k:
                    request.num_lookahead_tokens += k
                    self._lookahead_steps.setdefault(plan.step_id, {})[request.request_id] = k
            if request.group is not None and request.group.chooses_tokens:
                continue
            outputs = request.output_token_ids
            if computed + n == len(request.prompt_token_ids) + len(outputs):
                outputs.append(PLACEHOLDER)
                request.num_pending_outputs += 1

    def _prompt_computed(self, request: Request, num_computed: int) -> None:
        """Caches the prompt's newly full blocks; once a leader's whole prompt is
        computed, its held followers join the front of the queue."""
        num_prompt = len(request.prompt_token_ids)
        if self.kv_cache.enable_prefix_caching:
            n = num_computed if num_computed < num_prompt else num_prompt
            self.kv_cache.cache_computed(request.request_id, request.token_ids, n)
        group = request.group
        if group is not None and group.held and num_computed >= num_prompt:
            self.waiting.extendleft(reversed(group.held))
            group.held.clear()

    def on_verified(self, step_id: int, accepted: dict[str, int]) -> None:
        """Step `step_id`'s result is in: each row it planned with a lookahead gives its
        reservation back and counts the drafts it accepted (`accepted`, by request) as
        computed; its table shrinks to what is left reserved plus one lookahead of slack
        (the next step's drafts would take freed blocks right back, and a fresh block
        each time walks the pool: every first write to a page faults). A swapped-out
        table shrinks to exactly what is reserved."""
        planned = self._lookahead_steps.pop(step_id, None)
        if not planned:
            return
        for request_id, k in planned.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # ended meanwhile: its blocks are free already
            request.num_lookahead_tokens -= k
            request.num_computed_tokens += accepted.get(request_id, 0)
            keep = request.num_computed_tokens + request.num_lookahead_tokens
            running = request.status == RequestStatus.RUNNING
            if running:  # its next lookahead will want these slots again: no churn
                keep += self.lookahead.k
            if self.kv_cache.trim(request_id, keep) and running:
                entry = self.kv_cache.entries_for(keep)
                self._trimmed[request_id] = min(entry, self._trimmed.get(request_id, entry))

    def _note_trimmed(self, scheduled: list[ScheduledRequest]) -> None:
        """Tables that lost tail blocks to a trim since the workers last saw them are
        sent again from there (their new blocks need not be the ones trimmed)."""
        for s in scheduled:
            first = self._trimmed.pop(s.request.request_id, None)
            if first is not None:
                self._rewritten.append((s.request.request_id, first))

    def _drop_lookahead(self, request: Request) -> None:
        request_id = request.request_id
        for planned in self._lookahead_steps.values():
            planned.pop(request_id, None)
        request.num_lookahead_tokens = 0
        self._trimmed.pop(request_id, None)

    def check_integrity(self) -> None:
        """Blocks are consistent with every running request's computed tokens (and the
        slots its steps in flight reserved for drafts, with at most one lookahead of
        slack after them)."""
        kv, slack = self.kv_cache, self.lookahead.k if self.lookahead else 0
        slots_per_entry = kv.block_size / kv.num_groups
        stored = {}
        for r in self.running:  # a count in range whose blocks the table must hold exactly
            reserved = r.num_computed_tokens + r.num_lookahead_tokens
            slots = int(len(kv.block_table(r.request_id)) * slots_per_entry)
            stored[r.request_id] = min(max(slots, reserved), reserved + slack)
        for r in self.loading.values():  # a table for the prompt, its KV on the way
            stored[r.request_id] = r.num_prompt_tokens
        self.kv_cache.check_integrity(stored)
        for r in self.waiting:
            assert not self.kv_cache.block_table(r.request_id), f"{r.request_id} waits with blocks"
        for r in self.swapped:
            have = len(kv.swapped_table(r.request_id))
            reserved = r.num_computed_tokens + r.num_lookahead_tokens
            need = kv.entries_for(reserved), kv.entries_for(reserved + slack)
            assert need[0] <= have <= need[1], f"{r.request_id}: {have} swapped entries for {need}"
