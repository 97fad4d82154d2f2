"""`RequestIds`: an engine client's request ids, minted or checked.

Every engine client starts a request the same way: the caller's id, checked, or one of
its own; and an id already in flight is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

from engine.text.text_checks import check_request_id


class RequestIds:
    """Mints ids `{kind}-{n}` (n counts every id this client minted, of any kind) and
    checks the ones callers name (`check_request_id`: ValueError naming the problem)."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def mint(self, kind: str) -> str:
        return f"{kind}-{next(self._count)}"

    def claim(self, request_id: str | None, kind: str) -> str:
        """`request_id`, checked, or (None or empty) a new id of `kind`."""
        request_id = request_id or self.mint(kind)
        check_request_id(request_id)
        return request_id


def refuse_open(request_id: str, open_ids: Container[str]) -> None:
    """ValueError when `request_id` is one of the requests in flight, `open_ids`."""
    if request_id in open_ids:
        raise ValueError(f"request_id {request_id!r} is already in flight")
