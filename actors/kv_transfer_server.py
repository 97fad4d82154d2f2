"""The producer's side of KV transfer: held blocks served on a ZeroMQ ROUTER socket.

Each consumer connects a DEALER (`actors.kv_transfer_client`) and sends a sealed
`FetchBlocks`; the server answers `[BlocksSent, raw bytes]` with the blocks (which are
then no longer held) or `[FetchFailed]` (not held, never saved, another engine). A
frame that does not open under the cluster secret (none, another secret, tampered,
replayed: `actors.frame_auth`) is refused, counted and logged, and never answered, so a
stranger learns nothing, not even which requests exist. Messages and channels:
`engine.kv_transfer.wire`.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from actors.frame_auth import FrameAuth, FrameRefused, RefusalLog
from actors.transport import peer_address
from engine.codec import DecodeError, InboxDecoder, encode
from engine.kv_transfer.connector import KVTransferError
from engine.kv_transfer.held_blocks import HeldBlocks
from engine.kv_transfer.wire import (
    BLOCKS_CHANNEL,
    FETCH_CHANNEL,
    PRODUCER_INBOX,
    BlocksSent,
    FetchBlocks,
    FetchFailed,
    payload_digest,
)

logger = logging.getLogger(__name__)


class KVTransferServer:
    """Serves `held` (engine `engine_id`'s saved blocks) at `address` (`tcp://host:port`;
    port 0: any free one, see `port`) to holders of `auth`'s secret, from `start()` until
    `close()`. Fetches are answered one at a time, in the order they arrive."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        held: HeldBlocks,
        engine_id: str,
        auth: FrameAuth,
    ) -> None:
        self.address = address
        self.held = held
        self.engine_id = engine_id
        self.num_served = 0
        self._requests = auth.for_channel(FETCH_CHANNEL)  # opens fetches; their replay memory
        self._answers = auth.for_channel(BLOCKS_CHANNEL)  # seals answers
        self._refusals = RefusalLog(f"KV transfer server {address}")
        self._decoder = InboxDecoder(PRODUCER_INBOX)
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone consumer: an error, not a drop
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise OSError(f"cannot bind the KV transfer server to {address}: {exc}") from exc
        self._task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The TCP port bound (the one taken for port 0)."""
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return int(endpoint.rsplit(":", 1)[1])

    @property
    def num_refused(self) -> int:
        """Frames refused because they did not open under the cluster secret."""
        return self._refusals.count

    def start(self) -> None:
        """Starts serving on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="kv-server")

    def close(self) -> None:
        """Stops serving at once (a fetch being answered is cut off); idempotent."""
        if self._task is not None:
            self._task.cancel()
        self._socket.close(linger=0)

    async def _serve(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                await self._answer(frames)
            except zmq.ZMQError as exc:  # the consumer went away before its answer
                logger.warning(
                    "KV transfer server %s: an answer was not sent: %s", self.address, exc
                )
            except Exception:  # a bug must not stop the serving of other fetches
                logger.exception(
                    "KV transfer server %s: a fetch could not be answered", self.address
                )

    async def _answer(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            peer = peer_address(frames[-1])
            logger.warning(
                "KV transfer server %s refused a message of %d frames from %s (a fetch is one)",
                self.address,
                len(frames) - 1,
                peer or "an unknown peer",
            )
            return
        identity, sealed = frames
        try:
            fetch = self._decoder.decode(self._requests.open(sealed.bytes))
        except FrameRefused as refused:
            self._refusals.note(refused.reason, peer_address(sealed))
            return
        except DecodeError as exc:  # a holder of the secret speaking another version
            logger.error("KV transfer server %s: undecodable fetch: %s", self.address, exc)
            return
        await self._send(identity.bytes, fetch)

    async def _send(self, identity: bytes, fetch: FetchBlocks) -> None:
        if fetch.engine_id != self.engine_id:
            error = f"this is KV engine {self.engine_id!r}, not {fetch.engine_id!r}"
            await self._reply(identity, FetchFailed(fetch.fetch_id, error))
            return
        try:
            payload = self.held.take(fetch.request_id, fetch.block_ids)
        except KVTransferError as exc:
            await self._reply(identity, FetchFailed(fetch.fetch_id, str(exc)))
            return
        digest = await asyncio.to_thread(payload_digest, payload.data, payload.hidden)
        answer = BlocksSent(fetch.fetch_id, payload.header, digest)
        await self._reply(identity, answer, payload.data, payload.hidden)
        self.num_served += 1
        logger.debug(
            "KV transfer server %s sent request %s: %d blocks, %d bytes",
            self.address,
            fetch.request_id,
            payload.header.num_blocks,
            payload.header.num_bytes,
        )

    async def _reply(self, identity: bytes, answer: object, *data: memoryview) -> None:
        frames = [identity, self._answers.seal(encode(answer)), *data]
        await self._socket.send_multipart(frames, copy=False)
