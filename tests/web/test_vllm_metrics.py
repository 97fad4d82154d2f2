"""/metrics speaks vLLM's names (what a stock vLLM Grafana dashboard queries) next to
ours, counts every error answer and every abort, and types totals as counters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import msgpack
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from actors.async_engine import WatchStats
from engine.core.stats import EngineStats
from engine.messages import ErrorKind, OutputDelta
from tests.eventually import eventually
from tests.web.conftest import start_server, stop_server
from web.error_counter import ErrorAnswerCounter
from web.generation import SequenceEnds
from web.metrics import (
    VLLM_E2E_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_TTFT_BUCKETS,
    FinishReason,
    Metrics,
    buckets_1_2_5,
)

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "pagedserve-builtin-tiny"
LONG = {"max_tokens": 1500, "ignore_eos": True}

GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
)
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "vllm:time_per_output_token_seconds": VLLM_ITL_BUCKETS,
    "vllm:inter_token_latency_seconds": VLLM_ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": VLLM_E2E_BUCKETS,
    "vllm:request_prompt_tokens": None,
    "vllm:request_generation_tokens": None,
}


def parse(text: str) -> dict[str, object]:
    """family name -> its parsed family."""
    return {family.name: family for family in text_string_to_metric_families(text)}


class Scrape:
    """One /metrics answer: `value(sample, **labels)`, summed over the label sets that
    match (0 when none does)."""

    def __init__(self, text: str) -> None:
        self.families = parse(text)
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, sample: str, **labels: str) -> float:
        return sum(
            s.value
            for s in self.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )


def scrape(server) -> Scrape:
    return Scrape(httpx.get(f"{server.http}/metrics", headers=AUTH, timeout=10).text)


# -- without a server -------------------------------------------------------------------
STATS = EngineStats(
    num_blocks=200,
    num_used_blocks=50,
    num_free_blocks=150,
    kv_slot_utilization=0.9,
    mean_kv_slot_utilization=0.8,
    num_preemptions=7,
    num_steps=1000,
    num_running=3,
    num_waiting=4,
    prefix_cache_queried_tokens=400,
    prefix_cache_hit_tokens=100,
    num_swapped=2,
)


def metrics() -> Metrics:
    return Metrics(lambda: STATS, lambda: WatchStats(1, 0, 0.5, 0.1), {}, "my-model", 2048)


def test_vllm_names_types_labels_and_buckets():
    m = metrics()
    families = parse(m.render().decode())
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
        assert all(s.name == name + "_total" for s in families[name].samples), name
    for name, buckets in HISTOGRAMS.items():
        assert families[name].type == "histogram", name
        bounds = [
            float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")
        ]
        expected = buckets if buckets is not None else buckets_1_2_5(2048)
        assert bounds == [*map(float, expected), float("inf")], name
    for name in (*GAUGES, *COUNTERS, *HISTOGRAMS):
        assert all(s.labels["model_name"] == "my-model" for s in families[name].samples), name
    # the engine's totals are counters in our vocabulary too
    for name in ("pagedserve_num_preemptions", "pagedserve_prefix_cache_hit_tokens"):
        assert families[name].type == "counter", name
    assert families["pagedserve_num_timed_out_requests"].type == "counter"


def test_engine_numbers_are_read_from_one_snapshot():
    text = metrics().render().decode()
    s = Scrape(text)
    assert s.value("vllm:num_requests_running", model_name="my-model") == 3
    assert s.value("vllm:num_requests_waiting") == 4
    assert s.value("vllm:num_requests_swapped") == 2
    assert s.value("vllm:kv_cache_usage_perc") == s.value("vllm:gpu_cache_usage_perc") == 0.25
    assert s.value("vllm:prefix_cache_queries_total") == 400
    assert s.value("vllm:prefix_cache_hits_total") == 100
    assert s.value("vllm:num_preemptions_total") == s.value("pagedserve_num_preemptions_total") == 7
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_recording_api_feeds_both_vocabularies():
    m = metrics()
    m.first_token(0.05, 12)
    m.generated(1, None)
    m.generated(3, 0.3)  # three tokens, 0.1 s each
    m.finished(FinishReason.LENGTH, 0.5, 12, 4)
    m.finished(FinishReason.TIMEOUT, 9.0, 12, 0)
    m.refused("invalid_request")
    s = Scrape(m.render().decode())
    assert s.value("vllm:prompt_tokens_total") == s.value("pagedserve_prompt_tokens_total") == 12
    assert s.value("vllm:generation_tokens_total") == 4
    assert s.value("vllm:inter_token_latency_seconds_count") == 3
    assert s.value("vllm:time_per_output_token_seconds_sum") == pytest.approx(0.3)
    assert s.value("vllm:request_success_total", finished_reason="length") == 1
    assert s.value("vllm:request_success_total", finished_reason="abort") == 1  # a timeout
    assert s.value("pagedserve_requests_total", finish_reason="timeout") == 1
    assert s.value("vllm:request_generation_tokens_sum") == 4
    assert s.value("vllm:e2e_request_latency_seconds_count") == 2
    assert s.value("pagedserve_requests_rejected_total", reason="invalid_request") == 1
    assert m.token_totals() == (12, 4)


def delta(index: int, finish: str | None, outputs: int, kind: ErrorKind | None = None):
    return OutputDelta(
        request_id="r",
        text="",
        token_ids=(),
        finish_reason=finish,
        stop_reason=None,
        num_prompt_tokens=5,
        num_output_tokens=outputs,
        error=None,
        index=index,
        error_kind=kind,
    )


def test_every_sequence_ends_exactly_once():
    ends = SequenceEnds(3)
    assert ends.seen(delta(0, None, 1)) == []
    assert ends.seen(delta(0, "stop", 2)) == [(5, 2)]
    assert ends.seen(delta(1, None, 4)) == []
    assert ends.seen(OutputDelta.aborted("r")) == [(5, 4), (5, 0)]  # request-wide: the rest
    assert ends.abandon() == []  # nothing left open for the client leaving
    ends = SequenceEnds(2)
    ends.seen(delta(1, None, 3))
    assert ends.abandon() == [(5, 0), (5, 3)]
    assert FinishReason.of(delta(-1, "error", 0, ErrorKind.TIMEOUT)) is FinishReason.TIMEOUT
    assert FinishReason.of(delta(-1, "error", 0, ErrorKind.ENGINE)).vllm == "error"


def test_the_middleware_counts_each_error_answer_once_by_code():
    counted: list[str] = []

    async def refuse(request):
        return JSONResponse({"error": {"code": "overloaded", "message": "busy"}}, 503)

    async def other_404(request):
        return PlainTextResponse("Not Found", 404)

    async def ok(request):
        return JSONResponse({"error": {"code": "not an error answer"}})  # a 200

    async def stream(request):
        async def events() -> AsyncIterator[str]:
            yield 'data: {"choices": []}\n\n'
            yield 'data: {"error": {"code": "timeout", "message": "late"}}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [
        Route(p, f) for p, f in (("/r", refuse), ("/n", other_404), ("/o", ok), ("/s", stream))
    ]
    counter = Middleware(ErrorAnswerCounter, count=lambda scope, code: counted.append(code))
    client = TestClient(Starlette(routes=routes, middleware=[counter]))
    for path in ("/r", "/n", "/o", "/s", "/r"):
        client.get(path)
    assert counted == ["overloaded", "timeout", "overloaded"]


# -- a real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    s = start_server(api_key=KEY, extra=["--max-queued-requests", "2"])
    yield s
    stop_server(s)


def test_every_vllm_metric_is_served_with_the_model_name(server):
    r = httpx.post(
        f"{server.http}/v1/completions",
        json={"prompt": "Once upon", "max_tokens": 5},
        headers=AUTH,
        timeout=60,
    )
    usage = r.json()["usage"]
    s = scrape(server)
    for name in (*GAUGES, *COUNTERS, *HISTOGRAMS):
        family = s.families[name]
        assert family.samples and all(x.labels["model_name"] == MODEL for x in family.samples)
    assert s.value("vllm:request_success_total", finished_reason="length") >= 1
    assert s.value("vllm:generation_tokens_total") >= usage["completion_tokens"]
    assert s.value("vllm:prefix_cache_queries_total") >= usage["prompt_tokens"]
    assert 0 <= s.value("vllm:kv_cache_usage_perc") <= 1


def bad_http(client: httpx.AsyncClient, server, body: bytes | dict, headers=AUTH):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(f"{server.http}/v1/completions", content=content, headers=headers)


BAD_WS_FRAMES = [
    "{oops",  # not JSON
    msgpack.packb([1, 2]),  # msgpack, but not an object
    {"type": "fly"},
    {"type": "generate", "prompt": "x"},  # no id
    {"type": "generate", "id": "a", "prompt": 5},
    {"type": "generate", "id": "b", "prompt": "x", "params": {"tempo": 1}},
    {"type": "generate", "id": "c", "prompt": "x", "params": {"temperature": -1}},
    {"type": "generate", "id": "d", "session_id": "nope", "message": "hi"},  # not_found
]


async def ws_error_events(server) -> int:
    async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=AUTH) as ws:
        for frame in BAD_WS_FRAMES:
            await ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))
            event = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert event["type"] == "error", event
    return len(BAD_WS_FRAMES)


async def test_every_refusal_is_counted_exactly_once_by_reason(server):
    before = scrape(server)
    flood = json.dumps({"prompt": "flood", "max_tokens": 4}).encode()
    async with httpx.AsyncClient(timeout=60) as client:
        replies = [
            await bad_http(client, server, b"{not json"),
            await bad_http(client, server, {"prompt": "x", "bogus": 1}),
            await bad_http(client, server, {"prompt": "x", "temperature": "hot"}),
            await bad_http(client, server, {"prompt": "x", "n": 0}),
            await bad_http(client, server, {"prompt": "ab" * 1500}),  # over the context
            await bad_http(client, server, {"prompt": "x", "model": "gpt-9"}),
            await bad_http(client, server, {"prompt": "x"}, headers={}),
            *await asyncio.gather(*(bad_http(client, server, flood) for _ in range(30))),
        ]
    refused = [r for r in replies if r.status_code >= 400]
    by_code: dict[str, int] = {}
    for r in refused:
        code = r.json()["error"]["code"]
        by_code[code] = by_code.get(code, 0) + 1
    assert by_code.get("overloaded", 0) >= 1, by_code  # the flood hit the queue limit
    ws_refused = await ws_error_events(server)
    by_code["invalid_request"] = by_code.get("invalid_request", 0) + ws_refused - 1
    by_code["not_found"] = by_code.get("not_found", 0) + 1  # the unknown session

    after = scrape(server)
    total = "pagedserve_requests_rejected_total"
    assert after.value(total) - before.value(total) == len(refused) + ws_refused
    for code, n in by_code.items():
        assert after.value(total, reason=code) - before.value(total, reason=code) == n, code


async def test_a_cancelled_stream_counts_as_an_abort(server):
    before = scrape(server)
    async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=AUTH) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "x", "prompt": "Hi", "params": LONG}))
        async with asyncio.timeout(30):
            while json.loads(await ws.recv())["type"] != "delta":
                pass
            await ws.send(json.dumps({"type": "cancel", "id": "x"}))
            while (event := json.loads(await ws.recv()))["type"] != "done":
                pass
    assert event["finish_reason"] == "abort"
    after = scrape(server)
    for sample, label in (
        ("vllm:request_success_total", {"finished_reason": "abort"}),
        ("pagedserve_requests_total", {"finish_reason": "abort"}),
    ):
        assert after.value(sample, **label) - before.value(sample, **label) == 1, sample
    assert after.value("pagedserve_requests_rejected_total") == before.value(
        "pagedserve_requests_rejected_total"
    )  # an abort is not an error answer


async def test_an_sse_client_that_hangs_up_counts_as_an_abort(server):
    before = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    body = {"prompt": "Hi", "stream": True, **LONG}
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"{server.http}/v1/completions"
        async with client.stream("POST", url, json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # leaving the block closes the connection mid-stream

    def aborts() -> float:
        return scrape(server).value("vllm:request_success_total", finished_reason="abort")

    await eventually(lambda: aborts() == before + 1, 10, lambda: f"{aborts() - before} aborts")
