"""Fixtures of the tests that run the real default model (SmolLM2-135M-Instruct).

They need the model in the cache (`pagedserve fetch`, which `bash .ci/setup` runs) and
are skipped, saying so, when it has not been fetched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cuda_ext.build import cache_root
from engine.default_model import SMOLLM2, cached_default_model
from tests.web.conftest import RunningServer
from web.launch import ServerProcess


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = cached_default_model(cache_root())
    if path is None:
        pytest.skip(f"the default model {SMOLLM2.name} is not fetched: run `pagedserve fetch`")
    return path


@pytest.fixture(scope="session")
def smollm2_server(smollm2_path: Path) -> Iterator[RunningServer]:
    """`pagedserve serve` with no model argument: the default model."""
    args = ["--kv-cache-memory", str(256 << 20), "--max-model-len", "2048"]
    process = ServerProcess(args, env={"OMP_NUM_THREADS": "2"})
    process.start(timeout=240)
    yield RunningServer(process.port, SMOLLM2.name, str(smollm2_path), None, process)
    process.stop()
