"""The layout's promises: the pure-logic packages (the simulator among them) never
import torch, no module of the product imports itself through others (no import
circle), each declared seam (`EngineClient`, `BlockTables`, the SDK's `Connection`) is
implemented in full by every class behind it, and each rule has one home (the scheduler
is built in one file, stop strings matched in one)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.protocols import conformance_errors

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "actors", "web", "bench", "cuda_ext")


def _product_files() -> list[Path]:
    return [f for d in PRODUCT for f in (REPO / d).rglob("*.py")]


PURE = ["engine.core", "engine.kv", "engine.text", "engine.messages", "engine.sim"]


@pytest.mark.parametrize("module", PURE)
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(name: str, path: Path):
    """Every module name an import anywhere in `path` may refer to (a function's
    lazy import and a TYPE_CHECKING one count too), relative imports resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (a package's own __init__ excluded)."""
    modules = {
        _module_name(f): f
        for d in ("engine", "actors", "web", "cuda_ext")
        for f in (REPO / d).rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next((w for w in edges if w not in index or w in stack), None)
            if step is not None and step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step is not None:
                low[node] = min(low[node], index[step])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(group) > 1:
                        circles.append(sorted(group))
    return circles


def test_no_module_imports_itself_through_others():
    assert _circles(_import_graph()) == []


def test_a_planted_import_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def _seams():
    """(protocol, implementation, a built instance or None) for every declared seam."""
    from actors.async_engine import AsyncEngine
    from actors.engine_client import EngineClient
    from actors.replica_set import ReplicaSet
    from actors.restarting_engine import RestartingEngine
    from engine.kv.block_ledger import BlockLedger
    from engine.kv.block_tables import BlockTables
    from engine.kv.kv_cache_manager import KVCacheManager
    from engine.sim.baselines.contiguous_kv_cache import ContiguousKVCacheManager
    from engine.sim.baselines.reservation import ReservationPolicy
    from engine.sim.baselines.unshared_kv_cache import UnsharedKVCacheManager
    from web.client import AsyncClient
    from web.client_connection import Connection

    tables = [
        KVCacheManager(8, 4),
        BlockLedger(8, 4),
        UnsharedKVCacheManager(8, 4),
        ContiguousKVCacheManager(8, 4, ReservationPolicy.MAX, 32),
    ]
    return [
        *((EngineClient, cls, None) for cls in (AsyncEngine, RestartingEngine, ReplicaSet)),
        *((BlockTables, type(t), t) for t in tables),
        (Connection, AsyncClient, AsyncClient("ws://127.0.0.1:1")),
    ]


def test_every_seam_is_implemented_in_full():
    errors = [e for protocol, cls, obj in _seams() for e in conformance_errors(cls, protocol, obj)]
    assert errors == []


def test_a_missing_or_reshaped_member_is_found():
    from actors.engine_client import EngineClient

    class Partial:
        async def abort(self, request_id: str, extra: int) -> None: ...
        def stats(self): ...

    errors = conformance_errors(Partial, EngineClient)
    assert any("Partial.abort(" in e for e in errors)
    assert any("'generate'" in e for e in errors)
