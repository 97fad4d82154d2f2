"""Authenticated frames: only a holder of the cluster secret can drive a worker or forge
its results, and a captured frame cannot be played again.

Every frame on an authenticated channel is sealed by its sender and opened by its
receiver (`FrameAuth.seal` / `FrameAuth.open`). Wire layout of a sealed frame (57 bytes
more than the payload; the payload is the codec's msgpack frame, unchanged):

    offset  bytes  field
    0       1      version, 1
    1       16     sender nonce: random, one per sending socket (per `FrameAuth` object)
    17      8      counter: unsigned big-endian; 1 on the sender's first frame, +1 per frame
    25      n      payload, in plaintext
    25+n    32     tag: HMAC-SHA256(secret, DOMAIN || len(channel) as u16 big-endian
                   || channel (utf-8) || bytes 0 .. 25+n of this frame)

The receiver checks, in this order: length ("too short"), version ("unsupported
version"), the tag with `hmac.compare_digest` ("bad tag: wrong secret or tampered"), then
that the counter is above the last one it accepted from that sender nonce ("replayed
frame"). Only a frame whose tag is good touches the replay memory, so a stranger cannot
fill it. ZeroMQ keeps one socket's frames in order, so one sender's counters arrive
increasing; each outbox seals under a nonce of its own (`for_channel`), so two sockets
sending to one inbox never interleave one counter.

What the tag binds, and what stops a replay:
- `channel` (not on the wire) names the receiving end, e.g. "worker-0" or "scheduler":
  a frame sealed for worker 0 does not open at worker 1 (it reads as a bad tag), so a
  StepPlan captured on one channel cannot be injected into another.
- The replay memory is per receiver and lives as long as it does, bounded to
  `max_senders` nonces (the least recently heard is forgotten first; it would take that
  many sender sockets on one channel, i.e. as many worker restarts, before a frame of
  the forgotten one could be replayed). A receiver that restarts starts with an empty
  memory: to stop frames captured in an earlier run being replayed into a new one, put
  a per-run id in the channel (the launcher mints one and passes it to the worker with
  its addresses), e.g. `f"{run_id}/worker-0"`.

Integrity and authenticity only: payloads travel in plaintext, so anyone on the path can
read prompts and sampled tokens. Confidentiality needs encryption: ZeroMQ's CURVE
(CurveZMQ: per-connection encryption with a key pair per host, plus a ZAP authenticator,
`zmq.auth`, to say which client keys may connect) or a TLS tunnel / private network
between the hosts. CURVE exists only where libzmq was built with it: `zmq.has("curve")`
is True for pyzmq 27's wheels (their bundled libzmq 4.3.5 links a bundled libsodium),
but a distro's or a source-built libzmq may lack it. We chose HMAC because it needs only
Python's standard library (no question of how libzmq was built, no key pairs and no
authenticator thread: one shared secret, see `actors.cluster_secret`) and works the same
on ipc, tcp and in tests. Treat the channel as readable by the network.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import StrEnum

logger = logging.getLogger(__name__)

VERSION = 1
DOMAIN = b"pagedserve-frame-v1\0"  # separates our tags from any other use of the secret
NONCE_BYTES = 16
TAG_BYTES = 32
_HEADER = struct.Struct(">B16sQ")  # version, sender nonce, counter
OVERHEAD = _HEADER.size + TAG_BYTES
MIN_SECRET_BYTES = 16
MAX_SENDERS = 1024


class Refusal(StrEnum):
    """Why a frame was refused (the closed set `FrameRefused.reason` takes)."""

    TOO_SHORT = "too short"
    UNSUPPORTED_VERSION = "unsupported version"
    BAD_TAG = "bad tag: wrong secret or tampered"
    REPLAYED = "replayed frame"


class FrameRefused(ValueError):
    """A frame not sealed for this channel by a holder of the secret, or one seen before."""

    def __init__(self, reason: Refusal) -> None:
        super().__init__(reason.value)
        self.reason = reason


def check_secret(secret: bytes, source: str = "the cluster secret") -> None:
    """Raises ValueError unless `secret` is bytes of at least MIN_SECRET_BYTES (the one
    place that rule lives; `source` names where the secret came from)."""
    if not isinstance(secret, bytes):
        raise ValueError(f"{source} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{source} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
            "(write a new one with `python -m actors.cluster_secret FILE`)"
        )


class FrameAuth:
    """Seals and opens frames for one channel under one shared secret (see the module doc).

    One object is one sender identity (a random nonce and its counter) and one receiver's
    replay memory: give each sending socket its own (`for_channel`); a receiver may share
    one between its sockets. `seal` and `open` are thread-safe. The secret is kept only
    inside a keyed HMAC state, never as a bytes attribute, and never shown by `repr`."""

    def __init__(self, secret: bytes, channel: str = "", max_senders: int = MAX_SENDERS) -> None:
        check_secret(secret)
        self._init(hmac.new(secret, digestmod=hashlib.sha256), channel, max_senders)

    def _init(self, keyed: hmac.HMAC, channel: str, max_senders: int) -> None:
        if max_senders < 1:
            raise ValueError(f"max_senders must be at least 1, got {max_senders}")
        name = channel.encode()
        if len(name) > 0xFFFF:
            raise ValueError(f"channel name has {len(name)} bytes; at most 65535")
        self.channel = channel
        self.max_senders = max_senders
        self._keyed = keyed
        self._channel_mac = keyed.copy()
        self._channel_mac.update(DOMAIN + struct.pack(">H", len(name)) + name)
        self._nonce = os.urandom(NONCE_BYTES)
        self._counter = 0
        self._last_counter: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def for_channel(self, channel: str) -> FrameAuth:
        """The same secret for `channel`, with a sender nonce, counter and replay memory
        of its own (pass `self.channel` for a second sender on this channel)."""
        other = object.__new__(FrameAuth)
        other._init(self._keyed.copy(), channel, self.max_senders)
        return other

    @property
    def num_senders_remembered(self) -> int:
        """How many sender nonces the replay memory holds (at most `max_senders`)."""
        return len(self._last_counter)

    def seal(self, frame: bytes) -> bytes:
        """`frame` with this sender's header in front and the tag behind."""
        with self._lock:
            self._counter += 1
            counter = self._counter
        signed = _HEADER.pack(VERSION, self._nonce, counter) + frame
        return signed + self._tag(signed)

    def open(self, sealed: bytes) -> bytes:
        """The payload of a frame sealed for this channel; raises FrameRefused otherwise."""
        if len(sealed) < OVERHEAD:
            raise FrameRefused(Refusal.TOO_SHORT)
        view = memoryview(sealed)
        version, nonce, counter = _HEADER.unpack_from(view)
        if version != VERSION:
            raise FrameRefused(Refusal.UNSUPPORTED_VERSION)
        if not hmac.compare_digest(self._tag(view[:-TAG_BYTES]), view[-TAG_BYTES:]):
            raise FrameRefused(Refusal.BAD_TAG)
        self._accept_counter(nonce, counter)
        return bytes(view[_HEADER.size : -TAG_BYTES])

    def _tag(self, signed: bytes | memoryview) -> bytes:
        mac = self._channel_mac.copy()
        mac.update(signed)
        return mac.digest()

    def _accept_counter(self, nonce: bytes, counter: int) -> None:
        with self._lock:
            last = self._last_counter.get(nonce, 0)
            if counter <= last:
                raise FrameRefused(Refusal.REPLAYED)
            self._last_counter[nonce] = counter
            self._last_counter.move_to_end(nonce)
            if len(self._last_counter) > self.max_senders:
                self._last_counter.popitem(last=False)

    def __repr__(self) -> str:
        return f"FrameAuth(channel={self.channel!r}, secret=<hidden>)"


class RefusalLog:
    """Counts the frames a receiver refused (`count`) and logs a warning for them: at most
    one per reason per `interval_s`, naming the receiver, the sender's address when known,
    the reason and how many were refused for it since the last warning. Never the payload
    (nor the secret, which it never sees)."""

    def __init__(
        self,
        receiver: str,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.receiver = receiver
        self.interval_s = interval_s
        self.count = 0
        self._clock = clock
        self._last_warned: dict[Refusal, float] = {}
        self._unreported: dict[Refusal, int] = {}

    def note(self, reason: Refusal, peer: str | None = None) -> None:
        self.count += 1
        self._unreported[reason] = self._unreported.get(reason, 0) + 1
        now = self._clock()
        last = self._last_warned.get(reason)
        if last is not None and now - last < self.interval_s:
            return
        self._last_warned[reason] = now
        logger.warning(
            "%s refused a frame from %s: %s (%d refused for this reason since the last "
            "such warning)",
            self.receiver,
            peer or "an unknown peer",
            reason.value,
            self._unreported.pop(reason),
        )
