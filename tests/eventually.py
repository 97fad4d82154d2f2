"""Waiting for what has no event to await (a metric, another process's state): one
poll helper, bounded, that says what it waited for when it gives up (`what`: a text, or
a function asked then, for the state it gave up on)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

POLL_S = 0.02


Says = str | Callable[[], str]


async def eventually(check: Callable[[], object], timeout: float = 5.0, what: Says = "") -> None:
    """Returns once `check()` is truthy (awaited when it returns an awaitable: a check
    that asks another process); fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await _value(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {_said(what) or check}")
        await asyncio.sleep(POLL_S)


def _said(what: Says) -> str:
    return what() if callable(what) else what


async def _value(result: object) -> object:
    return await result if inspect.isawaitable(result) else result


def eventually_sync(check: Callable[[], object], timeout: float = 5.0, what: Says = "") -> None:
    """`eventually` for synchronous tests."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {_said(what) or check}")
        time.sleep(POLL_S)
