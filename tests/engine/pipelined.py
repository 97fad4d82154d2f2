"""Test helpers: the served path's pure pieces (core on a block ledger, block manager,
worker) driven in-process, with up to `depth` plans in flight."""

from __future__ import annotations

from collections import deque

from engine.core.engine_core import EngineCore
from engine.engine_args import EngineArgs
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from engine.wiring import EngineParts, build_engine
from engine.worker.worker import Worker, build_worker
from tests.engine.tiny_models import kv_memory

BS = 4  # the swap and beam tests' block size


def served_parts(args: EngineArgs) -> tuple[EngineParts, Worker]:
    """The served wiring (a BlockLedger and a block manager) over a real worker."""
    config = args.build()
    worker, ready = build_worker(args, config=config)
    return build_engine(config, ready, with_block_manager=True), worker


def add_all(core: EngineCore, prompts, params: list[SamplingParams], prefix: str = "r") -> None:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(AddRequest(f"{prefix}{i}", tuple(p), sp, 0.0))


def run_pipelined(parts: EngineParts, worker: Worker, depth: int, ranked: dict | None = None):
    """Up to `depth` plans in flight; results delivered oldest first. Returns token ids
    by sequence id and the number of tokens the worker computed that were thrown away;
    beam searches' whole outputs go to `ranked` (request id -> RankedSequences)."""
    core, blocks = parts.core, parts.block_manager
    in_flight: deque = deque()
    outputs: dict[str, list[int]] = {}
    discarded = 0
    while core.has_unfinished or in_flight:
        plan = core.plan(blocks.apply) if len(in_flight) < depth else None
        if plan is not None:
            in_flight.append(worker.execute(plan))
            continue
        result = in_flight.popleft()
        deltas = core.on_result(result)
        for seq in deltas.ranked:
            ranked.setdefault(seq.request_id, []).append(seq)
        delivered = set(deltas.request_ids)
        discarded += sum(1 for s in result.sampled_ids if s not in delivered)
        for d in deltas.deltas():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
    flush = core.plan(blocks.apply)
    if flush is not None:
        worker.execute(flush)
    return outputs, discarded


def swap_engine_kwargs(
    model_dir: str, num_blocks: int, swap_blocks: int = 0, max_model_len: int = 40, **overrides
) -> dict:
    """An engine of exactly `num_blocks` KV blocks of BS tokens (and `swap_blocks` of
    CPU swap space, preempting by swap), no tokenizer, no prefix caching unless asked."""
    per_block = kv_memory(model_dir, 1, BS)
    kw = dict(
        skip_tokenizer_init=True,
        block_size=BS,
        max_model_len=max_model_len,
        kv_cache_memory=per_block * num_blocks,
        enable_prefix_caching=False,
        seed=0,
    )
    if swap_blocks:
        kw |= dict(swap_space=per_block * swap_blocks / 1024**3, preemption_mode="swap")
    return kw | overrides
