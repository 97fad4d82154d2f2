"""Prefill/decode disaggregation on this machine: what a handoff costs a request.

A `kv_producer` and a `kv_consumer` server (random-weight Llama, `--load-format dummy`,
float32) on loopback, and a lone server beside them. For each prompt length, greedy,
`--output-len` new tokens: the lone server's time for the request; the producer's
handoff (prefill + first token + saving the blocks); the consumer's request with the
handoff's `kv_transfer_params` (fetching the blocks and the prompt's last hidden state
over ZeroMQ, sampling the first token from it, decoding); the KV bytes moved (2 x
layers x prompt tokens x KV heads x head size x 4 bytes). Texts are checked equal to
the lone server's. Medians of `--repeats` distinct prompts per length (no prefix cache
hits). Then a stream decoding on the consumer, alone and while four handed-off prompts
of the longest length arrive (their loads run beside its steps): its chunk gaps.

    python bench/prefill_decode.py --out bench/results/prefill_decode.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from pipeline_bubble import write_config  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from web.launch import ServerProcess, free_port  # noqa: E402

SECRET = "prefill-decode-bench-secret-0123456789"


def post(url: str, body: dict) -> tuple[float, dict]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.load(reply)
    return time.perf_counter() - start, answer


def start(model_dir: str, extra: list[str]) -> ServerProcess:
    server = ServerProcess(
        ["--model", model_dir, "--load-format", "dummy", "--served-model-name", "m"]
        + ["--kv-cache-memory", str(512 << 20), "--max-model-len", "2048", *extra],
        env={"PAGEDSERVE_CLUSTER_SECRET": SECRET, "OMP_NUM_THREADS": "1"},
    )
    server.start(timeout=180)
    return server


def write_model(directory: Path, hidden: int, layers: int) -> None:
    """config.json of a random-weight Llama with the built-in model's byte-level
    tokenizer (258 tokens), which the server needs beside it."""
    import shutil

    from engine.worker.builtin_model import builtin_model_dir

    write_config(directory, hidden, layers, vocab_size=258, bos_token_id=256, eos_token_id=257)
    source = Path(builtin_model_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)


def kv_config(role: str, port: int | None = None) -> list[str]:
    config = {"kv_connector": "PagedServeConnector", "kv_role": role}
    if port is not None:
        config["kv_port"] = port
    return ["--kv-transfer-config", json.dumps(config)]


def measure(servers, prompts: list[list[int]], out_len: int) -> dict:
    """Medians over `prompts` (distinct: no prefix cache hit)."""
    producer, consumer, lone = servers
    lone_s, handoff_s, decode_s = [], [], []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": out_len, "temperature": 0}
        body["ignore_eos"] = True
        seconds, want = post(f"{lone.url}/v1/completions", body)
        lone_s.append(seconds)
        remote = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        seconds, handoff = post(f"{producer.url}/v1/completions", remote)
        handoff_s.append(seconds)
        moved = {**body, "kv_transfer_params": handoff["kv_transfer_params"]}
        seconds, got = post(f"{consumer.url}/v1/completions", moved)
        decode_s.append(seconds)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    return dict(
        prompt_len=len(prompts[0]),
        lone_s=round(statistics.median(lone_s), 4),
        handoff_s=round(statistics.median(handoff_s), 4),
        consumer_s=round(statistics.median(decode_s), 4),
    )


def stream_gaps(url: str, body: dict) -> list[float]:
    """Seconds between the streamed chunks of one completion."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def stall(servers, prompts: list[list[int]], stream_len: int) -> dict:
    """A stream decoding on the consumer, alone and while handed-off prompts arrive
    (their KV loads run beside its steps): its chunk gaps, median and largest."""
    producer, consumer, _ = servers
    stream = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": stream_len, "temperature": 0}
    stream["ignore_eos"] = True
    alone = stream_gaps(f"{consumer.url}/v1/completions", stream)
    moved = []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        remote = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        _, handoff = post(f"{producer.url}/v1/completions", remote)
        moved.append({**body, "kv_transfer_params": handoff["kv_transfer_params"]})
    gaps: list[float] = []
    runner = threading.Thread(
        target=lambda: gaps.extend(stream_gaps(f"{consumer.url}/v1/completions", stream))
    )
    runner.start()
    time.sleep(0.2)  # the stream is decoding: the transfers land in its steps
    for body in moved:
        post(f"{consumer.url}/v1/completions", body)
    runner.join()
    ms = lambda xs: round(1000 * xs, 2)  # noqa: E731
    return dict(
        transfers=len(moved),
        prompt_len=len(prompts[0]),
        alone_gap_ms=dict(median=ms(statistics.median(alone)), max=ms(max(alone))),
        during_gap_ms=dict(median=ms(statistics.median(gaps)), max=ms(max(gaps))),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 512, 1536])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream-len", type=int, default=120, help="tokens of the timed stream")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    kv_heads, head_size = max(1, a.hidden // 256), 64
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), a.hidden, a.layers)
        servers = [
            start(tmp, kv_config("kv_producer", free_port())),
            start(tmp, kv_config("kv_consumer")),
            start(tmp, []),
        ]
        try:
            for length in a.prompt_lens:
                prompts = [[rng.randrange(3, 256) for _ in range(length)] for _ in range(a.repeats)]
                row = measure(servers, prompts, a.output_len)
                row["kv_bytes"] = 2 * a.layers * length * kv_heads * head_size * 4
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
            longest = max(a.prompt_lens)
            moving = [[rng.randrange(3, 256) for _ in range(longest)] for _ in range(4)]
            stalls = stall(servers, moving, a.stream_len)
            print(stalls, file=sys.stderr, flush=True)
        finally:
            for server in servers:
                server.stop()
    report = dict(
        command=invocation(__file__),
        machine=machine(),
        model=dict(hidden=a.hidden, layers=a.layers, kv_heads=kv_heads, dtype="float32"),
        kv_bytes_per_token=2 * a.layers * kv_heads * head_size * 4,
        output_len=a.output_len,
        texts_identical=True,
        rows=rows,
        stream_during_transfers=stalls,
    )
    write_report(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
