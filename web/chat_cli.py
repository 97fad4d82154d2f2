"""`pagedserve chat`: a terminal chat with a running server, built on the SDK.

Ctrl-C while a reply streams stops that reply (cancelled on the server) and gives the
prompt back; Ctrl-C anywhere else quits with status 130, as shells expect, and Ctrl-D
at the prompt quits with 0. Neither prints a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import sys
import threading

from web.client import AsyncClient, ChatSession, PagedServeError

try:
    import termios
except ImportError:  # not a POSIX system
    termios = None

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C


class LineReader:
    """Reads stdin lines on a daemon thread, one per `read()`: a read still pending
    when the chat quits never holds up the process's exit (a thread of the default
    executor would, until Enter). A terminal gets `input()` (line editing; it holds no
    lock of sys.stdin while it waits); a pipe is read from its file descriptor, as a
    daemon thread blocked inside sys.stdin would abort the interpreter's exit."""

    def __init__(self) -> None:
        self._asks: queue.SimpleQueue[tuple[str, asyncio.Future[str | None]]] = queue.SimpleQueue()
        self._loop = asyncio.get_running_loop()
        self._pending = b""  # what a pipe gave past the last line
        self._tty = sys.stdin.isatty() and sys.stdout.isatty()
        if self._tty:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401 - input() then edits lines and keeps history
        threading.Thread(target=self._serve, name="stdin", daemon=True).start()

    async def read(self, prompt: str) -> str | None:
        """The next line (None at end of input)."""
        answer: asyncio.Future[str | None] = self._loop.create_future()
        self._asks.put((prompt, answer))
        return await answer

    def _serve(self) -> None:
        while True:
            prompt, answer = self._asks.get()
            try:
                line = input(prompt) if self._tty else self._pipe_line(prompt)
            except (EOFError, OSError, ValueError):
                line = None
            self._loop.call_soon_threadsafe(_settle, answer, line)

    def _pipe_line(self, prompt: str) -> str | None:
        print(prompt, end="", flush=True)
        while b"\n" not in self._pending:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                line, self._pending = self._pending, b""
                return line.decode(errors="replace") if line else None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode(errors="replace")


class TerminalChat:
    """One `pagedserve chat` run: its SIGINT handler cancels the reply streaming now,
    or (when none is) the whole chat."""

    def __init__(self, url: str, api_key: str | None, system: str | None, sampling: dict):
        self.url, self.api_key, self.system, self.sampling = url, api_key, system, sampling
        self.reply: asyncio.Task[None] | None = None
        self.main: asyncio.Task | None = None
        self.interrupted = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.main = asyncio.current_task()
        terminal = _terminal_settings()
        loop.add_signal_handler(signal.SIGINT, self._on_interrupt)
        try:
            return await self._chat()
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            self.main.uncancel()
            print(file=sys.stderr)
            return INTERRUPTED
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            if terminal is not None:  # input() may have left it mid-line (no echo)
                with contextlib.suppress(termios.error):
                    termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, terminal)

    def _on_interrupt(self) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()  # stops this reply only
        elif not self.interrupted:
            self.interrupted = True
            self.main.cancel()

    async def _chat(self) -> int:
        try:
            async with AsyncClient(self.url, api_key=self.api_key) as client:
                chat = client.chat_session(system=self.system)
                reader = LineReader()
                print(f"connected to {self.url}; type a message (Ctrl-D to quit)", file=sys.stderr)
                while (line := await reader.read("> ")) is not None:
                    if line.strip():
                        await self._reply(chat, line)
                return 0
        except PagedServeError as exc:
            print(f"pagedserve chat: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    async def _reply(self, chat: ChatSession, line: str) -> None:
        self.reply = asyncio.create_task(_stream_reply(chat, line, self.sampling))
        try:
            await asyncio.shield(self.reply)
        except asyncio.CancelledError:
            if not self.reply.cancelled():
                raise  # the chat itself is being cancelled
            print("\n[stopped]", file=sys.stderr)
        finally:
            self.reply = None


async def _stream_reply(chat: ChatSession, line: str, sampling: dict) -> None:
    """Prints the reply as it streams (cancelling this cancels it on the server)."""
    try:
        async with chat.send(line, **sampling) as stream:
            async for delta in stream:
                print(delta.text, end="", flush=True)
        print()
    except PagedServeError as exc:
        print(f"\n[error: {exc}]", file=sys.stderr)


def _terminal_settings() -> list | None:
    """stdin's terminal settings, to put back on exit; None when it is not a terminal."""
    if termios is None or not sys.stdin.isatty():
        return None
    try:
        return termios.tcgetattr(sys.stdin.fileno())
    except termios.error:
        return None


def _settle(answer: asyncio.Future, line: str | None) -> None:
    if not answer.done():
        answer.set_result(line)


async def run_chat(
    url: str, api_key: str | None, system: str | None, temperature: float, max_tokens: int
) -> int:
    """Reads lines from stdin and streams each reply; returns the exit status."""
    sampling = {"temperature": temperature, "max_tokens": max_tokens}
    with contextlib.suppress(KeyboardInterrupt):
        return await TerminalChat(url, api_key, system, sampling).run()
    return INTERRUPTED
