"""Builds and loads the native CPU kernels (`cuda_ext/csrc/cpu/*.cpp`), once per process.

`load_cpu_ops()` compiles the sources with torch's extension builder (ninja, `-O3
-march=native -fopenmp`) into `<cache>/torch_extensions/pagedserve_cpu_<key>/`, where
`<cache>` is `$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve`, else
`~/.cache/pagedserve`, and `<key>` hashes the sources, the torch version, the Python ABI,
the CPU's feature flags and the build flags: changed sources or another CPU build anew,
an unchanged one imports the finished library directly (no compiler, no ninja run).

It never raises: a missing compiler, a failed build or a failed import give a
`LoadResult` with no module and the reason (the first lines of the compiler's error),
logged once at WARNING; callers fall back to `cuda_ext.reference`. `PAGEDSERVE_NATIVE=0`
turns the native kernels off.

Concurrent builds: one process builds while the others wait on an flock of
`build.lock` in the build directory (released by the kernel if the builder dies), and a
library counts as finished only once its `built` marker exists.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CPU_SOURCES = Path(__file__).resolve().parent / "csrc" / "cpu"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
DISABLE_ENV = "PAGEDSERVE_NATIVE"
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"
_REASON_LINES = 6


@dataclass(frozen=True)
class LoadResult:
    """The outcome of loading the native CPU ops: the module, or None and why."""

    module: ModuleType | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.module is not None


@functools.cache
def load_cpu_ops() -> LoadResult:
    """The compiled ops module, built on first use; never raises (see the module doc)."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return LoadResult(None, f"native CPU kernels disabled by {DISABLE_ENV}=0")
    try:
        module, where = _build_and_import()
    except Exception as exc:  # noqa: BLE001 - any failure means "use the reference"
        reason = _summarize(exc)
        logger.warning("native CPU kernels unavailable, using the pure-torch ops: %s", reason)
        return LoadResult(None, reason)
    return LoadResult(module, f"native CPU kernels loaded from {where}")


def cache_root() -> Path:
    """Where pagedserve keeps files it can rebuild."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "pagedserve"


def build_key() -> str:
    """What the built library depends on, hashed: sources, torch, Python ABI, CPU, flags."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(CPU_SOURCES.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    compiler = os.environ.get("CXX", "c++")
    for part in (torch.__version__, sys.implementation.cache_tag, platform.machine(),
                 _cpu_flags(), compiler, *CFLAGS, *LDFLAGS):  # fmt: skip
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _build_and_import() -> tuple[ModuleType, Path]:
    name = f"pagedserve_cpu_{build_key()}"
    build_dir = cache_root() / "torch_extensions" / name
    marker = build_dir / "built"
    if not marker.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(build_dir / "build.lock"):
            if not marker.exists():
                module = _build(name, build_dir)
                marker.touch()
                return module, build_dir
    try:
        return _import(name, build_dir / f"{name}.so"), build_dir
    except ImportError as exc:
        raise ImportError(f"{exc} (delete {build_dir} to rebuild)") from exc


def _build(name: str, build_dir: Path) -> ModuleType:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: `{compiler}` is not on PATH (install g++ or set CXX)")
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja is not on PATH (pip install ninja)")
    from torch.utils import cpp_extension

    # Left by a build that was killed: torch's own lock file, a half-written library.
    (build_dir / "lock").unlink(missing_ok=True)
    (build_dir / f"{name}.so").unlink(missing_ok=True)
    logger.info("building native CPU kernels (once, ~1 min) in %s ...", build_dir)
    start = time.monotonic()
    module = cpp_extension.load(
        name=name,
        sources=[str(path) for path in sorted(CPU_SOURCES.glob("*.cpp"))],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    logger.info("built native CPU kernels in %.0f s", time.monotonic() - start)
    return module


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive flock on lock_path; the kernel drops it if this process dies."""
    import fcntl

    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building native CPU kernels ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _summarize(exc: Exception) -> str:
    """The first lines of a failure: the compiler's `error:` lines where there are any."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    diagnostics = [line for line in lines if "error:" in line]
    chosen = (diagnostics or lines)[:_REASON_LINES] or [repr(exc)]
    return f"{type(exc).__name__}: " + "\n".join(line[:300] for line in chosen)
