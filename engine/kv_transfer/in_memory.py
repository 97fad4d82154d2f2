"""A KV connector without sockets: producers and consumers in one process, for tests
and for wiring the engine before a network is involved."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.kv_transfer.config import KVRole
from engine.kv_transfer.connector import KVTransferError, LoadResult
from engine.kv_transfer.endpoint import KVEndpoint
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.payload import KVPayload


class InMemoryFabric:
    """The producers reachable in this process, by engine id (the network's stand-in)."""

    def __init__(self) -> None:
        self._producers: dict[str, KVEndpoint] = {}

    def attach(self, endpoint: KVEndpoint) -> None:
        engine_id = endpoint.config.engine_id
        if engine_id in self._producers:
            raise ValueError(f"engine id {engine_id!r} is already attached")
        self._producers[engine_id] = endpoint

    def detach(self, endpoint: KVEndpoint) -> None:
        if self._producers.get(endpoint.config.engine_id) is endpoint:
            del self._producers[endpoint.config.engine_id]

    def fetch(self, params: KVTransferParams, block_ids: Sequence[int]) -> KVPayload:
        """What a producer would send for `params`; KVTransferError as it would fail."""
        producer = self._producers.get(params.remote_engine_id)
        if producer is None:
            raise KVTransferError(f"no producer engine {params.remote_engine_id!r} is reachable")
        return producer.held.take(params.remote_request_id, block_ids)


class InMemoryConnector:
    """`KVConnector` over an `InMemoryFabric`: a load is fetched at `start_load` and, as
    with any connector, reported (and written into the cache) at the next `poll()`."""

    def __init__(self, endpoint: KVEndpoint, fabric: InMemoryFabric) -> None:
        self.endpoint = endpoint
        self.fabric = fabric
        if endpoint.role.produces:
            fabric.attach(endpoint)

    @property
    def role(self) -> KVRole:
        return self.endpoint.role

    def save_request(self, request_id: str, block_ids: Sequence[int], hidden: Any) -> None:
        self.endpoint.save(request_id, block_ids, hidden)

    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> KVTransferParams:
        port = self.endpoint.config.kv_port or 1  # nothing is bound in memory; params need one
        return self.endpoint.params(request_id, block_ids, port)

    def start_load(
        self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int]
    ) -> None:
        wanted = self.endpoint.begin_load(request_id, params, local_block_ids)
        if wanted is None:
            return
        try:
            payload = self.fabric.fetch(params, wanted)
        except KVTransferError as exc:
            self.endpoint.failed(request_id, str(exc))
        else:
            self.endpoint.arrived(request_id, payload)

    def poll(self) -> list[LoadResult]:
        return self.endpoint.poll()

    def wait(self, timeout_s: float) -> None:
        self.endpoint.wait(timeout_s)

    def cancel(self, request_id: str) -> None:
        self.endpoint.cancel(request_id)

    def close(self) -> None:
        self.fabric.detach(self.endpoint)
        self.endpoint.fail_all("the KV connector was closed")
