"""The producer's saved blocks, waiting for their consumer (torch-free)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_transfer.connector import KVTransferError
from engine.kv_transfer.payload import KVPayload, select_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Held:
    block_ids: tuple[int, ...]  # the producer's ids, in the payload's order
    payload: KVPayload
    expires: float


class HeldBlocks:
    """Payloads by request id, each held until taken once, until `hold_timeout_s` has
    passed, or, oldest first, until room is needed: the bytes held never exceed
    `max_bytes`. Thread-safe (a worker saves, a server thread takes)."""

    def __init__(
        self,
        max_bytes: int,
        hold_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.hold_timeout_s = hold_timeout_s
        self._clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def put(self, request_id: str, block_ids: Sequence[int], payload: KVPayload) -> None:
        """Holds `payload` (the blocks `block_ids`) for `request_id`, replacing any
        earlier one; ValueError if it alone exceeds `max_bytes`."""
        if len(block_ids) != payload.header.num_blocks:
            raise ValueError(
                f"{len(block_ids)} block ids for a payload of {payload.header.num_blocks} blocks"
            )
        size = payload.header.num_bytes
        if size > self.max_bytes:
            raise ValueError(
                f"request {request_id}'s blocks take {size} bytes, more than kv_buffer_size="
                f"{self.max_bytes}; raise kv_buffer_size"
            )
        with self._lock:
            self._drop(request_id)
            self._expire()
            while self._bytes + size > self.max_bytes:
                oldest = next(iter(self._held))
                logger.warning(
                    "KV transfer: dropping the unfetched blocks of request %s to hold %s's "
                    "(kv_buffer_size=%d bytes is full)",
                    oldest,
                    request_id,
                    self.max_bytes,
                )
                self._drop(oldest)
            expires = self._clock() + self.hold_timeout_s
            self._held[request_id] = _Held(tuple(block_ids), payload, expires)
            self._bytes += size

    def take(self, request_id: str, block_ids: Sequence[int]) -> KVPayload:
        """The blocks `block_ids` (some of those saved, in any order) of `request_id`;
        the request's blocks are then no longer held. KVTransferError if there are none
        or an id was not saved."""
        with self._lock:
            self._expire()
            held = self._held.get(request_id)
            if held is None:
                raise KVTransferError(
                    f"no KV blocks are held for request {request_id!r}: never saved, already "
                    f"fetched, or dropped (after hold_timeout_s={self.hold_timeout_s:g} s, or "
                    "to make room in kv_buffer_size)"
                )
            position = {b: i for i, b in enumerate(held.block_ids)}
            unknown = [b for b in block_ids if b not in position]
            if unknown:
                raise KVTransferError(
                    f"blocks {unknown} were not saved for request {request_id!r} "
                    f"(saved: {list(held.block_ids)})"
                )
            self._drop(request_id)
        return select_blocks(held.payload, [position[b] for b in block_ids])

    def expire(self) -> list[str]:
        """Drops what has been held past `hold_timeout_s`; returns those request ids."""
        with self._lock:
            return self._expire()

    def _expire(self) -> list[str]:
        now, gone = self._clock(), []
        while self._held and next(iter(self._held.values())).expires <= now:  # oldest first
            gone.append(next(iter(self._held)))
            self._drop(gone[-1])
        if gone:
            logger.info("KV transfer: %d requests' blocks expired unfetched", len(gone))
        return gone

    def _drop(self, request_id: str) -> _Held | None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._bytes -= held.payload.header.num_bytes
        return held
