"""The consumer's side of KV transfer: blocks fetched from producers over ZeroMQ DEALERs.

One DEALER per producer address, connected on first use and shared by every fetch to
it; answers are matched to fetches by `fetch_id`. Every fetch ends within `timeout_s`:
with the blocks (their SHA-256 checked against the sealed `BlocksSent`), or with a
`KVTransferError` saying why (the producer refused, is gone, is silent, or does not hold
this cluster's secret: its answers do not open here, and ours are refused there). The
DEALER queues nothing for a producer it is not connected to (`IMMEDIATE`), so a fetch
to a dead address waits out its timeout instead of landing on a later producer.
Messages and channels: `engine.kv_transfer.wire`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence

import zmq
import zmq.asyncio

from actors.frame_auth import FrameAuth, FrameRefused, RefusalLog
from actors.transport import RECONNECT_IVL_MS, peer_address
from engine.codec import DecodeError, InboxDecoder, encode
from engine.kv_transfer.connector import KVTransferError
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.payload import KVPayload
from engine.kv_transfer.wire import (
    BLOCKS_CHANNEL,
    CONSUMER_INBOX,
    FETCH_CHANNEL,
    BlocksSent,
    FetchBlocks,
    FetchFailed,
    payload_digest,
)

logger = logging.getLogger(__name__)


class KVTransferClient:
    """Fetches held blocks for holders of `auth`'s secret; each fetch ends within
    `timeout_s`. Use from one event loop; `close()` fails the fetches in flight."""

    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._auth = auth
        self._producers: dict[str, _Producer] = {}

    async def fetch(self, params: KVTransferParams, block_ids: Sequence[int]) -> KVPayload:
        """The blocks `block_ids` (the producer's ids) of the request `params` point at."""
        address = params.remote_address
        producer = self._producers.get(address)
        if producer is None:
            producer = self._producers[address] = _Producer(self._ctx, address, self._auth)
        fetch = FetchBlocks(
            params.remote_request_id,
            tuple(block_ids),
            params.remote_engine_id,
            secrets.token_hex(8),
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                return await producer.fetch(fetch)
        except TimeoutError:
            raise KVTransferError(
                f"no answer from the KV producer at {address} within {self.timeout_s:g} s "
                f"for request {fetch.request_id!r}: it is down, unreachable or overloaded, or "
                "does not hold this cluster's secret"
            ) from None

    def close(self) -> None:
        for producer in self._producers.values():
            producer.close()
        self._producers.clear()


class _Producer:
    """The DEALER to one producer and the fetches waiting for its answers."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, auth: FrameAuth) -> None:
        self.address = address
        self._seal = auth.for_channel(FETCH_CHANNEL)
        self._open = auth.for_channel(BLOCKS_CHANNEL)
        self._refusals = RefusalLog(f"KV transfer client of {address}")
        self._decoder = InboxDecoder(CONSUMER_INBOX)
        self._waiting: dict[str, asyncio.Future[KVPayload]] = {}
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self._socket.connect(address)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="kv-client")

    async def fetch(self, fetch: FetchBlocks) -> KVPayload:
        answer = asyncio.get_running_loop().create_future()
        self._waiting[fetch.fetch_id] = answer
        try:
            await self._socket.send(self._seal.seal(encode(fetch)))
            return await answer
        finally:
            self._waiting.pop(fetch.fetch_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                answer = self._decoder.decode(self._open.open(frames[0].bytes))
            except FrameRefused as refused:
                self._refusals.note(refused.reason, peer_address(frames[0]))
                continue
            except DecodeError as exc:
                logger.error("KV transfer client of %s: undecodable answer: %s", self.address, exc)
                continue
            waiting = self._waiting.get(answer.fetch_id)
            if waiting is None or waiting.done():  # an answer after its fetch timed out
                continue
            try:
                payload = await self._payload(answer, frames[1:])
            except Exception as exc:  # noqa: BLE001 - the fetch fails with it, the reader goes on
                if not waiting.done():
                    waiting.set_exception(_as_transfer_error(exc))
            else:
                if not waiting.done():
                    waiting.set_result(payload)

    async def _payload(self, answer: BlocksSent | FetchFailed, data: list[zmq.Frame]) -> KVPayload:
        if isinstance(answer, FetchFailed):
            raise KVTransferError(f"the KV producer at {self.address} refused: {answer.error}")
        header = answer.header
        sizes = [len(frame) for frame in data]
        if sizes != [header.num_bytes, header.hidden_bytes]:
            raise KVTransferError(
                f"the KV producer at {self.address} sent frames of {sizes} bytes for "
                f"{header.num_bytes} bytes of blocks and {header.hidden_bytes} of hidden state"
            )
        blocks, hidden = data[0].buffer, data[1].buffer
        digest = await asyncio.to_thread(payload_digest, blocks, hidden)
        if digest != answer.sha256:
            raise KVTransferError(
                f"the blocks from the KV producer at {self.address} were altered on the way "
                "(their SHA-256 does not match the sealed header)"
            )
        return KVPayload(header, blocks, hidden)

    def close(self) -> None:
        self._reader.cancel()
        self._socket.close(linger=0)
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(KVTransferError("the KV transfer client was closed"))
        self._waiting.clear()


def _as_transfer_error(exc: Exception) -> KVTransferError:
    if isinstance(exc, KVTransferError):
        return exc
    logger.exception("KV transfer client: an answer could not be read")
    return KVTransferError(f"an answer could not be read: {type(exc).__name__}: {exc}")
