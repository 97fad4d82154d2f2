"""`PagedServeConnector`: the `KVConnector` over TCP with ZeroMQ.

A producer serves its held blocks at `kv_transfer_config`'s `kv_ip:kv_port`
(`KVTransferServer`); a consumer fetches them (`KVTransferClient`). The sockets live on
an event loop of the connector's own, in a daemon thread, so transfers go on while the
worker's thread runs a step. Call the `KVConnector` methods from one thread (the
worker's, whichever it is): they return at once (`save_request` once the blocks are
copied out of the cache, `close()` once the sockets are closed). Frames are sealed with
the cluster secret, which is required: KV blocks cross the network.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import zmq.asyncio

from actors.frame_auth import FrameAuth
from actors.kv_transfer_client import KVTransferClient
from actors.kv_transfer_server import KVTransferServer
from engine.kv_transfer.config import KVRole
from engine.kv_transfer.connector import KVTransferError, LoadResult
from engine.kv_transfer.endpoint import KVEndpoint
from engine.kv_transfer.params import KVTransferParams

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0


class ZmqConnector:
    """`KVConnector` for `endpoint` (its config, cache and held blocks), sealing frames
    with `secret` (`actors.cluster_secret.load_cluster_secret`). Binding the server
    happens in the constructor: an address in use raises OSError there."""

    def __init__(self, endpoint: KVEndpoint, secret: bytes | None) -> None:
        if secret is None:
            raise ValueError(
                "KV transfer needs the cluster secret (--cluster-secret-file FILE or "
                "$PAGEDSERVE_CLUSTER_SECRET; make one with `python -m actors.cluster_secret "
                "FILE`): KV blocks cross the network"
            )
        self.endpoint = endpoint
        self._auth = FrameAuth(secret)
        self._server: KVTransferServer | None = None
        self._client: KVTransferClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kv-transfer", daemon=True
        )
        self._thread.start()
        try:
            self.port = self._call(self._open())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def role(self) -> KVRole:
        return self.endpoint.role

    @property
    def server(self) -> KVTransferServer | None:
        """The producer's server (None for a consumer): its counters, for stats and tests."""
        return self._server

    def save_request(self, request_id: str, block_ids: Sequence[int], hidden: Any) -> None:
        self.endpoint.save(request_id, block_ids, hidden)

    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> KVTransferParams:
        return self.endpoint.params(request_id, block_ids, self.port)

    def start_load(
        self, request_id: str, params: KVTransferParams, local_block_ids: Sequence[int]
    ) -> None:
        if self._closed:
            raise RuntimeError("start_load on a closed KV connector")
        wanted = self.endpoint.begin_load(request_id, params, local_block_ids)
        if wanted is not None:
            asyncio.run_coroutine_threadsafe(self._load(request_id, params, wanted), self._loop)

    def poll(self) -> list[LoadResult]:
        return self.endpoint.poll()

    def wait(self, timeout_s: float) -> None:
        self.endpoint.wait(timeout_s)

    def cancel(self, request_id: str) -> None:
        self.endpoint.cancel(request_id)

    def close(self) -> None:
        """Closes the sockets; loads in flight end failed at the next `poll()`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shut())
        finally:
            self._stop_loop()
            self.endpoint.fail_all("the KV connector was closed")

    async def _open(self) -> int:
        self._ctx = zmq.asyncio.Context()
        config = self.endpoint.config
        if config.kv_role.consumes:
            self._client = KVTransferClient(self._ctx, self._auth, config.fetch_timeout_s)
        if not config.kv_role.produces:
            return config.kv_port
        held = self.endpoint.held
        try:
            self._server = KVTransferServer(
                self._ctx, config.address, held, config.engine_id, self._auth
            )
        except OSError:
            self._ctx.destroy(linger=0)
            raise
        self._server.start()
        port = self._server.port
        logger.info(
            "KV transfer: engine %s serves blocks on %s port %d",
            config.engine_id,
            config.kv_ip,
            port,
        )
        return port

    async def _load(
        self, request_id: str, params: KVTransferParams, wanted: tuple[int, ...]
    ) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            payload = await self._client.fetch(params, wanted)
        except KVTransferError as exc:
            self.endpoint.failed(request_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure ends the load, with its reason
            logger.exception("KV transfer: the load of request %s failed", request_id)
            self.endpoint.failed(request_id, f"{type(exc).__name__}: {exc}")
        else:  # written off the loop (a fresh cache's pages fault in: tens of ms)
            await asyncio.to_thread(self.endpoint.arrived, request_id, payload)
        finally:
            self._tasks.discard(task)

    async def _shut(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for end in (self._client, self._server):
            if end is not None:
                end.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.gather(*others, return_exceptions=True)  # this loop runs only ours
        self._ctx.destroy(linger=0)

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(START_TIMEOUT_S)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
