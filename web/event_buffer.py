"""Events waiting for a slow WebSocket client (see EventBuffer)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

MAX_CONTROL_EVENTS = 1024  # unsent non-delta events before a connection is closed


class EventBuffer:
    """Events waiting for a slow client, in order; a request's unsent deltas coalesce.

    Deltas merge, so only the other events (done, error, pong, session) can pile up:
    past MAX_CONTROL_EVENTS of them `push` refuses (returns False) from then on, and the
    connection is closed with SLOW_READER_CLOSE."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque()
        self.open_delta: dict[str, dict[str, Any]] = {}  # id -> its unsent delta event
        self.ready = asyncio.Event()
        self.overflowed = False

    def push(self, event: dict[str, Any]) -> bool:
        if self.overflowed:
            return False
        rid = event.get("id")
        if event["type"] == "delta":
            pending = self.open_delta.get(rid)
            if pending is not None:
                pending["text"] += event["text"]
                pending["token_ids"] += event["token_ids"]
                if "logprobs" in event:
                    pending.setdefault("logprobs", []).extend(event["logprobs"])
                return True
            self.open_delta[rid] = event
        else:
            self.open_delta.pop(rid, None)  # later deltas must not merge before this
            if len(self.events) - len(self.open_delta) >= MAX_CONTROL_EVENTS:
                self.overflowed = True
                return False
        self.events.append(event)
        self.ready.set()
        return True

    def pop(self) -> dict[str, Any] | None:
        if not self.events:
            self.ready.clear()
            return None
        event = self.events.popleft()
        if event["type"] == "delta" and self.open_delta.get(event["id"]) is event:
            del self.open_delta[event["id"]]
        return event
