"""The native CPU kernels (`cuda_ext/csrc/cpu`), behind thin wrappers that check arguments.

Use:

    from cuda_ext.native_cpu import NativeCpuOps

    ops = NativeCpuOps.load()  # a NativeCpuOps, or None where the kernels cannot run
    if ops is None:
        ok, reason = NativeCpuOps.available()  # (False, why); fall back to cuda_ext.reference

(`available()` is also a module-level function here.)

The first load on a machine compiles the kernels (about a minute, then cached; see
`cuda_ext.build`); a process loads them once. Every op writes into its output tensors
and returns None:

    ops.paged_attention_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                               sliding_window=0, soft_cap=0.0, sinks=None, kv_format=0)
    ops.paged_attention_prefill(out, query, key_cache, value_cache, block_tables,
                                query_start_loc, seq_lens, scale,
                                sliding_window=0, soft_cap=0.0, sinks=None, kv_format=0)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_format=0)
    ops.copy_blocks(key_caches, value_caches, block_mapping)
    ops.swap_blocks(src, dst, block_mapping)
    ops.rms_norm(out, x, weight, eps)
    ops.fused_add_rms_norm(x, residual, weight, eps)  # in place: both
    ops.silu_and_mul(out, gate_up)
    ops.rotary_embedding(positions, query, key, cos, sin)  # in place: query, key
    ops.quantized_matmul(out, x, blocks, qtype, k)  # out = x @ W.T, W in GGUF blocks

Layouts (one layer): key_cache, value_cache head-major, `[num_blocks, num_kv_heads,
block_size, head_size]`, contiguous (each KV head's rows of a block lie together, so
what one attention task reads is one contiguous run per block); a slot is `block_id *
block_size + offset`. `cuda_ext.reference` and the CUDA kernels take the token-major
house layout `[num_blocks, block_size, num_kv_heads, head_size]`;
`cuda_ext.reference.head_major()` turns one into the other. query/out/key/value rows
may be strided views, with unit stride in the last dim. Index tensors are int64 (block
tables int32 or int64), contiguous. Everything lives on the CPU. The attention
ops take float32 or bfloat16 (query, out and caches one dtype; math in float32); the copy
ops take any dtype their tensors share. The attention ops' optional features are
`cuda_ext.reference.paged_attention_reference`'s: a sliding window W (0: none; the blocks
wholly before a query's window are not read, so their block-table entries may be
anything), a logit soft cap c (0: none), and per-head sink logits (float32 [num_heads]).

8-bit caches (`cuda_ext.kv_quant`): `kv_format` 1, 2, 3 (a `KVRowCode`: int8,
float8_e4m3fn, float8_e5m2; 0, the default, is the float cache above) makes key_cache
and value_cache uint8 `[num_blocks, num_kv_heads, block_size, head_size + 4]`, each row
head_size one-byte codes and its float32 scale. reshape_and_cache codes float32 or
bfloat16 key/value rows into them (bit for bit `kv_quant.quantize_rows`); the attention
ops read them in place (query and out float32 or bfloat16), matching the float kernels
over the dequantized cache within float32 rounding. copy_blocks and swap_blocks move
whole rows, so the scales go with their codes.
The elementwise ops (rms_norm to rotary_embedding) take
float32 or bfloat16 rows `[num_tokens, d]` (query/key `[num_tokens, heads, head_size]`)
with unit last stride and rows that do not overlap. The math is `cuda_ext.reference`'s.
quantized_matmul takes x `[M, k]` float32 or bfloat16 (unit last stride), W as uint8
blocks `[N, row_bytes]` in ggml's layout of a `cuda_ext.quant_gemm.QuantType`, and writes
out `[M, N]` in x's dtype; by its `levels` it quantizes x per block (it matches the float
product within the activation's rounding) or decodes W into float panels (it matches it
within float sums' rounding); `cuda_ext.quant_gemm` holds the reference.

A bad argument raises ValueError naming it and what was expected. Data-dependent errors
(a block id outside the cache, a slot past its end, a context longer than its block
table row, query_start_loc going backwards) raise ValueError from the kernel before it
touches memory. The kernels release the GIL while they run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import torch

from cuda_ext.build import load_cpu_ops
from cuda_ext.kv_quant import SCALE_BYTES, KVRowCode
from cuda_ext.quant_blocks import BLOCK_SHAPES, QuantType, row_bytes

ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
BLOCK_TABLE_DTYPES = (torch.int32, torch.int64)


class NativeCpuOps:
    """The native CPU ops, each checking its arguments before the kernel runs."""

    def __init__(self, module: ModuleType) -> None:
        self._ops = module

    @classmethod
    def load(cls) -> NativeCpuOps | None:
        """The ops, compiled and loaded on first use; None where they cannot run."""
        result = load_cpu_ops()
        return None if result.module is None else cls(result.module)

    @property
    def unchecked(self) -> ModuleType:
        """The compiled ops without these wrappers' Python checks, for hot paths whose
        arguments are right by construction (the model's layer ops, called ~4 times a
        layer). Same signatures. Every kernel still checks structure (ranks, sizes,
        strides, dtypes, index ranges) and raises ValueError, never reading wild; only
        the messages are terser. Why: the checks cost 4-8 us a call where the fused
        kernels take about 1 us at batch 1 (docs/performance.md, "Fused layer ops")."""
        return self._ops

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether the ops load here, and the loader's reason (why not, or from where)."""
        result = load_cpu_ops()
        return result.ok, result.reason

    def paged_attention_decode(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_size]
        query: torch.Tensor,  # [num_seqs, num_heads, head_size], each sequence's last token
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 or int64
        seq_lens: torch.Tensor,  # [num_seqs] int64, context lengths including the query
        scale: float,
        *,
        sliding_window: int = 0,  # 0: none; W: keys at positions > seq_len - 1 - W
        soft_cap: float = 0.0,  # 0: none; c: logits -> c * tanh(logit / c)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits
        kv_format: int = 0,  # 0: float caches; a KVRowCode: 8-bit rows (+ 4: the scale)
    ) -> None:
        """One query token per sequence over its paged context (or window; GQA/MQA aware)."""
        kv_format = _check_kv_format(kv_format)
        _check_caches(key_cache, value_cache, kv_format, attention=True)
        _check_rows("query", query, key_cache, kv_format, is_query=True)
        _check_like("out", out, query)
        _check_block_tables(block_tables, query.shape[0])
        _check_index("seq_lens", seq_lens, (query.shape[0],))
        features = _check_features(sliding_window, soft_cap, sinks, query.shape[1])
        self._ops.paged_attention_decode(
            out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), *features,
            kv_format=kv_format,
        )  # fmt: skip

    def paged_attention_prefill(
        self,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
        query: torch.Tensor,  # [num_tokens, num_heads, head_size], sequences back to back
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 or int64
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int64, cumulative query lengths
        seq_lens: torch.Tensor,  # [num_seqs] int64, context lengths including the query
        scale: float,
        *,
        sliding_window: int = 0,  # 0: none; W: a query at p sees keys p - W < j <= p
        soft_cap: float = 0.0,  # 0: none; c: logits -> c * tanh(logit / c)
        sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits
        kv_format: int = 0,  # 0: float caches; a KVRowCode: 8-bit rows (+ 4: the scale)
    ) -> None:
        """Causal attention of each sequence's last q_len positions over its context.

        Query j of sequence i sits at position seq_lens[i] - q_len + j and sees keys at
        positions <= that (and, with a window W, > that - W); the chunk's own K/V must
        already be in the cache.
        """
        kv_format = _check_kv_format(kv_format)
        _check_caches(key_cache, value_cache, kv_format, attention=True)
        _check_rows("query", query, key_cache, kv_format, is_query=True)
        _check_like("out", out, query)
        _check_index("seq_lens", seq_lens, None)
        num_seqs = seq_lens.shape[0]
        _check_index("query_start_loc", query_start_loc, (num_seqs + 1,))
        _check_block_tables(block_tables, num_seqs)
        features = _check_features(sliding_window, soft_cap, sinks, query.shape[1])
        self._ops.paged_attention_prefill(
            out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
            float(scale), *features, kv_format=kv_format,
        )  # fmt: skip

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size (+ 4)]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 is padding, skipped
        *,
        kv_format: int = 0,  # 0: float caches; a KVRowCode: 8-bit rows (+ 4: the scale)
    ) -> None:
        """Writes each token's K and V rows into its slot (kv_format 1..3: coded, as
        `cuda_ext.kv_quant.quantize_rows`)."""
        kv_format = _check_kv_format(kv_format)
        _check_caches(key_cache, value_cache, kv_format, attention=False)
        _check_rows("key", key, key_cache, kv_format, is_query=False)
        _check_like("value", value, key)
        _check_index("slot_mapping", slot_mapping, (key.shape[0],))
        self._ops.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, kv_format=kv_format
        )

    def copy_blocks(
        self,
        key_caches: Sequence[torch.Tensor],  # per layer, blocks along dim 0
        value_caches: Sequence[torch.Tensor],  # per layer, the same shape and dtype
        block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src, dst) block ids
    ) -> None:
        """Copies block src to block dst in every layer's K and V cache, in one call.

        dst ids must be distinct and none of them a src (pairs run in parallel). Each
        layer's caches are checked in the kernel (no per-layer Python loop).
        """
        if not isinstance(key_caches, Sequence) or not isinstance(value_caches, Sequence):
            raise ValueError("key_caches and value_caches must be lists of tensors, one per layer")
        if len(key_caches) != len(value_caches):
            raise ValueError(
                f"key_caches has {len(key_caches)} layers but value_caches {len(value_caches)}"
            )
        _check_index("block_mapping", block_mapping, (None, 2))
        self._ops.copy_blocks(list(key_caches), list(value_caches), block_mapping)

    def swap_blocks(
        self,
        src: torch.Tensor,  # [src_blocks, ...] one cache
        dst: torch.Tensor,  # [dst_blocks, ...] another, the same block shape and dtype
        block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block)
    ) -> None:
        """Copies blocks of src into blocks of dst (swap out to or in from a CPU cache)."""
        for name, cache in (("src", src), ("dst", dst)):
            _check_cpu(name, cache)
            if cache.dim() < 1 or not cache.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous cache [num_blocks, ...]; got {_describe(cache)}"
                )
        if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
            raise ValueError(
                f"dst must have src's block shape and dtype ({_describe(src)}); "
                f"got {_describe(dst)}"
            )
        _check_index("block_mapping", block_mapping, (None, 2))
        self._ops.swap_blocks(src, dst, block_mapping)

    def rms_norm(
        self,
        out: torch.Tensor,  # [num_tokens, hidden_size]; may be x
        x: torch.Tensor,  # [num_tokens, hidden_size]
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> None:
        """out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the norm in float32."""
        _check_tokens("x", x, None)
        _check_tokens("out", out, x)
        _check_weight(weight, x)
        self._ops.rms_norm(out, x, weight, float(eps))

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size], a sublayer's output; overwritten
        residual: torch.Tensor,  # [num_tokens, hidden_size], the residual stream; updated
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> None:
        """In place: residual += x (rounded to the dtype); x = rms_norm(residual)."""
        _check_tokens("x", x, None)
        _check_tokens("residual", residual, x)
        if x.numel() and residual.data_ptr() == x.data_ptr():
            raise ValueError("residual must not be x: both are written")
        _check_weight(weight, x)
        self._ops.fused_add_rms_norm(x, residual, weight, float(eps))

    def silu_and_mul(
        self,
        out: torch.Tensor,  # [num_tokens, d]
        gate_up: torch.Tensor,  # [num_tokens, 2 * d]: [gate | up]
    ) -> None:
        """out = silu(gate) * up, rounded as torch's `F.silu(gate) * up`."""
        _check_tokens("gate_up", gate_up, None)
        if gate_up.shape[1] % 2:
            raise ValueError(
                f"gate_up must be [num_tokens, 2 * d] (an even last dim); got {_describe(gate_up)}"
            )
        shape = (gate_up.shape[0], gate_up.shape[1] // 2)
        if out.shape != shape:
            raise ValueError(f"out must be {list(shape)}; got {_describe(out)}")
        _check_tokens("out", out, None)
        if out.dtype != gate_up.dtype:
            raise ValueError(f"out must have gate_up's dtype {gate_up.dtype}; got {out.dtype}")
        self._ops.silu_and_mul(out, gate_up)

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [num_tokens] int64, each < max_positions
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]; rotated in place
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]; rotated in place
        cos: torch.Tensor,  # [max_positions, head_size], float32 or the query's dtype
        sin: torch.Tensor,  # [max_positions, head_size], cos's dtype
    ) -> None:
        """Rotate-half rotary of every query and key head at its token's position.

        Table rows repeat their angles in both halves (as `RotaryEmbedding` builds them);
        the kernel reads the first half. A position outside the tables raises ValueError.
        """
        _check_index("positions", positions, (None,))
        num_tokens = positions.shape[0]
        _check_heads("query", query, num_tokens, None)
        _check_heads("key", key, num_tokens, query)
        head_size = query.shape[2]
        for name, table in (("cos", cos), ("sin", sin)):
            _check_cpu(name, table)
            ok_dtype = table.dtype in (torch.float32, query.dtype)
            if table.dim() != 2 or table.shape[1] != head_size or not table.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous [max_positions, {head_size}]; "
                    f"got {_describe(table)}"
                )
            if not ok_dtype or table.dtype != cos.dtype or table.shape != cos.shape:
                raise ValueError(
                    f"{name} must be float32 or {query.dtype}, cos and sin alike; "
                    f"got cos {_describe(cos)}, sin {_describe(sin)}"
                )
        self._ops.rotary_embedding(positions, query, key, cos, sin)

    def quantized_matmul(
        self,
        out: torch.Tensor,  # [M, N], x's dtype
        x: torch.Tensor,  # [M, k] float32 or bfloat16
        blocks: torch.Tensor,  # [N, row_bytes(qtype, k)] uint8, W's rows in ggml blocks
        qtype: QuantType,
        k: int,
        levels: int = 2,
    ) -> None:
        """out = x @ W.T with W [N, k] kept quantized (see cuda_ext.quant_gemm); `levels`
        a `cuda_ext.quant_gemm.Method`: activations rounded to int8 once (1, llama.cpp's
        scheme) or twice (2), or not at all (W decoded into float panels multiplied by
        torch's mm, 0, or by oneDNN, -1, where torch has it)."""
        if levels not in (-1, 0, 1, 2):
            raise ValueError(f"levels must be -1, 0, 1 or 2 (a quant_gemm.Method); got {levels!r}")
        if levels == -1 and not torch.backends.mkldnn.is_available():
            raise ValueError("levels=-1 (oneDNN panels) needs torch built with oneDNN (mkldnn)")
        if qtype not in BLOCK_SHAPES:
            names = ", ".join(f"{t.name} ({t.value})" for t in QuantType)
            raise ValueError(f"qtype must be a ggml type id of {names}; got {qtype!r}")
        if not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive int; got {k!r}")
        _check_cpu("x", x)
        if x.dim() != 2 or x.shape[1] != k or x.dtype not in ATTENTION_DTYPES or not _rows_apart(x):
            raise ValueError(
                f"x must be [M, {k}] float32 or bfloat16 with unit last stride; "
                f"got {_describe(x)} with strides {x.stride()}"
            )
        _check_cpu("blocks", blocks)
        nbytes = row_bytes(qtype, k)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
            raise ValueError(
                f"blocks must be uint8 [N, {nbytes}] ({QuantType(qtype).name} rows of {k} "
                f"elements); got {_describe(blocks)}"
            )
        if not blocks.is_contiguous():
            raise ValueError(f"blocks must be contiguous; got {_describe(blocks)}")
        shape = (x.shape[0], blocks.shape[0])
        _check_cpu("out", out)
        if out.shape != shape or out.dtype != x.dtype or not _rows_apart(out):
            raise ValueError(
                f"out must be {list(shape)} {x.dtype} with unit last stride; got {_describe(out)}"
            )
        self._ops.quantized_matmul(out, x, blocks, int(qtype), k, levels)


available = NativeCpuOps.available


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else ", not contiguous"
    return f"{list(t.shape)} {t.dtype} on {t.device}{layout}"


def _check_cpu(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (native CPU kernels); got {t.device}")


def _check_kv_format(kv_format: int) -> int:
    """0 (a float cache) or a KVRowCode's value, as the kernels take it."""
    if isinstance(kv_format, bool) or not isinstance(kv_format, int) or not 0 <= kv_format <= 3:
        codes = ", ".join(f"{code.value} ({code.name})" for code in KVRowCode)
        raise ValueError(
            f"kv_format must be 0 (a float cache) or a KVRowCode, {codes}; got {kv_format!r}"
        )
    return int(kv_format)


def _check_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, kv_format: int, *, attention: bool
) -> None:
    row = "head_size + 4" if kv_format else "head_size"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cpu(name, cache)
        if cache.dim() != 4 or not cache.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous [num_blocks, num_kv_heads, block_size, {row}]; "
                f"got {_describe(cache)}"
            )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must match key_cache ({_describe(key_cache)}); "
            f"got {_describe(value_cache)}"
        )
    if kv_format and (key_cache.dtype != torch.uint8 or key_cache.shape[3] <= SCALE_BYTES):
        raise ValueError(
            f"key_cache must be uint8 [num_blocks, num_kv_heads, block_size, head_size + 4] "
            f"for kv_format={kv_format} ({KVRowCode(kv_format).name} codes and a float32 scale "
            f"per row); got {_describe(key_cache)}"
        )
    if not kv_format and attention and key_cache.dtype not in ATTENTION_DTYPES:
        hint = " (8-bit caches take kv_format 1, 2 or 3)" if key_cache.dtype == torch.uint8 else ""
        raise ValueError(
            f"key_cache has dtype {key_cache.dtype}, not supported on CPU: use float32 or "
            f"bfloat16{hint}"
        )


def _check_rows(
    name: str, t: torch.Tensor, key_cache: torch.Tensor, kv_format: int, *, is_query: bool
) -> None:
    """t: [num_tokens, heads, head_size] rows, unit last stride: of the cache's dtype
    (kv_format 0), or float32 / bfloat16 with cache rows head_size + 4 bytes wide (1..3);
    heads is a multiple of the cache's KV heads for a query, equal to them for K/V."""
    _check_cpu(name, t)
    _, num_kv_heads, _, head_size = key_cache.shape
    if kv_format:
        if t.dim() == 3 and head_size != t.shape[2] + SCALE_BYTES:
            raise ValueError(
                f"key_cache rows must be {name}'s head_size + 4 = {t.shape[2] + SCALE_BYTES} "
                f"bytes ({KVRowCode(kv_format).name} codes and a float32 scale); "
                f"got {_describe(key_cache)}"
            )
        head_size -= SCALE_BYTES
    if is_query:
        shape_ok = t.dim() == 3 and num_kv_heads > 0 and t.shape[1] % num_kv_heads == 0
        expected = f"[num_tokens, num_heads (a multiple of {num_kv_heads}), {head_size}]"
    else:
        shape_ok = t.dim() == 3 and t.shape[1] == num_kv_heads
        expected = f"[num_tokens, {num_kv_heads}, {head_size}]"
    if not shape_ok or t.shape[2] != head_size or t.stride(2) != 1:
        raise ValueError(f"{name} must be {expected} with unit last stride; got {_describe(t)}")
    if kv_format and t.dtype not in ATTENTION_DTYPES:
        raise ValueError(
            f"{name} must be float32 or bfloat16 over 8-bit caches (kv_format={kv_format}); "
            f"got {t.dtype}"
        )
    if not kv_format and t.dtype != key_cache.dtype:
        raise ValueError(f"{name} must have the caches' dtype {key_cache.dtype}; got {t.dtype}")


def _check_like(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    _check_cpu(name, t)
    if t.shape != like.shape or t.dtype != like.dtype or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {list(like.shape)} {like.dtype} with unit last stride; "
            f"got {_describe(t)}"
        )


def _check_features(
    sliding_window: int, soft_cap: float, sinks: torch.Tensor | None, num_heads: int
) -> tuple[int, float, torch.Tensor | None]:
    """The attention ops' optional features, checked, as the kernels take them."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(
            f"sliding_window must be an int (0: no window); got {type(sliding_window).__name__}"
        )
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: no window); got {sliding_window}")
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, int | float):
        raise ValueError(f"soft_cap must be a float (0: no cap); got {type(soft_cap).__name__}")
    if not math.isfinite(soft_cap) or soft_cap < 0:
        raise ValueError(f"soft_cap must be finite and >= 0 (0: no cap); got {soft_cap}")
    if sinks is not None:
        _check_cpu("sinks", sinks)
        if sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
            raise ValueError(
                f"sinks must be contiguous float32 [{num_heads}] (one logit per query head); "
                f"got {_describe(sinks)}"
            )
    return sliding_window, float(soft_cap), sinks


def _check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    _check_cpu("block_tables", block_tables)
    if (
        block_tables.dtype not in BLOCK_TABLE_DTYPES
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or not block_tables.is_contiguous()
    ):
        raise ValueError(
            f"block_tables must be contiguous [{num_seqs}, max_blocks] int32 or int64; "
            f"got {_describe(block_tables)}"
        )


def _check_index(name: str, t: torch.Tensor, shape: tuple[int | None, ...] | None) -> None:
    """t: contiguous int64 of `shape` (None: any 1-D; a None entry: any size there)."""
    _check_cpu(name, t)
    expected = shape or (None,)
    shape_ok = t.dim() == len(expected) and all(
        want is None or got == want for got, want in zip(t.shape, expected, strict=True)
    )
    if t.dtype != torch.int64 or not shape_ok or not t.is_contiguous():
        dims = ", ".join("n" if want is None else str(want) for want in expected)
        raise ValueError(f"{name} must be contiguous int64 [{dims}]; got {_describe(t)}")


def _rows_apart(t: torch.Tensor) -> bool:
    """Unit last stride, and rows (dim 0) that do not overlap: safe to write in parallel."""
    rows, cols = t.shape[0], t.shape[-1]
    return (cols <= 1 or t.stride(-1) == 1) and (rows <= 1 or t.stride(0) >= cols)


def _check_tokens(name: str, t: torch.Tensor, like: torch.Tensor | None) -> None:
    """t: [num_tokens, d] float32/bfloat16 rows (like `like`'s shape and dtype if given)."""
    _check_cpu(name, t)
    if like is not None and (t.shape != like.shape or t.dtype != like.dtype):
        raise ValueError(f"{name} must be {list(like.shape)} {like.dtype}; got {_describe(t)}")
    if t.dim() != 2 or t.dtype not in ATTENTION_DTYPES or not _rows_apart(t):
        raise ValueError(
            f"{name} must be [num_tokens, d] float32 or bfloat16 with unit last stride and "
            f"rows that do not overlap; got {_describe(t)} with strides {t.stride()}"
        )


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    _check_cpu("weight", weight)
    if weight.shape != x.shape[1:] or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous [{x.shape[1]}] {x.dtype} (x's hidden size and dtype); "
            f"got {_describe(weight)}"
        )


def _check_heads(name: str, t: torch.Tensor, num_tokens: int, query: torch.Tensor | None) -> None:
    """t: [num_tokens, heads, head_size] float32/bfloat16, head_size even (query's for a
    key), unit last stride, heads and tokens that do not overlap."""
    _check_cpu(name, t)
    head_size = query.shape[2] if query is not None else (t.shape[2] if t.dim() == 3 else 0)
    shape_ok = t.dim() == 3 and t.shape[0] == num_tokens and t.shape[2] == head_size
    if not shape_ok or head_size % 2 or t.dtype not in ATTENTION_DTYPES:
        size = head_size if query is not None else "head_size (even)"
        raise ValueError(
            f"{name} must be [{num_tokens}, heads, {size}] float32 or bfloat16; got {_describe(t)}"
        )
    if query is not None and t.dtype != query.dtype:
        raise ValueError(f"{name} must have the query's dtype {query.dtype}; got {t.dtype}")
    heads_apart = t.shape[1] <= 1 or t.stride(1) >= head_size
    tokens_apart = num_tokens <= 1 or t.stride(0) >= t.shape[1] * max(t.stride(1), head_size)
    if t.stride(2) != 1 or not heads_apart or not tokens_apart:
        raise ValueError(
            f"{name} must have unit last stride and heads that do not overlap; "
            f"got strides {t.stride()}"
        )
