"""A rank of an offline tensor-parallel group other than rank 0: it loads its slices,
then runs every plan rank 0 relays (`PlanRelay`), until a `Shutdown` or rank 0 is gone.

Run by `OfflineRanks` as `python -m engine.worker.parallel.follower --engine-args JSON
--rank R` (JSON of `EngineArgs` fields; no pickle). Its results are not sent anywhere:
rank 0 answers for the group. A step that fails requests here and not on rank 0 would
leave the ranks' caches apart, so any failure ends this process (exit status 1), and
rank 0 sees it before its next step.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from engine.engine_args import EngineArgs
from engine.messages import Shutdown
from engine.worker.parallel.plan_relay import PlanRelay
from engine.worker.worker import Worker, build_worker

logger = logging.getLogger(__name__)


def follow(worker: Worker, relay: PlanRelay) -> int:
    """Runs relayed plans until Shutdown (0) or a failure (1)."""
    while True:
        try:
            message = relay.recv()
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone: nothing left to follow
            logger.error("rank 0 is unreachable (%s); this rank exits", exc)
            return 1
        if isinstance(message, Shutdown):
            return 0
        result = worker.execute(message)
        if result.failed:
            logger.error("step %d failed here: %s", message.step_id, result.failed[0].error)
            return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve-rank")
    p.add_argument("--engine-args", required=True, help="JSON of EngineArgs fields")
    p.add_argument("--rank", type=int, required=True)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank-{ns.rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's process stops us
    args = EngineArgs(**json.loads(ns.engine_args))
    worker, _ = build_worker(args, worker_id=ns.rank, rank=ns.rank)
    return follow(worker, PlanRelay(worker.runner.group))


if __name__ == "__main__":
    sys.exit(main())
