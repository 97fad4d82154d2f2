"""Fixtures the actor tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context for one test, destroyed (sockets unlingered) after it."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)
