"""Waiting for what has no event to await (a metric, another process's state): one
poll helper, bounded, that says what it waited for when it gives up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.02


async def eventually(check: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Returns once `check()` is truthy; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or check}")
        await asyncio.sleep(POLL_S)


def eventually_sync(check: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """`eventually` for synchronous tests."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or check}")
        time.sleep(POLL_S)
