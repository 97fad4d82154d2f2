"""Server-side chat sessions: the message history of a multi-turn chat.

A session belongs to whoever opened it: the API key (by fingerprint) when the server
has keys, else the WebSocket connection, whose sessions close with it. Another owner
asking for it by id is told it does not exist. Sessions are bounded in number (per
owner and in all) and in characters (the system text counts too): a memory bound.

What fits the model is counted in tokens (`fit_history`): before each turn the history
is rendered and counted, and the oldest turns are left out until the prompt leaves
room for the reply; the system prompt always stays.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from web.errors import ApiError, invalid
from web.params import valid_text

MAX_SESSION_ID_CHARS = 128


@dataclass
class Session:
    """One chat's history. Each turn's prompt is the rendered history plus the new user
    message, so the next turn's prompt starts with this turn's prompt and reply (the
    prefix a prefix cache reuses)."""

    session_id: str
    owner: str
    messages: list[dict[str, str]] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False  # a turn is generating: a second one must wait for it

    @property
    def num_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


class SessionStore:
    """Sessions by id, each bounded by `max_history_chars` (the oldest non-system turns
    are dropped first), at most `max_per_owner` per owner and `max_sessions` in all,
    expired `ttl_s` seconds after their last turn."""

    def __init__(
        self,
        ttl_s: float = 1800.0,
        max_history_chars: int = 32_000,
        max_sessions: int = 10_000,
        max_per_owner: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_history_chars = max_history_chars
        self.max_sessions = max_sessions
        self.max_per_owner = max_per_owner
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, owner: str, session_id: Any = None, system: Any = None) -> Session:
        """The owner's session `session_id` (made if new; a fresh id when None)."""
        self.expire()
        _check_id(session_id, none_ok=True)
        system = self._check_system(system)
        if session_id is not None and session_id in self._sessions:
            return self.get(owner, session_id)
        if len(self._sessions) >= self.max_sessions:
            raise ApiError("overloaded", f"too many open sessions (max {self.max_sessions})")
        if sum(s.owner == owner for s in self._sessions.values()) >= self.max_per_owner:
            raise invalid(
                f"this client has {self.max_per_owner} open sessions, the most allowed; "
                "close one (session.close) first",
                "session_id",
            )
        sid = session_id or uuid.uuid4().hex
        session = Session(sid, owner, last_used=self.clock())
        if system:
            session.messages.append({"role": "system", "content": system})
        self._sessions[sid] = session
        return session

    def get(self, owner: str, session_id: Any) -> Session:
        self.expire()
        _check_id(session_id)
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:  # another's: as if it did not exist
            raise ApiError(
                "not_found", f"no session {session_id!r} (closed or expired)", "session_id"
            )
        session.last_used = self.clock()
        return session

    def close(self, owner: str, session_id: Any) -> None:
        _check_id(session_id)
        session = self._sessions.get(session_id)
        if session is not None and session.owner == owner:
            del self._sessions[session_id]

    def close_owned_by(self, owner: str) -> None:
        """Closes every session of `owner` (a connection that went away)."""
        for sid in [sid for sid, s in self._sessions.items() if s.owner == owner]:
            del self._sessions[sid]

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
        if reply is None or session.session_id not in self._sessions:
            return
        session.messages += [message, {"role": "assistant", "content": reply}]
        self._trim(session)

    def forget_oldest(self, session: Session, count: int) -> None:
        """Drops the `count` oldest messages after the system prompt (`fit_history`
        left them out of a turn: they no longer fit the model's context)."""
        first = _num_system(session.messages)
        del session.messages[first : first + count]

    def _trim(self, session: Session) -> None:
        while session.num_chars > self.max_history_chars:
            first = 1 if session.messages and session.messages[0]["role"] == "system" else 0
            if len(session.messages) - first <= 2:
                break  # keep at least the last exchange
            del session.messages[first : first + 2]

    def _check_system(self, system: Any) -> str | None:
        if system is None:
            return None
        if not isinstance(system, str):
            raise invalid(f"system must be a string, got {type(system).__name__}", "system")
        if len(system) > self.max_history_chars:
            raise invalid(
                f"system has {len(system):,} characters; a session holds at most "
                f"{self.max_history_chars:,} (--session-max-chars)",
                "system",
            )
        valid_text("system", system)
        return system

    def expire(self) -> None:
        now = self.clock()
        stale = [
            sid
            for sid, s in self._sessions.items()
            if not s.busy and now - s.last_used > self.ttl_s
        ]
        for sid in stale:
            del self._sessions[sid]


def _check_id(session_id: Any, none_ok: bool = False) -> None:
    if session_id is None and none_ok:
        return
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise invalid(
            f"session_id must be a string of 1 to {MAX_SESSION_ID_CHARS} characters, "
            f"got {repr(session_id)[:60]}",
            "session_id",
        )
    valid_text("session_id", session_id)


TokenCount = Callable[[list[dict[str, str]]], Awaitable[int]]


def reply_room(max_model_len: int, max_tokens: int | None) -> int:
    """Tokens of the context kept for the reply: max_tokens, but at most half the
    context (a server default of max_tokens >= the context would leave no room)."""
    half = max(1, max_model_len // 2)
    return half if max_tokens is None else min(max_tokens, half)


async def fit_history(
    messages: list[dict[str, str]],
    count: TokenCount,
    max_model_len: int,
    max_tokens: int | None,
    field: str,
) -> tuple[list[dict[str, str]], int]:
    """`messages` less their oldest turns, so that its prompt (`count` renders and
    counts it) leaves `reply_room` tokens of the context free; and how many messages
    were left out. The leading system messages and the last message always stay, and
    what remains starts at a user message (templates that want turns to alternate).
    Bounded: a few counts (the common cases: 1 or 2), a binary search at worst.
    Raises invalid_request naming `field` when even the last message alone is too long."""
    room = max_model_len - reply_room(max_model_len, max_tokens)
    head, body = messages[: _num_system(messages)], messages[_num_system(messages) :]
    starts = [0, *(i for i, m in enumerate(body) if i and m["role"] == "user")]
    if len(body) > 1 and starts[-1] != len(body) - 1:
        starts.append(len(body) - 1)
    sizes: dict[int, int] = {}

    async def fits(k: int) -> bool:
        sizes[k] = await count(head + body[starts[k] :])
        return sizes[k] <= room

    if await fits(0):
        return messages, 0
    last = len(starts) - 1
    if last == 0 or not await fits(last):
        raise invalid(
            f"{field} cannot fit this model's context even without earlier turns: the "
            f"system prompt and the new message take {sizes[last]:,} tokens, and at most "
            f"{room:,} fit (max_model_len {max_model_len:,} less {max_model_len - room:,} kept "
            "for the reply: max_tokens, at most half the context); shorten the message or "
            "lower max_tokens",
            field,
        )
    lo, hi = 0, last  # lo does not fit, hi fits
    if hi > 1:  # the common case first: one turn more than fits
        lo, hi = (lo, 1) if await fits(1) else (1, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if await fits(mid) else (mid, hi)
    return head + body[starts[hi] :], starts[hi]


def _num_system(messages: list[dict[str, str]]) -> int:
    """How many messages at the start are system messages (the system prompt)."""
    return next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
