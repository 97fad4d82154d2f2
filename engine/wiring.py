"""The one wiring factory: an engine's core, block tables, limits and text processor.

`AsyncEngine.start`, the offline `LLM`, `bench/control_plane.py` and the tests build
their engines here, from the engine config and the worker's `WorkerReady` (the values
only known once the worker has loaded the model and sized the KV cache).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from engine.config import EngineConfig, PreemptionMode, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.lookahead_policy import LookaheadPolicy
from engine.core.stats import MemoryReport
from engine.kv.block_ledger import BlockLedger, HybridBlockLedger
from engine.kv.block_manager import BlockManager, block_tables_for
from engine.kv.block_tables import BlockTables
from engine.kv_transfer.config import KVTransferConfig
from engine.messages import WorkerReady
from engine.speculative_config import SpeculativeConfig
from engine.text.request_validation import RequestLimits
from engine.text.text_processor import TextProcessor
from engine.text.tokenizer import Tokenizer, load_tokenizer
from engine.worker.grammar.backend import build_backend
from engine.worker.grammar.checker import GrammarChecker


@dataclass(frozen=True)
class EngineParts:
    """One engine's pure-logic pieces (the request limits are `processor.limits`).
    `block_manager` holds the authoritative block
    tables when they live in a block-manager actor (the core then plans on a
    `BlockLedger` replica of them); None when the core's own tables are the real ones."""

    core: EngineCore
    processor: TextProcessor
    block_manager: BlockManager | None


def build_core(
    scheduler: SchedulerConfig,
    blocks: BlockTables,
    eos_token_ids: frozenset[int] = frozenset(),
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
    attention_backend: str = "",
    memory: MemoryReport | None = None,
    speculative: SpeculativeConfig | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> EngineCore:
    """The one place an `EngineCore` is built: for the engines (`build_engine`) and for
    the simulator (`engine.sim`, its block tables paged or contiguous)."""
    lookahead = None
    if speculative is not None:
        lookahead = LookaheadPolicy(
            speculative.num_speculative_tokens, max_batch=speculative.disable_by_batch_size
        )
    return EngineCore(
        scheduler,
        blocks,
        eos_token_ids,
        preemption_mode,
        attention_backend,
        memory,
        lookahead,
        kv_transfer,
    )


def build_engine(
    config: EngineConfig,
    ready: WorkerReady,
    with_block_manager: bool = False,
    tokenizer: Tokenizer | None = None,
) -> EngineParts:
    """The engine for `config` on a worker that announced `ready`. The tokenizer is
    `load_engine_tokenizer(config)` unless given."""
    cache, model = config.cache, config.model
    tables = {
        "num_blocks": ready.num_blocks,
        "block_size": ready.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "num_cpu_blocks": ready.num_cpu_blocks,
    }
    layout = model.kv_cache_layout
    if not with_block_manager:
        blocks = block_tables_for(layout=layout, **tables)
    elif layout.is_hybrid:
        blocks = HybridBlockLedger(layout=layout, **tables)
    else:
        blocks = BlockLedger(**tables)
    core = build_core(
        config.scheduler,
        blocks,
        model.eos_token_ids,
        cache.preemption_mode,
        ready.attention_backend,
        MemoryReport.from_ready(ready),
        config.speculative,
        config.kv_transfer,
    )
    if tokenizer is None:
        tokenizer = load_engine_tokenizer(config)
    limits = RequestLimits(
        ready.vocab_size,
        ready.max_model_len,
        model.eos_token_ids,
        tokenizer is not None,
        ready.num_blocks,
        ready.block_size,
        config.scheduler.max_num_seqs,
        max_tokens_per_request=config.max_tokens_per_request,
        kv_layout=layout,
        max_chunk=config.scheduler.max_num_batched_tokens,
        kv_role=config.kv_transfer.kv_role if config.kv_transfer is not None else None,
    )
    manager = BlockManager(layout=layout, **tables) if with_block_manager else None
    grammar_backend = functools.partial(
        build_backend, tokenizer, ready.vocab_size, model.eos_token_ids
    )
    checker = GrammarChecker(grammar_backend, config.grammar_cache_size)
    processor = TextProcessor(tokenizer, limits, checker.check)
    return EngineParts(core, processor, manager)


def load_engine_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The tokenizer `config` names (its own path, else the model's directory); None
    with `skip_tokenizer_init`. Callers that can load it while the worker starts (it
    needs no `WorkerReady`) pass it to `build_engine`."""
    if config.skip_tokenizer_init:
        return None
    hf_tokenizer = load_tokenizer(config.tokenizer or config.model.model_dir)
    return Tokenizer(
        hf_tokenizer,
        chat_template=config.chat_template,
        parse_special_tokens_in_content=config.parse_special_tokens_in_content,
    )
