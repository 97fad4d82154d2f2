"""Directories written once into the cache and then only read."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_once(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write(scratch)` into a sibling scratch directory and renamed
    into place unless `target/marker` already exists: a half-written directory is never
    seen, and of two processes racing the loser's identical copy is dropped."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
