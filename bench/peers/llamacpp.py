"""llama.cpp for the end-to-end comparison: build `llama-server` once, convert HF
checkpoints to GGUF, run the server on 127.0.0.1.

Everything lives under one cache directory (default `~/.cache/pagedserve/peers/llamacpp`):

    llama_cpp_python-VERSION.tar.gz   the sdist from PyPI (it vendors llama.cpp)
    llama_cpp_python-VERSION/         unpacked; vendor/llama.cpp is the source tree
    build/bin/llama-server            the binary (shared libs beside it)
    build.log, build-info.json        the build's output, and what was built how (seconds)

A finished build is reused; an interrupted one resumes (`cmake --build` is incremental).
The build runs under `nice` with few jobs (two cores take 10-20 minutes) so that it does
not starve other work on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what gets built
DEFAULT_DIR = Path.home() / ".cache" / "pagedserve" / "peers" / "llamacpp"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=ON",  # this machine's ISA (AVX2 here), as our torch build uses it
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
)
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class LlamaCpp:
    """The cache directory's layout for one llama-cpp-python version."""

    root: Path = DEFAULT_DIR
    version: str = VERSION

    @property
    def sdist(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def server_bin(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    @property
    def build_info_file(self) -> Path:
        return self.root / "build-info.json"

    def build_info(self) -> dict | None:
        if not self.build_info_file.is_file():
            return None
        return json.loads(self.build_info_file.read_text())


def fetch_source(lcpp: LlamaCpp, log: Log) -> None:
    """Downloads the sdist with pip (PyPI) and unpacks it, unless already there."""
    if (lcpp.source / "CMakeLists.txt").is_file():
        return
    lcpp.root.mkdir(parents=True, exist_ok=True)
    if not lcpp.sdist.is_file():
        log(f"downloading the llama-cpp-python {lcpp.version} sdist into {lcpp.root}")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run(
            [*pip, "-d", str(lcpp.root), f"llama-cpp-python=={lcpp.version}"], check=True
        )
    with tarfile.open(lcpp.sdist) as tar:
        tar.extractall(lcpp.root, filter="data")


def build_server(lcpp: LlamaCpp, jobs: int, log: Log) -> dict:
    """Builds llama-server unless it exists; returns build-info (with `reused`)."""
    if lcpp.server_bin.is_file():
        info = lcpp.build_info() or {"version": lcpp.version}
        return {**info, "reused": True, "server_bin": str(lcpp.server_bin)}
    fetch_source(lcpp, log)
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"building llama-server needs {' and '.join(missing)}; install them")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake",
        "-S",
        str(lcpp.source),
        "-B",
        str(lcpp.build_dir),
        *generator,
        *CMAKE_FLAGS,
    ]
    build = ["cmake", "--build", str(lcpp.build_dir), "--config", "Release", f"-j{jobs}"]
    build += ["--target", "llama-server"]
    niced = ["nice", "-n", "10"]
    log(f"building llama-server in {lcpp.build_dir} ({jobs} jobs, nice 10; log: build.log)")
    t0 = time.monotonic()
    with (lcpp.root / "build.log").open("a") as out:
        if not (lcpp.build_dir / "CMakeCache.txt").is_file():
            subprocess.run([*niced, *configure], stdout=out, stderr=subprocess.STDOUT, check=True)
        done = subprocess.run([*niced, *build], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not lcpp.server_bin.is_file():
        raise RuntimeError(f"the llama-server build failed; see {lcpp.root / 'build.log'}")
    info = {
        "version": lcpp.version,
        "build_seconds": round(time.monotonic() - t0, 1),
        "jobs": jobs,
        "cmake_flags": list(CMAKE_FLAGS),
        "generator": "Ninja" if generator else "default",
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    lcpp.build_info_file.write_text(json.dumps(info, indent=1) + "\n")
    log(f"built llama-server in {info['build_seconds']:.0f} s")
    return {**info, "reused": False, "server_bin": str(lcpp.server_bin)}


def convert_to_gguf(lcpp: LlamaCpp, hf_dir: Path, dtype: str, python: Path, log: Log) -> Path:
    """HF_DIR/model-<type>.gguf made by the sdist's vendored `convert_hf_to_gguf.py` (with
    its vendored gguf-py, so converter and format match the binary), unless already made
    after the weights were written."""
    outtype = GGUF_TYPES[dtype]
    out = hf_dir / f"model-{outtype}.gguf"
    weights = hf_dir / "model.safetensors"
    if out.is_file() and out.stat().st_mtime >= weights.stat().st_mtime:
        return out
    fetch_source(lcpp, log)
    log(f"converting {hf_dir} to {out.name}")
    env = dict(os.environ, PYTHONPATH=str(lcpp.source / "gguf-py"))
    cmd = [str(python), str(lcpp.source / "convert_hf_to_gguf.py"), str(hf_dir)]
    cmd += ["--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"GGUF conversion of {hf_dir} failed:\n{tail}")
    return out


@dataclass(frozen=True)
class ServerOptions:
    """llama-server's knobs for one run. `ctx` is the KV size in tokens for all slots
    together; `kv_unified` shares it between slots (one buffer, as our block pool)."""

    parallel: int
    threads: int
    ctx: int
    batch: int = 2048
    ubatch: int = 512
    flash_attn: str = "auto"
    kv_unified: bool = True


class LlamaServer:
    """`llama-server` on 127.0.0.1:`port`, continuous batching over `parallel` slots, no
    prompt cache (`--cache-ram 0`; requests also send `cache_prompt: false`)."""

    def __init__(self, binary: Path, gguf: Path, options: ServerOptions, port: int, log_path: Path):
        o = options
        self.port = port
        self.log_path = log_path
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        self.cmd += ["-np", str(o.parallel), "-c", str(o.ctx), "-cb"]
        self.cmd += ["-t", str(o.threads), "-tb", str(o.threads)]
        self.cmd += ["-b", str(o.batch), "-ub", str(o.ubatch), "-fa", o.flash_attn]
        self.cmd += ["--cache-ram", "0", "--no-webui", "-kvu" if o.kv_unified else "-no-kvu"]
        self.proc: subprocess.Popen | None = None

    def start(self, healthy: Callable[[], bool], timeout: float = 120.0) -> None:
        """Starts the process and returns once `healthy()` (GET /health) says so."""
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}{self._tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s{self._tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return ":\n" + "\n".join(text)


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """/completion with token ids: greedy, exactly `max_tokens` tokens (end-of-generation
    logits masked), no prompt cache, the generated ids in the answer."""
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "seed": 0,
    }


def completion_tokens(answer: dict) -> int:
    return len(answer.get("tokens") or []) or int(answer.get("tokens_predicted", 0))
