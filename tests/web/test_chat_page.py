"""The chat page at `/` in headless Chromium, driven over the DevTools protocol.

Streams a reply, stops it (the server frees its KV blocks), then runs a second turn;
a long chat on a small context forgets its oldest turns and keeps working.
Needs a Chromium binary (Debian: `apt-get install chromium`); skipped without one.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tests.eventually import eventually
from tests.web.conftest import start_server, stop_server

BROWSER = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason="needs Debian chromium (apt-get install chromium)"
)


class Browser:
    """A headless Chromium process and its DevTools WebSocket URL."""

    def __init__(self, binary: str, profile: Path) -> None:
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        args += ["--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}"]
        self.process = subprocess.Popen(
            [binary, *args, "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its helper processes share our kill below
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:  # keeps the pipe empty so the browser never blocks on it
        for line in self.process.stderr:
            self.lines.put(line)

    def devtools_url(self, timeout: float = 20) -> str:
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            seen.append(line)
            if line.startswith("DevTools listening on "):
                return line.split(" on ", 1)[1].strip()
        raise RuntimeError("chromium gave no DevTools URL; stderr:\n" + "".join(seen[-20:]))

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)


class Page:
    """One tab over a flattened DevTools session; events are ignored."""

    def __init__(self, ws, session_id: str) -> None:
        self.ws, self.session_id, self.next_id = ws, session_id, 0

    @classmethod
    async def open(cls, ws) -> Page:
        browser = cls(ws, "")
        target = await browser.call("Target.createTarget", url="about:blank")
        attached = await browser.call(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        return cls(ws, attached["sessionId"])

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        command = {"id": self.next_id, "method": method, "params": params}
        if self.session_id:
            command["sessionId"] = self.session_id
        await self.ws.send(json.dumps(command))
        async with asyncio.timeout(30):
            while True:
                reply = json.loads(await self.ws.recv())
                ours = reply.get("sessionId", "") == self.session_id
                if reply.get("id") == self.next_id and ours:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]

    async def eval(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10) -> None:
        await eventually(lambda: self.eval(expression), timeout, expression)

    async def fill(self, selector: str, value: str) -> None:
        await self.eval(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            f" el.value = {json.dumps(value)};"
            " el.dispatchEvent(new Event('input', {bubbles: true}));"
            " el.dispatchEvent(new Event('change', {bubbles: true})); })()"
        )

    async def click(self, selector: str) -> None:
        await self.eval(f"document.querySelector({json.dumps(selector)}).click()")


ASSISTANT = "document.querySelectorAll('#messages .msg.assistant')"
LAST_REPLY = f"[...{ASSISTANT}].at(-1)"
STREAMING = "document.querySelector('#messages [data-streaming=\"true\"]') !== null"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    chromium = Browser(BROWSER, tmp_path / "profile")
    try:
        yield chromium
    finally:
        chromium.kill()


async def test_chat_page_streams_stops_and_continues(builtin_server, browser: Browser) -> None:
    async with connect(browser.devtools_url(), max_size=None, proxy=None) as ws:
        page = await Page.open(ws)
        await page.call("Page.navigate", url=builtin_server.http + "/")
        await page.wait_for("document.readyState === 'complete'")
        note = "document.getElementById('builtin-note')"
        await page.wait_for(f"!{note}.hidden && getComputedStyle({note}).display !== 'none'")
        assert "noise" in await page.eval(f"{note}.textContent")
        assert await page.eval("document.getElementById('error').hidden")

        # Greedy decoding from this prompt runs the builtin model to max_tokens (no EOS),
        # a second or two of streaming on a CPU: stopped as soon as it is seen to grow.
        # The whole reply can still outrun the click on a busy machine (it ends without
        # "(stopped)"): then the scenario is played again on a fresh page, up to 3 times.
        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "1900")
        stopped = False
        for _ in range(3):
            stopped = await _send_and_stop(page, "hello there")
            if stopped:
                break
            await page.call("Page.navigate", url=builtin_server.http + "/")
            await page.wait_for("document.readyState === 'complete'")
            await page.fill("#temperature", "0")
            await page.fill("#max-tokens", "1900")
        assert stopped, "the whole reply outran the stop click 3 times"
        await eventually(
            lambda: builtin_server.metric("pagedserve_kv_blocks_used") == 0,
            5,
            "the stopped reply's KV blocks free",
        )

        await page.fill("#max-tokens", "20")
        await page.fill("#prompt", "and again")
        await page.click("#send")
        await page.wait_for(f"{ASSISTANT}.length === 2 && !({STREAMING})", timeout=10)
        users = await page.eval("document.querySelectorAll('#messages .msg.user').length")
        assert users == 2
        assert "(stopped)" not in await page.eval(f"{LAST_REPLY}.textContent")
        assert await page.eval("document.getElementById('error').hidden")
        roles = await page.eval("transcript.map((m) => m.role)")
        assert roles == ["user", "assistant", "user", "assistant"]


async def _send_and_stop(page: Page, prompt: str) -> bool:
    """Sends `prompt`, clicks stop once the reply is seen to grow, waits for the stream
    to end; True if the reply says "(stopped)" (False: it ended before the click)."""
    await page.fill("#prompt", prompt)
    await page.click("#send")
    lengths: list[int] = []

    async def grew() -> bool:
        streaming = await page.eval(STREAMING)
        length = await page.eval(f"({LAST_REPLY}?.textContent ?? '').length")
        assert not lengths or length >= lengths[-1]
        lengths.append(length)
        if not streaming:  # not begun yet, or already over (the race this retries)
            return length > 0
        return len(set(lengths)) >= 2

    await eventually(grew, 10, lambda: f"reply did not stream: lengths {lengths}")
    assert lengths[-1] > 0
    await page.click("#stop")
    await page.wait_for(f"!({STREAMING})", timeout=5)
    return "(stopped)" in await page.eval(f"{LAST_REPLY}.textContent")


@pytest.fixture(scope="module")
def small_context():
    """The built-in model with a 256-token context: a chat outgrows it in a few turns."""
    server = start_server(extra=["--max-model-len", "256"])
    yield server
    stop_server(server)


async def test_a_long_chat_on_a_small_context_forgets_its_oldest_turns(
    small_context, browser: Browser
) -> None:
    async with connect(browser.devtools_url(), max_size=None, proxy=None) as ws:
        page = await Page.open(ws)
        await page.call("Page.navigate", url=small_context.http + "/")
        await page.wait_for("document.readyState === 'complete'")
        await page.fill("#system", "You tell short stories.")
        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "16")
        for turn in range(1, 11):
            await page.fill("#prompt", f"turn {turn}: tell me more")
            await page.click("#send")
            await page.wait_for(f"{ASSISTANT}.length === {turn} && !({STREAMING})", timeout=30)
            assert await page.eval("document.getElementById('error').hidden"), await page.eval(
                "document.getElementById('error').textContent"
            )
        kept = await page.eval("transcript.length")
        dropped = await page.eval("document.querySelectorAll('#messages .msg.dropped').length")
        assert kept + dropped == 20 and dropped > 0 and kept >= 2
        assert await page.eval("transcript.at(-2).content") == "turn 10: tell me more"
        failed = await page.eval("document.querySelectorAll('#messages .msg.failed').length")
        assert failed == 0


RECORD_FRAMES = (
    "(() => { window.sent = []; const send = WebSocket.prototype.send;"
    " WebSocket.prototype.send = function (data) { window.sent.push(data);"
    " return send.call(this, data); }; })()"
)
GENERATE_PARAMS = (
    "window.sent.map((d) => JSON.parse(d)).filter((f) => f.type === 'generate').at(-1).params"
)


async def test_the_json_switch_asks_for_a_json_object(builtin_server, browser: Browser) -> None:
    """With JSON on, a turn goes out with structured_outputs {json_object: true} (the
    server takes it: the reply streams, no error); off, with no constraint."""
    async with connect(browser.devtools_url(), max_size=None, proxy=None) as ws:
        page = await Page.open(ws)
        await page.call("Page.navigate", url=builtin_server.http + "/")
        await page.wait_for("document.readyState === 'complete'")
        await page.eval(RECORD_FRAMES)
        await page.fill("#max-tokens", "8")
        for turn, json_mode in enumerate([True, False], start=1):
            if await page.eval("document.getElementById('json-mode').checked") != json_mode:
                await page.click("#json-mode")
            await page.fill("#prompt", "name a colour, as JSON")
            await page.click("#send")
            await page.wait_for(f"{ASSISTANT}.length === {turn} && !({STREAMING})", timeout=30)
            assert await page.eval("document.getElementById('error').hidden"), await page.eval(
                "document.getElementById('error').textContent"
            )
            params = await page.eval(GENERATE_PARAMS)
            want = {"json_object": True} if json_mode else None
            assert params.get("structured_outputs") == want, params
