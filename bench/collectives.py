"""What moving activations and KV between processes costs on this machine: the numbers
behind pipeline, expert and prefill/decode parallelism here.

Two ranks (processes, gloo over loopback, as the CPU tests run them) time, per hidden
size and token count: the all-reduce tensor parallelism does twice per layer, the
send/recv a pipeline stage boundary does once per step (hidden states [T, H]), and the
all-to-all an expert-parallel dispatch does twice per MoE layer (each token's hidden
state to its top-2 experts' rank and back). Then the KV one token occupies per model,
and the time to move a prompt's KV over ZeroMQ on loopback TCP (a P/D transfer).
Medians of `--repeats` timed calls after warm-up.

    python bench/collectives.py --out bench/results/collectives.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

# (name, hidden size, layers, KV heads, head size): SmolLM2-135M, Llama-3-8B, Llama-3-70B
MODELS = [
    ("SmolLM2-135M", 576, 30, 3, 64),
    ("Llama-3-8B", 4096, 32, 8, 128),
    ("Llama-3-70B", 8192, 80, 8, 128),
]
TOKENS = (1, 16, 256, 2048)
WARMUP = 3  # untimed calls before the timed ones


def log(msg: str) -> None:
    print(f"[collectives] {msg}", file=sys.stderr, flush=True)


def rank_main(rank: int, init: str, repeats: int, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = []
    for name, hidden, *_ in MODELS:
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden)  # float32 [T, H]

            def send_recv(x=x):
                if rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(x, 0)

            dispatched = torch.randn(2 * tokens, hidden)  # top-2 assignments, half each way
            out = torch.empty_like(dispatched)
            times = dict(
                all_reduce_ms=median_seconds(lambda x=x: dist.all_reduce(x), repeats, WARMUP) * 1e3,
                send_recv_ms=median_seconds(send_recv, repeats, WARMUP) * 1e3,
                all_to_all_ms=median_seconds(
                    lambda d=dispatched, o=out: dist.all_to_all_single(o, d), repeats, WARMUP
                )
                * 1e3,
            )
            if rank == 0:
                rows.append(dict(model=name, hidden=hidden, tokens=tokens) | {
                    k: round(v, 4) for k, v in times.items()
                })  # fmt: skip
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def kv_transfers(repeats: int) -> list[dict]:
    """Bytes of KV per token (bfloat16) and a 1,024-token prompt's transfer over ZeroMQ
    on loopback TCP."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    rows = []
    try:
        for name, _, layers, kv_heads, head in MODELS:
            per_token = 2 * layers * kv_heads * head * 2  # K and V, bfloat16
            payload = bytes(per_token * 1024)

            def move(payload=payload):
                push.send(payload, copy=False)
                pull.recv(copy=False)

            seconds = median_seconds(move, max(3, repeats // 10), WARMUP)
            rows.append(
                dict(
                    model=name,
                    kv_bytes_per_token=per_token,
                    prompt_tokens=1024,
                    transfer_ms=round(seconds * 1e3, 3),
                    gb_per_s=round(len(payload) / seconds / 1e9, 2),
                )
            )
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = [ctx.Process(target=rank_main, args=(r, init, a.repeats, results)) for r in (0, 1)]
        for proc in ranks:
            proc.start()
        collectives = results.get(timeout=600)
        for proc in ranks:
            proc.join(timeout=60)
    for row in collectives:
        log(row)
    transfers = kv_transfers(a.repeats)
    for row in transfers:
        log(row)
    result = dict(
        command=invocation(__file__),
        ranks="2 processes, gloo over loopback, float32 hidden states, 1 thread each",
        collectives=collectives,
        kv_transfers=transfers,
        machine=machine(),
    )
    write_report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
