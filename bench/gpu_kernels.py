"""The CUDA kernels on a GPU: paged decode attention (v1 and v2) against the device's copy
bandwidth and against torch SDPA over the same K/V stored contiguously, and where v2
starts to beat v1 (what `CudaKernels.paged_attention` should pick).

For each (batch, context): `batch` sequences of one query token, their contexts scattered
over a shuffled block pool, attended by v1, by v2 and by SDPA on a dense copy
`[B, kv_heads, context, head]`. Times are medians of CUDA-event-timed calls
(`triton.testing.do_bench` where triton is installed, else events by hand), the K/V bytes
read over that time beside a device-to-device copy's rate (bytes read + written). Each
point first checks v1 and v2 against SDPA. Also: prefill attention (causal, whole
prompts) and reshape_and_cache. With `--window W`: decode over long contexts with a
sliding window of W (the automatic v1/v2 pick) against the same contexts without one and
against SDPA over the last W tokens alone, and the cost of a soft cap and sinks.

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.json
    python bench/gpu_kernels.py --quick
    python bench/gpu_kernels.py --window 4096 --batch 1 32 --context 8192 32768 --no-prefill
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

BLOCK_SIZE = 16
PREFILL_POINTS = [(1, 512), (1, 2048), (8, 512), (4, 2048), (1, 8192)]  # (batch, prompt)
MAX_KV_BYTES = 20e9  # a point's paged K/V (its dense copy for SDPA doubles it)


def log(msg: str) -> None:
    print(f"[gpu_kernels] {msg}", file=sys.stderr, flush=True)


def median_ms(fn, repeats: int = 50) -> float:
    """Median milliseconds per call, timed with CUDA events after warm-up calls."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gb_s() -> float:
    """A 2 GiB device-to-device copy: bytes read plus written, per second."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms / 1e3) / 1e9


def decode_inputs(gen, batch, context, heads, kv_heads, head, dtype, device="cuda"):
    """`batch` sequences of `context` tokens scattered over a shuffled block pool (the
    CUDA kernels' layout) and one query token each: (key_cache, value_cache, tables
    [B, per_seq] int32, seq_lens [B] int32, query [B, H, D])."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=gen, device=device)
    tables = order[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head, generator=gen, device=device).to(dtype)
    return key_cache, value_cache, tables, seq_lens, query


def dense_kv(caches, tables, start: int, end: int) -> list:
    """Tokens [start, end) of every sequence in each cache, contiguous: [B, KVH, n, D]."""
    batch, per_seq = tables.shape
    dense = []
    for c in caches:  # [B, per_seq, BS, KVH, D] -> [B, KVH, per_seq * BS, D]
        rows = c[tables.long()].permute(0, 3, 1, 2, 4)
        rows = rows.reshape(batch, c.shape[2], per_seq * BLOCK_SIZE, c.shape[3])
        dense.append(rows[:, :, start:end].contiguous())
    return dense


def paged_case(kernels, batch, context, heads, kv_heads, head, dtype) -> dict:
    """One (batch, context) point: v1, v2 and contiguous SDPA, checked then timed."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100_003 + context)
    inputs = decode_inputs(gen, batch, context, heads, kv_heads, head, dtype)
    key_cache, value_cache, tables, seq_lens, query = inputs
    scale = head**-0.5
    k, v = dense_kv((key_cache, value_cache), tables, 0, context)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    gqa = heads != kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    expected = sdpa().squeeze(2).float()
    outs = {}
    for name in ("paged_attention_v1", "paged_attention_v2", "paged_attention"):
        out = torch.full_like(query, float("nan"))
        op = getattr(kernels, name)
        args = (out, query, key_cache, value_cache, tables, seq_lens, scale)
        kwargs = {} if name.endswith("v1") else {"max_seq_len": context}
        op(*args, **kwargs)
        torch.cuda.synchronize()
        error = ((out.float() - expected).norm() / expected.norm()).item()
        outs[name] = dict(ms=median_ms(lambda op=op, a=args, kw=kwargs: op(*a, **kw)), error=error)
    t_sdpa = median_ms(sdpa)
    kv_bytes = 2 * batch * context * kv_heads * head * key_cache.element_size()
    t1, t2 = outs["paged_attention_v1"]["ms"], outs["paged_attention_v2"]["ms"]
    return dict(
        batch=batch,
        context=context,
        v1_us=round(t1 * 1e3, 2),
        v2_us=round(t2 * 1e3, 2),
        sdpa_contiguous_us=round(t_sdpa * 1e3, 2),
        best_paged_over_sdpa=round(min(t1, t2) / t_sdpa, 3),
        v2_over_v1=round(t2 / t1, 3),
        auto_us=round(outs["paged_attention"]["ms"] * 1e3, 2),  # the v1/v2 rule's pick
        v1_gb_s=round(kv_bytes / (t1 / 1e3) / 1e9, 1),
        v2_gb_s=round(kv_bytes / (t2 / 1e3) / 1e9, 1),
        v1_rel_error=outs["paged_attention_v1"]["error"],
        v2_rel_error=outs["paged_attention_v2"]["error"],
    )


def window_case(kernels, batch, context, window, heads, kv_heads, head, dtype) -> dict:
    """Decode over `context` tokens with and without a window of `window`: checked against
    SDPA over the window's tokens, then timed; also a soft cap and sinks without a window."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context + window)
    inputs = decode_inputs(gen, batch, context, heads, kv_heads, head, dtype)
    key_cache, value_cache, tables, seq_lens, query = inputs
    scale = head**-0.5
    k, v = dense_kv((key_cache, value_cache), tables, context - window, context)
    q = query.unsqueeze(2)  # [B, H, 1, D]

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=heads != kv_heads)

    out = torch.full_like(query, float("nan"))
    args = (out, query, key_cache, value_cache, tables, seq_lens, scale, context)
    sinks = torch.randn(heads, generator=gen, device="cuda")
    variants = dict(
        full={},
        windowed=dict(sliding_window=window),
        soft_cap_and_sinks=dict(soft_cap=30.0, sinks=sinks),
    )
    kernels.paged_attention(*args, **variants["windowed"])
    expected = sdpa().squeeze(2).float()
    error = ((out.float() - expected).norm() / expected.norm()).item()
    times = {
        name: median_ms(lambda kw=kw: kernels.paged_attention(*args, **kw))
        for name, kw in variants.items()
    }
    t_sdpa = median_ms(sdpa)
    return dict(
        batch=batch,
        context=context,
        window=window,
        full_us=round(times["full"] * 1e3, 2),
        windowed_us=round(times["windowed"] * 1e3, 2),
        sdpa_over_window_us=round(t_sdpa * 1e3, 2),
        full_over_windowed=round(times["full"] / times["windowed"], 2),
        windowed_over_sdpa=round(times["windowed"] / t_sdpa, 3),
        soft_cap_and_sinks_over_full=round(times["soft_cap_and_sinks"] / times["full"], 3),
        windowed_rel_error=error,
    )


def prefill_case(kernels, batch, prompt, heads, kv_heads, head, dtype) -> dict:
    """Whole prompts of `prompt` tokens: paged prefill vs causal SDPA on dense tensors."""
    gen = torch.Generator(device="cuda").manual_seed(prompt + batch)
    per_seq = -(-prompt // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head)
    key = torch.randn(batch * prompt, kv_heads, head, generator=gen, device="cuda").to(dtype)
    value = torch.randn(batch * prompt, kv_heads, head, generator=gen, device="cuda").to(dtype)
    query = torch.randn(batch * prompt, heads, head, generator=gen, device="cuda").to(dtype)
    key_cache = torch.zeros(shape, dtype=dtype, device="cuda")
    value_cache = torch.zeros(shape, dtype=dtype, device="cuda")
    tables = torch.arange(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
    pos = torch.arange(prompt, device="cuda")
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    t_cache = median_ms(
        lambda: kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    )
    starts = torch.arange(0, (batch + 1) * prompt, prompt, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), prompt, dtype=torch.int32, device="cuda")
    out = torch.full_like(query, float("nan"))
    scale = head**-0.5
    args = (out, query, key_cache, value_cache, tables, starts, seq_lens, scale, prompt)

    q, k, v = (  # [B, H, prompt, D]
        x.view(batch, prompt, -1, head).transpose(1, 2) for x in (query, key, value)
    )

    def sdpa():
        return F.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=True, enable_gqa=heads != kv_heads
        )

    kernels.prefill_attention(*args)
    expected = sdpa().transpose(1, 2).reshape_as(out).float()
    error = ((out.float() - expected).norm() / expected.norm()).item()
    t_paged, t_sdpa = median_ms(lambda: kernels.prefill_attention(*args)), median_ms(sdpa)
    flops = 4 * batch * heads * head * prompt * prompt / 2  # causal: half the QK^T and PV
    return dict(
        batch=batch,
        prompt=prompt,
        prefill_us=round(t_paged * 1e3, 1),
        sdpa_causal_us=round(t_sdpa * 1e3, 1),
        prefill_over_sdpa=round(t_paged / t_sdpa, 3),
        prefill_tflop_s=round(flops / (t_paged / 1e3) / 1e12, 2),
        reshape_and_cache_us=round(t_cache * 1e3, 2),
        rel_error=error,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    p.add_argument("--no-prefill", action="store_true", help="decode attention only")
    p.add_argument(
        "--window", type=int, default=0, help="time these contexts with a sliding window too"
    )
    p.add_argument("--quick", action="store_true", help="batch 1 and 32, contexts 256 and 4096")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.context = [1, 32], [256, 4096]
    from cuda_ext.native_cuda import cuda_unavailable_reason, load_cuda_kernels

    kernels = load_cuda_kernels()
    if kernels is None:
        log(f"CUDA kernels unavailable: {cuda_unavailable_reason()}")
        return 1
    dtype = getattr(torch, a.dtype)
    shape = (a.heads, a.kv_heads, a.head_size, dtype)
    copy = copy_bandwidth_gb_s()
    log(f"device-to-device copy: {copy:.0f} GB/s")
    decode = []
    for batch in a.batch:
        for context in a.context:
            kv_bytes = 2 * batch * context * a.kv_heads * a.head_size * dtype.itemsize
            if kv_bytes > MAX_KV_BYTES:
                continue
            try:
                row = paged_case(kernels, batch, context, *shape)
            except Exception as exc:  # noqa: BLE001 - record it, time the other points
                log(f"decode batch {batch} context {context} failed: {exc}")
                decode.append(dict(batch=batch, context=context, error=str(exc)[:500]))
                continue
            row["best_of_copy_bandwidth"] = round(max(row["v1_gb_s"], row["v2_gb_s"]) / copy, 3)
            log(
                f"decode batch {batch:4d} context {context:6d}: v1 {row['v1_us']:8.1f} us "
                f"v2 {row['v2_us']:8.1f} us SDPA {row['sdpa_contiguous_us']:8.1f} us "
                f"({row['best_of_copy_bandwidth']:.0%} of copy bandwidth; rel errors "
                f"{row['v1_rel_error']:.1e} {row['v2_rel_error']:.1e})"
            )
            decode.append(row)
    windowed = []
    for batch in a.batch if a.window else []:
        for context in (c for c in a.context if c > a.window):
            try:
                row = window_case(kernels, batch, context, a.window, *shape)
            except Exception as exc:  # noqa: BLE001 - record it, time the other points
                row = dict(batch=batch, context=context, window=a.window, error=str(exc)[:500])
            log(f"window batch {batch} context {context}: {row}")
            windowed.append(row)
    prefill = []
    for batch, prompt in [] if a.no_prefill else PREFILL_POINTS:
        try:
            row = prefill_case(kernels, batch, prompt, *shape)
        except Exception as exc:  # noqa: BLE001 - record it, time the other points
            row = dict(batch=batch, prompt=prompt, error=str(exc)[:500])
        log(f"prefill batch {batch} prompt {prompt}: {row}")
        prefill.append(row)
    props = torch.cuda.get_device_properties(0)
    result = dict(
        command=invocation(__file__),
        device=props.name,
        multiprocessors=props.multi_processor_count,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        dtype=a.dtype,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_size=a.head_size,
        block_size=BLOCK_SIZE,
        copy_gb_s=round(copy, 1),
        decode=decode,
        windowed=windowed,
        prefill=prefill,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in result["decode"]}):
        rows = [r for r in result["decode"] if r["batch"] == batch and "error" not in r]
        ctx = [r["context"] for r in rows]
        axes[0].plot(
            ctx, [r["best_of_copy_bandwidth"] for r in rows], marker="o", label=f"B={batch}"
        )
        axes[1].plot(ctx, [r["v2_over_v1"] for r in rows], marker="o", label=f"B={batch}")
    axes[0].set_ylabel("best paged kernel, share of D2D copy bandwidth")
    axes[1].set_ylabel("v2 time / v1 time (< 1: v2 wins)")
    axes[1].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Paged decode attention on {result['device']}, {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
