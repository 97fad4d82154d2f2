"""Native CUDA kernels for the paged KV cache, behind wrappers that check their arguments.

`load_cuda_kernels()` builds the extension from `csrc/cuda/` with
`torch.utils.cpp_extension.load` on first use (once per process) and returns a
`CudaKernels`, or None where it cannot: a torch without CUDA, no GPU, a failed build.
`cuda_unavailable_reason()` then says why (also logged, once).

Contract of every kernel: the house cache layout, one layer's key_cache and value_cache
`[num_blocks, block_size, num_kv_heads, head_size]` contiguous (a slot is
`block_id * block_size + offset`); float16, bfloat16 or float32 storage with float32
arithmetic; outputs written into tensors the caller allocates, on the current stream, with
no synchronization. Index tensors are int32 (block tables, sequence lengths, query start
offsets; `seq_lens` counts the context including this step's tokens), except slot and block
mappings, which are int64 as in `cuda_ext.reference`. Values inside index tensors live on
the device and are not checked (that would synchronize): out-of-range slots or block ids
are undefined behaviour, not errors.

The attention kernels take the optional features of
`cuda_ext.reference.paged_attention_reference` as keywords: `sliding_window` W (0: none;
a query at p sees keys p - W < j <= p, and no block wholly before the step's first window
is read, so those table entries may be anything), `soft_cap` (0: none) and `sinks`
(float32 `[num_heads]` on the query's device, or None). Without them the kernels compile
and run their plain path.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc" / "cuda"
SOURCES = (
    "reshape_and_cache.cu",
    "paged_attention_v1.cu",
    "paged_attention_v2.cu",
    "prefill_attention.cu",
    "copy_blocks.cu",
    "swap_blocks.cu",
    "bindings.cpp",
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_BLOCK_SIZES = (8, 16, 32)  # template instantiations of paged attention
MAX_HEAD_SIZE = 256  # kMaxHeadSize in launchers.h (64, 80, 96, 128 are specialized)
PARTITION_SIZE = 512  # kPartitionSize in launchers.h: context tokens per v2 thread block
ALIGNMENT = 16  # bytes: the kernels' widest vector load


GROUPED_HEADS = 4  # kMaxGroupedHeads in csrc/cuda/paged_attention.cuh
GROUPED_TOKEN_LANES = 8  # kTokenLanes in csrc/cuda/paged_attention_grouped.cuh


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_thread_blocks(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> int:
    """Thread blocks of one v1 decode launch, by the launcher's own rule: the grouped
    kernel (one block per KV head and slice of GROUPED_HEADS query heads) where it takes
    the head size, else one block per query head; times the sequences."""
    chunk = 16 // dtype.itemsize  # elements per 16-byte load
    if head_size in (64, 80, 96, 128) and head_size % (GROUPED_TOKEN_LANES * chunk) == 0:
        group = num_heads // num_kv_heads
        slices = 1 if group == 1 else cdiv(group, GROUPED_HEADS)
        return num_seqs * num_kv_heads * slices
    return num_seqs * num_heads


@functools.cache
def _load() -> tuple[CudaKernels | None, str | None]:
    if not torch.cuda.is_available():
        reason = (
            f"torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}): the native CUDA kernels need a GPU"
        )
        logger.info("CUDA kernels unavailable: %s", reason)
        return None, reason
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="pagedserve_cuda",
            sources=[str(CSRC / name) for name in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
        )
    except Exception as exc:  # the compiler's or linker's own message says what broke
        reason = f"building the CUDA kernels in {CSRC} failed: {exc}"
        logger.warning("CUDA kernels unavailable: %s", reason)
        return None, reason
    return CudaKernels(module), None


def load_cuda_kernels() -> CudaKernels | None:
    """The kernels, built on first use; None where they cannot run (see the reason)."""
    return _load()[0]


def cuda_unavailable_reason() -> str | None:
    """Why `load_cuda_kernels()` returns None; None when the kernels are available."""
    return _load()[1]


def _fail(name: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{name} must be {expected}; got {got}")


def _check(
    name: str,
    tensor: object,
    layout: str,
    shape: tuple[int | None, ...] | None,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None,
    *,
    contiguous: bool = True,
) -> torch.Tensor:
    """Shape (a None size matches any size; shape None, any shape of >= 1 dims), dtype,
    contiguity, then device. Device None means "any CUDA device": the first tensor of a
    call names the device for the rest."""
    if not isinstance(tensor, torch.Tensor):
        raise _fail(name, f"a torch.Tensor {layout}", type(tensor).__name__)
    if shape is None:
        shape = (None,) * max(1, tensor.dim())
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise _fail(name, f"{layout} = {wanted}", list(tensor.shape))
    if tensor.dtype not in dtypes:
        raise _fail(name, " or ".join(str(d) for d in dtypes), tensor.dtype)
    if contiguous and not tensor.is_contiguous():
        raise _fail(name, "contiguous (call .contiguous() on it)", f"strides {tensor.stride()}")
    if device is None and not tensor.is_cuda:
        raise _fail(name, "a CUDA tensor", f"device {tensor.device}")
    if device is not None and tensor.device != device:
        raise _fail(name, f"on {device}", tensor.device)
    return tensor


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    """[n, heads, head_size] whose rows may be strided (a view of a fused projection) but
    whose heads are contiguous and whose rows start 16-byte aligned."""
    if tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
        raise _fail(name, "contiguous within each token's heads", f"strides {tensor.stride()}")
    _check_aligned(name, tensor, tensor.stride(0))


def _check_aligned(name: str, tensor: torch.Tensor, row_stride: int | None = None) -> None:
    misaligned = tensor.data_ptr() % ALIGNMENT != 0
    if row_stride is not None:
        misaligned |= row_stride * tensor.element_size() % ALIGNMENT != 0
    if misaligned:
        raise _fail(name, f"{ALIGNMENT}-byte aligned (call .contiguous() on it)", "a view")


def _device_of(tensor: object) -> torch.device | None:
    """For arguments that may sit on either side (swap_blocks): their own device."""
    return tensor.device if isinstance(tensor, torch.Tensor) else None


def _check_head_size(head_size: int) -> None:
    if not 0 < head_size <= MAX_HEAD_SIZE:
        raise _fail("head_size", f"in 1..{MAX_HEAD_SIZE}", head_size)


def _check_attention_shapes(query: torch.Tensor, out: object, key_cache, value_cache) -> int:
    """query/out [n, num_heads, head_size] against the caches; returns the block size."""
    layout = "[num_tokens, num_heads, head_size]"
    _check("out", out, layout, tuple(query.shape), (query.dtype,), query.device)
    _check_rows("query", query)
    num_heads, head_size = query.shape[1], query.shape[2]
    _check_head_size(head_size)
    block_size, num_kv_heads, cache_head_size = _check_caches(
        key_cache, value_cache, query.dtype, query.device
    )
    if cache_head_size != head_size:
        raise _fail("key_cache", f"[*, *, *, {head_size}] like query", list(key_cache.shape))
    if num_heads % num_kv_heads != 0:
        raise _fail("query", f"a multiple of the {num_kv_heads} KV heads", f"{num_heads} heads")
    return block_size


def _check_caches(
    key_cache: object, value_cache: object, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int]:
    """Both caches in the house layout; returns (block_size, num_kv_heads, head_size)."""
    layout = "[num_blocks, block_size, num_kv_heads, head_size]"
    _check("key_cache", key_cache, layout, (None,) * 4, (dtype,), device)
    _check("value_cache", value_cache, layout, tuple(key_cache.shape), (dtype,), device)
    _check_aligned("key_cache", key_cache)
    _check_aligned("value_cache", value_cache)
    return key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]


class CudaKernels:
    """The CUDA kernels, each checking its arguments (ValueError naming the argument).

    Names and argument orders follow the vLLM kernels: outputs first, then inputs. Get
    one from `load_cuda_kernels()`.
    """

    def __init__(self, module: ModuleType) -> None:
        self._ops = module

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rows may be strided
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 is padding, skipped
    ) -> None:
        """Writes each token's K and V into its slot of the paged cache."""
        layout = "[num_tokens, num_kv_heads, head_size]"
        _check("key", key, layout, (None,) * 3, DTYPES, None, contiguous=False)
        shape = tuple(key.shape)
        _check("value", value, layout, shape, (key.dtype,), key.device, contiguous=False)
        _check_rows("key", key)
        _check_rows("value", value)
        _, num_kv_heads, head_size = _check_caches(key_cache, value_cache, key.dtype, key.device)
        if (num_kv_heads, head_size) != shape[1:]:
            raise _fail("key_cache", f"[*, *, {shape[1]}, {shape[2]}] like key", key_cache.shape)
        _check("slot_mapping", slot_mapping, "[num_tokens]", shape[:1], (torch.int64,), key.device)
        self._ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention_v1(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_size]
        query: torch.Tensor,  # [num_seqs, num_heads, head_size], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this token
        scale: float,
        *,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> None:
        """Decode attention (one query token per sequence), one pass over each context."""
        _check_decode(out, query, key_cache, value_cache, block_tables, seq_lens)
        features = _check_features(sliding_window, soft_cap, sinks, query)
        self._ops.paged_attention_v1(
            out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), *features
        )

    def paged_attention_v2(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_size]
        query: torch.Tensor,  # [num_seqs, num_heads, head_size], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this token
        scale: float,
        max_seq_len: int | None = None,  # >= max(seq_lens); None reads it (a device sync)
        *,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> None:
        """Decode attention with each context cut into PARTITION_SIZE-token partitions,
        attended in parallel and then combined; the float32 workspaces are allocated here."""
        _check_decode(out, query, key_cache, value_cache, block_tables, seq_lens)
        features = _check_features(sliding_window, soft_cap, sinks, query)
        max_seq_len = _max_seq_len(seq_lens, max_seq_len, block_tables, key_cache)
        caches = (key_cache, value_cache)
        self._v2(out, query, *caches, block_tables, seq_lens, scale, max_seq_len, features)

    def paged_attention(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_size]
        query: torch.Tensor,  # [num_seqs, num_heads, head_size], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this token
        scale: float,
        max_seq_len: int | None = None,  # >= max(seq_lens); None reads it (a device sync)
        *,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> None:
        """Decode attention: v2 when the attended span (the context, or the window) covers
        more than one PARTITION_SIZE partition and v1 would launch fewer thread blocks
        than the GPU has SMs, else v1. On an H200 that was the crossover
        (bench/gpu_kernels.py; docs/performance.md)."""
        _check_decode(out, query, key_cache, value_cache, block_tables, seq_lens)
        features = _check_features(sliding_window, soft_cap, sinks, query)
        max_seq_len = _max_seq_len(seq_lens, max_seq_len, block_tables, key_cache)
        span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        num_seqs, num_heads, head_size = query.shape
        blocks = decode_thread_blocks(
            num_seqs, num_heads, key_cache.shape[2], head_size, query.dtype
        )
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        caches = (key_cache, value_cache)
        if span <= PARTITION_SIZE or blocks >= sms:
            self._ops.paged_attention_v1(
                out, query, *caches, block_tables, seq_lens, float(scale), *features
            )
        else:
            self._v2(out, query, *caches, block_tables, seq_lens, scale, max_seq_len, features)

    def _v2(
        self,
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        max_seq_len,
        features,
    ):
        num_seqs, num_heads, head_size = query.shape
        partitions = max(1, cdiv(max_seq_len, PARTITION_SIZE))
        # float32 workspaces: [exp sums, max logits] per partition, and partial outputs.
        stats = torch.empty(2, num_seqs, num_heads, partitions, device=query.device)
        tmp_out = torch.empty(num_seqs, num_heads, partitions, head_size, device=query.device)
        self._ops.paged_attention_v2(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            float(scale),
            stats[0],
            stats[1],
            tmp_out,
            *features,
        )

    def prefill_attention(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
        query: torch.Tensor,  # [num_tokens, num_heads, head_size], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the queries
        scale: float,
        max_query_len: int | None = None,  # >= every query length; None reads it (a sync)
        *,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> None:
        """Causal attention of each sequence's new tokens, its last q_len positions (so
        seq_len >= q_len), over its paged context: any mix of prefill chunks and decodes."""
        layout = "[num_tokens, num_heads, head_size]"
        _check("query", query, layout, (None,) * 3, DTYPES, None, contiguous=False)
        _check_attention_shapes(query, out, key_cache, value_cache)
        _check("seq_lens", seq_lens, "[num_seqs]", (None,), (torch.int32,), query.device)
        num_seqs = seq_lens.shape[0]
        starts = (num_seqs + 1,)
        int32 = (torch.int32,)
        _check("query_start_loc", query_start_loc, "[num_seqs + 1]", starts, int32, query.device)
        _check_block_tables(block_tables, num_seqs, query.device)
        features = _check_features(sliding_window, soft_cap, sinks, query)
        if max_query_len is None:
            lens = query_start_loc[1:] - query_start_loc[:-1]
            max_query_len = int(lens.max()) if num_seqs else 0
        self._ops.prefill_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            int(max_query_len),
            float(scale),
            *features,
        )

    def copy_blocks(
        self,
        key_caches: Sequence[torch.Tensor],  # per layer: [num_blocks, ...] contiguous
        value_caches: Sequence[torch.Tensor],  # per layer: like key_caches
        block_mapping: torch.Tensor,  # [num_copies, 2] int64 (src, dst), the caches' device
    ) -> None:
        """Copy-on-write: block src -> dst in every layer's K and V cache, in one launch."""
        if len(key_caches) == 0 or len(value_caches) != len(key_caches):
            raise _fail(
                "value_caches",
                f"one cache per layer, like key_caches ({len(key_caches)} layers, at least 1)",
                len(value_caches),
            )
        first = _check("key_caches[0]", key_caches[0], "[num_blocks, ...]", None, DTYPES, None)
        for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
            for i, cache in enumerate(caches):
                like = "like key_caches[0]"
                _check(f"{name}[{i}]", cache, like, first.shape, (first.dtype,), first.device)
                _check_aligned(f"{name}[{i}]", cache)
        pairs, int64 = (None, 2), (torch.int64,)
        _check("block_mapping", block_mapping, "[num_copies, 2]", pairs, int64, first.device)
        if block_mapping.shape[0] == 0:
            return
        block_bytes = first[0].numel() * first.element_size()
        key_ptrs = _addresses(tuple(c.data_ptr() for c in key_caches), first.device)
        value_ptrs = _addresses(tuple(c.data_ptr() for c in value_caches), first.device)
        self._ops.copy_blocks(key_ptrs, value_ptrs, block_mapping, block_bytes)

    def swap_blocks(
        self,
        src: torch.Tensor,  # one layer's K or V cache [num_blocks, ...], CUDA or pinned CPU
        dst: torch.Tensor,  # the same block shape on the other side
        block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst) block ids, on CPU
    ) -> None:
        """Copies block src -> dst between a CUDA cache and a pinned CPU cache (either
        way), one async copy per block on the current stream: synchronize before reading
        a swapped-out block on the CPU or overwriting the CPU side of a swap-in."""
        _check("src", src, "[num_blocks, ...]", None, DTYPES, _device_of(src))
        block_shape = (None, *src.shape[1:])
        _check("dst", dst, "[num_blocks, ...] like src", block_shape, (src.dtype,), _device_of(dst))
        for name, tensor in (("src", src), ("dst", dst)):
            if not tensor.is_cuda and not tensor.is_pinned():
                raise _fail(name, "on CUDA or in pinned CPU memory (.pin_memory())", tensor.device)
        if not (src.is_cuda or dst.is_cuda):
            raise _fail("dst", "on CUDA when src is on the CPU", dst.device)
        if src.is_cuda and dst.is_cuda and src.device != dst.device:
            raise _fail("dst", f"on {src.device} or the CPU", dst.device)
        cpu = torch.device("cpu")
        _check("block_mapping", block_mapping, "[num_pairs, 2]", (None, 2), (torch.int64,), cpu)
        if block_mapping.shape[0] == 0:
            return
        for column, name, cache in ((0, "src", src), (1, "dst", dst)):
            low, high = int(block_mapping[:, column].min()), int(block_mapping[:, column].max())
            if low < 0 or high >= cache.shape[0]:
                raise _fail(
                    "block_mapping", f"{name} block ids in [0, {cache.shape[0]})", [low, high]
                )
        self._ops.swap_blocks(src, dst, block_mapping)


def _check_features(
    sliding_window: int, soft_cap: float, sinks: torch.Tensor | None, query: torch.Tensor
) -> tuple[int, float, torch.Tensor | None]:
    """The attention kernels' optional features, checked, as the bindings take them."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise _fail("sliding_window", "an int (0: no window)", type(sliding_window).__name__)
    if not 0 <= sliding_window <= 2**31 - 1:
        raise _fail("sliding_window", "in 0..2**31 - 1 (0: no window)", sliding_window)
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, int | float):
        raise _fail("soft_cap", "a float (0: no cap)", type(soft_cap).__name__)
    if not math.isfinite(soft_cap) or soft_cap < 0:
        raise _fail("soft_cap", "finite and >= 0 (0: no cap)", soft_cap)
    if sinks is not None:
        heads = (query.shape[1],)
        _check("sinks", sinks, "[num_heads]", heads, (torch.float32,), query.device)
    return sliding_window, float(soft_cap), sinks


def _check_block_tables(block_tables: object, num_seqs: int, device: torch.device) -> None:
    layout = "[num_seqs, max_blocks_per_seq]"
    _check("block_tables", block_tables, layout, (num_seqs, None), (torch.int32,), device)


def _check_decode(out, query, key_cache, value_cache, block_tables, seq_lens) -> None:
    layout = "[num_seqs, num_heads, head_size]"
    _check("query", query, layout, (None,) * 3, DTYPES, None, contiguous=False)
    block_size = _check_attention_shapes(query, out, key_cache, value_cache)
    if block_size not in DECODE_BLOCK_SIZES:
        raise _fail("key_cache", f"blocks of {DECODE_BLOCK_SIZES} tokens", block_size)
    num_seqs = query.shape[0]
    _check_block_tables(block_tables, num_seqs, query.device)
    _check("seq_lens", seq_lens, "[num_seqs]", (num_seqs,), (torch.int32,), query.device)


def _max_seq_len(
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int | None,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    key_cache: torch.Tensor,  # [num_blocks, block_size, ...]
) -> int:
    """The caller's bound on the contexts (or the true one: a device sync), checked against
    the block tables' width."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    room = block_tables.shape[1] * key_cache.shape[1]
    if max_seq_len > room:
        raise _fail(
            "block_tables",
            f"wide enough for max_seq_len = {max_seq_len} tokens",
            f"{block_tables.shape[1]} blocks of {key_cache.shape[1]} ({room} tokens)",
        )
    return max_seq_len


@functools.lru_cache(maxsize=8)
def _addresses(pointers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The caches' addresses as a device int64 array. The engine's caches live as long as
    it does, so each set is uploaded once, not every step."""
    return torch.tensor(pointers, dtype=torch.int64, device=device)
