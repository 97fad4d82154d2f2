"""Byte-frame channels between actors: one direction each, asyncio-native.

An `Outbox` sends frames, an `Inbox` receives them, in order, one frame per message. Frames
are `bytes` in and `bytes` out; what they mean is the codec's business (`engine.codec`).
No pickle anywhere.

Three kinds of channel, one interface:
- ZeroMQ `ipc:///path` (processes on one host) and `tcp://host:port` (across hosts):
  the inbox binds a PULL socket, each sender connects a PUSH socket. Either side may come
  up first; ZeroMQ reconnects. High-water marks are 0 (unbounded): a frame is never
  dropped and a send never waits on a slow receiver. LINGER is 0, so closing never hangs
  and frames still queued at close are discarded (the peer is shutting down anyway).
  A sender that connects before its inbox is bound (a worker launched before its
  engine) queues its frames and retries every `RECONNECT_IVL_MS` (ZeroMQ's default,
  100 ms, would add up to that to the start-up).
  An ipc inbox removes a stale socket file before it binds and unlinks its file on close.
  With a `FrameAuth` (required in practice for `tcp://`, see `actors.frame_auth`) the
  outbox seals every frame and the inbox opens every frame: a frame that does not open
  (no secret, wrong secret or channel, tampered, replayed) is dropped, counted
  (`num_refused`) and logged (at most once per reason per 10 s, never its bytes), and
  `recv` goes on to the next frame.
- In-process (`inproc_pair`): an `asyncio.Queue` for two actors that share a process and
  an event loop. It carries bytes frames like the others, and also the message objects
  themselves (`carries_messages`): messages are frozen dataclasses, so sharing one is
  safe, and `send_message` skips msgpack on the hot in-process hops (scheduler <-> block
  manager, scheduler -> tokenizer). The receiving `InboxDecoder` still checks that an
  object is one of the inbox's message types.

Closing is idempotent; `recv`/`send` after `close()` raise `TransportClosed`. Close a
channel only when no `recv` is pending on it (an `Actor` cancels its recv first).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import tempfile

import zmq
import zmq.asyncio

from actors.frame_auth import FrameAuth, FrameRefused, RefusalLog

# Linux's sockaddr_un.sun_path holds 108 bytes including the trailing NUL.
MAX_IPC_PATH = 107
RECONNECT_IVL_MS = 10


class TransportClosed(RuntimeError):
    """`recv` or `send` on a channel end that was closed."""


class Inbox:
    """The receiving end of a channel: frames arrive in the order they were sent."""

    async def recv(self) -> bytes:
        """The next frame (waits for one)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the channel end; idempotent."""
        raise NotImplementedError


class Outbox:
    """The sending end of a channel."""

    carries_messages = False  # True: `send` also takes message objects, not just bytes

    async def send(self, frame: bytes) -> None:
        """Queue `frame` for the receiver; raises TypeError unless it is `bytes`."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the channel end; idempotent."""
        raise NotImplementedError


def _check_frame(frame: object) -> None:
    if not isinstance(frame, bytes):
        raise TypeError(f"a frame must be bytes, got {type(frame).__name__}")


# ---------------------------------------------------------------- ZeroMQ


class ZmqInbox(Inbox):
    """A bound PULL socket; owns (and on close removes) its ipc socket file. With `auth`,
    `recv` returns only frames that open (the others are refused, see the module doc)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, auth: FrameAuth | None = None
    ) -> None:
        self.address = address
        self._auth = auth
        self._refusals = RefusalLog(f"inbox {address}")
        self._ipc_path = _ipc_path(address)
        if self._ipc_path is not None:
            _remove_stale_socket(self._ipc_path)
        self._socket = ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise OSError(f"cannot bind an inbox to {address}: {exc}") from exc
        self._closed = False

    @property
    def num_refused(self) -> int:
        """Frames dropped because they did not open (always 0 without `auth`)."""
        return self._refusals.count

    @property
    def endpoint(self) -> str:
        """Where it is bound, a wildcard resolved (`tcp://10.0.0.2:*` gives the port)."""
        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> bytes:
        if self._closed:
            raise TransportClosed(f"inbox {self.address} is closed")
        if self._auth is None:
            return await self._socket.recv()
        while True:
            frame = await self._socket.recv(copy=False)
            try:
                return self._auth.open(frame.bytes)
            except FrameRefused as refused:
                self._refusals.note(refused.reason, peer_address(frame))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._socket.close(linger=0)
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass


class ZmqOutbox(Outbox):
    """A PUSH socket connected to one inbox's address; with `auth`, every frame is sealed
    under a sender nonce of this outbox's own."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, auth: FrameAuth | None = None
    ) -> None:
        self.address = address
        self._auth = None if auth is None else auth.for_channel(auth.channel)
        _ipc_path(address)  # validates ipc path length
        self._socket = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self._socket.connect(address)
        self._closed = False

    async def send(self, frame: bytes) -> None:
        _check_frame(frame)
        if self._closed:
            raise TransportClosed(f"outbox to {self.address} is closed")
        if self._auth is not None:
            frame = self._auth.seal(frame)
        await self._socket.send(frame, copy=len(frame) < zmq.COPY_THRESHOLD)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)


def zmq_inbox(ctx: zmq.asyncio.Context, address: str, auth: FrameAuth | None = None) -> Inbox:
    """Bind a PULL socket at `address` (`ipc:///path` or `tcp://host:port`); with `auth`,
    it receives only frames sealed for `auth.channel` by a holder of the secret."""
    return ZmqInbox(ctx, address, auth)


def zmq_outbox(ctx: zmq.asyncio.Context, address: str, auth: FrameAuth | None = None) -> Outbox:
    """Connect a PUSH socket to the inbox bound at `address`; with `auth`, it seals every
    frame for `auth.channel`."""
    return ZmqOutbox(ctx, address, auth)


def peer_address(frame: zmq.Frame) -> str | None:
    """Who sent a received frame, as libzmq tells it: a tcp peer's IP; on ipc,
    `localhost:UID:GID:PID` of the sending process; None where it cannot tell."""
    try:
        return frame.get("Peer-Address") or None
    except zmq.ZMQError:
        return None


def ipc_address(run_dir: str, name: str) -> str:
    """`ipc://{run_dir}/{name}.sock`; raises ValueError if the path is too long for a socket."""
    path = os.path.join(run_dir, f"{name}.sock")
    if len(path) > MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path {path!r} has {len(path)} characters; unix sockets allow "
            f"{MAX_IPC_PATH}. Use a shorter run directory (new_run_dir(), or set TMPDIR) "
            "or a shorter name"
        )
    return f"ipc://{path}"


RUN_DIR_PREFIX = "pagedserve-"


def new_run_dir() -> str:
    """A fresh private directory for one run's ipc sockets, under the system temp dir,
    named after the process that owns it (`pagedserve-PID-XXXX`).

    The caller removes it at shutdown (e.g. `shutil.rmtree`); a process killed before
    that leaves it behind for `remove_stale_run_dirs`."""
    prefix = f"{RUN_DIR_PREFIX}{os.getpid()}-"
    return tempfile.mkdtemp(prefix=prefix, dir=tempfile.gettempdir())


def remove_stale_run_dirs(root: str | None = None) -> list[str]:
    """Removes the run directories whose owning process is gone (`kill -9` leaves them)
    and returns their paths. Only this user's directories of the `new_run_dir` form."""
    root = root or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(root):
        pid = _owner_pid(entry.name)
        if pid is None or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _owner_pid(name: str) -> int | None:
    if not name.startswith(RUN_DIR_PREFIX):
        return None
    pid = name[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ipc_path(address: str) -> str | None:
    """The filesystem path of an ipc address (validated), or None for other transports."""
    if not address.startswith("ipc://"):
        return None
    path = address.removeprefix("ipc://")
    if not path or path.startswith("@"):  # abstract-namespace sockets have no file
        return None
    if len(path) > MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path {path!r} has {len(path)} characters; unix sockets allow "
            f"{MAX_IPC_PATH}; use a shorter run directory"
        )
    return path


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left behind by an earlier run; refuse to delete anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)


# ---------------------------------------------------------------- in-process


class _QueueInbox(Inbox):
    def __init__(self, queue: asyncio.Queue[bytes]) -> None:
        self._queue = queue
        self.closed = False

    async def recv(self) -> bytes:
        if self.closed:
            raise TransportClosed("in-process inbox is closed")
        return await self._queue.get()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            while not self._queue.empty():  # frames sent to a closed inbox are discarded
                self._queue.get_nowait()


class _QueueOutbox(Outbox):
    carries_messages = True

    def __init__(self, queue: asyncio.Queue[bytes], peer: _QueueInbox) -> None:
        self._queue = queue
        self._peer = peer
        self._closed = False

    async def send(self, frame: bytes | object) -> None:
        if not (isinstance(frame, bytes) or dataclasses.is_dataclass(frame)):
            raise TypeError(f"a frame must be bytes or a message, got {type(frame).__name__}")
        if self._closed:
            raise TransportClosed("in-process outbox is closed")
        if not self._peer.closed:  # like ZeroMQ, a sender cannot tell the receiver is gone
            await self._queue.put(frame)

    def close(self) -> None:
        self._closed = True


def inproc_pair(maxsize: int = 0) -> tuple[Outbox, Inbox]:
    """An (outbox, inbox) pair over an asyncio.Queue, for two actors in one process and loop.

    Frames are bytes or message objects (see the module doc). `maxsize` > 0
    bounds the queue: `send` then waits while it is full (0 = unbounded, like the ZeroMQ
    channels). Use it only from the event loop that runs both actors."""
    queue: asyncio.Queue[bytes | object] = asyncio.Queue(maxsize)
    inbox = _QueueInbox(queue)
    return _QueueOutbox(queue, inbox), inbox
