"""Frozen, narrow configs. Each component receives only the config it needs.

`EngineArgs` (engine/engine_args.py) is the user-facing bag of keyword arguments (the
`LLM(...)` signature); `EngineArgs.build()` resolves it once into an `EngineConfig` of
narrow frozen parts. No torch here: the scheduler reads these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv_transfer.config import KVTransferConfig
from engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "native", "triton", "sdpa", "reference")
MAX_BLOCK_SIZE = 2048  # tokens per block (linear-attention states may need large pages)
LINEAR_KERNELS = ("auto", "onednn", "torch")
INPUT_PREPARATIONS = ("auto", "host", "device")


def layer_sliding_window(hf_config: Any, index: int) -> int | None:
    """Layer `index`'s sliding window (None: it sees the whole context), as transformers
    reads it: `layer_types` ("sliding_attention") where the config has them (Gemma,
    GPT-OSS, Qwen2 with use_sliding_window), else `sliding_window` on every layer
    (Mistral, Phi-3) unless `use_sliding_window` is false."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[index] == "sliding_attention" else None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def linear_attention_layers(hf_config: Any) -> tuple[int, ...]:
    """The layers `layer_types` marks "linear_attention" (Qwen 3.5, Qwen3-Next: Gated
    DeltaNet), which keep a recurrent state per sequence instead of K/V per token."""
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention")


def linear_attention_state_bytes(hf_config: Any, world_size: int = 1) -> tuple[int, int]:
    """One linear-attention layer's float32 state per sequence, in bytes, on one of
    `world_size` tensor-parallel ranks (each holds its share of the heads): (recurrent,
    convolution). Recurrent: the gated delta rule's [value heads, key dim, value dim];
    convolution: the last (kernel - 1) inputs of its [2 * keys + values] channels."""
    cfg = hf_config
    key_heads = cfg.linear_num_key_heads // world_size
    value_heads = cfg.linear_num_value_heads // world_size
    key_dim = key_heads * cfg.linear_key_head_dim
    value_dim = value_heads * cfg.linear_value_head_dim
    recurrent = value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * (cfg.linear_conv_kernel_dim - 1)
    return 4 * recurrent, 4 * conv


class Quantization(StrEnum):
    """How the linear layers hold their weights (`--quantization`, vLLM's spelling)."""

    NONE = "none"  # floats in the model's dtype (a GGUF's blocks dequantized at load)
    GGUF = "gguf"  # a GGUF's matrices kept in their blocks, multiplied by native kernels
    INT8 = "int8"  # a float checkpoint's linear weights quantized at load: 8-bit blocks
    Q4_0 = "q4_0"  # likewise, 4-bit blocks (llama.cpp's Q4_0)

    @property
    def at_load(self) -> bool:
        """Whether float weights are quantized while loading (int8, q4_0)."""
        return self in (Quantization.INT8, Quantization.Q4_0)


class KVCacheDtype(StrEnum):
    """What the KV cache stores (`--kv-cache-dtype`, vLLM's spelling; "fp8" means
    fp8_e4m3). The 8-bit kinds keep one byte per value and a float32 scale per (token,
    KV head) row (cuda_ext/kv_quant.py)."""

    AUTO = "auto"  # the model's dtype
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @classmethod
    def parse(cls, value: str | KVCacheDtype) -> KVCacheDtype:
        """The dtype a user's spelling names; ValueError listing the choices otherwise."""
        spelled = "fp8_e4m3" if value == "fp8" else value
        try:
            return cls(spelled)
        except ValueError:
            choices = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
            raise ValueError(f"kv_cache_dtype must be one of {choices}, got {value!r}") from None

    @property
    def is_8bit(self) -> bool:
        return self is not KVCacheDtype.AUTO


@dataclass(frozen=True)
class ModelConfig:
    """What the model code and loader need: the checkpoint, its HF config, dtype, length."""

    model: str  # local directory or hub id
    model_dir: str | None  # resolved local directory (None for dummy weights without files)
    hf_config: Any  # transformers.PretrainedConfig (never mutated after build)
    architecture: str  # e.g. "LlamaForCausalLM"
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    load_format: str
    seed: int
    quantization: Quantization = Quantization.NONE

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_hidden_layers", None) or cfg.n_layer)

    @property
    def num_attention_heads(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)

    @property
    def num_kv_heads(self) -> int:
        kv = getattr(self.hf_config, "num_key_value_heads", None)
        return int(kv) if kv else self.num_attention_heads

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window or None (`layer_sliding_window`)."""
        return tuple(layer_sliding_window(self.hf_config, i) for i in range(self.num_layers))

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """The model's KV cache groups by layer kind (engine/kv/kv_cache_groups.py)."""
        return KVCacheLayout.from_windows(
            self.sliding_windows, linear_attention_layers(self.hf_config)
        )

    def min_block_size(self, world_size: int = 1) -> int:
        """The smallest block size whose pages hold a linear-attention layer's state (a
        layer's K and V pages of one block, this rank's share of both; in multiples of 16
        tokens); 1 for models without such layers."""
        if not linear_attention_layers(self.hf_config):
            return 1
        heads = max(1, self.num_kv_heads // world_size)  # a share, or one replicated
        per_token = 2 * heads * self.head_size * self.dtype.itemsize
        state = sum(linear_attention_state_bytes(self.hf_config, world_size))
        return -(-state // (16 * per_token)) * 16

    @property
    def attention_features(self) -> frozenset[str]:
        """The optional attention features the model's layers use, named as
        `AttentionSpec.features` names them (backends that lack one are not chosen)."""
        cfg = self.hf_config
        named = (
            ("sliding window", any(w is not None for w in self.sliding_windows)),
            ("attention logit soft-capping", bool(getattr(cfg, "attn_logit_softcapping", None))),
            ("attention sinks", getattr(cfg, "model_type", None) == "gpt_oss"),
        )
        return frozenset(name for name, used in named if used)

    @property
    def head_size(self) -> int:
        cfg = self.hf_config
        head_dim = getattr(cfg, "head_dim", None)
        hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
        return int(head_dim) if head_dim else int(hidden) // self.num_attention_heads


class PreemptionMode(StrEnum):
    """What a preempted request's blocks become: freed and recomputed later, or copied
    to the CPU swap space and copied back."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class CacheConfig:
    """How large the paged KV cache is and how it is cut into blocks."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: the device's default (docs/serving.md)
    gpu_memory_utilization: float = 0.9  # CUDA without kv_cache_memory: fraction of memory
    enable_prefix_caching: bool = True  # reuse cached full blocks across requests
    swap_space: float = 0.0  # GiB of CPU memory for blocks of swapped-out sequences
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE  # SWAP needs swap_space
    cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # auto: the model's dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dtype", KVCacheDtype.parse(self.cache_dtype))
        if not 0.0 <= self.swap_space <= 1024.0:
            raise ValueError(f"swap_space must be in [0, 1024] GiB, got {self.swap_space}")
        if self.preemption_mode not in tuple(PreemptionMode):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if self.preemption_mode is PreemptionMode.SWAP and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory)")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's budgets: tokens per step, sequences per step, context length."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs, which attention backend it uses, whether the model's
    forward pass goes through `torch.compile` (off by default: measured no faster on
    CPU, see docs/performance.md), and which GEMM its linear layers run (`linear_kernel`:
    'auto' prepacks weights for oneDNN where it can, 'onednn' insists, 'torch' keeps
    torch's plain linear). `input_preparation`: where a step's model input is built,
    'host' (Python over the step's tokens) or 'device' (Triton kernels over buffers
    kept on the device: engine/worker/device_inputs.py); 'auto' is 'host' (on an H200
    the device path answered the same and built no step faster). Piecewise CUDA graphs
    (engine/worker/piecewise_graphs.py) run at the `cudagraph_capture_sizes` token
    counts when they are given and not `enforce_eager` (on the CPU the pieces are plain
    calls: the split and padding, checked)."""

    device: str = "cpu"
    attention_backend: str = "auto"
    compile_model: bool = False
    linear_kernel: str = "auto"
    input_preparation: str = "auto"
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(
                f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}"
            )
        if self.cudagraph_capture_sizes is not None:
            check_capture_sizes(self.cudagraph_capture_sizes)
        if self.input_preparation not in INPUT_PREPARATIONS:
            raise ValueError(
                f"input_preparation must be one of {INPUT_PREPARATIONS}, "
                f"got {self.input_preparation!r}"
            )


def check_capture_sizes(sizes) -> None:
    """ValueError unless `sizes` (cudagraph_capture_sizes) is a non-empty list of ints >= 1."""
    if not sizes or any(type(n) is not int or n < 1 for n in sizes):
        raise ValueError(
            f"cudagraph_capture_sizes must be a non-empty list of ints >= 1, got {sizes!r}"
        )


MAX_TENSOR_PARALLEL_SIZE = 64
EXPERT_DISPATCHES = ("all_reduce", "all_to_all")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks share one model (tensor parallelism within a stage, pipeline
    parallelism across stages), and where they meet:
    `distributed_address` is HOST:PORT of torch.distributed's TCP store, served by rank
    0's host; `init_method`, when set, overrides it (the launchers of ranks on one host
    set a `file://` rendezvous in a private directory)."""

    tensor_parallel_size: int = 1
    distributed_address: str | None = None
    distributed_init_method: str | None = None
    enable_expert_parallel: bool = False  # whole experts per rank (mixtures of experts)
    pipeline_parallel_size: int = 1  # stages, each a contiguous share of the layers
    pipeline_micro_batches: int = 0  # parts a step's rows split into (0: one per stage)
    context_parallel_size: int = 1  # ranks sharing each step's tokens (whole model each)
    # with expert parallelism: "all_reduce" (every rank routes every token) or
    # "all_to_all" (each rank's share of the tokens dispatched to the experts' ranks)
    expert_dispatch: str = "all_reduce"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
            size = getattr(self, name)
            if not isinstance(size, int) or not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
                raise ValueError(
                    f"{name} must be an integer in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {size!r}"
                )
        if not isinstance(self.pipeline_micro_batches, int) or self.pipeline_micro_batches < 0:
            raise ValueError(
                "pipeline_micro_batches must be an integer >= 0 (0: one per stage), "
                f"got {self.pipeline_micro_batches!r}"
            )
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise ValueError(
                f"expert_dispatch must be one of {EXPERT_DISPATCHES}, got {self.expert_dispatch!r}"
            )
        if self.context_parallel_size > 1 and self.world_size != self.context_parallel_size:
            raise ValueError(
                "context_parallel_size > 1 runs alone: tensor_parallel_size and "
                "pipeline_parallel_size must be 1 with it"
            )
        if self.world_size > MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size must be at most "
                f"{MAX_TENSOR_PARALLEL_SIZE} ranks, got {self.world_size}"
            )
        if self.distributed_address is not None:
            host, _, port = self.distributed_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    "distributed_address must be HOST:PORT with a port in [1, 65535], "
                    f"got {self.distributed_address!r}"
                )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size per stage, pipeline_parallel_size stages (or
        context_parallel_size ranks)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        return tp * pp * self.context_parallel_size

    @property
    def init_method(self) -> str:
        """torch.distributed's rendezvous URL."""
        if self.distributed_init_method is not None:
            return self.distributed_init_method
        if self.distributed_address is None:
            raise ValueError("more than one rank needs a distributed_address (HOST:PORT)")
        return f"tcp://{self.distributed_address}"


@dataclass(frozen=True)
class EngineConfig:
    """All narrow configs of one engine, built once by `EngineArgs.build()`."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    tokenizer: str | None  # tokenizer directory or hub id (None: the model's own)
    skip_tokenizer_init: bool = False
    chat_template: str | None = None  # Jinja text replacing the tokenizer's own
    parallel: ParallelConfig = ParallelConfig()
    # False: text in chat message content that spells a control token (`<|im_end|>`) is
    # encoded as that text, so a message cannot forge a turn; True: as the token
    parse_special_tokens_in_content: bool = False
    # the most output tokens one request may ask for: max_tokens x its sequences (None: no cap)
    max_tokens_per_request: int | None = None
    # compiled structured-output grammars kept per process (an LRU cache by constraint)
    grammar_cache_size: int = 128
    # draft tokens proposed and verified per step (None: no speculative decoding)
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # speculative.model's, for method draft_model
    # prefill/decode disaggregation: this instance's role and where it serves KV (None: off)
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        size = self.grammar_cache_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 65536:
            raise ValueError(f"grammar_cache_size must be an int in [1, 65536], got {size!r}")
        cap = self.max_tokens_per_request
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_tokens_per_request must be an int >= 1 or None, got {cap!r}")
