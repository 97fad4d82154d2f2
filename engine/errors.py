"""How an exception is named to the client whose request it ended."""

from __future__ import annotations

import traceback


def describe(exc: BaseException) -> str:
    """One line: the exception's type and message (no traceback; that goes to the log)."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


class EngineBusy(RuntimeError):
    """The engine refused a call for load, not for its content: the caller may retry
    (the web layer answers 503)."""
