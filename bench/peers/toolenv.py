"""The scratch venv for the GGUF tools.

llama.cpp's converter needs `sentencepiece` and `protobuf` (for SentencePiece
tokenizers), transformers' GGUF loader needs `gguf` and `accelerate`. None of them belongs
in the bench's own environment, so they go into a venv created with
`--system-site-packages` (it sees the installed torch and transformers) under /tmp.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path("/tmp/peer-venv")
# import name -> pip name
PACKAGES = {
    "sentencepiece": "sentencepiece",
    "google.protobuf": "protobuf",
    "gguf": "gguf",
    "accelerate": "accelerate",
}


def peer_python(venv: Path = DEFAULT_VENV, log=print) -> Path:
    """The venv's python, creating the venv and installing what is missing first."""
    python = venv / "bin" / "python"
    if not python.is_file():
        log(f"creating the scratch venv {venv} (--system-site-packages)")
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True
        )
    missing = [pip for mod, pip in PACKAGES.items() if not _importable(python, mod)]
    if missing:
        log(f"installing {', '.join(missing)} into {venv}")
        subprocess.run([str(python), "-m", "pip", "install", "-q", *missing], check=True)
    return python


def _importable(python: Path, module: str) -> bool:
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    return probe.returncode == 0
