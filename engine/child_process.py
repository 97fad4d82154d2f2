"""Starting a child Python process that runs a module of this repository.

The worker processes of a served engine (`actors.worker_launch`) and the follower ranks
of an offline one (`engine.worker.parallel.offline_ranks`) are both `python -m MODULE`
children that must import the same code as their parent, whether it was installed or
runs from a checkout: the repository goes first on their PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, the repository first on PYTHONPATH, `extra` over it."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **(extra or {}))


def start_module(
    module: str,
    args: Sequence[str],
    extra_env: Mapping[str, str] | None = None,
    popen_kwargs: Mapping[str, Any] | None = None,
) -> subprocess.Popen:
    """`python -m module *args` with this interpreter, in `child_environment(extra_env)`
    (`popen_kwargs`: pipes and the like, passed to Popen)."""
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.Popen(cmd, env=child_environment(extra_env), **(popen_kwargs or {}))
