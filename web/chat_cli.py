"""`pagedserve chat`: a terminal chat with a running server, built on the SDK."""

from __future__ import annotations

import asyncio
import sys

from web.client import AsyncClient, PagedServeError


async def run_chat(
    url: str, api_key: str | None, system: str | None, temperature: float, max_tokens: int
) -> int:
    """Reads lines from stdin, streams each reply; Ctrl-C stops a reply, Ctrl-D quits."""
    try:
        async with AsyncClient(url, api_key=api_key) as client:
            chat = client.chat_session(system=system)
            print(f"connected to {url}; type a message (Ctrl-D to quit)", file=sys.stderr)
            while True:
                line = await asyncio.to_thread(_read_line)
                if line is None:
                    return 0
                if not line.strip():
                    continue
                await _reply(chat, line, temperature, max_tokens)
    except PagedServeError as exc:
        print(f"pagedserve chat: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


async def _reply(chat, line: str, temperature: float, max_tokens: int) -> None:
    stream = chat.send(line, temperature=temperature, max_tokens=max_tokens)
    try:
        async for delta in stream:
            print(delta.text, end="", flush=True)
    except (KeyboardInterrupt, asyncio.CancelledError):
        await stream.cancel()
    except PagedServeError as exc:
        print(f"\n[error: {exc}]", file=sys.stderr)
    print()


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None
