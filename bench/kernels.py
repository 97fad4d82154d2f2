"""Does paging cost anything? Paged decode attention (the native kernel reading K/V
through block tables) vs torch SDPA over the same K/V stored contiguously.

For each batch size and context length: B sequences of one query token each, their
contexts scattered over a shuffled block pool (block size 16), attended by
`paged_attention_decode`; the same K/V laid out `[B, kv_heads, context, head]` and
attended by `scaled_dot_product_attention`. Median time per call of many; the ratio
paged / contiguous is what the paper's Fig. 18a measured (its kernel paid 20-26%).
On a GPU, bench/gpu_kernels.py measures the CUDA kernels the same way.

    python bench/kernels.py --out bench/results/kernels.json
    python bench/kernels.py --quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

from engine.worker.huge_pages import zeros_on_huge_pages  # noqa: E402

BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[kernels] {msg}", file=sys.stderr, flush=True)


def case(ops, batch: int, context: int, heads: int, kv_heads: int, head: int, dtype, repeats):
    """One (batch, context) point: paged native vs contiguous SDPA, seconds per call."""
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head)  # the CPU kernels' head-major layout
    # Both layouts on 2 MiB pages, as the engine allocates its CPU cache.
    key_cache = zeros_on_huge_pages(shape, dtype).copy_(torch.randn(shape, generator=gen))
    value_cache = zeros_on_huge_pages(shape, dtype).copy_(torch.randn(shape, generator=gen))
    tables = torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq].view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch, heads, head, generator=gen).to(dtype)
    out = torch.empty_like(query)
    scale = head**-0.5

    def paged():
        ops.paged_attention_decode(out, query, key_cache, value_cache, tables, seq_lens, scale)

    # The same K/V, contiguous per sequence and head: [B, KVH, context, D].
    k, v = (  # [B, per_seq, KVH, BS, D] -> [B, KVH, context, D]
        c[tables]
        .transpose(1, 2)
        .reshape(batch, kv_heads, per_seq * BLOCK_SIZE, head)[:, :, :context]
        for c in (key_cache, value_cache)
    )
    dense_shape = (batch, kv_heads, context, head)
    k, v = (zeros_on_huge_pages(dense_shape, dtype).copy_(x) for x in (k, v))
    q = query.unsqueeze(2)  # [B, H, 1, D]

    def contiguous():
        F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=heads != kv_heads)

    paged()
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=heads != kv_heads)
    error = (out.float() - expected.squeeze(2).float()).abs().max().item()
    t_paged, t_dense = median_seconds(paged, repeats), median_seconds(contiguous, repeats)
    kv_bytes = 2 * batch * context * kv_heads * head * key_cache.element_size()
    return dict(
        batch=batch,
        context=context,
        paged_us=round(t_paged * 1e6, 1),
        contiguous_sdpa_us=round(t_dense * 1e6, 1),
        paged_over_contiguous=round(t_paged / t_dense, 3),
        paged_gb_s=round(kv_bytes / t_paged / 1e9, 2),
        max_abs_error=error,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="batch 1 and 32, contexts 128 and 1024")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.context, a.repeats = [1, 32], [128, 1024], 5
    torch.set_num_threads(a.threads)
    from cuda_ext.native_cpu import NativeCpuOps

    ops = NativeCpuOps.load()
    _, reason = NativeCpuOps.available()
    if ops is None:
        log(f"native CPU kernels unavailable: {reason}")
        return 1
    dtype = getattr(torch, a.dtype)
    rows = []
    for batch in a.batch:
        for context in a.context:
            row = case(ops, batch, context, a.heads, a.kv_heads, a.head_size, dtype, a.repeats)
            log(
                f"batch {batch:4d} context {context:5d}: paged {row['paged_us']:9.1f} us, "
                f"contiguous SDPA {row['contiguous_sdpa_us']:9.1f} us "
                f"(x{row['paged_over_contiguous']:.2f})"
            )
            rows.append(row)
    result = dict(
        command=invocation(__file__),
        device="cpu",
        threads=a.threads,
        dtype=a.dtype,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_size=a.head_size,
        block_size=BLOCK_SIZE,
        kernels=reason,
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for batch in sorted({r["batch"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["batch"] == batch]
        ax.plot(
            [r["context"] for r in rows],
            [r["paged_over_contiguous"] for r in rows],
            marker="o",
            label=f"batch {batch}",
        )
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("paged native / contiguous SDPA (time)")
    ax.set_title(f"Paged decode attention cost, CPU {result['threads']} threads, {result['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
