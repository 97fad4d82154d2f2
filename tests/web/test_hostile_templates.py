"""A hostile chat template, given by --chat-template or inside a GGUF file, stops only
the request that triggers it: that one gets a 400 naming the template within 2 s, a
plain completion sent meanwhile answers within 1 s, the server's memory stays put, and
SIGTERM still ends the process. A template that renders nothing stops start-up."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.worker.builtin_model import CHAT_TEMPLATE, builtin_model_dir
from tests.web.conftest import start_server, stop_server
from web.launch import REPO

pytestmark = pytest.mark.timeout(300)

TRIGGERS = ("xyzzy", "kaboom", "deeper", "includeme")
HOSTILE = (
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}"
    "{% for m in messages %}"
    "{% if 'xyzzy' in m.content %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}"
    "{% elif 'kaboom' in m.content %}{{ 'a' | center(1500000000) }}"
    "{% elif 'deeper' in m.content %}{{ f(0) }}"
    "{% elif 'includeme' in m.content %}{% include 'other.jinja' %}"
    "{% endif %}{% endfor %}" + CHAT_TEMPLATE
)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def trigger_beside_a_plain_completion(
    server, word: str
) -> tuple[httpx.Response, float, float]:
    """The trigger chat's answer and seconds, and a plain completion's seconds, the
    completion sent while the trigger renders."""
    chat = {"messages": [{"role": "user", "content": f"please {word}"}], "max_tokens": 2}
    plain = {"prompt": "Once upon", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as client:

        async def timed(path: str, body: dict) -> tuple[httpx.Response, float]:
            start = time.monotonic()
            answer = await client.post(path, json=body)
            return answer, time.monotonic() - start

        hostile = asyncio.create_task(timed("/v1/chat/completions", chat))
        await asyncio.sleep(0.1)  # the trigger is rendering by now
        (ok, plain_s), (refused, trigger_s) = await asyncio.gather(
            timed("/v1/completions", plain), hostile
        )
    assert ok.status_code == 200, ok.text
    return refused, trigger_s, plain_s


def check_refused(refused: httpx.Response, trigger_s: float, plain_s: float, name: str) -> None:
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and name in error["message"], error
    assert trigger_s < 2.0, f"the trigger took {trigger_s:.2f} s to refuse"
    assert plain_s < 1.0, f"a plain completion took {plain_s:.2f} s beside it"


async def test_triggers_given_by_option_fail_alone(tmp_path: Path) -> None:
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE)
    server = start_server(extra=["--chat-template", str(template)])
    try:
        async with httpx.AsyncClient(base_url=server.http, timeout=30) as client:
            warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await client.post("/v1/chat/completions", json=warm)).status_code == 200
        before = rss_mib(server.process.proc.pid)
        for word in TRIGGERS:
            refused, trigger_s, plain_s = await trigger_beside_a_plain_completion(server, word)
            check_refused(refused, trigger_s, plain_s, "given by --chat-template")
        tokenized = httpx.post(
            f"{server.http}/tokenize",
            json={"messages": [{"role": "user", "content": "xyzzy"}]},
            timeout=30,
        )
        assert tokenized.status_code == 400 and "took longer" in tokenized.text
        assert rss_mib(server.process.proc.pid) - before < 100
        start = time.monotonic()
        server.process.proc.terminate()
        server.process.proc.wait(30)
        assert time.monotonic() - start < 5.0 + 5.0  # the grace period, and then some
    finally:
        stop_server(server)


async def test_a_trigger_inside_a_gguf_file_fails_alone(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType

    from tests.engine.gguf_files import write_gguf_and_twin

    hf_dir = tmp_path / "hf"
    shutil.copytree(builtin_model_dir(), hf_dir)
    config_path = hf_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": HOSTILE}))
    gguf_path = tmp_path / "hostile.gguf"
    write_gguf_and_twin(hf_dir, gguf_path, tmp_path / "twin", GGMLQuantizationType.F32)
    server = start_server(str(gguf_path))
    try:
        before = rss_mib(server.process.proc.pid)
        for word in TRIGGERS:
            refused, trigger_s, plain_s = await trigger_beside_a_plain_completion(server, word)
            check_refused(refused, trigger_s, plain_s, "the chat template of hostile")
        assert rss_mib(server.process.proc.pid) - before < 100
    finally:
        stop_server(server)


def test_a_template_that_renders_nothing_stops_start_up(tmp_path: Path) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% include 'other.jinja' %}")
    done = subprocess.run(
        [sys.executable, "-m", "web.cli", "serve", "--model", "builtin:tiny", "--port", "0"]
        + ["--chat-template", str(template)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "renders none of 3 sample conversations" in done.stderr
    assert "given by --chat-template" in done.stderr
