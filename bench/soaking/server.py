"""The server under test: its flags, its shutdown, and what its log says."""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shlex
import signal
import time
from pathlib import Path

from workload import SHARED

from web.launch import ServerProcess

from .procs import still_alive
from .progress import since

DEFAULT_MODEL = SHARED / "models" / "stories260K"
SHUTDOWN_S = 30.0  # SIGTERM to exit


def kv_cache_bytes(model: Path, max_num_seqs: int, block_size: int) -> int:
    """Enough blocks for `max_num_seqs` sequences at full context (no preemption)."""
    from engine.engine_args import EngineArgs
    from engine.worker.kv_cache import block_bytes

    config = EngineArgs(model=str(model), skip_tokenizer_init=True).build().model
    blocks_per_seq = -(-config.max_model_len // block_size)
    return block_bytes(config, block_size) * blocks_per_seq * max_num_seqs


def server_args(
    a: argparse.Namespace, data_parallel: int = 1, restart: bool | None = None
) -> list[str]:
    """`pagedserve serve` flags from the server options of the command line, with
    `data_parallel` replicas; `restart` False (default: not --no-restart) adds
    `--max-worker-restarts 0`."""
    kv = a.kv_cache_memory or kv_cache_bytes(Path(a.model), a.max_num_seqs, 16)
    restart = not a.no_restart if restart is None else restart
    return [
        "--model",
        str(a.model),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--kv-cache-memory",
        str(kv),
        "--max-message-bytes",
        str(a.max_message_bytes),
        *(["--chat-template", str(a.chat_template_file)] if a.chat_template_file else []),
        *(["--data-parallel-size", str(data_parallel)] if data_parallel > 1 else []),
        *([] if restart else ["--max-worker-restarts", "0"]),
        *shlex.split(a.server_args),
    ]


def shutdown(server: ServerProcess, procs: dict[int, str]) -> dict:
    """SIGTERM; the server must exit within SHUTDOWN_S and leave no worker behind."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
        code = None
        server.proc.kill()
        server.proc.wait()
    exit_s = since(start)
    time.sleep(0.5)
    left = still_alive(procs)
    for pid in procs:  # only the processes this script started (the server's children)
        if any(entry.startswith(f"{pid} ") for entry in left):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return {"exit_code": code, "exit_after_s": exit_s, "processes_left": left}


def server_log_summary(path: Path) -> dict:
    """Counts of ERROR lines, tracebacks and the most common exception lines."""
    lines = path.read_text(errors="replace").splitlines()
    exceptions = collections.Counter(
        line.strip()[:160]
        for line in lines
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b(: |$)", line.strip())
    )
    return {
        "path": str(path),
        "error_lines": sum(line.startswith("ERROR") for line in lines),
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
        "exceptions": dict(exceptions.most_common(12)),
    }
