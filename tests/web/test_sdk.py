"""The async SDK against a real server: streaming, cancel (explicit, by `break`, by
timeout), multiplexing requests, pings and sessions on one connection, typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.eventually import eventually
from web.client import (
    AsyncClient,
    ConnectionLostError,
    InvalidRequestError,
    NotFoundError,
    PagedServeError,
    RequestTimeout,
)

pytestmark = pytest.mark.asyncio(loop_scope="function")


@asynccontextmanager
async def bounded_client(url: str, seconds: float = 120, **kw) -> AsyncIterator[AsyncClient]:
    """An AsyncClient whose whole use must end within `seconds` (its streams wait for the
    server without a limit of their own)."""
    async with asyncio.timeout(seconds), AsyncClient(url, **kw) as client:
        yield client


async def wait_blocks_free(server) -> None:
    await eventually(
        lambda: server.metric("pagedserve_kv_blocks_used") == 0, 5, "every KV block free"
    )


async def test_stream_and_complete(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        deltas = [d async for d in client.stream("Once upon a time", max_tokens=12, temperature=0)]
        assert sum(len(d.token_ids) for d in deltas) == 12
        result = await client.complete("Once upon a time", max_tokens=12, temperature=0)
        assert result.finish_reason == "length"
        assert result.token_ids == [t for d in deltas for t in d.token_ids]
        assert result.text == "".join(d.text for d in deltas)
        assert result.usage.completion_tokens == 12 and result.timing["ttft_s"] > 0


async def test_cancel_mid_stream_frees_blocks(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        stream = client.stream("Hello", max_tokens=1500, ignore_eos=True)
        n = 0
        async for delta in stream:
            n += len(delta.token_ids)
            if n >= 5:
                await stream.cancel()
        assert stream.result.finish_reason == "abort"
        assert stream.result.usage is None or stream.result.usage.completion_tokens < 1500
        await wait_blocks_free(builtin_server)
        # leaving a loop early cancels too
        async with client.stream("Hello", max_tokens=1500, ignore_eos=True) as s2:
            async for _ in s2:
                break
        await wait_blocks_free(builtin_server)


async def wait_none_running(server) -> None:
    await eventually(
        lambda: server.metric("pagedserve_num_requests_running") == 0, 5, "no request running"
    )


LONG = dict(max_tokens=2000, ignore_eos=True)  # about 2,000 tokens: a second or more


async def test_break_out_of_a_stream_cancels_it_on_the_server(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        before = builtin_server.metric("pagedserve_generation_tokens_total")
        async for _ in client.stream("Hello", **LONG):
            break  # no `async with`, no aclose(): the dropped stream cancels itself
        await wait_none_running(builtin_server)
        streamed = builtin_server.metric("pagedserve_generation_tokens_total") - before
        assert 0 < streamed < 1000, f"{streamed} tokens: the request ran on after the break"
        await wait_blocks_free(builtin_server)
        assert len((await client.complete("Hello", max_tokens=4, ignore_eos=True)).token_ids) == 4


async def test_a_timeout_cancels_the_request_on_the_server(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        before = builtin_server.metric("pagedserve_generation_tokens_total")
        with pytest.raises(RequestTimeout, match="cancelled on the server") as raised:
            async for _ in client.stream("Hello", timeout=0.3, **LONG):
                pass
        assert isinstance(raised.value, PagedServeError) and raised.value.request_id
        await wait_none_running(builtin_server)
        streamed = builtin_server.metric("pagedserve_generation_tokens_total") - before
        assert streamed < 2000
    async with bounded_client(builtin_server.ws, timeout=0.3) as client:  # client-wide
        with pytest.raises(RequestTimeout):
            await client.complete("Hello", **LONG)
        # per call: no timeout (ignore_eos: a sampled EOS would end it as "stop")
        result = await client.complete("Hello", max_tokens=4, ignore_eos=True, timeout=None)
        assert result.finish_reason == "length"
        await wait_none_running(builtin_server)


async def test_pings_and_sessions_run_concurrently_on_one_client(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        await asyncio.gather(*(client.ping() for _ in range(8)))
        chats = [client.chat_session(system=f"You are bot {i}.") for i in range(2)]
        for turn in range(2):  # the first turns open both sessions at once
            sends = [chat.send(f"turn {turn}", max_tokens=4).collect() for chat in chats]
            results = await asyncio.gather(*sends, client.ping())
            assert all(r.finish_reason in ("stop", "length") for r in results[:2])
        assert chats[0].session_id != chats[1].session_id
        histories = await asyncio.gather(*(chat.history() for chat in chats))
        for i, history in enumerate(histories):
            assert history[0] == {"role": "system", "content": f"You are bot {i}."}
            assert [m["role"] for m in history[1:]] == ["user", "assistant"] * 2
        await asyncio.gather(*(chat.close() for chat in chats))
        with pytest.raises(NotFoundError, match="closed or expired") as raised:
            await chats[0].send("are you there?", max_tokens=2).collect()
        assert raised.value.param == "session_id"


async def test_32_concurrent_requests_equal_running_alone(builtin_server) -> None:
    prompts = [f"story number {i}:" for i in range(32)]
    kinds = [dict(temperature=0), dict(temperature=1.0, seed=7)]
    async with bounded_client(builtin_server.ws) as client:
        alone = []
        for i, p in enumerate(prompts):
            alone.append(await client.complete(p, max_tokens=16, **kinds[i % 2]))
        together = await asyncio.gather(
            *(client.complete(p, max_tokens=16, **kinds[i % 2]) for i, p in enumerate(prompts))
        )
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]


async def test_five_turn_session(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        chat = client.chat_session(system="You tell short stories.")
        prompt_sizes, replies, hits = [], [], []
        for turn in range(5):
            before = builtin_server.metric("pagedserve_prefix_cache_hit_tokens_total")
            stream = chat.send(f"turn {turn}: tell me more", max_tokens=8, temperature=0)
            text = "".join([d.text async for d in stream])
            assert stream.result.finish_reason in ("stop", "length")
            assert stream.result.text == text
            prompt_sizes.append(stream.result.usage.prompt_tokens)
            replies.append(stream.result)
            hits.append(builtin_server.metric("pagedserve_prefix_cache_hit_tokens_total") - before)
        # each turn's prompt holds the previous prompt, its reply and the new message; the
        # prefix cache serves all of that but the last partial block (< 16 tokens) and the
        # reply's last token (sampled, never fed back)
        for k in range(1, 5):
            grew = prompt_sizes[k] - prompt_sizes[k - 1]
            new = grew - replies[k - 1].usage.completion_tokens
            assert new >= len("turn k: tell me more")
            computed = prompt_sizes[k] - hits[k]
            assert new <= computed <= new + 16, (prompt_sizes, hits, new)
        await chat.close()


async def test_validation_error_is_typed_and_connection_survives(builtin_server) -> None:
    async with bounded_client(builtin_server.ws) as client:
        with pytest.raises(InvalidRequestError, match="temperature") as raised:
            await client.complete("hi", temperature=-1)
        assert raised.value.param == "temperature"
        result = await client.complete("hi", max_tokens=3, ignore_eos=True)
        assert len(result.token_ids) == 3


class TcpProxy:
    """Forwards 127.0.0.1:port to the server; `cut()` drops every open connection, as a
    network blip would, while new connections still go through."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> TcpProxy:
        self.server = await asyncio.start_server(self._pipe_both, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        self.server.close()

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def _pipe_both(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()


@pytest.mark.parametrize("reconnect", [True, False])
async def test_lost_connection_fails_in_flight_and_reconnects_for_new(
    builtin_server, reconnect: bool
) -> None:
    async with TcpProxy(builtin_server.port) as proxy:
        url = f"ws://127.0.0.1:{proxy.port}"
        async with bounded_client(url, reconnect=reconnect) as client:
            expected = await client.complete("Once", max_tokens=8, temperature=0)
            stream = client.stream("Hello", max_tokens=1500, ignore_eos=True)
            with pytest.raises(ConnectionLostError):
                async for _ in stream:
                    proxy.cut()
            await wait_blocks_free(builtin_server)  # the server aborted it
            if reconnect:
                again = await client.complete("Once", max_tokens=8, temperature=0)
                assert again.token_ids == expected.token_ids
            else:
                with pytest.raises(ConnectionLostError):
                    await client.complete("Once", max_tokens=8, temperature=0)
