"""The head of a tensor-parallel group whose ranks span hosts.

`pagedserve serve -tp N --local-ranks K --distributed-address HOST:PORT` runs the engine
and ranks 0..K-1 on this host; ranks K..N-1 join from other hosts with `pagedserve worker
--head tcp://HOST:PORT --rank R` (`actors.remote_rank`). The head process serves
torch.distributed's TCP store at HOST:PORT for as long as the engine runs, and the store
is where they meet:

    key                      value                                 sealed for channel
    pagedserve/run           the run id (fresh per start, plain)   -
    pagedserve/join          the JoinRecord (JSON)                 {run}/join
    pagedserve/claim/{R}     a counter: 1 for rank R's first claim -
    pagedserve/rank/{R}      rank R's plan inbox (tcp://IP:PORT)   {run}/rank-{R}
    {run}/group/...          torch.distributed's rendezvous        -

After that, plans reach rank R over ZeroMQ tcp:// sealed for `{run}/plan-{R}`, and its
heartbeats reach the head sealed for `{run}/heartbeat-{R}` (`actors.frame_auth`, one
cluster secret, `actors.cluster_secret`). The run id in every channel name keeps frames
captured in one run from opening in another.

What is protected, and what is not: nobody without the secret can drive a worker (a plan
that does not open is refused and logged), pass for a worker (heartbeats, the rank
announcement), or hand a worker other engine arguments. Payloads are readable on the
network (HMAC, no encryption). torch.distributed's store and collectives (gloo, NCCL)
carry no authentication at all: anyone who reaches them can disturb the group (at worst
a stalled or failed step, which takes the group down) and read activations. Run the
ranks on a private network (a VLAN, WireGuard), as with any torch.distributed job.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from actors.frame_auth import FrameAuth, FrameRefused
from actors.head_record import JOIN_KEY, RUN_KEY, JoinRecord, channel, rank_key
from actors.network_route import gloo_environment, split_host_port
from actors.worker_monitor import WorkerMonitor
from engine.worker.parallel.group import JOIN_TIMEOUT_S, head_init_method

if TYPE_CHECKING:
    from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)


class Head:
    """The head's side of a group with remote ranks (see the module doc): serves the
    store, publishes the sealed JoinRecord, watches each remote rank's heartbeats
    (`monitors`, rank order) and reads the plan inbox each one announced
    (`plan_addresses`). `local_args`: the engine arguments this host's ranks run with.
    `close()` stops the store (remote ranks then exit) and the monitors; idempotent."""

    def __init__(
        self,
        store: dist.TCPStore,
        run_id: str,
        auth: FrameAuth,
        local_args: EngineArgs,
        monitors: tuple[WorkerMonitor, ...],
    ) -> None:
        self._store: dist.TCPStore | None = store
        self.run_id = run_id
        self._auth = auth
        self.local_args = local_args
        self.monitors = monitors
        world = local_args.world_size
        self.remote_ranks = range(world - len(monitors), world)

    @classmethod
    def start(cls, args: EngineArgs, local_ranks: int, secret: bytes | None) -> Head:
        """Serves the store at `args.distributed_address` for ranks `local_ranks`..N-1
        to join; ValueError for what is missing (the address, the secret) or unusable."""
        world = args.world_size
        if not 1 <= local_ranks < world:
            raise ValueError(f"local_ranks must be in [1, {world}) here, got {local_ranks}")
        if args.distributed_address is None:
            raise ValueError(
                "ranks on other hosts need --distributed-address HOST:PORT: an address of "
                "this host that they reach, where it serves torch.distributed's store"
            )
        if secret is None:
            raise ValueError(
                "ranks on other hosts need the cluster secret: set PAGEDSERVE_CLUSTER_SECRET "
                "or pass --cluster-secret-file FILE (make one with "
                "`python -m actors.cluster_secret FILE`, copy it to every host)"
            )
        host, port = split_host_port(args.distributed_address, "distributed_address")
        store = _serve_store(host, port)
        run_id = secrets.token_hex(8)
        auth = FrameAuth(secret)
        monitors: list[WorkerMonitor] = []
        try:
            for rank in range(local_ranks, world):
                heartbeat = auth.for_channel(channel(run_id, f"heartbeat-{rank}"))
                monitors.append(WorkerMonitor(None, "tcp://*:*", heartbeat))
            init = head_init_method(args.distributed_address, run_id)
            local_args = dataclasses.replace(args, distributed_init_method=init)
            beats = tuple(f"tcp://{host}:{_port_of(m.endpoint)}" for m in monitors)
            record = JoinRecord(dataclasses.asdict(local_args), local_ranks, beats)
            sealed = auth.for_channel(channel(run_id, "join")).seal(record.encode())
            store.set(JOIN_KEY, sealed)
            store.set(RUN_KEY, run_id)
        except BaseException:
            for monitor in monitors:
                monitor.close()
            raise
        logger.info(
            "waiting for ranks %d..%d: on each of their hosts run `pagedserve worker --head "
            "tcp://%s:%d --rank R` with the cluster secret",
            local_ranks,
            world - 1,
            host,
            port,
        )
        return cls(store, run_id, auth, local_args, tuple(monitors))

    def local_environment(self) -> dict[str, str]:
        """What this host's ranks need in their environment to reach the remote ones."""
        host, port = split_host_port(self.local_args.distributed_address, "distributed_address")
        return gloo_environment(host, port)

    def plan_auth(self, rank: int) -> FrameAuth:
        """How plans to remote rank `rank` are sealed."""
        return self._auth.for_channel(channel(self.run_id, f"plan-{rank}"))

    def plan_addresses(self) -> dict[int, str]:
        """The plan inbox each remote rank announced, by rank (each does before it joins
        the group, so all are there once rank 0 is ready); RuntimeError if one is
        missing or does not open."""
        return {rank: self.plan_address(rank) for rank in self.remote_ranks}

    def plan_address(self, rank: int) -> str:
        """The plan inbox remote rank `rank` announced (see `plan_addresses`)."""
        store = self._open_store()
        key = rank_key(rank)
        if not store.check([key]):
            raise RuntimeError(f"rank {rank} never announced its plan inbox")
        try:
            opened = self._auth.for_channel(channel(self.run_id, f"rank-{rank}"))
            return opened.open(store.get(key)).decode()
        except FrameRefused as refused:
            raise RuntimeError(
                f"rank {rank}'s announcement was refused ({refused.reason.value}): "
                "a worker without this cluster secret, or a tampered store"
            ) from None

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self._store = None  # the store's server stops with its last reference

    def _open_store(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError("the head is closed")
        return self._store


def _serve_store(host: str, port: int) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            host, port, None, True, timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        raise ValueError(
            f"cannot serve torch.distributed's store at {host}:{port} "
            f"(distributed_address): {str(exc).splitlines()[0]}"
        ) from None


def _port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])
