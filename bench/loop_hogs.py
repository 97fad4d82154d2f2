"""How much a token stream slows while hostile requests are refused beside it.

Starts `pagedserve serve` (built-in model), then rounds of: a 1,500-token WebSocket
stream alone, and one beside three hostile requests sent at its first token (80,000 stop
strings, a megabyte of prompt, a header announcing a 200 MiB body; each must come back
400). The ratio is each stream's first-to-last-token time beside them over the mean of
the streams alone around it; the median is the figure (target below 1.10). The test
suite checks only that nothing stalls (tests/web/test_loop_hogs.py).

    python bench/loop_hogs.py --out bench/results/loop_hogs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import httpx  # noqa: E402
import websockets  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from web.launch import ServerProcess  # noqa: E402

STREAM = {"max_tokens": 1500, "ignore_eos": True}
STOPS = json.dumps({"prompt": "x", "stop": ["stop-word"] * 80_000}).encode()
PROMPT = json.dumps({"prompt": "word " * 200_000}).encode()
HUGE_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 209715200\r\n\r\n{"


def log(msg: str) -> None:
    print(f"[loop_hogs] {msg}", file=sys.stderr, flush=True)


async def stream_seconds(url: str, streaming: asyncio.Event | None = None) -> float:
    """First-to-last-token seconds of one stream; `streaming` is set at its first token."""
    async with websockets.connect(f"{url}/v1/stream") as ws:
        message = {"type": "generate", "id": "s", "prompt": "Once", "params": STREAM}
        await ws.send(json.dumps(message))
        first = last = None
        async with asyncio.timeout(120):
            while json.loads(await ws.recv())["type"] != "done":
                last = time.monotonic()
                first = first or last
                if streaming is not None:
                    streaming.set()
    return last - first


def huge_body_status(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HUGE_HEAD)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    return reply.decode("latin-1").split("\r\n", 1)[0]


async def hostile(http: str, port: int) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        url = f"{http}/v1/completions"
        stops, prompt, head = await asyncio.gather(
            client.post(url, content=STOPS),
            client.post(url, content=PROMPT),
            asyncio.to_thread(huge_body_status, port),
        )
    statuses = (stops.status_code, prompt.status_code, head)
    if statuses != (400, 400, "HTTP/1.1 400 Bad Request"):
        raise SystemExit(f"a hostile request was not refused: {statuses}")


async def rounds(port: int, n: int) -> list[dict]:
    http, ws = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"
    await stream_seconds(ws)  # warm-up
    alone, rows = await stream_seconds(ws), []
    for i in range(n):
        streaming = asyncio.Event()
        stream = asyncio.create_task(stream_seconds(ws, streaming))
        await asyncio.wait_for(streaming.wait(), 60)
        await hostile(http, port)
        beside = await stream
        after = await stream_seconds(ws)
        rows.append(
            dict(
                alone_s=alone, beside_s=beside, after_s=after, ratio=beside / ((alone + after) / 2)
            )
        )
        log(
            f"round {i + 1}/{n}: beside {beside:.3f} s, alone {alone:.3f}/{after:.3f} s, "
            f"x{rows[-1]['ratio']:.3f}"
        )
        alone = after
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (a PNG beside it)")
    a = parser.parse_args()
    server = ServerProcess(
        ["--model", "builtin:tiny", "--max-num-seqs", "64", "--kv-cache-memory", str(64 << 20)],
        env={"OMP_NUM_THREADS": "1"},
    )
    log("starting pagedserve serve (built-in model)")
    server.start(timeout=180)
    try:
        rows = asyncio.run(rounds(server.port, a.rounds))
    finally:
        server.stop()
    result = dict(
        command=invocation(__file__),
        median_ratio=statistics.median(r["ratio"] for r in rows),
        target="below 1.10",
        rows=rows,
        machine=machine(),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ratios = [r["ratio"] for r in result["rows"]]
    ax.bar(range(1, len(ratios) + 1), ratios)
    ax.axhline(1.10, color="red", linestyle="--", linewidth=1, label="target 1.10")
    ax.axhline(result["median_ratio"], color="gray", linewidth=1, label="median")
    ax.set_xlabel("round")
    ax.set_ylabel("stream time beside / alone")
    ax.set_title("A stream beside hostile requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
