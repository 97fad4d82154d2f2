"""The messages a KV consumer and producer exchange (msgpack through `engine.codec`).

One fetch, one answer, over a DEALER (consumer) -> ROUTER (producer) connection; every
msgpack frame sealed with the cluster secret (`actors.frame_auth`):

    consumer -> producer   [FetchBlocks]
    producer -> consumer   [BlocksSent, blocks' bytes, hidden state's bytes]   or   [FetchFailed]

The raw bytes frames are not sealed (that would copy them): the sealed `BlocksSent`
carries their SHA-256 (`payload_digest`), which the consumer checks before using a
byte. Field order is the wire format: append new fields at the end.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.kv_transfer.payload import BlocksHeader

FETCH_CHANNEL = "kv-transfer/fetch"  # what a producer's requests are sealed for
BLOCKS_CHANNEL = "kv-transfer/blocks"  # what a consumer's answers are sealed for


@dataclass(frozen=True)
class FetchBlocks:
    """Consumer -> producer: send the blocks `block_ids` (the producer's ids, in this
    order) held for `request_id` (the producer's request id) at engine `engine_id`.
    `fetch_id` is fresh for each fetch and comes back in the answer: a consumer takes
    only answers to fetches it is waiting for."""

    request_id: str
    block_ids: tuple[int, ...]
    engine_id: str
    fetch_id: str


@dataclass(frozen=True)
class BlocksSent:
    """Producer -> consumer: the blocks follow in the next frame (`header.num_bytes` raw
    bytes), then the hidden state (`header.hidden_bytes`); `sha256` is their
    `payload_digest`."""

    fetch_id: str
    header: BlocksHeader
    sha256: bytes


@dataclass(frozen=True)
class FetchFailed:
    """Producer -> consumer: the fetch cannot be served (`error` says why)."""

    fetch_id: str
    error: str


def payload_digest(blocks: memoryview, hidden: memoryview) -> bytes:
    """SHA-256 of a payload's blocks' bytes followed by its hidden state's bytes."""
    digest = hashlib.sha256(blocks)
    digest.update(hidden)
    return digest.digest()


PRODUCER_INBOX = (FetchBlocks,)
CONSUMER_INBOX = (BlocksSent, FetchFailed)
