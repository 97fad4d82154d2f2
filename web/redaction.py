"""What the server keeps out of its logs and its answers: query-string values in the
request lines uvicorn logs (a client may send its API key as `?api_key=...`, and log
files are read by more people than the keys' owners), and the server's own file paths
in what any client may read (`/v1/info`)."""

from __future__ import annotations

import logging
import os
import re

REDACTED = "<redacted>"
REQUEST_LINE_LOGGERS = ("uvicorn.access", "uvicorn.error")  # HTTP lines, WebSocket lines
_QUERY_SEPARATORS = re.compile(r"([&;])")
# An absolute path: a "/" that does not continue a word, a URL or another path.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/[^\s'\"`(),;:<>]+")


def redact_query(target: str) -> str:
    """A request target with every query value replaced by REDACTED, the parameter
    names kept: `/v1/models?api_key=sk-1&x=2` -> `/v1/models?api_key=<redacted>&x=<redacted>`.
    A parameter without `=` (which could be a bare key) is replaced whole."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    parts = _QUERY_SEPARATORS.split(query)
    return f"{path}?{''.join(_redact_part(p) for p in parts)}"


def _redact_part(part: str) -> str:
    if part in ("", "&", ";"):
        return part
    name, equals, value = part.partition("=")
    if not equals:
        return REDACTED
    return f"{name}={REDACTED}" if value else part


class QueryRedactor(logging.Filter):
    """Rewrites the request targets among a log record's arguments (strings starting
    with "/" that carry a query) with `redact_query`; lets every record through.
    uvicorn logs the target as an argument (`'%s - "%s %s HTTP/%s" %d'` on
    uvicorn.access, `'%s - "WebSocket %s" ...'` on uvicorn.error), so the formatted
    line, whatever formatter or handler writes it, holds no query value."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(map(_is_target, record.args)):
            record.args = tuple(redact_query(a) if _is_target(a) else a for a in record.args)
        return True


def _is_target(arg: object) -> bool:
    return isinstance(arg, str) and arg.startswith("/") and "?" in arg


def redact_request_lines() -> None:
    """Adds a QueryRedactor to uvicorn's request-line loggers (once). Call it after
    `uvicorn.Config(...)`, which configures those loggers."""
    for name in REQUEST_LINE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QueryRedactor) for f in logger.filters):
            logger.addFilter(QueryRedactor())


def hide_paths(text: str | None) -> str | None:
    """`text` with each absolute file path cut to its last part
    (`loaded from /root/.cache/x/ops` -> `loaded from .../ops`): a client learns what
    happened, not where the server keeps its files."""
    if text is None:
        return None
    return _ABSOLUTE_PATH.sub(lambda m: f".../{os.path.basename(m.group().rstrip('/'))}", text)
