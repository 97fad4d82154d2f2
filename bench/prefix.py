"""Prefix caching on vs off: a shared few-shot prefix, and multi-turn chats.

    python bench/prefix.py --out bench/results/prefix.json   # the default run
    python bench/prefix.py --quick                           # smoke test

(a) Shared prefix (the paper's translation test): every request is one of two few-shot
    prefixes (80 and 340 tokens) followed by its own Alpaca prompt; the offline engine
    runs them all, caching on then off; output tokens/s and the prefix hit rate.
(b) Multi-turn chats: sessions of 3 to 8 turns run concurrently on the streaming
    `AsyncEngine` (actors, one step ahead); each turn's prompt is the previous prompt,
    its reply and a new user message (ShareGPT prompts, cut to --message-len tokens).
    Per turn: time to first token, the new tokens, the context length; caching on then
    off. Target: with caching, turn k's TTFT grows with its new tokens, not with the
    conversation's length.

The model is a dummy-weight 58M Llama (bench/systems.py's shape), float32, 2 threads;
token ids come from the Llama 2 tokenizer in ../shared.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import write_report  # noqa: E402
from systems import BLOCK_SIZE, MODEL_SHAPE, write_model  # noqa: E402
from workload import SHARED, SharedDataMissing, sample_workload, shared_path  # noqa: E402

TOKENIZER_DIR = SHARED / "tokenizers" / "llama2"


def log(msg: str) -> None:
    print(f"[prefix] {msg}", file=sys.stderr, flush=True)


def engine_kwargs(model_dir: str, caching: bool, args) -> dict:
    return dict(
        model=model_dir,
        tokenizer=str(TOKENIZER_DIR),
        block_size=BLOCK_SIZE,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=caching,
        seed=0,
    )


# ---------------------------------------------------------------- (a) shared prefix


def shared_prefix(model_dir: str, args) -> list[dict]:
    from engine import LLM, SamplingParams

    wl = sample_workload("alpaca", args.num_prompts, args.seed, 1024, max_output=args.max_output)
    rng = random.Random(args.seed)
    prefixes = {n: [rng.randrange(3, 32000) for _ in range(n)] for n in (80, 340)}
    rows = []
    for plen, prefix in prefixes.items():
        prompts = [prefix + p[1:] for p in wl.prompts]  # drop each prompt's BOS
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens
        ]
        for caching in (True, False):
            llm = LLM(**engine_kwargs(model_dir, caching, args), skip_tokenizer_init=True)
            # warm-up: one request with the prefix, which caching keeps (a system prompt
            # served before); requests admitted together in one step do not share yet
            llm.generate(prompts[:1], params[:1], use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            stats = llm.stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            row = {
                "prefix_len": plen,
                "caching": caching,
                "requests": len(prompts),
                "wall_s": round(wall, 2),
                "output_tok_s": round(tokens / wall, 1),
                "req_s": round(len(prompts) / wall, 2),
                "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 3),
            }
            rows.append(row)
            hits = row["prefix_hit_rate"]
            log(f"prefix {plen}, caching {caching}: {row['output_tok_s']} tok/s, hits {hits}")
    return rows


# ---------------------------------------------------------------- (b) multi-turn chats


def chat_sessions(args) -> list[list[list[int]]]:
    """Per session, its user messages (token ids, no BOS)."""
    wl = sample_workload("sharegpt", args.sessions * 8, args.seed, 4096)
    rng = random.Random(args.seed)
    messages = [p[1 : 1 + args.message_len] for p in wl.prompts]
    sessions, k = [], 0
    for _ in range(args.sessions):
        turns = rng.randint(3, args.max_turns)
        sessions.append(messages[k : k + turns])
        k += turns
    return sessions


async def run_chats(model_dir: str, caching: bool, sessions, args) -> list[dict]:
    from actors.async_engine import AsyncEngine
    from engine import EngineArgs, SamplingParams

    engine = await AsyncEngine.start(EngineArgs(**engine_kwargs(model_dir, caching, args)))
    params = SamplingParams(temperature=0, max_tokens=args.reply_len, ignore_eos=True)
    turns: list[dict] = []

    async def session(s: int, messages: list[list[int]]) -> None:
        context: list[int] = [1]  # BOS
        for t, message in enumerate(messages):
            prompt = context + message
            start = time.perf_counter()
            ttft, reply = None, []
            async for out in engine.generate(prompt, params, f"s{s}-t{t}-{caching}"):
                if out.token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                reply += out.token_ids
            turns.append(
                {
                    "session": s,
                    "turn": t,
                    "context_len": len(prompt),
                    "new_tokens": len(prompt) - len(context),
                    "ttft_ms": round(1000 * ttft, 2),
                    "e2e_ms": round(1000 * (time.perf_counter() - start), 2),
                    "reply_tokens": len(reply),
                }
            )
            context = prompt + reply

    try:
        await engine.generate([1, 2, 3], params, "warmup").__anext__()
        start = time.perf_counter()
        await asyncio.gather(*(session(i, m) for i, m in enumerate(sessions)))
        wall = time.perf_counter() - start
        stats = engine.stats()
    finally:
        await engine.shutdown()
    tokens = sum(t["reply_tokens"] for t in turns)
    summary = {
        "caching": caching,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "prefix_hit_rate": round(stats.prefix_cache_hit_rate, 3),
        "turns": sorted(turns, key=lambda t: (t["session"], t["turn"])),
    }
    rate, wall, hits = summary["output_tok_s"], summary["wall_s"], summary["prefix_hit_rate"]
    log(f"chats, caching {caching}: {rate} tok/s in {wall} s, hits {hits}")
    return summary


def per_turn(summary: dict) -> list[dict]:
    """Median TTFT, context and new tokens by turn index."""
    by_turn: dict[int, list[dict]] = {}
    for t in summary["turns"]:
        by_turn.setdefault(t["turn"], []).append(t)
    return [
        {
            "turn": k,
            "sessions": len(ts),
            "ttft_ms_p50": round(statistics.median(t["ttft_ms"] for t in ts), 2),
            "context_len_p50": statistics.median(t["context_len"] for t in ts),
            "new_tokens_p50": statistics.median(t["new_tokens"] for t in ts),
        }
        for k, ts in sorted(by_turn.items())
    ]


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON path (a PNG beside it)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--num-prompts", type=int, default=64, help="(a) requests per prefix")
    p.add_argument("--max-output", type=int, default=64, help="(a) output length cap")
    p.add_argument("--sessions", type=int, default=6, help="(b) concurrent chat sessions")
    p.add_argument("--max-turns", type=int, default=8, help="(b) turns: 3 to this")
    p.add_argument("--message-len", type=int, default=64, help="(b) user message tokens")
    p.add_argument("--reply-len", type=int, default=32, help="(b) reply tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.sessions, args.max_turns, args.max_output = 8, 2, 3, 16
    return args


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(2)
    try:
        shared_path("tokenizer")
        sessions = chat_sessions(args)
    except SharedDataMissing as exc:
        log(str(exc))
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.seed)
        prefix_rows = shared_prefix(tmp, args)
        chats = [asyncio.run(run_chats(tmp, c, sessions, args)) for c in (True, False)]
    report = {
        "command": " ".join(["python", "bench/prefix.py", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "model": {"random_weights": True, **MODEL_SHAPE},
        "shared_prefix": prefix_rows,
        "chats": {("on" if c["caching"] else "off"): {**c, "per_turn": per_turn(c)} for c in chats},
    }
    write_report(report, args.out, lambda png: plot(report, png))
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, color in (("on", "tab:green"), ("off", "tab:red")):
        turns = report["chats"][key]["turns"]
        b.scatter(
            [t["context_len"] for t in turns],
            [t["ttft_ms"] for t in turns],
            s=14,
            color=color,
            label=f"caching {key}",
        )
        pts = report["chats"][key]["per_turn"]
        a.plot(
            [p["turn"] + 1 for p in pts],
            [p["ttft_ms_p50"] for p in pts],
            "o-",
            color=color,
            label=f"caching {key}",
        )
    a.set_xlabel("turn")
    a.set_ylabel("TTFT p50 (ms)")
    a.set_title("multi-turn chats: TTFT per turn")
    b.set_xlabel("context length at the turn (tokens)")
    b.set_ylabel("TTFT (ms)")
    b.set_title("TTFT vs conversation length")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
