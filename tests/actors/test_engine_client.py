"""`EngineClient` is the one interface web/ talks to: web/ uses nothing of an engine
that the protocol lacks (that each engine client implements the protocol in full is a
layout rule: tests/engine/test_layout.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from actors.engine_client import EngineClient
from tests.protocols import protocol_members

REPO = Path(__file__).resolve().parents[2]
MEMBERS = sorted(protocol_members(EngineClient))


def _engine_members_used(path: Path) -> set[str]:
    """The attributes read of anything named `engine` (`engine.x`, `self.engine.x`)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
            isinstance(owner, ast.Attribute) and owner.attr == "engine"
        ):
            used.add(node.attr)
    return used


def test_web_uses_nothing_of_an_engine_beyond_the_protocol():
    used = set().union(*(_engine_members_used(f) for f in (REPO / "web").rglob("*.py")))
    assert used, "web/ reads nothing of an engine: this check has gone blind"
    assert used <= set(MEMBERS), f"web/ uses {sorted(used - set(MEMBERS))} beyond EngineClient"
