"""Server-side chat sessions: the message history of a multi-turn chat."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from web.errors import ApiError, invalid


@dataclass
class Session:
    """One chat's history. Each turn's prompt is the rendered history plus the new user
    message, so the next turn's prompt starts with this turn's prompt and reply (the
    prefix a prefix cache reuses)."""

    session_id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False  # a turn is generating: a second one must wait for it


class SessionStore:
    """Sessions by id, each bounded by `max_history_chars` (the oldest non-system turns
    are dropped first) and expired `ttl_s` seconds after their last turn."""

    def __init__(
        self,
        ttl_s: float = 1800.0,
        max_history_chars: int = 32_000,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_history_chars = max_history_chars
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str | None = None, system: str | None = None) -> Session:
        self.expire()
        if session_id is not None and session_id in self._sessions:
            return self.get(session_id)
        if len(self._sessions) >= self.max_sessions:
            raise ApiError("overloaded", f"too many open sessions (max {self.max_sessions})")
        sid = session_id or uuid.uuid4().hex
        session = Session(sid, last_used=self.clock())
        if system:
            session.messages.append({"role": "system", "content": system})
        self._sessions[sid] = session
        return session

    def get(self, session_id: str) -> Session:
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(
                "not_found", f"no session {session_id!r} (closed or expired)", "session_id"
            )
        session.last_used = self.clock()
        return session

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def begin_turn(self, session: Session, message: dict[str, str]) -> list[dict[str, str]]:
        """The messages to render for this turn (history + `message`)."""
        if session.busy:
            raise invalid(
                f"session {session.session_id!r} is still generating its previous turn",
                "session_id",
            )
        session.busy = True
        return [*session.messages, message]

    def end_turn(self, session: Session, message: dict[str, str], reply: str | None) -> None:
        """Appends the turn (only a completed reply: an aborted or failed turn leaves the
        history as it was) and trims the history to its bound."""
        session.busy = False
        session.last_used = self.clock()
        if reply is None:
            return
        session.messages += [message, {"role": "assistant", "content": reply}]
        self._trim(session)

    def _trim(self, session: Session) -> None:
        def size() -> int:
            return sum(len(m["content"]) for m in session.messages)

        while size() > self.max_history_chars:
            first = 1 if session.messages and session.messages[0]["role"] == "system" else 0
            if len(session.messages) - first <= 2:
                break  # keep at least the last exchange
            del session.messages[first : first + 2]

    def expire(self) -> None:
        now = self.clock()
        stale = [
            sid
            for sid, s in self._sessions.items()
            if not s.busy and now - s.last_used > self.ttl_s
        ]
        for sid in stale:
            del self._sessions[sid]
