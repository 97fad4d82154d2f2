"""What the server keeps out of its logs and answers: query values in the request lines
uvicorn logs (names kept), and its own file paths in what a client reads."""

from __future__ import annotations

import logging

import pytest

from web.redaction import QueryRedactor, hide_paths, redact_query, redact_request_lines

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "target, logged",
    [
        ("/v1/models", "/v1/models"),
        ("/v1/models?api_key=sk-1", "/v1/models?api_key=<redacted>"),
        (
            "/v1/stream?encoding=msgpack&token=sk-2",
            "/v1/stream?encoding=<redacted>&token=<redacted>",
        ),
        ("/x?sk-bare-key", "/x?<redacted>"),
        ("/x?a=;b=2&&", "/x?a=;b=<redacted>&&"),
    ],
)
def test_query_values_are_redacted_and_names_kept(target, logged) -> None:
    assert redact_query(target) == logged


def access_record(target: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes one."""
    args = ("127.0.0.1:5555", "GET", target, "1.1", 200)
    line = '%s - "%s %s HTTP/%s" %d'
    return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, line, args, None)


def test_the_filter_rewrites_the_logged_line_and_lets_it_through() -> None:
    record = access_record("/v1/completions?api_key=sk-secret-1")
    assert QueryRedactor().filter(record)
    line = record.getMessage()
    assert "sk-secret-1" not in line
    assert line == '127.0.0.1:5555 - "GET /v1/completions?api_key=<redacted> HTTP/1.1" 200'
    ws_args = ("127.0.0.1:5555", "/v1/stream?token=sk-2", "[accepted]")
    ws = logging.LogRecord(
        "uvicorn.error", logging.INFO, "ws.py", 1, '%s - "WebSocket %s" %s', ws_args, None
    )
    assert QueryRedactor().filter(ws) and "sk-2" not in ws.getMessage()


class Lines(logging.Handler):
    """The formatted lines a logger wrote."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_the_request_line_loggers_get_one_filter_each() -> None:
    redact_request_lines()
    redact_request_lines()  # once only
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        assert sum(isinstance(f, QueryRedactor) for f in logger.filters) == 1
    logger, written = logging.getLogger("uvicorn.access"), Lines()
    level = logger.level
    logger.addHandler(written)
    logger.setLevel(logging.INFO)
    try:
        logger.info('%s - "%s %s HTTP/%s" %d', "c", "GET", "/v1/models?api_key=sk-3", "1.1", 200)
    finally:
        logger.removeHandler(written)
        logger.setLevel(level)
    assert written.lines == ['c - "GET /v1/models?api_key=<redacted> HTTP/1.1" 200']


def test_paths_are_cut_to_their_last_part() -> None:
    reason = "native CPU kernels loaded from /root/.cache/pagedserve/torch_extensions/ops_1"
    assert hide_paths(reason) == "native CPU kernels loaded from .../ops_1"
    assert hide_paths("failed: /a/b/x.cpp:12: error") == "failed: .../x.cpp:12: error"
    kept = "see https://example.org/a/b, ./rel/dir and 3/4"
    assert hide_paths(kept) == kept
    assert hide_paths(None) is None
