"""Frames as a stranger on the network would send them to an authenticated inbox."""

from __future__ import annotations

import zmq

from actors.frame_auth import FrameAuth
from engine.codec import encode
from engine.messages import Shutdown


def forgeries(secret: bytes, channel: str) -> list[bytes]:
    """A Shutdown (it would stop a worker): unsealed, sealed under another secret, and
    sealed right for `channel` but altered on the way."""
    plan = encode(Shutdown("forged"))
    tampered = bytearray(FrameAuth(secret, channel).seal(plan))
    tampered[30] ^= 0xFF
    return [plan, FrameAuth(b"not-the-secret!!" * 2, channel).seal(plan), bytes(tampered)]


def push(address: str, frames: list[bytes]) -> None:
    """Connects a PUSH socket to `address` and sends `frames` (waiting up to 5 s for
    them to leave)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    for frame in frames:
        sock.send(frame)
    sock.close()
    ctx.term()
