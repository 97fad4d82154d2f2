"""Runs a benchmark child that writes its result to a JSON file, and reads that file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def run_for_result(cmd: list[str], env: dict[str, str], result_file: Path, name: str) -> dict:
    """`cmd` with `env` added to this environment; its JSON result, or RuntimeError with
    the last lines of its stderr when it failed or wrote nothing."""
    done = subprocess.run(
        cmd,
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0 or not result_file.is_file():
        tail = "\n".join(done.stderr.replace("\r", "\n").splitlines()[-15:])
        raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{tail}")
    return json.loads(result_file.read_text())
