"""A tensor-parallel rank on another host: `pagedserve worker --head tcp://HOST:PORT
--rank R` (or `python -m actors.remote_rank ...`).

It joins the head through the store the head serves at HOST:PORT (`actors.head` has the
keys and channels): it reads the run id and the sealed JoinRecord (the engine arguments,
where to send heartbeats), refusing a record that does not open with its cluster secret;
claims rank R (one worker per rank); binds its plan inbox on the address it routes to
the head through and announces it, sealed; then loads its slices of the model and joins
the group like any rank. It runs until the head sends Shutdown, until the head's store
is gone (the head stopped or died: nobody is left to serve), or until a collective
fails (another rank died). Exit status: 0 after Shutdown, 1 after a failure, 2 when it
could not join (a message says why).

The secret comes from `--cluster-secret-file` or $PAGEDSERVE_CLUSTER_SECRET, never from
the command line; the model path in the engine arguments must exist on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from actors.cluster_secret import ENV_VAR, load_cluster_secret
from actors.frame_auth import FrameAuth, FrameRefused
from actors.head_record import JOIN_KEY, RUN_KEY, JoinRecord, channel, claim_key, rank_key
from actors.network_route import address_towards, gloo_environment, split_host_port

if TYPE_CHECKING:  # the rest is imported when a worker runs: `pagedserve --help` stays quick
    import torch.distributed as dist

    from engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)
HEAD_CHECK_TIMEOUT_S = 5.0


class JoinRefused(RuntimeError):
    """This worker cannot join the head's group (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class Joined:
    """What joining gave: the run, the engine arguments (the head's rendezvous in them),
    where this rank's heartbeats go, and the rank claimed."""

    run_id: str
    args: EngineArgs
    heartbeat_address: str
    rank: int


def join(store: dist.Store, rank: int, auth: FrameAuth) -> Joined:
    """Reads and opens the head's JoinRecord and claims `rank` (JoinRefused otherwise)."""
    from engine.engine_args import EngineArgs

    run_id = store.get(RUN_KEY).decode()
    try:
        opened = auth.for_channel(channel(run_id, "join")).open(store.get(JOIN_KEY))
    except FrameRefused as refused:
        raise JoinRefused(
            f"the head's join record was refused ({refused.reason.value}): this host's "
            "cluster secret is not the head's"
        ) from None
    record = JoinRecord.decode(opened)
    if not record.first_remote_rank <= rank < record.world_size:
        raise JoinRefused(
            f"--rank must be in [{record.first_remote_rank}, {record.world_size}) for this "
            f"head (it runs ranks 0..{record.first_remote_rank - 1} itself), got {rank}"
        )
    if store.add(claim_key(rank), 1) != 1:
        raise JoinRefused(f"rank {rank} has already joined run {run_id}")
    args = EngineArgs(**record.engine_args)
    return Joined(run_id, args, record.heartbeat_address(rank), rank)


async def serve_rank(head: str, rank: int, secret: bytes, join_timeout_s: float) -> bool:
    """Joins the head at `head` (tcp://HOST:PORT) as `rank` and runs until it ends (see
    the module doc); False after a failure. JoinRefused when it cannot join."""
    import zmq.asyncio

    from actors.transport import zmq_inbox
    from actors.worker_actor import HEARTBEAT_INTERVAL_S, Heartbeat, run_worker

    host, port = split_host_port(head, "--head")
    store = await asyncio.to_thread(_connect, host, port, join_timeout_s)
    auth = FrameAuth(secret)
    joined = await asyncio.to_thread(join, store, rank, auth)
    os.environ.update(gloo_environment(host, port))  # read by this process's gloo
    # the only rank on this host: its cores are its own (join_group would split them)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    ctx = zmq.asyncio.Context()
    plans = auth.for_channel(channel(joined.run_id, f"plan-{rank}"))
    inbox = zmq_inbox(ctx, f"tcp://{address_towards(host, port)}:*", plans)
    try:
        announce = auth.for_channel(channel(joined.run_id, f"rank-{rank}"))
        store.set(rank_key(rank), announce.seal(inbox.endpoint.encode()))
        logger.info("joined run %s as rank %d; plans at %s", joined.run_id, rank, inbox.endpoint)
        beats = auth.for_channel(channel(joined.run_id, f"heartbeat-{rank}"))
        heartbeat = Heartbeat(rank, joined.heartbeat_address, HEARTBEAT_INTERVAL_S, beats)
        gone = _head_gone(host, port, joined.run_id)
        return await run_worker(joined.args, inbox, None, heartbeat, rank, rank, gone)
    finally:
        inbox.close()
        ctx.term()


def _connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except RuntimeError:
        raise JoinRefused(
            f"no head answered at {host}:{port} within {timeout_s:g} s (is `pagedserve serve "
            f"--distributed-address {host}:{port} --local-ranks ...` running?)"
        ) from None


def _head_gone(host: str, port: int, run_id: str):
    """Gone once the head's store stops answering, or serves another run."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, None, False, timedelta(seconds=HEAD_CHECK_TIMEOUT_S))

    def check() -> str | None:
        try:
            current = store.get(RUN_KEY).decode()
        except RuntimeError:
            return f"the head at {host}:{port} is gone"
        return None if current == run_id else f"the head at {host}:{port} started another run"

    async def gone() -> str | None:
        return await asyncio.to_thread(check)

    return gone


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head", required=True, help="tcp://HOST:PORT: the head's --distributed-address"
    )
    p.add_argument("--rank", required=True, type=int, help="this worker's tensor-parallel rank")
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help=f"the cluster secret (mode 600; default: ${ENV_VAR})",
    )
    p.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for the head")


def run(ns: argparse.Namespace) -> int:
    """The `pagedserve worker` command."""
    secret = load_cluster_secret(ns.cluster_secret_file)  # ValueError: the CLI says why
    if secret is None:
        raise ValueError(
            f"a worker on another host needs the cluster secret: set ${ENV_VAR} or pass "
            "--cluster-secret-file FILE (the head's, copied here)"
        )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the head stops us (Shutdown, its exit)
    try:
        ok = asyncio.run(serve_rank(ns.head, ns.rank, secret, ns.join_timeout))
    except JoinRefused as refused:
        logger.error("cannot join: %s", refused)
        return 2
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve worker")
    add_arguments(p)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank-{ns.rank} %(levelname)s %(message)s")
    try:
        return run(ns)
    except ValueError as exc:
        print(f"pagedserve worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
