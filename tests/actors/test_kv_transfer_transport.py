"""KV transfer over TCP (actors/kv_transfer_server.py, kv_transfer_client.py,
kv_transfer_connector.py) on loopback: blocks arrive byte-identical; a stranger, or a
consumer with another secret, is refused, logged and never answered with data; a
producer that is gone, goes away mid-fetch, or is silent fails the load within its
timeout; a fetch of an unknown request fails at once with the producer's reason."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
import torch
import zmq
import zmq.asyncio

from actors.frame_auth import FrameAuth
from actors.kv_transfer_client import KVTransferClient
from actors.kv_transfer_connector import ZmqConnector
from actors.kv_transfer_server import KVTransferServer
from engine.codec import InboxDecoder, encode
from engine.kv_transfer.blocks import TOKEN_MAJOR, KVLayout, gather_blocks, with_hidden
from engine.kv_transfer.config import CONNECTOR, KVRole, KVTransferConfig
from engine.kv_transfer.connector import KVConnector, KVTransferError, LoadResult
from engine.kv_transfer.endpoint import KVEndpoint
from engine.kv_transfer.held_blocks import HeldBlocks
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.wire import (
    BLOCKS_CHANNEL,
    FETCH_CHANNEL,
    PRODUCER_INBOX,
    BlocksSent,
    FetchBlocks,
    payload_digest,
)
from engine.worker.attention.sdpa import SdpaBackend
from tests.eventually import eventually
from tests.protocols import conformance_errors

SECRET = b"kv-transfer-test-secret-32-bytes"
OTHER_SECRET = b"some-other-deployments-secret!!!"
TIMEOUT_S = 1.0  # the consumers' fetch timeout here (the default is 5 s)
SHAPE = (16, 16, 4, 64)  # house layout: [num_blocks, block_size, num_kv_heads, head_size]
HIDDEN = torch.arange(6, dtype=torch.float32)  # a prompt's last hidden state


def kv_cache(seed: int | None = None, dtype: torch.dtype = torch.bfloat16):
    """4 layers of (K, V): random (`seed`) or zeroed (None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    make = (
        (lambda: torch.zeros(SHAPE))
        if seed is None
        else (lambda: torch.randn(SHAPE, generator=gen))
    )
    return [(make().to(dtype), make().to(dtype)) for _ in range(4)]


def params_for(port: int, request_id: str = "p-1", block_ids=(3, 9, 4)) -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="P",
        remote_block_ids=tuple(block_ids),
        remote_host="127.0.0.1",
        remote_port=port,
        remote_request_id=request_id,
    )


@pytest.fixture
def source():
    """The producer's cache."""
    return kv_cache(seed=1)


@pytest.fixture
async def producer(ctx, source) -> AsyncIterator[KVTransferServer]:
    """A server holding request p-1's blocks [3, 9, 4] of `source`."""
    held = HeldBlocks(max_bytes=1 << 30, hold_timeout_s=60)
    held.put("p-1", [3, 9, 4], gather_blocks(source, [3, 9, 4]))
    server = KVTransferServer(ctx, "tcp://127.0.0.1:0", held, "P", FrameAuth(SECRET))
    server.start()
    yield server
    server.close()


@pytest.fixture
async def client(ctx) -> AsyncIterator[KVTransferClient]:
    consumer = KVTransferClient(ctx, FrameAuth(SECRET), TIMEOUT_S)
    yield consumer
    consumer.close()


@pytest.mark.timeout(30)
async def test_blocks_arrive_byte_identical(producer, client, source):
    payload = await client.fetch(params_for(producer.port), [3, 9, 4])
    assert bytes(payload.data) == bytes(gather_blocks(source, [3, 9, 4]).data)
    assert payload.header.num_bytes == 3 * 4 * 2 * 16 * 4 * 64 * 2
    assert (producer.num_served, producer.num_refused, len(producer.held)) == (1, 0, 0)


@pytest.mark.timeout(30)
async def test_a_tail_of_the_blocks_arrives_and_the_rest_are_freed(producer, client, source):
    payload = await client.fetch(params_for(producer.port), [4])
    assert bytes(payload.data) == bytes(gather_blocks(source, [4]).data)
    assert len(producer.held) == 0


@pytest.mark.timeout(30)
async def test_a_consumer_with_another_secret_is_refused_logged_and_fails(ctx, producer, caplog):
    stranger = KVTransferClient(ctx, FrameAuth(OTHER_SECRET), TIMEOUT_S)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        fetch = asyncio.ensure_future(stranger.fetch(params_for(producer.port), [3, 9, 4]))
        await eventually(lambda: producer.num_refused == 1, 5, "the fetch refused")
        with pytest.raises(KVTransferError, match="no answer from the KV producer .* within 1 s"):
            await fetch
    assert time.monotonic() - started < 10
    refusals = [r.getMessage() for r in caplog.records if r.name == "actors.frame_auth"]
    assert len(refusals) == 1
    assert "KV transfer server" in refusals[0] and "127.0.0.1" in refusals[0]
    assert "bad tag: wrong secret or tampered" in refusals[0]
    assert SECRET.decode() not in caplog.text and OTHER_SECRET.decode() not in caplog.text
    assert (producer.num_served, len(producer.held)) == (0, 1)  # nothing sent, still held
    stranger.close()


@pytest.mark.timeout(30)
async def test_unsealed_frames_are_refused_and_never_answered(ctx, producer, caplog):
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{producer.port}")
    sealed_elsewhere = FrameAuth(SECRET, "worker-0").seal(b"fetch everything")
    with caplog.at_level(logging.WARNING):
        await raw.send(b"fetch everything")
        await raw.send(sealed_elsewhere)  # right secret, another channel
        await eventually(lambda: producer.num_refused == 2, 5, "both frames refused")
    assert "too short" in caplog.text and "bad tag" in caplog.text
    assert await raw.poll(100) == 0  # no answer came
    assert len(producer.held) == 1
    raw.close(linger=0)


@pytest.mark.timeout(30)
async def test_a_fetch_of_an_unknown_request_fails_cleanly_and_at_once(producer, client):
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="refused: no KV blocks are held for request 'nope'"):
        await client.fetch(params_for(producer.port, "nope"), [3])
    with pytest.raises(KVTransferError, match=r"blocks \[11\] were not saved for request 'p-1'"):
        await client.fetch(params_for(producer.port), [11])
    wrong_engine = KVTransferParams.from_dict(
        {**params_for(producer.port).to_dict(), "remote_engine_id": "Q"}
    )
    with pytest.raises(KVTransferError, match="this is KV engine 'P', not 'Q'"):
        await client.fetch(wrong_engine, [3])
    assert time.monotonic() - started < TIMEOUT_S  # answered, not timed out
    assert len(producer.held) == 1  # the good request is still there for its consumer


@pytest.mark.timeout(30)
async def test_a_producer_gone_mid_fetch_fails_the_load_within_the_timeout(ctx, client):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fetch = asyncio.ensure_future(client.fetch(params_for(port), [3]))
    await asyncio.wait_for(router.recv_multipart(), 5)  # the fetch reached the producer...
    router.close(linger=0)  # ...which dies before it answers
    gone = time.monotonic()
    with pytest.raises(KVTransferError, match="no answer from the KV producer"):
        await fetch
    assert time.monotonic() - gone < 10


@pytest.mark.timeout(30)
async def test_a_closed_producer_fails_later_loads_within_the_timeout(producer, client):
    port = producer.port
    producer.close()
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="it is down, unreachable or overloaded"):
        await client.fetch(params_for(port), [3])
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
async def test_blocks_altered_on_the_way_are_refused(ctx, client):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fetch = asyncio.ensure_future(client.fetch(params_for(port), [3]))
    identity, sealed = await asyncio.wait_for(router.recv_multipart(), 5)
    payload = with_hidden(gather_blocks(kv_cache(seed=2), [3]), HIDDEN)
    honest = payload_digest(payload.data, payload.hidden)
    answer = BlocksSent(opened_fetch(sealed).fetch_id, payload.header, honest)
    altered = bytearray(payload.hidden)  # the hidden state counts as much as the blocks
    altered[0] ^= 1
    seal = FrameAuth(SECRET).for_channel(BLOCKS_CHANNEL)
    frames = [identity, seal.seal(encode(answer)), payload.data, bytes(altered)]
    await router.send_multipart(frames)
    with pytest.raises(KVTransferError, match="altered on the way"):
        await fetch
    router.close(linger=0)


def opened_fetch(sealed: bytes) -> FetchBlocks:
    """What a producer holding the secret reads from a consumer's sealed frame."""
    frame = FrameAuth(SECRET).for_channel(FETCH_CHANNEL).open(sealed)
    return InboxDecoder(PRODUCER_INBOX).decode(frame)


def connector(
    role: KVRole, cache, engine_id: str, secret: bytes = SECRET, layout: KVLayout = TOKEN_MAJOR
) -> ZmqConnector:
    """A connector on a free port, with this file's fetch timeout."""
    settings = KVTransferConfig(
        CONNECTOR, role, kv_port=0, engine_id=engine_id, fetch_timeout_s=TIMEOUT_S
    )
    return ZmqConnector(KVEndpoint(settings, cache, layout), secret)


async def load(consumer: ZmqConnector) -> LoadResult:
    """The one load that ends next (the connector's thread writes it; poll() reports it)."""
    ended: list[LoadResult] = []
    await eventually(lambda: ended.extend(consumer.poll()) or ended, 5, "a load to end")
    (result,) = ended
    return result


@pytest.mark.timeout(30)
async def test_zmq_connectors_move_a_prompt_between_two_instances():
    shape = SdpaBackend.kv_cache_shape(16, 16, 4, 64)  # [num_kv_heads, num_blocks, ...]
    source = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(2)]
    target = [(torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()) for _ in range(2)]
    sdpa = KVLayout.of(SdpaBackend.kv_cache_shape)
    producer = connector(KVRole.PRODUCER, source, "P", layout=sdpa)
    consumer = connector(KVRole.CONSUMER, target, "D", layout=sdpa)
    try:
        for end in (producer, consumer):
            assert conformance_errors(ZmqConnector, KVConnector, end) == []
        producer.save_request("p-1", [5, 1, 12], HIDDEN)
        params = producer.request_finished("p-1", [5, 1, 12])
        assert params.remote_port == producer.port != 0
        consumer.start_load("d-1", KVTransferParams.from_dict(params.to_dict()), [0, 2, 3])
        loaded = await load(consumer)
        assert loaded == LoadResult("d-1") and torch.equal(loaded.hidden, HIDDEN)
        for layer in range(2):
            for kv in range(2):
                assert torch.equal(
                    target[layer][kv][:, [0, 2, 3]], source[layer][kv][:, [5, 1, 12]]
                )
        consumer.start_load("d-2", params, [4])
        assert "no KV blocks are held for request 'p-1'" in (await load(consumer)).error
    finally:
        producer.close()
        consumer.close()


@pytest.mark.timeout(30)
async def test_a_zmq_connector_with_another_secret_fails_its_load(caplog):
    producer = connector(KVRole.PRODUCER, kv_cache(seed=1), "P")
    consumer = connector(KVRole.CONSUMER, kv_cache(), "D", secret=OTHER_SECRET)
    try:
        producer.save_request("p-1", [1], HIDDEN)
        with caplog.at_level(logging.WARNING):
            consumer.start_load("d-1", producer.request_finished("p-1", [1]), [2])
            result = await load(consumer)
        assert "no answer from the KV producer" in result.error
        assert producer.server.num_refused == 1 and "bad tag" in caplog.text
    finally:
        producer.close()
        consumer.close()


@pytest.mark.timeout(30)
async def test_closing_a_consumer_fails_its_loads_in_flight():
    silent = zmq.Context()
    router = silent.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    consumer = connector(KVRole.CONSUMER, kv_cache(), "D")
    consumer.start_load("d-1", params_for(port), [0, 1, 2])
    assert router.poll(5000)  # the fetch is out; nobody will answer it
    consumer.close()
    assert consumer.poll() == [LoadResult("d-1", "the KV connector was closed")]
    router.close(linger=0)
    silent.term()


@pytest.mark.timeout(30)
def test_a_zmq_connector_needs_the_cluster_secret_and_a_free_port():
    with pytest.raises(ValueError, match="KV transfer needs the cluster secret"):
        connector(KVRole.CONSUMER, kv_cache(), "D", secret=None)
    producer = connector(KVRole.PRODUCER, kv_cache(), "P")
    try:
        settings = KVTransferConfig(
            CONNECTOR, KVRole.PRODUCER, kv_port=producer.port, engine_id="Q"
        )
        with pytest.raises(OSError, match="cannot bind the KV transfer server"):
            ZmqConnector(KVEndpoint(settings, kv_cache()), SECRET)
    finally:
        producer.close()
