"""A server-sent event is one `data:` line for every line splitter: generated text
holding characters that `str.splitlines` counts as line breaks (U+0085, U+2028,
U+2029; httpx's `aiter_lines` splits on them too) must not cut the event in two."""

from __future__ import annotations

import json

import httpx

from web.openai_format import sse

TEXT = "a\x85b\u2028c\u2029d\ne\rf\x1cg é"


def test_an_event_with_unicode_line_breaks_stays_one_line() -> None:
    event = sse({"choices": [{"text": TEXT}]})
    assert event.endswith("\n\n")
    (line,) = event[:-2].splitlines()
    assert json.loads(line[len("data: ") :]) == {"choices": [{"text": TEXT}]}
    assert "é" in line  # other non-ASCII text stays raw


def test_httpx_reads_the_event_back_whole() -> None:
    body = sse({"text": TEXT}) + "data: [DONE]\n\n"
    response = httpx.Response(200, content=body.encode("utf-8"))
    lines = [x for x in response.iter_lines() if x]
    assert len(lines) == 2
    assert json.loads(lines[0][len("data: ") :]) == {"text": TEXT}
    assert lines[1] == "data: [DONE]"
