"""`EngineArgs`: the keyword arguments of `LLM(...)` and `pagedserve serve`, resolved
once by `build()` into the frozen `EngineConfig` (engine/config.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import uuid
from dataclasses import dataclass

from engine.config import (
    MAX_BLOCK_SIZE,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVCacheDtype,
    ParallelConfig,
    SchedulerConfig,
    linear_attention_layers,
)
from engine.kv_transfer.config import KVTransferConfig
from engine.speculative_config import SpeculativeConfig, SpeculativeMethod

logger = logging.getLogger(__name__)


def _num_experts(hf_config) -> int:
    """The experts of a mixture-of-experts config (0: a dense model)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", 0) or 0)


DEFAULT_SPECULATIVE_BATCH = 1  # drafts are verified only while one sequence runs


@dataclass(frozen=True)
class EngineArgs:
    """The keyword arguments of `LLM(...)`, with vLLM's names and defaults."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    quantization: str | None = None  # gguf | none | int8 | q4_0; None: gguf for a GGUF on CPU
    seed: int = 0
    device: str | None = None
    attention_backend: str = "auto"
    compile_model: bool = False
    linear_kernel: str = "auto"  # auto | onednn | torch: the linear layers' GEMM
    input_preparation: str = "auto"  # auto | host | device: where a step's input is built
    enforce_eager: bool = False  # no piecewise CUDA graphs
    cudagraph_capture_sizes: list[int] | None = None  # token counts graphs are captured at
    skip_tokenizer_init: bool = False
    chat_template: str | None = None  # a file or the Jinja text itself
    enable_prefix_caching: bool = True
    swap_space: float = 0.0  # GiB
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2 | int8
    preemption_mode: str = "recompute"
    tensor_parallel_size: int = 1  # ranks sharing the model (one worker process each)
    enable_expert_parallel: bool = False  # experts placed whole on the ranks, not sliced
    pipeline_parallel_size: int = 1  # stages of layers, tensor_parallel_size ranks each
    pipeline_micro_batches: int = 0  # parts of a step in flight across stages (0: one each)
    context_parallel_size: int = 1  # ranks splitting each step's tokens (whole model each)
    expert_dispatch: str = "all_reduce"  # or all_to_all: tokens sent to the experts' ranks
    distributed_executor_backend: str = "mp"  # mp: ranks as local processes; ray: Ray places
    distributed_address: str | None = None  # HOST:PORT of rank 0's torch.distributed store
    distributed_init_method: str | None = None  # set by launchers: a file:// rendezvous
    parse_special_tokens_in_content: bool = False  # chat content may spell control tokens
    max_tokens_per_request: int | None = None  # max_tokens x sequences, per request
    grammar_cache_size: int = 128  # compiled structured-output grammars kept (LRU)
    # {"method": "ngram", "num_speculative_tokens": k, ...} (or its JSON text); None: off
    speculative_config: dict | str | None = None
    # prefill/decode disaggregation, vLLM's {"kv_connector": ..., "kv_role": ...} (or its
    # JSON text, decoded at construction); None: this instance transfers no KV
    kv_transfer_config: dict | str | None = None

    def __post_init__(self) -> None:
        """kv_transfer_config's JSON text is decoded once, here, and one without an
        engine_id gets one now, so every process built from these args (the engine's,
        each worker's) names the same engine."""
        given = self.kv_transfer_config
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if isinstance(given, dict) and given.get("engine_id") is None:
            given = {**given, "engine_id": uuid.uuid4().hex}
        object.__setattr__(self, "kv_transfer_config", given)

    @property
    def world_size(self) -> int:
        """Ranks (worker processes) in all: tensor_parallel_size x pipeline_parallel_size
        x context_parallel_size."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        return tp * pp * self.context_parallel_size

    def build(self) -> EngineConfig:
        import torch  # here, not at import: the server's CLI imports this module first

        from engine.text.tokenizer import resolve_chat_template
        from engine.worker.model_loader import build_model_config  # loads model code: on demand
        from engine.worker.parallel.shardable import (
            check_context_parallel,
            check_shardable,
            check_stageable,
        )

        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_address=self.distributed_address,
            distributed_init_method=self.distributed_init_method,
            enable_expert_parallel=self.enable_expert_parallel,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pipeline_micro_batches=self.pipeline_micro_batches,
            context_parallel_size=self.context_parallel_size,
            expert_dispatch=self.expert_dispatch,
        )
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._check_executor()
        model_config = build_model_config(self, device)
        if self.enable_expert_parallel and not _num_experts(model_config.hf_config):
            raise ValueError(
                f"enable_expert_parallel: {model_config.architecture} has no experts to place"
            )
        check_shardable(model_config, parallel.tensor_parallel_size)
        check_stageable(model_config, parallel.pipeline_parallel_size)
        check_context_parallel(model_config, parallel.context_parallel_size)
        max_len = model_config.max_model_len
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or max(2048, self.max_num_seqs),
            max_model_len=max_len,
        )
        speculative = self._speculative(model_config)
        if speculative is not None and parallel.world_size > parallel.tensor_parallel_size:
            raise ValueError(
                "speculative_config: not supported with pipeline or context parallelism "
                "(drafts are verified by one rank's batch)"
            )
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                self._block_size(model_config, parallel.tensor_parallel_size),
                self.kv_cache_memory,
                self.gpu_memory_utilization,
                self.enable_prefix_caching,
                self.swap_space,
                self.preemption_mode,
                self._cache_dtype(model_config),
            ),
            scheduler=scheduler,
            device=DeviceConfig(
                device,
                self.attention_backend,
                self.compile_model,
                self.linear_kernel,
                self.input_preparation,
                self.enforce_eager,
                _sizes(self.cudagraph_capture_sizes),
            ),
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            chat_template=resolve_chat_template(self.chat_template),
            parallel=parallel,
            parse_special_tokens_in_content=self.parse_special_tokens_in_content,
            max_tokens_per_request=self.max_tokens_per_request,
            grammar_cache_size=self.grammar_cache_size,
            speculative=speculative,
            draft_model=self._draft_model(speculative, model_config, device, parallel),
            kv_transfer=self._kv_transfer(model_config, parallel),
        )

    def _kv_transfer(self, model_config, parallel: ParallelConfig) -> KVTransferConfig | None:
        """`kv_transfer_config`, parsed; refused where this instance cannot move its KV
        whole (several ranks, a hybrid cache layout, a foreign connector)."""
        if self.kv_transfer_config is None:
            return None
        config = KVTransferConfig.parse(self.kv_transfer_config)  # decoded in __post_init__
        problem = None
        if config.kv_connector != "PagedServeConnector":
            problem = (
                f"kv_connector {config.kv_connector!r} is not built here (PagedServeConnector)"
            )
        elif parallel.world_size > 1:
            problem = "one rank per instance (tensor_parallel_size and pipeline_parallel_size 1)"
        elif model_config.kv_cache_layout.is_hybrid:
            problem = "sliding-window or linear-attention layers share cache tensors"
        elif config.kv_role.produces and not config.kv_port:
            problem = "kv_port: a producer needs a fixed port (its answers tell decode instances)"
        if problem is not None:
            raise ValueError(f"kv_transfer_config: {problem}")
        return config

    def _speculative(self, model_config) -> SpeculativeConfig | None:
        """`speculative_config`, parsed; refused for what cannot verify drafts here.
        `disable_by_batch_size` defaults to 1: beside a second sequence, verifying drafts
        cost more than it saved on both devices measured (a CPU's integer kernels pay
        per row; a GPU step here is bound by its launches and the host's work per row):
        docs/speculative_decoding.md has the figures."""
        given = self.speculative_config
        if given is None:
            return None
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        spec = SpeculativeConfig.parse(given)
        if linear_attention_layers(model_config.hf_config):
            raise ValueError(
                f"speculative_config: {model_config.architecture}'s linear-attention layers "
                "keep one recurrent state per sequence, which rejected drafts would corrupt; "
                "speculative decoding is not supported for this model"
            )
        if spec.disable_by_batch_size is None:
            spec = dataclasses.replace(spec, disable_by_batch_size=DEFAULT_SPECULATIVE_BATCH)
        return spec

    def _check_executor(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend='ray' needs the `ray` package (pip install ray)"
            )

    def _draft_model(self, spec, target, device: str, parallel: ParallelConfig):
        """The draft model's config (method draft_model), checked against the target:
        the same vocabulary, one set of block tables (no hybrid layouts), one rank."""
        if spec is None or spec.method is not SpeculativeMethod.DRAFT_MODEL:
            return None
        from engine.worker.model_loader import build_model_config

        draft_args = dataclasses.replace(
            self, model=spec.model, quantization=None, speculative_config=None
        )
        draft = build_model_config(draft_args, device)
        problem = None
        if draft.vocab_size != target.vocab_size:
            problem = (
                f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
            )
        elif draft.kv_cache_layout.is_hybrid or target.kv_cache_layout.is_hybrid:
            problem = "sliding-window or linear-attention layers (several block tables)"
        elif parallel.tensor_parallel_size > 1:
            problem = "tensor parallelism (each rank would have to run the whole draft)"
        if problem is not None:
            raise ValueError(f"speculative_config: draft model {spec.model!r}: {problem}")
        return draft

    def _cache_dtype(self, model_config) -> KVCacheDtype:
        """`kv_cache_dtype`, refused for models whose pages hold linear-attention states
        (those are float32 recurrences, not rows of K/V)."""
        dtype = KVCacheDtype.parse(self.kv_cache_dtype)
        if dtype.is_8bit and linear_attention_layers(model_config.hf_config):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} cannot hold the linear-attention "
                f"states of {model_config.architecture}; use kv_cache_dtype='auto'"
            )
        return dtype

    def _block_size(self, model_config, world_size: int) -> int:
        """`block_size`, raised where a linear-attention layer's state needs bigger pages
        (vLLM raises the attention block size the same way for such models)."""
        need = model_config.min_block_size(world_size)
        if self.block_size >= need:
            return self.block_size
        if need > MAX_BLOCK_SIZE:
            raise ValueError(
                f"{model_config.architecture}'s linear-attention state needs pages of "
                f"{need} tokens, more than block_size's limit of {MAX_BLOCK_SIZE}"
            )
        logger.warning(
            "block_size raised from %d to %d: %s's linear-attention state must fit one page",
            self.block_size,
            need,
            model_config.architecture,
        )
        return need


def _sizes(sizes) -> tuple[int, ...] | None:
    """`cudagraph_capture_sizes` as given (a list or a tuple), as a tuple."""
    if sizes is None or isinstance(sizes, str | int):
        return sizes
    return tuple(sizes)
