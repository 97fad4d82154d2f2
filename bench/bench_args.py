"""Command-line arguments of `offline_throughput.py` (parent and per-system children)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offline_throughput.json"
QUICK_OUT = DEFAULT_OUT.with_name("offline_throughput_quick.json")


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--dataset", choices=["sharegpt", "alpaca"], default="sharegpt")
    p.add_argument(
        "--output-lengths",
        choices=["azure", "alpaca"],
        default="alpaca",
        help="where output lengths come from (default alpaca: random Alpaca "
        "answers for sharegpt prompts, the records' own answers for alpaca "
        "prompts; azure: the Azure conversation trace, ~4x more decode work)",
    )
    p.add_argument(
        "--max-output-len",
        type=int,
        default=None,
        help="cap every output length (default: no cap; 64 in --quick)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every system")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-memory",
        type=_parse_bytes,
        default=None,
        help="KV cache bytes for ours and hf_cb (e.g. 512M, 2G); default: enough "
        "for the max-num-seqs longest requests at once (no preemption)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        type=_int_list,
        default=None,
        help="static-batch sizes for HF generate (default 4,8,16; 4,16 in --quick)",
    )
    p.add_argument("--hf-cb-page-size", type=int, default=16)
    p.add_argument("--hf-cb-max-requests", type=int, default=16)
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=512)
    p.add_argument("--systems", type=_str_list, default=["ours", "hf_static", "hf_cb"])
    p.add_argument(
        "--check-requests",
        type=int,
        default=4,
        help="requests checked token-for-token against unbatched HF generate",
    )
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument(
        "--quick",
        action="store_true",
        help="16 prompts, outputs capped at 64 tokens, HF batch sizes 4 and 16: "
        "a smoke test (< 2 minutes)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plot", action="store_true")
    # Internal: one system in a child process.
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts = min(args.num_prompts, 16)
        args.max_output_len = args.max_output_len or 64
        args.hf_batch_sizes = args.hf_batch_sizes or [4, 16]
    args.hf_batch_sizes = args.hf_batch_sizes or [4, 8, 16]
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
