"""`pagedserve` command line. `generate` runs an offline batch through `engine.LLM`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

DEFAULT_PROMPTS = ("Once upon a time", "The little dog", "Lily and Ben went to the park")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF directory or hub id")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--seed", type=int, default=0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_PROMPTS})")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    return parser


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "load_format": args.load_format,
        "seed": args.seed,
    }


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    start = time.perf_counter()
    outputs = llm.generate(list(args.prompts or DEFAULT_PROMPTS), params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            print(
                json.dumps({"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason})
            )
        else:
            print(f"--- {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text}")
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {n} tokens in {elapsed:.2f}s", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _generate(args)
    except ValueError as exc:  # configuration errors: one clear line, no traceback
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
