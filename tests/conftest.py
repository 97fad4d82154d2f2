"""Shared fixtures: where ../shared is, and tiny random HF checkpoints on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton's kernels run interpreted on a machine without a GPU (cuda_ext/triton_kernels):
# Triton reads this once, when first imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.network_namespace import two_hosts  # noqa: F401 - a fixture for every test

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the test (a user's checkout has no ../shared)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared holds real weights and data)")
    return path


@pytest.fixture(autouse=True, scope="session")
def _single_thread_torch():
    """Tiny test models run fastest on one thread, and CI's 2 cores stay uncontended."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
