"""The layout's promises: the pure-logic packages never import torch, and each rule
has one home (the scheduler is built in one file, stop strings matched in one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "actors", "web", "bench", "cuda_ext")


def _product_files() -> list[Path]:
    return [f for d in PRODUCT for f in (REPO / d).rglob("*.py")]


@pytest.mark.parametrize("module", ["engine.core", "engine.kv", "engine.text", "engine.messages"])
def test_pure_packages_do_not_import_torch(module):
    code = (
        "import importlib, pkgutil, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "for info in pkgutil.walk_packages(getattr(m, '__path__', []), m.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('transformers')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"


def _callers(pattern: str) -> set[str]:
    call = re.compile(pattern)
    return {str(f.relative_to(REPO)) for f in _product_files() if call.search(f.read_text())}


def test_the_scheduler_is_constructed_in_one_file():
    assert _callers(r"\bScheduler\(") == {"engine/core/engine_core.py"}


def test_stop_strings_are_matched_in_one_module():
    assert _callers(r"(?<!def )\b(find_stop|hold_back)\(") == {"engine/text/text_processor.py"}


def test_engine_core_is_built_in_one_factory():
    assert _callers(r"\bEngineCore\(") == {"engine/wiring.py"}
