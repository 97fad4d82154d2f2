"""Quantized weights computed in their blocks, beside llama.cpp on the same GGUF files.

    python bench/quantized.py --out bench/results/quantized.json      # both parts
    python bench/quantized.py --parts 7b --batches 1 16

(7b)  A random-weight model at Llama-3-8B's shapes (32 layers, hidden 4096, FFN 14336,
      32 query and 8 KV heads) in llama.cpp's Q4_K_M layout, with SmolLM2's 49,152-token
      vocabulary (bench/peers/random_gguf.py; about 4.6 GB, written once under
      --cache-dir). `pagedserve serve` (bfloat16 activations and KV cache) and
      llama-server on the file, at each batch size B (--max-num-seqs B / -np B):
      --requests-per-slot x B requests of --prompt-len random token ids and --output-len
      output tokens, all sent at once. Output tok/s, and the peak RSS of each server's
      process tree.
(perplexity) SmolLM2-135M-Instruct's shipped Q4_1 GGUF: llama-perplexity's perplexity of
      a fixed text (the first ShareGPT prompts, joined) in 512-token chunks, each scored
      on its second half, beside ours over the same chunks (our tokenizer's tokens; the
      file's blocks computed in place, and dequantized at load).

llama.cpp's binaries come from --lcpp-dir (bench/e2e.py --build-only builds them; add the
llama-perplexity target, or use ../shared/peers/build_llamacpp.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(BENCH)]

from peers import llamacpp  # noqa: E402
from peers.http_load import healthy, peak_rss_mib, post_json, process_tree, send_all  # noqa: E402
from peers.random_gguf import LlamaShape, write_random_q4_k_m  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

from web.launch import ServerProcess, free_port  # noqa: E402

CHUNK = 512  # llama-perplexity's default context per chunk
DEFAULT_CACHE = Path.home() / ".cache" / "pagedserve" / "bench"


def log(msg: str) -> None:
    print(f"[quantized] {msg}", file=sys.stderr, flush=True)


def default_model_file() -> Path:
    from cuda_ext.build import cache_root
    from engine.default_model import resolve_default_model

    return Path(resolve_default_model(cache_root()))


# ---------------------------------------------------------------------------- 7B-class


def model_7b(args) -> Path:
    path = args.cache_dir / "random-llama3-8b-shape-q4_k_m.gguf"
    if not path.exists():
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        log(f"writing {path.name} (random Q4_K_M blocks) ...")
        t = time.perf_counter()
        partial = path.with_suffix(".partial")
        write_random_q4_k_m(partial, LlamaShape(), default_model_file())
        partial.rename(path)
        log(f"written in {time.perf_counter() - t:.0f} s: {path.stat().st_size / 2**30:.2f} GiB")
    return path


def workload(args, batch: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) of each request at batch size `batch`."""
    rng = random.Random(batch)
    prompts = [
        [rng.randrange(3, 49152) for _ in range(args.prompt_len)]
        for _ in range(args.requests_per_slot * batch)
    ]
    return [(p, args.output_len) for p in prompts]


def run_ours(args, gguf: Path, batch: int) -> dict:
    requests = workload(args, batch)
    server_args = ["--model", str(gguf), "--dtype", "bfloat16", "--max-num-seqs", str(batch)]
    server_args += ["--max-model-len", str(args.prompt_len + args.output_len + 64)]
    server_args += ["--kv-cache-memory", str(args.kv_cache_mib << 20)]
    server_args += ["--max-num-batched-tokens", "512", "--quantization", "gguf"]
    bodies = [
        {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True} for p, m in requests
    ]
    with tempfile.NamedTemporaryFile(prefix="pagedserve-quantized-", suffix=".log") as server_log:
        server = ServerProcess(server_args, env=_threads(args), log=server_log)
        server.start(timeout=900)
        try:
            post_json(server.port, "/v1/completions", {**bodies[0], "max_tokens": 4}, timeout=600)
            info = _get_json(server.port, "/v1/info")
            load = send_all(server.port, "/v1/completions", bodies)
            rss = sum(v or 0 for v in (peak_rss_mib(p) for p in process_tree(server.proc.pid)))
        finally:
            server.stop()
    tokens = sum(a["usage"]["completion_tokens"] for a in load.answers if a)
    return _result(load, tokens, rss, server.cmd, memory=info.get("memory"))


def run_llama_server(args, gguf: Path, batch: int) -> dict:
    requests = workload(args, batch)
    options = llamacpp.ServerOptions(
        parallel=batch,
        threads=args.threads,
        ctx=batch * (args.prompt_len + args.output_len + 64),
        batch=512,
        ubatch=512,
    )
    bodies = [llamacpp.completion_body(p, m) for p, m in requests]
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="llama-server-quantized-", suffix=".log") as srv_log:
        server = llamacpp.LlamaServer(
            args.lcpp_dir / "build" / "bin" / "llama-server",
            gguf,
            options,
            port,
            Path(srv_log.name),
        )
        server.start(lambda: healthy(port), timeout=900)
        try:
            post_json(port, "/completion", {**bodies[0], "n_predict": 4}, timeout=600)
            load = send_all(port, "/completion", bodies)
            rss = peak_rss_mib(server.proc.pid)
        finally:
            server.stop()
    tokens = sum(llamacpp.completion_tokens(a) for a in load.answers if a)
    return _result(load, tokens, rss, server.cmd)


def part_7b(args) -> dict:
    gguf = model_7b(args)
    out: dict = {
        "model": "random Llama-3-8B shapes, Q4_K_M, SmolLM2's vocabulary",
        "file_gib": round(gguf.stat().st_size / 2**30, 3),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
    }
    for batch in args.batches:
        cell = {}
        for name, run in (("pagedserve", run_ours), ("llama_server", run_llama_server)):
            log(f"7b, batch {batch}: {name} ...")
            try:
                cell[name] = run(args, gguf, batch)
            except Exception as exc:  # noqa: BLE001 - report it, run the rest
                cell[name] = {"error": str(exc)[-2000:]}
            log(f"7b, batch {batch}: {name}: {json.dumps(cell[name])[:300]}")
        ours, theirs = cell.get("pagedserve", {}), cell.get("llama_server", {})
        if "output_tokens_per_s" in ours and "output_tokens_per_s" in theirs:
            cell["tok_s_ratio"] = round(
                ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3
            )
            cell["peak_rss_ratio"] = round(ours["peak_rss_mib"] / theirs["peak_rss_mib"], 3)
        out[f"batch_{batch}"] = cell
    return out


# ---------------------------------------------------------------------------- perplexity


def perplexity_text(args) -> str:
    data = json.loads(
        (REPO.parent / "shared" / "data" / "sharegpt_v3_filtered_1000.json").read_text()
    )
    texts = []
    for item in data:
        turns = item.get("conversations") or []
        texts += [t["value"] for t in turns if t.get("from") in ("human", "gpt")]
        if sum(len(t) for t in texts) > args.perplexity_chars:
            break
    return "\n\n".join(texts)[: args.perplexity_chars]


# llama-perplexity's settings beside its defaults: a float32 KV cache and attention
# without flash attention (whose CPU kernel computes in float16) are its most exact.
LLAMA_EXACT = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


def llama_perplexity(args, gguf: Path, text_file: Path, extra: tuple[str, ...] = ()) -> dict:
    binary = args.lcpp_dir / "build" / "bin" / "llama-perplexity"
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(CHUNK)]
    cmd += ["-b", str(CHUNK), "-t", str(args.threads), "--chunks", str(args.chunks), *extra]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{done.stderr[-1500:]}")
    return {
        "ppl": float(found[1]),
        "seconds": round(time.perf_counter() - t, 1),
        "command": " ".join(cmd),
    }


def our_perplexity(gguf: Path, text: str, chunks: int, quantization: str) -> dict:
    """llama-perplexity's recipe: CHUNK-token chunks, each scored on tokens CHUNK/2 + 1
    to the end (each given every token before it in the chunk)."""
    from engine import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        str(gguf), quantization=quantization, max_model_len=CHUNK + 1, kv_cache_memory=256 << 20
    )
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    sequences = [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(min(chunks, len(ids) // CHUNK))]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(sequences, params, use_tqdm=False)
    scored = [
        row[seq[j]].logprob
        for out, seq in zip(outs, sequences, strict=True)
        for j, row in enumerate(out.prompt_logprobs)
        if j > CHUNK // 2
    ]
    return {
        "ppl": round(math.exp(-sum(scored) / len(scored)), 4),
        "tokens_scored": len(scored),
        "chunks": len(sequences),
        "seconds": round(time.perf_counter() - t, 1),
        "weights_bytes": llm.stats().weights_bytes,
    }


def part_perplexity(args) -> dict:
    gguf = default_model_file()
    text = perplexity_text(args)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    out = {"model": gguf.name, "text_chars": len(text), "chunk": CHUNK}
    out["llama_perplexity"] = llama_perplexity(args, gguf, Path(f.name))
    out["llama_perplexity_exact"] = llama_perplexity(args, gguf, Path(f.name), LLAMA_EXACT)
    for quantization in ("gguf", "none"):
        log(f"perplexity: ours, quantization={quantization} ...")
        out[f"pagedserve_{quantization}"] = our_perplexity(gguf, text, args.chunks, quantization)
    for q in ("gguf", "none"):
        ours = out[f"pagedserve_{q}"]["ppl"]
        out[f"pagedserve_{q}_over_llama"] = round(ours / out["llama_perplexity"]["ppl"], 4)
        exact = out["llama_perplexity_exact"]["ppl"]
        out[f"pagedserve_{q}_over_llama_exact"] = round(ours / exact, 4)
    return out


# ---------------------------------------------------------------------------- plot


def plot(report: dict, path: Path) -> None:
    """7b: output tok/s and peak RSS per batch size, ours beside llama-server;
    perplexity: llama.cpp's and ours (in blocks, dequantized)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    cells = {k: v for k, v in report.get("7b", {}).items() if k.startswith("batch_")}
    systems = ("pagedserve", "llama_server")
    for ax, metric, label in (
        (axes[0], "output_tokens_per_s", "output tok/s"),
        (axes[1], "peak_rss_mib", "peak RSS (MiB)"),
    ):
        for i, name in enumerate(systems):
            values = [cells[c].get(name, {}).get(metric) or 0 for c in cells]
            xs = [j + 0.4 * i for j in range(len(cells))]
            ax.bar(xs, values, width=0.4, label=name)
        ax.set_xticks([j + 0.2 for j in range(len(cells))], [c.replace("_", " ") for c in cells])
        ax.set_title(f"8B-shaped Q4_K_M: {label}")
        ax.legend()
    ppl = report.get("perplexity", {})
    systems = ("llama_perplexity", "llama_perplexity_exact", "pagedserve_gguf", "pagedserve_none")
    names = [n for n in systems if n in ppl]
    colors = ["tab:orange" if n.startswith("llama") else "tab:green" for n in names]
    axes[2].bar(names, [ppl[n]["ppl"] for n in names], color=colors)
    axes[2].set_title("SmolLM2 Q4_1: perplexity (512-token chunks)")
    axes[2].set_ylim(min((ppl[n]["ppl"] for n in names), default=1) * 0.95, None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- helpers


def _result(load, tokens: int, rss: float | None, cmd: list[str], **extra) -> dict:
    return {
        "output_tokens": tokens,
        "wall_s": round(load.wall_s, 2),
        "output_tokens_per_s": round(tokens / load.wall_s, 2),
        "peak_rss_mib": round(rss, 1) if rss else None,
        "errors": load.errors[:5],
        "command": " ".join(cmd),
        **{k: v for k, v in extra.items() if v is not None},
    }


def _get_json(port: int, path: str) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _threads(args) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["7b", "perplexity"], choices=["7b", "perplexity"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="ours (bfloat16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunks", type=int, default=8, help="perplexity chunks of 512 tokens")
    p.add_argument("--perplexity-chars", type=int, default=30000)
    p.add_argument("--lcpp-dir", type=Path, default=llamacpp.DEFAULT_DIR)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t = time.perf_counter()
    report = {"command": invocation(__file__), "machine": machine()}
    if "perplexity" in args.parts:
        report["perplexity"] = part_perplexity(args)
        log(f"perplexity: {json.dumps(report['perplexity'])[:600]}")
    if "7b" in args.parts:
        report["7b"] = part_7b(args)
    report["wall_s"] = round(time.perf_counter() - t, 1)
    write_report(report, args.out, lambda png: plot(report, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
