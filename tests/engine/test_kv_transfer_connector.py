"""The KV connector's contract (engine/kv_transfer/connector.py) on the in-memory
connector: a producer's saved blocks reach a consumer's own blocks byte for byte, each
load ends exactly once at `poll()`, ok or failed with the reason; held blocks go once
fetched, after their timeout, or oldest first when the buffer is full."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.kv_transfer.blocks import KVLayout, gather_blocks
from engine.kv_transfer.config import CONNECTOR, KVRole, KVTransferConfig
from engine.kv_transfer.connector import KVConnector, KVTransferError, LoadResult
from engine.kv_transfer.endpoint import KVEndpoint
from engine.kv_transfer.held_blocks import HeldBlocks
from engine.kv_transfer.in_memory import InMemoryConnector, InMemoryFabric
from engine.kv_transfer.params import KVTransferParams
from engine.worker.attention.native import NativeCpuBackend
from tests.protocols import conformance_errors

pytestmark = pytest.mark.timeout(30)

SHAPE = (12, 4, 2, 8)  # house layout: [num_blocks, block_size, num_kv_heads, head_size]
HIDDEN = torch.arange(6, dtype=torch.float32)  # a prompt's last hidden state


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cache(seed: int | None = None, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed or 0)
    make = (
        (lambda: torch.zeros(shape))
        if seed is None
        else (lambda: torch.randn(shape, generator=gen))
    )
    return [(make(), make()) for _ in range(2)]


def endpoint(role: KVRole, kv_cache, engine_id: str, clock=None, **config) -> KVEndpoint:
    settings = KVTransferConfig(CONNECTOR, role, engine_id=engine_id, **config)
    return KVEndpoint(settings, kv_cache, clock=clock or Clock())


@pytest.fixture
def pair():
    fabric = InMemoryFabric()
    producer = InMemoryConnector(endpoint(KVRole.PRODUCER, cache(seed=1), "P"), fabric)
    consumer = InMemoryConnector(endpoint(KVRole.CONSUMER, cache(), "D"), fabric)
    yield producer, consumer
    producer.close()
    consumer.close()


def test_the_in_memory_connector_implements_the_protocol(pair):
    for connector in pair:
        assert conformance_errors(InMemoryConnector, KVConnector, connector) == []


def test_saved_blocks_load_byte_identical_and_end_once(pair):
    producer, consumer = pair
    producer.save_request("p-1", [3, 7, 5], HIDDEN)
    params = producer.request_finished("p-1", [3, 7, 5])
    assert params == KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="P",
        remote_block_ids=(3, 7, 5),
        remote_host="127.0.0.1",
        remote_port=14579,
        remote_request_id="p-1",
    )
    consumer.start_load("d-1", KVTransferParams.from_dict(params.to_dict()), [0, 1, 2])
    (loaded,) = consumer.poll()
    assert loaded == LoadResult("d-1") and torch.equal(loaded.hidden, HIDDEN)
    assert consumer.poll() == []
    sent = gather_blocks(producer.endpoint.kv_cache, [3, 7, 5])
    assert bytes(gather_blocks(consumer.endpoint.kv_cache, [0, 1, 2]).data) == bytes(sent.data)
    assert len(producer.endpoint.held) == 0  # fetched once: no longer held
    consumer.start_load("d-2", params, [4, 6, 8])
    (again,) = consumer.poll()
    assert not again.ok and "no KV blocks are held for request 'p-1'" in again.error


def test_blocks_are_copied_at_save_so_the_producer_may_reuse_them(pair):
    producer, consumer = pair
    before = gather_blocks(producer.endpoint.kv_cache, [2])
    producer.save_request("p-1", [2], HIDDEN)
    producer.endpoint.kv_cache[0][0][2].fill_(9.0)
    consumer.start_load("d-1", producer.request_finished("p-1", [2]), [11])
    assert consumer.poll()[0].ok
    assert bytes(gather_blocks(consumer.endpoint.kv_cache, [11]).data) == bytes(before.data)


def test_fewer_local_blocks_load_the_remote_tail(pair):
    producer, consumer = pair
    producer.save_request("p-1", [3, 7, 5], HIDDEN)
    consumer.start_load("d-1", producer.request_finished("p-1", [3, 7, 5]), [9])
    assert consumer.poll() == [LoadResult("d-1")]
    assert torch.equal(consumer.endpoint.kv_cache[1][1][9], producer.endpoint.kv_cache[1][1][5])


def test_loads_that_cannot_fit_fail_with_the_reason(pair):
    producer, consumer = pair
    producer.save_request("p-1", [3, 7], HIDDEN)
    params = producer.request_finished("p-1", [3, 7])
    consumer.start_load("d-1", params, [0, 1, 2])
    consumer.start_load("d-2", KVTransferParams.remote_decode(), [0])
    elsewhere = KVTransferParams.from_dict({**params.to_dict(), "remote_engine_id": "Q"})
    consumer.start_load("d-3", elsewhere, [0])
    errors = {r.request_id: r.error for r in consumer.poll()}
    assert "3 blocks were allocated for it here but the producer saved 2" in errors["d-1"]
    assert "do not say do_remote_prefill" in errors["d-2"]
    assert "no producer engine 'Q' is reachable" in errors["d-3"]


def test_a_payload_that_does_not_fit_the_consumer_cache_fails_its_load():
    fabric = InMemoryFabric()
    producer = InMemoryConnector(endpoint(KVRole.PRODUCER, cache(seed=1), "P"), fabric)
    wide = cache(shape=(12, 4, 2, 16))
    consumer = InMemoryConnector(endpoint(KVRole.CONSUMER, wide, "D"), fabric)
    producer.save_request("p-1", [1], HIDDEN)
    consumer.start_load("d-1", producer.request_finished("p-1", [1]), [0])
    (result,) = consumer.poll()
    assert "payload (4, 2, 8), cache (4, 2, 16)" in result.error


def test_each_half_refuses_the_other_halfs_calls(pair):
    producer, consumer = pair
    with pytest.raises(RuntimeError, match="start_load needs kv_role kv_consumer or kv_both"):
        producer.start_load("x", KVTransferParams.remote_decode(), [])
    with pytest.raises(RuntimeError, match="save_request needs kv_role kv_producer or kv_both"):
        consumer.save_request("x", [1], HIDDEN)
    with pytest.raises(RuntimeError, match="request_finished needs kv_role kv_producer"):
        consumer.request_finished("x", [1])


def test_closing_fails_the_loads_in_flight_and_a_second_load_of_one_request_is_refused():
    consumer = endpoint(KVRole.BOTH, cache(), "D")
    params = KVTransferParams.from_dict(
        {
            "do_remote_prefill": True,
            "remote_engine_id": "P",
            "remote_block_ids": [1],
            "remote_host": "h",
            "remote_port": 1,
            "remote_request_id": "p",
        }
    )
    assert consumer.begin_load("d-1", params, [0]) == (1,)
    with pytest.raises(ValueError, match="a load for request 'd-1' is already in flight"):
        consumer.begin_load("d-1", params, [0])
    consumer.fail_all("closed")
    assert consumer.poll() == [LoadResult("d-1", "closed")]
    consumer.arrived("d-1", gather_blocks(cache(), [0]))  # a late answer: already ended
    assert consumer.poll() == [] and consumer.num_loading == 0


def test_held_blocks_expire_and_make_room_oldest_first(caplog):
    clock = Clock()
    payload = gather_blocks(cache(seed=1), [0, 1])
    held = HeldBlocks(max_bytes=3 * payload.header.num_bytes, hold_timeout_s=10, clock=clock)
    for i in range(3):
        held.put(f"r{i}", [0, 1], payload)
    with caplog.at_level(logging.WARNING):
        held.put("r3", [0, 1], payload)
    assert "dropping the unfetched blocks of request r0 to hold r3's" in caplog.text
    assert held.num_bytes == 3 * payload.header.num_bytes
    with pytest.raises(KVTransferError, match="no KV blocks are held for request 'r0'"):
        held.take("r0", [0, 1])
    with pytest.raises(KVTransferError, match=r"blocks \[5\] were not saved for request 'r1'"):
        held.take("r1", [5])
    assert len(held) == 3  # a bad fetch leaves the blocks held
    clock.now = 10.0
    assert held.expire() == ["r1", "r2", "r3"]
    assert held.num_bytes == 0
    with pytest.raises(ValueError, match="more than kv_buffer_size=1; raise kv_buffer_size"):
        HeldBlocks(max_bytes=1, hold_timeout_s=1).put("big", [0, 1], payload)


def test_a_native_cpu_consumer_loads_a_house_layout_producer():
    fabric = InMemoryFabric()
    producer = InMemoryConnector(endpoint(KVRole.PRODUCER, cache(seed=3), "P"), fabric)
    layout = KVLayout.of(NativeCpuBackend.kv_cache_shape)
    native = [(torch.zeros(12, 2, 4, 8), torch.zeros(12, 2, 4, 8)) for _ in range(2)]
    settings = KVTransferConfig(CONNECTOR, KVRole.CONSUMER, engine_id="D")
    consumer = InMemoryConnector(KVEndpoint(settings, native, layout), fabric)
    producer.save_request("p", [4], HIDDEN)
    consumer.start_load("d", producer.request_finished("p", [4]), [0])
    assert consumer.poll() == [LoadResult("d")]
    assert torch.equal(native[1][0][0], producer.endpoint.kv_cache[1][0][4].transpose(0, 1))
