"""Online serving benchmark: Poisson arrivals against a running `pagedserve serve`.

The same request sequence and the same arrival times are replayed, at each request rate,
over the WebSocket API (`/v1/stream`, every request multiplexed on ONE connection by
default) and over the OpenAI HTTP API (`POST /v1/completions`, `stream: true`, one HTTP
request and SSE stream per request). Per (api, rate) it reports TTFT, time per output
token, inter-token latency (mean/p50/p90/p99), end-to-end latency, the paper's normalized
latency (end-to-end latency / output tokens), throughput and goodput under SLOs, as JSON
plus a PNG (normalized latency, TTFT p90 and goodput versus request rate).

    python bench/serve.py --quick --out /tmp/serve_quick.json          # about 1 minute
    python bench/serve.py --out bench/results/serve.json               # the default run

Workload: input/output lengths from ../shared (ShareGPT prompts with Alpaca answer
lengths by default, see bench/workload.py) or from a lengths file (`--dataset PATH`);
prompts are random token ids of those lengths in the model's vocabulary, sent as token
ids, and every request generates exactly its output length (`ignore_eos`, `max_tokens`).
The bench starts the server itself (stories260K from ../shared when present, else the
built-in tiny model) unless `--url` points at one. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from workload import SHARED, SharedDataMissing, clip_to_context, sample_workload  # noqa: E402

from web.launch import ServerProcess  # noqa: E402

APIS = ("ws", "sse")
STORIES = SHARED / "models" / "stories260K"
PERCENTILES = (50, 90, 99)
FIRST_TOKEN_ID = 3  # random prompt ids avoid the usual <unk>, <s>, </s> (0, 1, 2)
LENGTH_COLUMNS = (  # (input, output) column pairs a `--dataset PATH` file may use
    ("input_len", "output_len"),
    ("prompt_len", "output_len"),
    ("input_length", "output_length"),  # Mooncake traces
    ("num_prefill_tokens", "num_decode_tokens"),  # Azure traces (vidur's copies)
    ("prompt_tokens", "completion_tokens"),
)


def log(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


# -- workload -------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One benchmark request: token ids to send and the exact number of tokens to get."""

    prompt: list[int]
    output_len: int


def load_lengths(path: Path) -> list[tuple[int, int]]:
    """(input, output) token counts from a CSV, JSON list or JSONL file of records."""
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    elif path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
    if not rows or not isinstance(rows, list) or not isinstance(rows[0], dict):
        raise ValueError(f"{path}: expected a non-empty list of records (CSV, JSON or JSONL)")
    for cin, cout in LENGTH_COLUMNS:
        if cin in rows[0] and cout in rows[0]:
            return [(int(r[cin]), int(r[cout])) for r in rows]
    raise ValueError(
        f"{path}: no length columns found; records need one of the pairs "
        f"{', '.join(f'{i}/{o}' for i, o in LENGTH_COLUMNS)}"
    )


def build_requests(a: argparse.Namespace, max_model_len: int, vocab: int) -> tuple[list, dict]:
    """The workload: `a.num_prompts` requests, reproducible from `a.seed`, clipped to the
    context as in workload.py; prompts are random ids of the sampled lengths."""
    if a.dataset in ("sharegpt", "alpaca"):
        wl = sample_workload(
            a.dataset,
            a.num_prompts,
            a.seed,
            max_model_len,
            a.output_lengths,
            max_output=a.max_output_len,
        )
        lens, outs, summary = wl.input_lens, wl.output_lens, wl.summary()
    else:
        rows = load_lengths(Path(a.dataset))
        if a.num_prompts > len(rows):
            raise ValueError(f"asked for {a.num_prompts} prompts but {a.dataset} has {len(rows)}")
        picked = [rows[i] for i in random.Random(a.seed).sample(range(len(rows)), a.num_prompts)]
        prompts, outs, clipping = clip_to_context(
            [range(n) for n, _ in picked],
            [max(0, o) for _, o in picked],
            max_model_len,
            max_output=a.max_output_len,
        )
        lens = [len(p) for p in prompts]
        summary = {
            "dataset": str(a.dataset),
            "num_prompts": a.num_prompts,
            "seed": a.seed,
            "max_model_len": max_model_len,
            "total_input_tokens": sum(lens),
            "total_output_tokens": sum(outs),
            "input_len": stats(lens, ndigits=1),
            "output_len": stats(outs, ndigits=1),
            "clipping": clipping,
        }
    rng = random.Random(a.seed)
    requests = [
        Request([rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)], out)
        for n, out in zip(lens, outs, strict=True)
    ]
    summary["prompt_token_ids"] = f"uniform random in [{FIRST_TOKEN_ID}, {vocab})"
    return requests, summary


# -- pure helpers ---------------------------------------------------------------------
def parse_rate(text: str) -> float:
    rate = math.inf if text.strip().lower() == "inf" else float(text)
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be > 0 or inf, got {text!r}")
    return rate


def rate_label(rate: float) -> float | str:
    """JSON has no infinity: `inf` is written as the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def arrival_times(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from the start) of `n` requests: the first at 0, then gaps drawn
    from a gamma distribution of mean 1/rate (shape `burstiness`; 1 = Poisson process).
    An infinite rate sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:{rate}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def stats(values: Sequence[float], scale: float = 1.0, ndigits: int = 2) -> dict:
    """mean, p50/p90/p99 and max of `values` times `scale`; None for no values."""
    s = sorted(v * scale for v in values)
    if not s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    out = {"mean": round(sum(s) / len(s), ndigits)}
    out |= {f"p{p}": round(percentile(s, p), ndigits) for p in PERCENTILES}
    return out | {"max": round(s[-1], ndigits)}


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives (seconds); e2e None = not checked."""

    ttft: float
    tpot: float
    e2e: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft > self.ttft:
            return False
        if r.tpot is not None and r.tpot > self.tpot:
            return False
        return self.e2e is None or r.e2e <= self.e2e


@dataclass
class RequestResult:
    """What the client saw of one request; times are `time.perf_counter()` values."""

    input_len: int
    output_len: int  # requested
    sent: float = math.nan
    send_lag: float = 0.0  # how late the client sent it against its schedule
    token_times: list[float] = field(default_factory=list)  # one per output token
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens as received (0 inside one message)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def summarize(results: list[RequestResult], start: float, slo: Slo) -> dict:
    """Metrics of one (api, rate) run; latencies in ms, normalized latency in s/token."""
    ok = [r for r in results if r.ok]
    end = max((r.end for r in ok), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(len(r.token_times) for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted(set(errors))[:5],
        "token_count_mismatches": sum(len(r.token_times) != r.output_len for r in ok),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput_tok_s": round(out_tokens / duration, 1),
        "total_throughput_tok_s": round((out_tokens + sum(r.input_len for r in ok)) / duration, 1),
        "goodput_req_s": round(sum(slo.met(r) for r in ok) / duration, 3),
        "slo_attainment": round(sum(slo.met(r) for r in results) / len(results), 4),
        "ttft_ms": stats([r.ttft for r in ok], 1e3),
        "tpot_ms": stats([r.tpot for r in ok if r.tpot is not None], 1e3),
        "itl_ms": stats([g for r in ok for g in r.itls], 1e3),
        "e2e_ms": stats([r.e2e for r in ok], 1e3),
        "normalized_latency_s_per_token": stats(
            [r.e2e / len(r.token_times) for r in ok], ndigits=5
        ),
        "send_lag_ms": stats([r.send_lag for r in results], 1e3),
    }


# -- the server -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    path: str | None  # None: the built-in model, or unknown behind --url
    max_model_len: int
    vocab_size: int


def model_info(a: argparse.Namespace) -> ModelInfo:
    """Context length and vocabulary of the served model, from its config.json."""
    path = a.model
    if path is None and a.url is None:
        path = str(STORIES) if STORIES.is_dir() else None
    config_dir = path
    if config_dir is None and a.url is None:
        from engine.worker.builtin_model import builtin_model_dir

        config_dir = str(builtin_model_dir())
    config = {}
    if config_dir is not None:
        config_file = Path(config_dir) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file} not found: --model must be a local HF directory")
        config = json.loads(config_file.read_text())
    max_len = a.max_model_len or config.get("max_position_embeddings")
    vocab = a.vocab_size or config.get("vocab_size")
    if not max_len or not vocab:
        raise ValueError(
            "the served model's context and vocabulary are unknown: with --url, pass --model "
            "(its local directory) or --max-model-len and --vocab-size"
        )
    return ModelInfo(path, min(max_len, config.get("max_position_embeddings", max_len)), vocab)


class Server:
    """`pagedserve serve` in a subprocess on a free port; its log goes to a file."""

    def __init__(self, a: argparse.Namespace, model: ModelInfo) -> None:
        args = ["--model", "builtin:tiny" if model.path is None else model.path]
        limit = str(max(256, a.num_prompts))  # nothing refused: every request must run
        args += ["--max-queued-requests", limit, "--max-requests-per-connection", limit]
        args += ["--max-num-seqs", str(a.max_num_seqs), "--pipeline-depth", str(a.pipeline_depth)]
        for flag in ("max_num_batched_tokens", "kv_cache_memory", "max_model_len"):
            if getattr(a, flag) is not None:
                args += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
        args += ["--block-size", str(a.block_size), "--dtype", a.dtype]
        args += ["--load-format", a.load_format, *shlex.split(a.server_args)]
        self.log_file = tempfile.NamedTemporaryFile(prefix="pagedserve-bench-", suffix=".log")
        threads = str(a.threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        self.process = ServerProcess(args, env=env, log=self.log_file)
        self.port = self.process.port
        self.cmd = self.process.cmd

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc

    def start(self, timeout: float = 300.0) -> None:
        log(f"starting server: {shlex.join(self.cmd)}")
        self.process.start(timeout)

    def stop(self) -> None:
        self.process.stop()
        self.log_file.close()


# -- clients --------------------------------------------------------------------------
Send = Callable[[Request, RequestResult], Awaitable[None]]


class WsClient:
    """WebSocket connections to /v1/stream, requests spread round-robin over them; on each,
    a reader task routes `delta`/`done`/`error` events to their request by id."""

    def __init__(self, base_url: str, connections: int, encoding: str, api_key: str | None):
        query = "?encoding=msgpack" if encoding == "msgpack" else ""
        self.url = base_url.replace("http", "ws", 1) + "/v1/stream" + query
        self.num_connections, self.binary = connections, encoding == "msgpack"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.pending: dict[str, tuple[RequestResult, asyncio.Future]] = {}
        self.conns: list = []
        self.readers: list[asyncio.Task] = []
        self.ids = iter(range(1 << 62))

    async def __aenter__(self) -> WsClient:
        from websockets.asyncio.client import connect

        for _ in range(self.num_connections):
            # no permessage-deflate: SSE is not compressed either; no keepalive pings
            ws = await connect(
                self.url,
                additional_headers=self.headers,
                compression=None,
                max_size=None,
                ping_interval=None,
            )
            self.conns.append(ws)
            self.readers.append(asyncio.create_task(self._read(ws)))
        return self

    async def __aexit__(self, *exc) -> None:
        for ws in self.conns:
            await ws.close()
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)

    async def send(self, req: Request, result: RequestResult) -> None:
        n = next(self.ids)
        rid = f"r{n}"
        done = asyncio.get_running_loop().create_future()
        self.pending[rid] = (result, done)
        message = {
            "type": "generate",
            "id": rid,
            "prompt_token_ids": req.prompt,
            "params": {"max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0},
        }
        try:
            result.sent = time.perf_counter()
            await self.conns[n % len(self.conns)].send(json.dumps(message))
            await done
        finally:
            self.pending.pop(rid, None)

    async def _read(self, ws) -> None:
        import msgpack

        try:
            async for frame in ws:
                now = time.perf_counter()
                event = msgpack.unpackb(frame) if self.binary else json.loads(frame)
                entry = self.pending.get(event.get("id"))
                if entry is None:
                    continue
                result, done = entry
                kind = event["type"]
                if kind == "delta":
                    result.token_times += [now] * len(event["token_ids"])
                elif kind in ("done", "error"):
                    result.end = now
                    if kind == "error":
                        result.error = f"{event.get('code')}: {event.get('message')}"
                    elif event["finish_reason"] != "length":
                        result.error = f"finish_reason {event['finish_reason']}"
                    if not done.done():
                        done.set_result(None)
        except Exception as exc:  # noqa: BLE001 - the connection died: fail its requests
            log(f"websocket reader stopped: {exc!r}")
        for result, done in list(self.pending.values()):
            if not done.done():
                result.error = result.error or "websocket closed"
                done.set_result(None)


class SseClient:
    """One streaming `POST /v1/completions` per request (httpx, connections pooled)."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.url = base_url + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __aenter__(self) -> SseClient:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(limits=limits, timeout=None, headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def send(self, req: Request, result: RequestResult) -> None:
        body = {
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        result.sent = time.perf_counter()
        async with self.client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    result.end = now
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return
                for choice in chunk.get("choices", ()):  # one engine delta = one token
                    result.token_times.append(now)
                    if choice.get("finish_reason") not in (None, "length"):
                        result.error = f"finish_reason {choice['finish_reason']}"
        result.error = result.error or "stream ended without [DONE]"


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of this process (the clients) and, when the bench started the
    server, of the server process and of its children (the engine's worker) from /proc."""
    out = {"client": time.process_time()}
    if server_pid is None:
        return out
    tick = os.sysconf("SC_CLK_TCK")

    def of(pid: int | str) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    try:
        children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
        out["server"] = of(server_pid)
        out["worker"] = sum(of(c) for c in children)
    except (OSError, IndexError, ValueError):
        pass  # no /proc (or the process is gone): client time only
    return out


def make_client(api: str, a: argparse.Namespace, base_url: str):
    if api == "ws":
        return WsClient(base_url, a.ws_connections, a.ws_encoding, a.api_key)
    return SseClient(base_url, a.api_key)


async def replay(
    send: Send, requests: list[Request], times: list[float], timeout: float
) -> tuple[list[RequestResult], float]:
    """Sends request i at `times[i]` seconds after the start; returns results and start."""
    results = [RequestResult(len(r.prompt), r.output_len) for r in requests]
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        results[i].send_lag = time.perf_counter() - start - times[i]
        try:
            async with asyncio.timeout(timeout):
                await send(requests[i], results[i])
        except Exception as exc:  # noqa: BLE001 - recorded per request
            results[i].error = results[i].error or f"{type(exc).__name__}: {exc}"

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results, start


async def run_all(
    a: argparse.Namespace, base_url: str, requests: list[Request], server_pid: int | None
) -> list[dict]:
    slo = Slo(a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3, a.slo_e2e_ms and a.slo_e2e_ms / 1e3)
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            api: await stack.enter_async_context(make_client(api, a, base_url)) for api in a.apis
        }
        warm = [Request(r.prompt[:16], min(r.output_len, 8)) for r in requests[:4]]
        for client in clients.values():  # first requests are slow: not measured
            await replay(client.send, warm, [0.0] * len(warm), a.request_timeout)
        runs = []
        for rate in a.request_rates:
            times = arrival_times(len(requests), rate, a.seed, a.burstiness)
            for api, client in clients.items():
                cpu0 = cpu_seconds(server_pid)
                results, start = await replay(client.send, requests, times, a.request_timeout)
                wall = time.perf_counter() - start
                cpu = {k: round(v - cpu0[k], 2) for k, v in cpu_seconds(server_pid).items()}
                run = {"api": api, "request_rate": rate_label(rate)}
                run |= summarize(results, start, slo)
                run["cpu_s"] = cpu
                run["cpu_busy_share"] = round(sum(cpu.values()) / (wall * os.cpu_count()), 3)
                runs.append(run)
                log(
                    f"{api:>3} rate {rate:>5}: {run['completed']}/{len(requests)} ok in "
                    f"{run['duration_s']:.1f} s, {run['output_throughput_tok_s']} tok/s, "
                    f"TTFT p50/p90 {run['ttft_ms']['p50']}/{run['ttft_ms']['p90']} ms, "
                    f"TPOT p50 {run['tpot_ms']['p50']} ms, normalized "
                    f"{run['normalized_latency_s_per_token']['mean']} s/tok, goodput "
                    f"{run['goodput_req_s']} req/s; CPU {cpu}"
                )
                if run["failed"]:
                    log(f"    {run['failed']} failed: {run['errors']}")
                await asyncio.sleep(a.cooldown)
        return runs


def compare(runs: list[dict]) -> list[dict]:
    """WebSocket / SSE ratios at each rate (< 1: the WebSocket is lower)."""
    by = {(r["api"], str(r["request_rate"])): r for r in runs}
    out = []
    for rate in dict.fromkeys(str(r["request_rate"]) for r in runs):
        ws, sse = by.get(("ws", rate)), by.get(("sse", rate))
        if not (ws and sse):
            continue
        row: dict = {"request_rate": ws["request_rate"]}
        for key, stat in (
            ("ttft_ms", "p50"),
            ("ttft_ms", "p90"),
            ("tpot_ms", "p50"),
            ("itl_ms", "p90"),
            ("normalized_latency_s_per_token", "mean"),
        ):
            w, s = ws[key][stat], sse[key][stat]
            row[f"ws_over_sse_{key}_{stat}"] = round(w / s, 3) if w and s else None
        row["goodput_ws"], row["goodput_sse"] = ws["goodput_req_s"], sse["goodput_req_s"]
        out.append(row)
    return out


# -- report ---------------------------------------------------------------------------
def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else ())
        if line.startswith("model name")
    ]
    versions = {}
    for pkg in ("torch", "websockets", "httpx", "uvicorn", "starlette"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": names[0] if names else platform.processor(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    finite = [r["request_rate"] for r in runs if r["request_rate"] != "inf"]
    inf_x = 1.25 * max(finite) if finite else 1.0  # where "inf" is drawn

    def x(rate) -> float:
        return inf_x if rate == "inf" else rate

    panels = (
        ("normalized_latency_s_per_token", "mean", "normalized latency, mean (s/token)"),
        ("ttft_ms", "p90", "TTFT p90 (ms)"),
        ("goodput_req_s", None, "goodput (req/s meeting SLOs)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    styles = {"ws": ("tab:green", "o-", "WebSocket"), "sse": ("tab:blue", "s--", "HTTP SSE")}
    for ax, (key, stat, label) in zip(axes, panels, strict=True):
        for api, (color, fmt, name) in styles.items():
            rows = [r for r in runs if r["api"] == api]
            if not rows:
                continue
            xs = [x(r["request_rate"]) for r in rows]
            ys = [r[key][stat] if stat else r[key] for r in rows]
            ax.plot(xs, [math.nan if y is None else y for y in ys], fmt, color=color, label=name)
            if key == "goodput_req_s":
                tput = [r["request_throughput"] for r in rows]
                ax.plot(xs, tput, ":", color=color, lw=1, label=f"{name} throughput")
        ticks = sorted({x(r["request_rate"]) for r in runs})
        labels = {x(r["request_rate"]): str(r["request_rate"]) for r in runs}
        ax.set_xticks(ticks, [labels[t].removesuffix(".0") for t in ticks])
        ax.set_xlim(0, None)
        ax.set_ylim(0, None)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    wl, srv = report["workload"], report["server"]
    fig.suptitle(
        f"Online serving: {srv['model_name']}, {wl['num_prompts']} requests ({wl['dataset']}), "
        f"Poisson arrivals; WS = {report['config']['ws_connections']} multiplexed "
        f"connection(s), SSE = one HTTP stream per request; SLO TTFT "
        f"{report['slo']['ttft_ms']:g} ms, TPOT {report['slo']['tpot_ms']:g} ms",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serve.json")
    p.add_argument("--quick", action="store_true", help="smoke test: 30 prompts, rates 2,8")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--dataset",
        default="sharegpt",
        help="sharegpt, alpaca (../shared/data), or a CSV/JSON/JSONL file of input/output "
        "token counts (columns " + ", ".join(f"{i}/{o}" for i, o in LENGTH_COLUMNS) + ")",
    )
    w.add_argument(
        "--output-lengths",
        default="alpaca",
        choices=["alpaca", "azure"],
        help="output lengths for sharegpt/alpaca (see bench/workload.py)",
    )
    w.add_argument("--num-prompts", type=int, default=None, help="default 200 (30 in --quick)")
    w.add_argument("--max-output-len", type=int, default=None, help="cap output lengths")
    w.add_argument(
        "--request-rates",
        type=lambda s: [parse_rate(x) for x in s.split(",")],
        default=None,
        help="req/s, comma separated, 'inf' = all at once (default 2,4,8,12,16,20,24,32,inf)",
    )
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("clients")
    c.add_argument("--api", choices=["ws", "sse", "both"], default="both")
    c.add_argument("--ws-connections", type=int, default=1, help="requests multiplexed over K")
    c.add_argument("--ws-encoding", choices=["json", "msgpack"], default="json")
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    c.add_argument("--cooldown", type=float, default=1.0, help="seconds of idle between runs")
    c.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    c.add_argument("--slo-tpot-ms", type=float, default=100.0)
    c.add_argument("--slo-e2e-ms", type=float, default=None)
    s = p.add_argument_group("server (started by the bench unless --url is given)")
    s.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    s.add_argument("--api-key", default=None)
    s.add_argument(
        "--model",
        default=None,
        help="local HF directory (default ../shared/models/stories260K, else the built-in model)",
    )
    s.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    s.add_argument("--vocab-size", type=int, default=None, help="with --url and no --model")
    s.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the server")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    s.add_argument("--pipeline-depth", type=int, default=2, choices=[1, 2])
    s.add_argument("--server-args", default="", help="more `pagedserve serve` flags, quoted")
    a = p.parse_args(argv)
    a.num_prompts = a.num_prompts or (30 if a.quick else 200)
    a.request_rates = a.request_rates or (
        [2.0, 8.0] if a.quick else [2.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 32.0, math.inf]
    )
    a.apis = list(APIS) if a.api == "both" else [a.api]
    if a.num_prompts < 1 or a.ws_connections < 1 or a.burstiness <= 0:
        p.error("--num-prompts and --ws-connections must be >= 1, --burstiness > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        model = model_info(a)
        requests, workload = build_requests(a, model.max_model_len, model.vocab_size)
    except (SharedDataMissing, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log(
        f"{len(requests)} requests: {workload['total_input_tokens']} input, "
        f"{workload['total_output_tokens']} output tokens; rates {a.request_rates}; apis {a.apis}"
    )
    server = None if a.url else Server(a, model)
    load_before = os.getloadavg()
    try:
        if server is not None:
            server.start()
        base_url = a.url.rstrip("/") if a.url else server.url
        runs = asyncio.run(run_all(a, base_url, requests, server.proc.pid if server else None))
    finally:
        if server is not None:
            server.stop()
    config = {k: v for k, v in vars(a).items() if k != "api_key"}
    config |= {
        "out": str(a.out),
        "request_rates": [rate_label(r) for r in a.request_rates],
    }
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "config": config,
        "machine": machine_info()
        | {"load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "server": {
            "url": a.url or "started by the bench",
            "command": shlex.join(server.cmd) if server else None,
            "model": model.path or ("built-in tiny model" if a.url is None else "unknown"),
            "model_name": Path(model.path).name
            if model.path
            else ("pagedserve-builtin-tiny" if a.url is None else "served model"),
            "max_model_len": model.max_model_len,
            "vocab_size": model.vocab_size,
            "threads": a.threads if server else None,
        },
        "workload": workload,
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms, "e2e_ms": a.slo_e2e_ms},
        "runs": runs,
        "ws_vs_sse": compare(runs),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, a.out.with_suffix(".png"))
    log(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    print(json.dumps(report["ws_vs_sse"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
