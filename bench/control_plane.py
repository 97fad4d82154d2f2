"""Control-plane benchmark of the actor runtime: how fast the scheduler can drive a worker.

Three measurements, each over the real runtime (scheduler and block manager actors on
this process's event loop, the worker in its own process over ZeroMQ ipc, msgpack on
every hop; TokenDeltas are decoded and counted where the tokenizer actor would be):

1. `null_worker`: scheduler steps/s with a NullWorker (no model, a fixed sampled token)
   at 1, 64 and 256 running sequences, one step ahead (depth 2) and synchronous (1).
2. `outside_model`: the share of wall time the worker is NOT executing the model (its
   idle share: Python, messages, planning) with real small models, depth 1 and 2.
3. `sharegpt_workload`: output tok/s of the offline ShareGPT workload (ShareGPT prompts, Alpaca
   output lengths) through the actors with depth 1 and 2, beside the offline `LLM` in
   the same run, on the 58M model (long steps) and a 2-layer model (short steps).
   Token ids are checked equal across the three.

    python bench/control_plane.py --out bench/results/control_plane.json
    python bench/control_plane.py --quick      # about 2 minutes

Needs ../shared for parts 2-3 (stories260K, data, tokenizer); part 1 runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from systems import (  # noqa: E402
    BLOCK_SIZE,
    MODEL_SHAPE,
    WARMUP_PROMPTS,
    kv_bytes_per_token,
    write_model,
)
from workload import SHARED, SharedDataMissing, sample_workload  # noqa: E402

from actors.actor import await_ready, send_message  # noqa: E402
from actors.engine_graph import EngineGraph  # noqa: E402
from actors.transport import ipc_address, new_run_dir, zmq_inbox, zmq_outbox  # noqa: E402
from actors.worker_launch import spawn_worker  # noqa: E402
from engine.codec import InboxDecoder  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402
from engine.messages import INBOXES, AbortRequest, AddRequest, WorkerReady  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.wiring import build_engine  # noqa: E402

SHORT_STEP_SHAPE = {**MODEL_SHAPE, "hidden_size": 128, "intermediate_size": 344}
SHORT_STEP_SHAPE.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
NULL_SHAPE = {**MODEL_SHAPE, "max_position_embeddings": 1 << 16}  # config only, no weights
PROMPT_LEN = 32
STEPS_TARGET = 1000  # steps/s at 256 running sequences


def log(msg: str) -> None:
    print(f"[control_plane] {msg}", file=sys.stderr, flush=True)


class Rig:
    """The actor runtime minus the tokenizer: the engine's actor graph without one
    (scheduler + block manager actors here), one worker process (real or null) over
    ipc, a sink counting the TokenDeltas the tokenizer would get."""

    def __init__(self, args: EngineArgs, depth: int, null: bool, threads: int) -> None:
        self.args, self.depth, self.null, self.threads = args, depth, null, threads
        self.added: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        self.num_tokens = 0
        self.record = not null
        self.finished: set[str] = set()
        self.all_finished = asyncio.Event()
        self.expected = 0

    async def start(self) -> None:
        import zmq.asyncio

        self.run_dir = new_run_dir()
        self.ctx = zmq.asyncio.Context()
        sched, work = ipc_address(self.run_dir, "scheduler"), ipc_address(self.run_dir, "w0")
        inbox = zmq_inbox(self.ctx, sched)
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        self.proc = spawn_worker(self.args, work, sched, extra_env=env, null_worker=self.null)
        decoder = InboxDecoder(INBOXES["scheduler"])
        ready, _ = await await_ready(inbox, decoder, WorkerReady, 300, sender="worker")
        # As served (prefix caching on by default); no text processing: no tokenizer.
        config = dataclasses.replace(self.args.build(), skip_tokenizer_init=True)
        parts = build_engine(config, ready, with_block_manager=True)
        to_worker = zmq_outbox(self.ctx, work)
        self.graph = EngineGraph(parts.core, parts.block_manager, inbox, [to_worker], self.depth)
        self.scheduler = self.graph.scheduler
        self.to_scheduler = zmq_outbox(self.ctx, sched)
        await self.graph.start()
        self.sink = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        decoder = InboxDecoder(INBOXES["tokenizer"])
        while True:
            message = decoder.decode(await self.graph.tokenizer_inbox.recv())
            self.num_tokens += len(message.token_ids)
            if self.record:  # the tokens themselves only where they are compared
                for rid, token in zip(message.request_ids, message.token_ids, strict=True):
                    self.tokens.setdefault(rid, []).append(token)
            self.finished.update(f.request_id for f in message.finished)
            if self.expected and len(self.finished) >= self.expected:
                self.all_finished.set()

    async def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.added.append(request_id)
        await send_message(self.to_scheduler, AddRequest(request_id, tuple(prompt), params, 0.0))

    async def abort_all(self) -> None:
        for request_id in self.added:
            await send_message(self.to_scheduler, AbortRequest(request_id))
        manager = self.graph.block_manager.manager
        for _ in range(500):
            if manager.num_free_blocks == manager.num_blocks and self.scheduler.in_flight == 0:
                return
            await asyncio.sleep(0.01)

    def snapshot(self) -> tuple[float, int, float, int]:
        s = self.scheduler
        return time.perf_counter(), s.num_steps, s.worker_busy_seconds, self.num_tokens

    async def stop(self) -> None:
        await self.graph.shut_down_workers("bench done")
        self.sink.cancel()
        await self.graph.stop()
        await asyncio.to_thread(self.proc.wait, 30)
        self.to_scheduler.close()
        self.graph.tokenizer_inbox.close()
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)


async def steady_state(rig: Rig, num_seqs: int, seconds: float, vocab: int) -> dict:
    """`num_seqs` sequences decoding without end; steps/s and busy share over `seconds`."""
    rng = random.Random(num_seqs)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=60_000)
    for i in range(num_seqs):
        await rig.add(f"s{i}", [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)], params)
    scheduler = rig.scheduler.core.scheduler
    async with asyncio.timeout(120):
        while len(scheduler.running) < num_seqs or scheduler.waiting:
            await asyncio.sleep(0.005)  # warm-up: every sequence admitted ...
        steps = rig.scheduler.num_steps
        while rig.scheduler.num_steps < steps + 8:
            await asyncio.sleep(0.005)  # ... and past its prefill
    t0, steps0, busy0, tok0 = rig.snapshot()
    await asyncio.sleep(seconds)
    t1, steps1, busy1, tok1 = rig.snapshot()
    await rig.abort_all()
    wall, steps = t1 - t0, steps1 - steps0
    busy = busy1 - busy0
    return {
        "running_seqs": num_seqs,
        "steps_per_s": round(steps / wall, 1),
        "ms_per_step": round(1e3 * wall / steps, 3),
        "output_tokens_per_s": round((tok1 - tok0) / wall, 1),
        "worker_busy_ms_per_step": round(1e3 * busy / steps, 3),
        "share_outside_model": round(1 - busy / wall, 4),
        "window_s": round(wall, 2),
    }


async def run_steady(
    model: str, shape_args: dict, null: bool, seqs: list[int], depth: int, a
) -> list[dict]:
    args = EngineArgs(model=model, **shape_args)
    rig = Rig(args, depth, null, a.threads)
    await rig.start()
    try:
        out = []
        for n in seqs:
            rig.added.clear()
            r = await steady_state(rig, n, a.window, args.build().model.vocab_size)
            log(f"{Path(model).name} null={null} depth={depth} seqs={n}: {r}")
            out.append({"depth": depth, **r})
        return out
    finally:
        await rig.stop()


async def run_workload(model: str, engine_kwargs: dict, wl, depth: int, threads: int) -> dict:
    rig = Rig(EngineArgs(model=model, **engine_kwargs), depth, False, threads)
    await rig.start()
    try:
        rig.expected = len(WARMUP_PROMPTS)  # first forwards are slow: not timed
        for i, p in enumerate(WARMUP_PROMPTS):
            await rig.add(f"warm{i}", p, SamplingParams(ignore_eos=True, max_tokens=8))
        await rig.all_finished.wait()
        rig.all_finished.clear()
        rig.finished.clear()
        rig.expected = len(wl.prompts)
        busy0, steps0 = rig.scheduler.worker_busy_seconds, rig.scheduler.num_steps
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
            await rig.add(
                f"w{i}", p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            )
        await rig.all_finished.wait()
        wall = time.perf_counter() - t0
        tokens = [rig.tokens[f"w{i}"] for i in range(len(wl.prompts))]
        busy = rig.scheduler.worker_busy_seconds - busy0
        return _throughput(wall, tokens) | {
            "num_steps": rig.scheduler.num_steps - steps0,
            "share_outside_model": round(1 - busy / wall, 4),
            "tokens": tokens,
        }
    finally:
        await rig.stop()


def run_offline(model: str, engine_kwargs: dict, wl, threads: int) -> dict:
    import torch

    from engine import LLM

    torch.set_num_threads(threads)
    llm = LLM(model=model, skip_tokenizer_init=True, **engine_kwargs)
    llm.generate(WARMUP_PROMPTS, SamplingParams(ignore_eos=True, max_tokens=8), use_tqdm=False)
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in wl.output_lens
    ]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return _throughput(wall, tokens) | {"num_steps": llm.stats().num_steps, "tokens": tokens}


def _throughput(wall: float, tokens: list[list[int]]) -> dict:
    n = sum(len(t) for t in tokens)
    return {"wall_s": round(wall, 2), "output_tokens": n, "output_tokens_per_s": round(n / wall, 1)}


def _kv_bytes(shape: dict, tokens: int) -> int:
    """float32 KV bytes of `tokens` tokens, rounded up to whole blocks."""
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token("float32", shape)


async def main_async(a) -> dict:
    report: dict = {
        "command": " ".join(["python", *sys.argv]),
        "null_worker": [],
        "outside_model": [],
        "sharegpt_workload": {},
    }
    with tempfile.TemporaryDirectory(prefix="pagedserve-cp-") as tmp:
        tmp = Path(tmp)
        # 1. null worker ------------------------------------------------------------
        null_dir = tmp / "null"
        null_dir.mkdir()
        from transformers import LlamaConfig

        LlamaConfig(**NULL_SHAPE, architectures=["LlamaForCausalLM"]).save_pretrained(null_dir)
        max_seqs = max(a.seqs)
        seq_tokens = NULL_SHAPE["max_position_embeddings"]
        null_kwargs = dict(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, max_seqs),
            block_size=BLOCK_SIZE,
            kv_cache_memory=_kv_bytes(NULL_SHAPE, max_seqs * 4096 + seq_tokens),
            skip_tokenizer_init=True,
        )
        for depth in (2, 1) if "null" in a.parts else ():
            report["null_worker"] += await run_steady(
                str(null_dir), null_kwargs, True, a.seqs, depth, a
            )
        if a.null_only:
            return report
        # 2. outside-model share with real small models --------------------------------
        models = {}
        stories = SHARED / "models" / "stories260K"
        if stories.is_dir():
            models["stories260K"] = (str(stories), 512)
        model_dir = tmp / "llama_58M"
        model_dir.mkdir()
        write_model(model_dir, 0)
        models["llama_58M"] = (str(model_dir), 1024)
        short_dir = tmp / "short"
        short_dir.mkdir()
        write_model(short_dir, 0, SHORT_STEP_SHAPE)
        models["short_2layer"] = (str(short_dir), 1024)
        for name, (path, _) in models.items() if "outside" in a.parts else ():
            # default KV budget: room for 64 full-length sequences, so none is preempted
            kwargs = dict(max_num_seqs=64, block_size=BLOCK_SIZE, skip_tokenizer_init=True)
            for depth in (2, 1):
                for r in await run_steady(path, kwargs, False, [64], depth, a):
                    report["outside_model"].append({"model": name, **r})
        # 3. the offline ShareGPT workload, sync vs async, beside offline LLM -------------
        wl = sample_workload(
            "sharegpt", a.num_prompts, 0, 1024, "alpaca", max_output=a.max_output_len
        )
        report["workload"] = wl.summary()
        for name in ("short_2layer", "llama_58M") if "workload" in a.parts else ():
            path = models[name][0]
            kwargs = dict(
                max_num_seqs=128,
                max_num_batched_tokens=2048,
                block_size=BLOCK_SIZE,
                kv_cache_memory=a.kv_cache_memory,
                seed=0,
            )
            runs = {}
            log(f"{name}: offline LLM ...")
            runs["offline_llm"] = run_offline(path, kwargs, wl, a.threads)
            for depth in (1, 2):
                log(f"{name}: actors depth {depth} ...")
                runs[f"actors_depth{depth}"] = await run_workload(
                    path, kwargs, wl, depth, a.threads
                )
            ref = runs["offline_llm"].pop("tokens")
            for key in ("actors_depth1", "actors_depth2"):
                runs[key]["tokens_equal_offline"] = runs[key].pop("tokens") == ref
            d1, d2 = runs["actors_depth1"], runs["actors_depth2"]
            runs["async_over_sync"] = round(
                d2["output_tokens_per_s"] / d1["output_tokens_per_s"], 3
            )
            runs["async_over_offline"] = round(
                d2["output_tokens_per_s"] / runs["offline_llm"]["output_tokens_per_s"], 3
            )
            log(f"{name}: {json.dumps(runs)}")
            report["sharegpt_workload"][name] = runs
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    show = [k for k in ("null_worker", "sharegpt_workload") if report[k]]
    if not show:
        return
    fig, axes = plt.subplots(1, len(show), figsize=(5.5 * len(show), 4), squeeze=False)
    panels = dict(zip(show, axes[0], strict=True))
    if "null_worker" in panels:
        _plot_null(panels["null_worker"], report)
    if "sharegpt_workload" in panels:
        _plot_workload(panels["sharegpt_workload"], report)
    fig.suptitle(
        "Control plane: scheduler + block manager actors, worker process over ipc, "
        f"{report['machine']['threads']} torch thread(s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_null(ax, report: dict) -> None:
    for depth, color in ((2, "tab:green"), (1, "tab:blue")):
        rows = [r for r in report["null_worker"] if r["depth"] == depth]
        ax.plot(
            [r["running_seqs"] for r in rows],
            [r["steps_per_s"] for r in rows],
            "o-",
            color=color,
            label=f"depth {depth}" + (" (one step ahead)" if depth == 2 else " (sync)"),
        )
    ax.axhline(STEPS_TARGET, color="gray", ls="--", lw=1, label="target at 256")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running sequences")
    ax.set_ylabel("scheduler steps/s (null worker)")
    ax.legend(fontsize=8)


def _plot_workload(ax, report: dict) -> None:
    names, values, colors = [], [], []
    for model, runs in report["sharegpt_workload"].items():
        for key, color in (
            ("offline_llm", "tab:gray"),
            ("actors_depth1", "tab:blue"),
            ("actors_depth2", "tab:green"),
        ):
            names.append(f"{model}\n{key.replace('actors_', '')}")
            values.append(runs[key]["output_tokens_per_s"])
            colors.append(color)
    bars = ax.bar(names, values, color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s (offline ShareGPT workload)")
    ax.tick_params(axis="x", labelsize=6)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "control_plane.json")
    p.add_argument("--quick", action="store_true", help="short windows, 40 prompts")
    p.add_argument("--null-only", action="store_true", help="part 1 only (no ../shared needed)")
    p.add_argument(
        "--parts",
        type=lambda s: set(s.split(",")),
        default={"null", "outside", "workload"},
        help="which parts to run (default null,outside,workload)",
    )
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    p.add_argument("--window", type=float, default=None, help="seconds per steady-state point")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads (worker and offline LLM)")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    a = p.parse_args(argv)
    a.window = a.window or (1.0 if a.quick else 4.0)
    a.num_prompts = a.num_prompts or (40 if a.quick else 200)
    if a.quick and a.max_output_len is None:
        a.max_output_len = 32
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        report = asyncio.run(main_async(a))
    except SharedDataMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "threads": a.threads,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, a.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "workload"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
