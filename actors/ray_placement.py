"""Worker ranks placed by Ray (`--distributed-executor-backend ray`, vLLM's spelling).

Each rank gets a bundle of a placement group (one CPU, or one GPU on a CUDA machine;
packed onto as few nodes as Ray can), and a small Ray actor in that bundle starts the
rank's process, so only where it runs is Ray's choice. The process dies with its actor
(the parent-death signal), and the actor with the placement group.

Ranks whose bundles are on this node (the server's) run the worker exactly as the
default launch would (`python -m actors.worker_actor ...`, on this host's ipc
addresses). Ranks Ray put on other nodes run `pagedserve worker --head tcp://ADDRESS
--rank R`, as a rank on another host started by hand would: they join the head this
launch serves at `--distributed-address` and talk over authenticated tcp (the cluster
secret travels to them in their environment). This node's bundles take the first ranks.

`RayRank` stands in for the worker's `subprocess.Popen` where the launch keeps one
(`pid`, `poll`, `wait`, `kill`), asking the actor.

Ray runs where `ray` is installed: a cluster given by RAY_ADDRESS, else a local instance
started here (and stopped with the last placement).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PLACEMENT_TIMEOUT_S = 60.0


class RayRank:
    """A rank's worker process, through the Ray actor that started it (the part of
    `subprocess.Popen` the launch uses)."""

    def __init__(self, actor, placement, pid: int) -> None:
        self.actor, self.placement, self.pid = actor, placement, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._ask("poll"))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._ask("wait", timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"ray rank pid {self.pid}", timeout or 0.0)
            self._ended(code)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._ended(self._ask("kill"))

    def _ended(self, code: int | None) -> None:
        """Once the worker has exited: its actor and bundle go back to Ray."""
        if code is None or self.returncode is not None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        self.returncode = code
        ray.kill(self.actor)
        try:
            remove_placement_group(self.placement)  # the first rank to end frees it
        except Exception:  # noqa: BLE001 - another rank removed it already
            pass

    def _ask(self, method: str, *args):
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except ray.exceptions.RayActorError:
            return -9  # the actor (and with it the worker) is gone


@dataclass(frozen=True)
class RayPlacement:
    """A ready placement group of one bundle per rank: `local_bundles` on this node,
    `remote_bundles` on others (bundle indices)."""

    group: object
    local_bundles: tuple[int, ...]
    remote_bundles: tuple[int, ...]


def reserve_bundles(num_ranks: int, on_gpu: bool) -> RayPlacement:
    """A placement group of `num_ranks` bundles (one CPU or GPU each), once Ray has
    placed it."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS"),
            include_dashboard=False,
            ignore_reinit_error=True,
            log_to_driver=False,
        )
    resource = {"GPU": 1} if on_gpu else {"CPU": 1}
    group = placement_group([dict(resource) for _ in range(num_ranks)], strategy="PACK")
    ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    nodes = placement_group_table(group)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    local = tuple(b for b in range(num_ranks) if nodes[b] == here)
    remote = tuple(b for b in range(num_ranks) if nodes[b] != here)
    if not local:
        raise RuntimeError(
            "Ray placed no rank on this node: rank 0 runs beside the server (give this node "
            "a CPU or GPU in the cluster)"
        )
    return RayPlacement(group, local, remote)


def start_ranks(
    placement: RayPlacement,
    bundles: Sequence[int],
    commands: Sequence[Sequence[str]],
    env: Mapping[str, str],
) -> list[RayRank]:
    """Starts command i (a `python -m` module's arguments) in bundle `bundles[i]`."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.remote(_RankHost)
    ranks = []
    for bundle, command in zip(bundles, commands, strict=True):
        strategy = PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=bundle
        )
        actor = host.options(scheduling_strategy=strategy, num_cpus=0).remote(
            list(command), dict(env)
        )
        ranks.append(RayRank(actor, placement.group, ray.get(actor.pid.remote())))
    return ranks


class _RankHost:
    """Runs inside a Ray actor: the rank's worker process, killed with this actor."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        from engine.child_process import start_module

        self.process = start_module(command[0], command[1:], env, {"preexec_fn": _die_with_parent})

    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (the actor) dies (Linux)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
