"""Holds the model and its KV cache; runs one step plan and samples."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import CacheConfig, DeviceConfig, ModelConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.worker.attention.backend_race import AttentionShape
from engine.worker.attention.selector import select_backend
from engine.worker.compiled_model import compile_model
from engine.worker.input_batch import ModelInput, batch_order, build_model_input
from engine.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    KVCache,
    allocate_kv_cache,
    block_bytes,
    cache_storage,
    cuda_budget_bytes,
    distinct_tensors,
    num_blocks_for,
    reserved_blocks,
    row_code,
)
from engine.worker.logprobs import TokenLogprobs, compute_token_logprobs, to_dicts
from engine.worker.model_loader import load_model
from engine.worker.model_output import LogprobDict, ModelOutput, Verified
from engine.worker.models.prepack import prepack_linears
from engine.worker.parallel.context import ContextShards
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import kv_heads_per_rank
from engine.worker.parallel.pipeline import split_rows
from engine.worker.quantized_weight import QuantizedWeight
from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow
from engine.worker.speculative.draft_verifier import DraftVerifier

if TYPE_CHECKING:
    from engine.worker.device_inputs import DeviceInputBatch
    from engine.worker.grammar.matchers import GrammarMatchers
    from engine.worker.grammar.step_bitmask import GrammarBitmask
    from engine.worker.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    """One device's executor: model weights, KV cache, sampler.

    `num_blocks()` sizes the cache from the memory budget (kv_cache_memory bytes where
    set; else on CUDA gpu_memory_utilization minus weights and a profiled peak), `initialize_cache`
    allocates it, and `execute(plan)` runs the plan's flattened batch.

    Under tensor parallelism (`group`) each rank's runner holds its slices of the
    weights and its key/value heads; every rank runs every plan (the layers' collectives
    pair up), all ranks agree on the smallest block count, and rank 0 samples and
    broadcasts the sampled tokens, so every rank's worker appends the same ones. Under
    pipeline parallelism a rank holds its stage's layers and caches only theirs; the
    stages before the last compute no logits and only receive the tokens.

    Structured outputs: on the rank that samples (`grammars`), each step's rows whose
    request holds a grammar matcher sample only what it allows (a bitmask applied to the
    processed logits); a step without such rows builds no mask.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device_config: DeviceConfig,
        max_num_batched_tokens: int,
        max_num_seqs: int = 256,
        group: TensorParallelGroup | None = None,
        grammars: GrammarMatchers | None = None,
    ) -> None:
        self.group = group or TensorParallelGroup()
        self.grammars = grammars
        self.model_config = model_config
        self.kv_layout = model_config.kv_cache_layout  # derived from the config: once
        # block tables interleave one table per KV cache group (entries per block position)
        self.num_table_groups = self.kv_layout.num_groups if self.kv_layout.is_hybrid else 1
        self.max_model_len = model_config.max_model_len
        self.cache_config = cache_config
        self.device = device_config.device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        try:
            choice = select_backend(
                device_config.attention_backend,
                self.device,
                model_config.dtype,
                model_config.attention_features,
                cache_config.block_size,
                row_code(cache_config.cache_dtype),
                AttentionShape(
                    model_config.num_attention_heads // self.group.world_size,
                    kv_heads_per_rank(model_config.num_kv_heads, self.group.world_size),
                    model_config.head_size,
                ),
            )
        except ValueError as exc:  # name the model: its layers may need what is missing
            raise ValueError(f"{model_config.model} ({model_config.architecture}): {exc}") from None
        self.backend, self.backend_reason = choice.backend, choice.reason
        self.device_inputs = self._device_inputs(device_config.input_preparation)
        self.model = load_model(model_config, self.backend, self.device, self.group)
        stage = self.group.stage  # a pipeline stage caches its own layers only
        self.cache_layers = (
            len(stage.layer_range(model_config.num_layers)) if stage.is_split else None
        )
        self.linear_kernel = prepack_linears(
            self.model, device_config.linear_kernel, self.device, device_config.compile_model
        )
        logger.info(
            "weights: %.1f MiB (%s, quantization=%s)",
            self.weights_bytes() / 2**20,
            str(model_config.dtype).removeprefix("torch."),
            model_config.quantization.value,
        )
        if device_config.compile_model:
            compile_model(self.model)
            logger.info("the model's forward pass runs through torch.compile")
        self.graphs = self._piecewise_graphs(device_config, max_num_batched_tokens)
        gen = torch.Generator(device=self.device).manual_seed(model_config.seed)
        self.sampler = Sampler(gen)
        self.verifier = DraftVerifier(model_config.vocab_size, self.device, gen)
        self.kv_cache: KVCache = []
        self.swap_cache: KVCache = []  # CPU blocks of swapped-out sequences

    def weights_bytes(self) -> int:
        """The model's weights here: its parameters and buffers, the blocks of weights
        kept quantized (each storage once), and the oneDNN-packed copies."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        packed_bytes = 0
        for module in self.model.modules():
            packed = getattr(module, "packed", None)
            if isinstance(packed, QuantizedWeight):
                tensors += [part.blocks for part in packed.parts]
            elif packed is not None:
                packed_bytes += packed.nbytes
            if getattr(module, "quantized", None) is not None:  # an embedding's blocks
                tensors.append(module.quantized.blocks)
        storages = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
        return sum(storages.values()) + packed_bytes

    def expert_load(self) -> list[list[int]]:
        """Per MoE layer, the (token, expert) assignments each expert got so far (every
        rank routes every token, so each rank counts all experts)."""
        return [
            m.tokens_per_expert.tolist()
            for m in self.model.modules()
            if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor)
        ]

    def kv_cache_bytes(self) -> int:
        """The device KV cache's bytes (layers sharing a tensor counted once)."""
        tensors = [t for pair in self.kv_cache for t in pair]
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())

    def num_blocks(self, extra_block_bytes: int = 0) -> int:
        """Blocks the budget holds; `extra_block_bytes`: what each block also costs
        elsewhere (a draft model's cache, which has the same blocks)."""
        if self.cache_config.kv_cache_memory is not None:  # the user's byte count, any device
            budget = self.cache_config.kv_cache_memory
        elif not str(self.device).startswith("cuda"):
            budget = self._default_cpu_budget(extra_block_bytes)
        else:
            budget = cuda_budget_bytes(
                self.cache_config, self._profile_peak(), torch.device(self.device)
            )
        if extra_block_bytes:  # the share of the budget the target's blocks take
            own = self._block_bytes()
            budget = budget * own // (own + extra_block_bytes)
        local = num_blocks_for(
            self.model_config,
            self.cache_config,
            budget,
            self.group.world_size,
            self.max_num_batched_tokens,
            self.cache_layers,
        )
        return self.group.min_int(local)

    def _block_bytes(self) -> int:
        c = self.cache_config
        m, world = self.model_config, self.group.world_size
        return block_bytes(m, c.block_size, world, c.cache_dtype, self.cache_layers)

    def _default_cpu_budget(self, extra_block_bytes: int = 0) -> int:
        """2 GiB, or less when max_num_seqs full-length sequences need less (their
        blocks in every cache that has them)."""
        bs, m = self.cache_config.block_size, self.model_config
        blocks = self.max_num_seqs * self.kv_layout.blocks_needed(0, m.max_model_len, bs)
        return min(DEFAULT_CPU_KV_CACHE_MEMORY, blocks * (self._block_bytes() + extra_block_bytes))

    def num_cpu_blocks(self) -> int:
        """Blocks of CPU swap space: `swap_space` GiB."""
        return int(self.cache_config.swap_space * 1024**3) // self._block_bytes()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Caches for the `num_blocks` (and `num_cpu_blocks`) the scheduler hands out,
        plus the pages its allocator reserves."""
        self.kv_cache = self._allocate(num_blocks, self.device)
        on_cuda = str(self.device).startswith("cuda")
        self.swap_cache = self._allocate(num_cpu_blocks, "cpu", on_cuda) if num_cpu_blocks else []

    def _allocate(self, num_blocks: int, device: str, pinned: bool = False) -> KVCache:
        """Caches of `num_blocks` blocks (and the allocator's reserved pages) on `device`."""
        m = self.model_config
        dtype, _ = cache_storage(m, self.cache_config.cache_dtype)
        shape = self._cache_shape(num_blocks + reserved_blocks(m))
        return allocate_kv_cache(m, shape, device, pinned, dtype, self.cache_layers)

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model_config
        heads = kv_heads_per_rank(m.num_kv_heads, self.group.world_size)  # this rank's
        _, width = cache_storage(m, self.cache_config.cache_dtype)  # an 8-bit row: + scale
        return self.backend.kv_cache_shape(num_blocks, self.cache_config.block_size, heads, width)

    @torch.inference_mode()
    def _profile_peak(self) -> int:
        """Peak CUDA bytes of one forward over max_num_batched_tokens tokens (weights included)."""
        from engine.worker.profiling import dummy_plan

        torch.cuda.reset_peak_memory_stats(self.device)
        block_size = self.cache_config.block_size
        layout = self.kv_layout
        plan = dummy_plan(
            self.max_num_batched_tokens,
            self.model_config.max_model_len,
            block_size,
            layout.num_groups,
        )
        num_blocks = sum(len(s.block_table) for s in plan.scheduled)
        saved, self.kv_cache = self.kv_cache, self._allocate(num_blocks, self.device)
        try:
            self.execute(plan, sample=False)
        finally:
            self.kv_cache = saved
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, sample: bool = True) -> ModelOutput:
        self.move_blocks(plan)
        if self.group.stage.is_split:
            return self._execute_stage(plan, sample)
        computed, handed = [], []  # rows to run, rows sampled from a sent hidden state
        for row in plan.scheduled:
            (handed if _samples_handed_hidden(row) else computed).append(row)
        if self.device_inputs is not None:
            batch = self.device_inputs.build(computed)
        else:
            batch = build_model_input(
                computed, self.cache_config.block_size, self.device, self.kv_layout
            )
        if not computed:
            hidden = None  # every row samples from a prefill instance's hidden state
        elif self.group.context.splits(batch.input_ids.shape[0]):
            hidden = self._forward_shard(batch)
        else:
            forward = self.graphs or self.model
            hidden = forward(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)
        prompt_lp = self._prompt_logprobs(batch, hidden)
        prompt_hidden = _prompt_hidden(batch, hidden)
        if not sample or not (batch.sample_rows or handed):
            return ModelOutput({}, prompt_logprobs=prompt_lp, prompt_hidden=prompt_hidden)
        # [S, vocab]: a row per sampling row, and one more per draft token it verifies
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if computed else None
        if handed:
            batch, logits = self._append_handed(batch, logits, handed)
        if batch.num_drafts:
            return self._sample_with_drafts(batch, logits, prompt_lp)
        sampled, rows = self._sample(batch.sample_rows, logits)
        return ModelOutput(sampled, rows, prompt_lp, prompt_hidden=prompt_hidden)

    def _piecewise_graphs(self, config: DeviceConfig, max_tokens: int) -> PiecewiseGraphs | None:
        """The model split at attention into pieces replayed from CUDA graphs (on the
        CPU, plain calls: the split and padding checked), when capture sizes are given
        and not `enforce_eager`. Not with pipeline or context parallelism, nor with
        compile_model (which compiles the whole forward its own way). Opt-in on CUDA
        too (docs/performance.md)."""
        wanted = config.cudagraph_capture_sizes is not None
        if config.enforce_eager or config.compile_model or self._split_steps or not wanted:
            return None
        from engine.worker.piecewise_graphs import PiecewiseGraphs, capture_sizes

        sizes = capture_sizes(config.cudagraph_capture_sizes, max_tokens)
        return PiecewiseGraphs(self.model, sizes, self.device)

    def _device_inputs(self, preparation: str) -> DeviceInputBatch | None:
        """The device-side input builder ('device'), or None for the host one ('host',
        and 'auto': on an H200 the device path answered as the host one but built no
        faster, docs/performance.md). Pipeline and context parallelism build on the host."""
        if preparation != "device" or self._split_steps:
            return None
        try:
            from engine.worker.device_inputs import DeviceInputBatch
        except ImportError as exc:  # triton is not installed
            raise ValueError(f"input_preparation='device' needs triton ({exc})") from None
        entries = -(-self.max_model_len // self.cache_config.block_size) * self.num_table_groups
        return DeviceInputBatch(
            self.max_model_len,
            entries + 2,
            self.cache_config.block_size,
            self.device,
            self.kv_layout,
        )

    @property
    def _split_steps(self) -> bool:
        """Pipeline or context parallelism: a step's batch is built in parts, on the host."""
        return self.group.stage.is_split or self.group.context.is_split

    def release_requests(self, request_ids) -> None:
        """Ended requests: their device input slots go back (a no-op on the host path)."""
        if self.device_inputs is not None:
            self.device_inputs.release(request_ids)

    def _append_handed(
        self, batch: ModelInput, logits: torch.Tensor | None, handed: Sequence[ScheduledRequest]
    ) -> tuple[ModelInput, torch.Tensor]:
        """The batch's sampling rows and logits with the handed rows after them: their
        logits come from the hidden states a prefill instance sent (no forward pass)."""
        hidden = torch.stack([r.request.remote_hidden for r in handed])  # [H, hidden]
        extra = self.model.compute_logits(hidden.to(self.device))  # [H, vocab]
        logits = extra if logits is None else torch.cat([logits, extra])
        drafts = (*batch.num_drafts, *[0] * len(handed)) if batch.num_drafts else ()
        rows = (*batch.sample_rows, *handed)
        return dataclasses.replace(batch, sample_rows=rows, num_drafts=drafts), logits

    def _forward_shard(self, batch: ModelInput) -> torch.Tensor:  # [T, hidden]
        """Context parallelism: this rank's shard of the step's tokens through the model
        (each attention layer gathering every shard's K/V), then every shard's hidden
        states gathered, in the step's token order."""
        context, num_tokens = self.group.context, batch.input_ids.shape[0]
        pieces = context.shard(batch.rows, num_tokens)
        shard = build_model_input(
            pieces, self.cache_config.block_size, self.device, self.kv_layout, ordered=True
        )
        sizes = tuple(end - start for start, end in context.bounds(num_tokens))
        shards = ContextShards(sizes, batch.metadata.slot_mapping)
        metadata = dataclasses.replace(shard.metadata, context=shards)
        hidden = self.model(shard.input_ids, shard.positions, self.kv_cache, metadata)
        return shards.gather(hidden)

    def _execute_stage(self, plan: SchedulerOutput, sample: bool) -> ModelOutput:
        """A pipeline stage's step: each micro-batch through this stage's layers in turn
        (an earlier stage sends each on without waiting, so the next stage computes it
        while this one goes on); the last stage samples every part's rows at once, the
        others take the tokens it broadcasts."""
        layout, bs = self.kv_layout, self.cache_config.block_size
        rows = batch_order(plan.scheduled)
        parts = split_rows(
            rows, [r.num_scheduled_tokens for r in rows], self.group.stage.micro_batches
        )
        batches = [  # parts of rows already in batch order
            build_model_input(part, bs, self.device, layout, ordered=True) for part in parts
        ]
        hiddens = [self.model(b.input_ids, b.positions, self.kv_cache, b.metadata) for b in batches]
        sample_rows = tuple(r for b in batches for r in b.sample_rows)
        if self.group.stage.sends:
            self.model.stage_link.flush()
            return self._receive_tokens(sample_rows) if sample else ModelOutput({})
        prompt_lp = {}
        for batch, hidden in zip(batches, hiddens, strict=True):
            prompt_lp.update(self._prompt_logprobs(batch, hidden))
        if not sample or not sample_rows:
            return ModelOutput({}, prompt_logprobs=prompt_lp)
        logits = torch.cat(  # [S, vocab], the rows in one batch's order
            [
                self.model.compute_logits(hidden[batch.logits_indices])
                for batch, hidden in zip(batches, hiddens, strict=True)
                if batch.sample_rows
            ]
        )
        sampled, lp_rows = self._sample(sample_rows, logits)
        return ModelOutput(sampled, lp_rows, prompt_lp)

    def _receive_tokens(self, rows: Sequence[ScheduledRequest]) -> ModelOutput:
        """An earlier pipeline stage's share of sampling: the tokens global rank 0
        broadcasts (no logprobs: rank 0 answers with those)."""
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        tokens = self.group.broadcast(tokens).tolist() if rows else []
        return ModelOutput({r.request.request_id: t for r, t in zip(rows, tokens, strict=True)})

    def _sample(
        self, sample_rows: Sequence[ScheduledRequest], logits: torch.Tensor
    ) -> tuple[dict[str, int], dict[str, LogprobDict]]:
        """One token per row from its logits [S, vocab]; the logprob rows asked for."""
        ids = [r.request.request_id for r in sample_rows]
        if self.group.is_first:
            out = self.sampler(logits, self._sampling_metadata(sample_rows))
            tokens, logprobs = out.sampled_token_ids, out.logprobs  # [S] int64
        else:  # rank 0 samples; this rank only needs the tokens, for its worker
            tokens, logprobs = torch.empty(len(ids), dtype=torch.int64, device=logits.device), None
        tokens = self.group.broadcast(tokens).tolist()
        sampled = dict(zip(ids, tokens, strict=True))
        return sampled, _sample_logprobs(sample_rows, tokens, logprobs)

    def _sample_with_drafts(
        self, batch: ModelInput, logits: torch.Tensor, prompt_lp: dict
    ) -> ModelOutput:
        """A step where some rows verify drafts: the others sample as usual (seeded and
        constrained rows among them), the drafting rows go through the verifier."""
        rows, counts = batch.sample_rows, batch.num_drafts
        starts = [0]
        for d in counts:
            starts.append(starts[-1] + d + 1)
        plain = [i for i, d in enumerate(counts) if d == 0]
        drafting = [i for i, d in enumerate(counts) if d > 0]
        sampled, lp_rows = {}, {}
        if plain:
            index = torch.tensor([starts[i] for i in plain], device=logits.device)
            sampled, lp_rows = self._sample([rows[i] for i in plain], logits[index])
        spans = [range(starts[i], starts[i + 1]) for i in drafting]
        index = torch.tensor([j for span in spans for j in span], device=logits.device)
        spec_rows = [rows[i] for i in drafting]
        emitted = self._verify(spec_rows, logits[index])  # [B, K + 1], EMPTY after each row's
        verified = {}
        for row, tokens in zip(spec_rows, emitted, strict=True):
            tokens = [t for t in tokens if t >= 0]
            request = row.request
            sampled[request.request_id] = tokens[-1]
            verified[request.request_id] = Verified(len(request.draft_token_ids), tokens[:-1])
        if self.group.is_first:
            self._verified_logprobs(spec_rows, spans, logits, sampled, verified, lp_rows)
        return ModelOutput(sampled, lp_rows, prompt_lp, verified)

    def _verify(self, rows: Sequence[ScheduledRequest], logits: torch.Tensor) -> list[list[int]]:
        """The drafting rows' emitted tokens (rank 0 verifies, every rank gets them)."""
        k = max(len(r.request.draft_token_ids) for r in rows)
        if self.group.is_first:
            sampling_rows = [self._sampling_row(r) for r in rows]
            drafts = [r.request.draft_token_ids for r in rows]
            emitted = self.verifier.verify(logits, sampling_rows, drafts).token_ids
        else:
            emitted = torch.empty((len(rows), k + 1), dtype=torch.int64, device=logits.device)
        return self.group.broadcast(emitted).tolist()

    def _verified_logprobs(self, rows, spans, logits, sampled, verified, lp_rows) -> None:
        """Each emitted token's logprob row, for the drafting rows that asked."""
        for row, span in zip(rows, spans, strict=True):
            request = row.request
            if request.params.logprobs is None:
                continue
            v = verified[request.request_id]
            tokens = [*v.accepted, sampled[request.request_id]]
            index = torch.tensor(list(span)[: len(tokens)], device=logits.device)
            num_top = request.params.logprobs
            lp = compute_token_logprobs(
                logits[index], torch.tensor(tokens, device=logits.device), num_top
            )
            dicts = to_dicts(lp, tokens, [num_top] * len(tokens))
            v.logprobs.extend(dicts[:-1])
            lp_rows[request.request_id] = dicts[-1]

    def move_blocks(self, plan: SchedulerOutput) -> None:
        """A step's block traffic before its forward pass: swap-outs (device -> CPU), then
        swap-ins (CPU -> device), then copy-on-write copies, each batched per tensor."""
        if plan.swap_out:
            self._swap(plan.swap_out, self.kv_cache, self.swap_cache)
        if plan.swap_in:
            self._swap(plan.swap_in, self.swap_cache, self.kv_cache)
        if plan.block_copies:
            self.copy_blocks(plan.block_copies)

    def _swap(self, pairs, src_cache: KVCache, dst_cache: KVCache) -> None:
        ids = torch.tensor(pairs, dtype=torch.int64)  # [num_blocks, 2]: (src, dst)
        src, dst = distinct_tensors(src_cache), distinct_tensors(dst_cache)
        self.backend.swap_blocks(src, dst, ids[:, 0], ids[:, 1])

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: every (src, dst) block copy of a step, one op per cache tensor."""
        pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)  # [num_copies, 2]
        self.backend.copy_blocks(distinct_tensors(self.kv_cache), pairs[:, 0], pairs[:, 1])

    def _sampling_metadata(self, sample_rows: Sequence[ScheduledRequest]) -> SamplingMetadata:
        rows = [self._sampling_row(item) for item in sample_rows]
        grammar = self._grammar_bitmask(sample_rows)
        vocab = self.model_config.vocab_size
        table = penalties = None
        if self.device_inputs is not None:  # state kept on the device, per slot
            table = self.device_inputs.sampling_table(sample_rows, vocab)
            penalties = functools.partial(
                self.device_inputs.penalty_tensors, sample_rows, vocab_size=vocab
            )
        return SamplingMetadata.from_rows(rows, vocab, self.device, grammar, table, penalties)

    @staticmethod
    def _sampling_row(item: ScheduledRequest) -> SamplingRow:
        r = item.request
        stops = frozenset(r.params.stop_token_ids or ())
        if not r.params.ignore_eos:
            stops |= r.eos_token_ids
        return SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, stops)

    def _grammar_bitmask(self, sample_rows: Sequence[ScheduledRequest]) -> GrammarBitmask | None:
        """The step's grammar mask over its sampling rows; None when none is constrained."""
        if self.grammars is None:
            return None
        matchers = [r.request.grammar for r in sample_rows]
        return self.grammars.step_bitmask(matchers, self.device)

    def _prompt_logprobs(self, batch: ModelInput, hidden: torch.Tensor) -> dict:
        """Each scored prompt position's row, by request."""
        result = {}
        for span in batch.prompt_logprob_spans:
            index = torch.tensor(span.token_indices, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden[index])  # [n, vocab]
            targets = torch.tensor(span.targets, dtype=torch.int64, device=hidden.device)
            request = next(r.request for r in batch.rows if r.request.request_id == span.request_id)
            num_top = request.params.prompt_logprobs
            lp = compute_token_logprobs(logits, targets, num_top)
            result[span.request_id] = to_dicts(lp, span.targets, [num_top] * len(span.targets))
        return result


def _samples_handed_hidden(row: ScheduledRequest) -> bool:
    """The row is a transferred prompt's last token, whose KV arrived with the prompt's
    and whose logits come from the hidden state sent beside it: nothing to compute."""
    request = row.request
    return (
        getattr(request, "remote_hidden", None) is not None
        and row.num_scheduled_tokens == 1
        and row.num_computed_tokens == request.num_prompt_tokens - 1
        and not request.draft_token_ids
    )


def _prompt_hidden(batch: ModelInput, hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The final hidden state ([hidden_size]) at the prompt's last position of each row
    that computes it for a decode instance (`kv_transfer_params.do_remote_decode`)."""
    if hidden is None:
        return {}
    out, start = {}, 0
    for row in batch.rows:
        request, computed, n = row.request, row.num_computed_tokens, row.num_scheduled_tokens
        transfer = request.params.kv_transfer_params
        last = request.num_prompt_tokens - 1
        if transfer is not None and transfer.do_remote_decode and computed <= last < computed + n:
            out[request.request_id] = hidden[start + last - computed]
        start += n
    return out


def _sample_logprobs(
    rows: Sequence[ScheduledRequest], tokens: list[int], logprobs: TokenLogprobs | None
) -> dict[str, LogprobDict]:
    """The sampled tokens' rows (each token first, then its request's own top
    `params.logprobs`) of the requests that asked for logprobs, by request id."""
    if logprobs is None:
        return {}
    tops = [r.request.params.logprobs or 0 for r in rows]
    dicts = to_dicts(logprobs, tokens, tops)
    return {
        r.request.request_id: row
        for r, row in zip(rows, dicts, strict=True)
        if r.request.params.logprobs is not None
    }
