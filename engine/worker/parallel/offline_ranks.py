"""The offline `LLM`'s ranks (tensor- and pipeline-parallel): rank 0 in the caller's
process, ranks 1..N-1 as `engine.worker.parallel.follower` processes fed by a `PlanRelay`.

`OfflineRanks.start(args)` picks a private `file://` rendezvous, spawns the followers
and returns the args rank 0 builds with; `RelayingWorker` is rank 0's worker as the
`InProcessEngine` sees it: each plan is relayed, then run here. A follower that exited
fails the next step with its exit status (a collective with it would wait for the
group's timeout); `close()` stops the followers (idempotent).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from engine.child_process import start_module
from engine.engine_args import EngineArgs
from engine.messages import Shutdown, StepPlan, StepResult
from engine.worker.parallel.plan_relay import PlanRelay
from engine.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class OfflineRanks:
    """Follower processes (ranks 1..N-1) and their rendezvous directory."""

    processes: list[subprocess.Popen]
    run_dir: str

    @classmethod
    def start(cls, args: EngineArgs) -> tuple[EngineArgs, OfflineRanks]:
        """The followers, and `args` with their rendezvous (rank 0 joins with those)."""
        run_dir = tempfile.mkdtemp(prefix="pagedserve-tp-")
        init = f"file://{os.path.join(run_dir, 'rendezvous')}"
        args = dataclasses.replace(args, distributed_init_method=init)
        payload = json.dumps(dataclasses.asdict(args))
        processes = [
            start_module(
                "engine.worker.parallel.follower", ["--engine-args", payload, "--rank", str(rank)]
            )
            for rank in range(1, args.world_size)
        ]
        logger.info("spawned ranks 1..%d (pids %s)", len(processes), [p.pid for p in processes])
        return args, cls(processes, run_dir)

    def check(self) -> None:
        """RuntimeError naming the first follower that exited."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {code}")

    def abandon(self) -> None:
        """Kills the followers at once (they cannot be told to stop) and cleans up."""
        for process in self.processes:
            process.kill()
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class RelayingWorker:
    """Rank 0's worker: relays each plan to the followers, then runs it here (its
    results are the group's)."""

    def __init__(self, worker: Worker, ranks: OfflineRanks) -> None:
        self.worker = worker
        self.ranks = ranks
        self.relay = PlanRelay(worker.runner.group)
        self._closed = False

    def execute(self, plan: StepPlan) -> StepResult:
        self.ranks.check()
        self.relay.send(plan)
        return self.worker.execute(plan)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.ranks.check()
            self.relay.send(Shutdown("the LLM is closed"))
        except Exception as exc:  # noqa: BLE001 - a follower already gone: stop the rest
            logger.warning("stopping the ranks: %s", exc)
            self.ranks.abandon()
        else:
            self.ranks.stop()
        self.worker.runner.group.leave()
