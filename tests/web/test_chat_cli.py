"""`pagedserve chat` and Ctrl-C (SIGINT): at the prompt it quits with status 130, while
a reply streams it stops that reply only (cancelled on the server); never a
traceback, and on a terminal the terminal's settings are put back. Each step waits for
what the chat prints, never for a fixed time."""

from __future__ import annotations

import asyncio
import os
import pty
import signal
import sys
import termios
from collections.abc import Callable

import pytest

from tests.eventually import eventually
from web.launch import REPO

pytestmark = pytest.mark.timeout(120)
PROMPT = b"> "


class Chat:
    """A `pagedserve chat` process with pipes; what it prints collects in `out` and
    `err` as it comes, and `until(check)` waits for it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out = self.err = b""
        self.changed = asyncio.Event()
        self.pumps = [
            asyncio.create_task(self._pump(proc.stdout, "out")),
            asyncio.create_task(self._pump(proc.stderr, "err")),
        ]

    @classmethod
    async def start(cls, url: str, *args: str) -> Chat:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "web.cli", "chat", "--url", url, *args),
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def _pump(self, pipe: asyncio.StreamReader, name: str) -> None:
        while chunk := await pipe.read(4096):
            setattr(self, name, getattr(self, name) + chunk)
            self.changed.set()
        self.changed.set()

    async def until(self, check: Callable[[], bool], what: str, timeout: float = 30) -> None:
        """Returns once `check()` holds, re-checked as output arrives."""
        async with asyncio.timeout(timeout):
            while not check():
                assert not all(p.done() for p in self.pumps), f"exited before {what}: {self}"
                self.changed.clear()
                await self.changed.wait()

    async def type(self, line: str) -> int:
        """Types `line`; where its reply will start in `out`."""
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return len(self.out)

    async def exit_status(self, timeout: float = 30) -> int:
        async with asyncio.timeout(timeout):
            await self.proc.wait()
            await asyncio.gather(*self.pumps)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    def __str__(self) -> str:
        return f"stdout {self.out[-300:]!r}, stderr {self.err[-2000:]!r}"


async def test_ctrl_c_at_the_prompt_quits_with_130_and_no_traceback(builtin_server) -> None:
    chat = await Chat.start(builtin_server.ws)
    try:
        await chat.until(lambda: chat.out.endswith(PROMPT), "the prompt")
        chat.proc.send_signal(signal.SIGINT)
        assert await chat.exit_status() == 130, chat
        assert b"Traceback" not in chat.err and b"Fatal" not in chat.err, chat
    finally:
        chat.kill()


async def test_ctrl_c_while_a_reply_streams_stops_that_reply_only(builtin_server) -> None:
    # greedy decoding runs the built-in model to max_tokens from this message (no EOS)
    chat = await Chat.start(builtin_server.ws, "--temperature", "0", "--max-tokens", "2000")
    try:
        for turn in (1, 2):  # the session goes on after a stopped reply
            # typed only once the prompt is back: output before it is not the reply's
            await chat.until(lambda: chat.out.endswith(PROMPT), "the prompt")
            reply = await chat.type("hello there" if turn == 1 else "and again")
            await chat.until(lambda: len(chat.out) > reply, "the reply streaming")  # noqa: B023
            chat.proc.send_signal(signal.SIGINT)
            await chat.until(lambda: chat.err.count(b"[stopped]") == turn, "[stopped]")  # noqa: B023
            await eventually(
                lambda: builtin_server.metric("pagedserve_num_requests_running") == 0,
                5,
                "the stopped reply ended on the server",
            )
            assert chat.proc.returncode is None, chat  # still chatting
        chat.proc.stdin.close()  # Ctrl-D at the prompt: status 0
        assert await chat.exit_status() == 0, chat
        assert b"Traceback" not in chat.err and b"error" not in chat.err, chat
    finally:
        chat.kill()


async def test_ctrl_c_at_a_terminal_prompt_quits_and_gives_the_terminal_back(
    builtin_server,
) -> None:
    """On a terminal the prompt is readline's (echo off while it edits the line); quitting
    mid-line puts the terminal's settings back."""
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "web.cli", "chat", "--url", builtin_server.ws),
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,  # the pty becomes its controlling terminal
    )
    os.close(slave)
    seen, changed = bytearray(), asyncio.Event()

    def on_output() -> None:
        try:
            seen.extend(os.read(master, 4096))
        except OSError:  # EIO: every process holding the terminal has exited
            asyncio.get_running_loop().remove_reader(master)
        changed.set()

    loop = asyncio.get_running_loop()
    loop.add_reader(master, on_output)
    try:
        async with asyncio.timeout(30):
            while not seen.endswith(PROMPT):
                changed.clear()
                await changed.wait()
        assert not termios.tcgetattr(master)[3] & termios.ECHO  # readline has the line
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            assert await proc.wait() == 130, bytes(seen)
        assert termios.tcgetattr(master)[3] & termios.ECHO, "the terminal was left without echo"
        assert b"Traceback" not in seen, bytes(seen)
    finally:
        loop.remove_reader(master)
        os.close(master)
        if proc.returncode is None:
            proc.kill()
