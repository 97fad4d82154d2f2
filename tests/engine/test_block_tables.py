"""`BlockTables`: the protocol names everything the engine core uses of its tables
(that each implementation has every member with its signature is a layout rule:
tests/engine/test_layout.py)."""

from __future__ import annotations

import re
from pathlib import Path

from engine.kv.block_tables import BlockTables
from tests.protocols import protocol_members

CORE = Path(__file__).resolve().parents[2] / "engine" / "core"


def test_the_protocol_names_about_two_dozen_members():
    assert 20 <= len(protocol_members(BlockTables)) <= 32


def test_the_engine_core_uses_only_protocol_members_of_its_tables():
    """What engine/core reads of `kv_cache` / `blocks` (the scheduler's and the core's
    names for their tables) is all in the protocol."""
    used = set()
    for path in CORE.glob("*.py"):
        used |= set(re.findall(r"(?<![\w.])(?:kv_cache|blocks|kv)\.(\w+)", path.read_text()))
    assert used, "the scan found no uses: the names changed?"
    assert used <= set(protocol_members(BlockTables)), sorted(
        used - set(protocol_members(BlockTables))
    )
