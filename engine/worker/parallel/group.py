"""`TensorParallelGroup`: this process's place among the ranks of one model, and the
collectives tensor parallelism needs, on torch.distributed (gloo on CPUs, NCCL on GPUs).

With pipeline parallelism the ranks form `pipeline_parallel_size` stages of
`tensor_parallel_size` ranks each (engine/worker/parallel/pipeline.py): `all_reduce` and
`all_gather` run within this rank's stage, while `broadcast`, `min_int` and
`all_gather_int` span every rank (the sampled tokens, the block count and the table
digests are the whole model's).

Contract: every rank calls the collectives in the same order with tensors of the same
shape (the layers guarantee it: each runs the same step plan). With one rank every
collective returns its input unchanged, so single-device code pays nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import ParallelConfig
from engine.worker.parallel.collectives import gather_rows
from engine.worker.parallel.context import ContextParallel
from engine.worker.parallel.pipeline import SINGLE_STAGE, PipelineStage

COLLECTIVE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 300.0  # how long ranks wait for each other to start (remote ones by hand)
HEAD_SCHEME = "pagedserve-head://"


def head_init_method(address: str, run_id: str) -> str:
    """The rendezvous of a group whose head process serves torch.distributed's TCP store
    at `address` (HOST:PORT) for run `run_id` (see `actors.head`): every rank, local or
    remote, joins it as a client, under keys prefixed by the run id."""
    return f"{HEAD_SCHEME}{address}/{run_id}"


@dataclass(frozen=True)
class TensorParallelGroup:
    """Tensor-parallel rank `rank` of `world_size` (0 of 1: no parallelism) within
    pipeline stage `stage`; `global_rank` of `num_ranks` in all. `device` holds the
    tensors its collectives exchange (NCCL's must be on the GPU). `expert_parallel`: a
    mixture of experts places whole experts on the ranks instead of slicing every expert
    (vLLM's `--enable-expert-parallel`; the rest of the model stays tensor-parallel).
    `process_group`: the stage's ranks (None: every rank is in it)."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    expert_parallel: bool = False
    global_rank: int = 0
    num_ranks: int = 0  # 0: world_size (one stage)
    stage: PipelineStage = SINGLE_STAGE
    process_group: object = field(default=None, compare=False)
    context: ContextParallel = ContextParallel()
    # expert parallelism dispatching each rank's share of the tokens to the experts'
    # ranks and back (all-to-all), instead of every rank routing every token (all-reduce)
    expert_all_to_all: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not self.num_ranks:
            object.__setattr__(self, "num_ranks", self.world_size)

    @classmethod
    def initialize(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str | None = None,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        device: str = "cpu",
        expert_parallel: bool = False,
        pipeline_parallel_size: int = 1,
        micro_batches: int = 0,
        context_parallel_size: int = 1,
        expert_all_to_all: bool = False,
    ) -> TensorParallelGroup:
        """Joins the default process group of `world_size` x `pipeline_parallel_size`
        ranks (`init_method`: `tcp://HOST:PORT`, the rank 0 host serving
        torch.distributed's TCP store; `file://PATH`; or `head_init_method(...)`, a
        store the head serves) as global rank `rank`, and with several stages its
        stage's subgroup; backend: NCCL when CUDA is available, else gloo. A collective
        waiting longer than `timeout_s` for a rank raises (a stalled rank cannot hang the
        others for ever)."""
        tp, num_ranks = world_size, world_size * pipeline_parallel_size * context_parallel_size
        if num_ranks > 1 and not dist.is_initialized():
            backend = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
            timeout = timedelta(seconds=timeout_s)
            where: dict = {"init_method": init_method}
            if init_method.startswith(HEAD_SCHEME):
                where = {"store": _head_store(init_method, rank, num_ranks)}
            dist.init_process_group(
                backend, rank=rank, world_size=num_ranks, timeout=timeout, **where
            )
        stage = SINGLE_STAGE
        if pipeline_parallel_size > 1:
            stage = PipelineStage.of_rank(rank, tp, pipeline_parallel_size, micro_batches)
        process_group = None
        if pipeline_parallel_size > 1:  # every rank creates every stage's group, in order
            for first in range(0, num_ranks, tp):
                members = dist.new_group(list(range(first, first + tp)))
                if first <= rank < first + tp:
                    process_group = members
        context = ContextParallel(rank, context_parallel_size)
        return cls(
            rank % tp,
            tp,
            str(device),
            expert_parallel,
            rank,
            num_ranks,
            stage,
            process_group,
            context,
            expert_all_to_all,
        )

    def leave(self) -> None:
        """Leaves the process group (this process may join another one later)."""
        if self.has_peers and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_first(self) -> bool:
        """Global rank 0 (the last stage's first rank): the one that samples and answers
        the scheduler."""
        return self.global_rank == 0

    @property
    def is_parallel(self) -> bool:
        """Several tensor-parallel ranks in this stage."""
        return self.world_size > 1

    @property
    def has_peers(self) -> bool:
        """Other ranks run this model too (tensor- or pipeline-parallel)."""
        return self.num_ranks > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the stage's ranks, in place (each of them gets it)."""
        if self.is_parallel:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The stage's ranks' `x` concatenated along `dim`, in rank order."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self, x: torch.Tensor, send: list[int], receive: list[int]
    ) -> torch.Tensor:  # [sum(send), ...] -> [sum(receive), ...]
        """Rows send[r] of `x` (in rank order) to each rank r of the stage; receive[r]
        rows from each, concatenated in rank order."""
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.process_group)
        return out

    def exchange_counts(self, send: torch.Tensor) -> torch.Tensor:  # [world] int64
        """What each rank of the stage will send this one (send[r]: what this one sends r)."""
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.process_group)
        return receive

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The stage's ranks' `x` of `sizes[r]` rows each, concatenated in rank order."""
        return gather_rows(x, sizes, self.process_group)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Global rank 0's `x` on every rank, in place (same shape and dtype everywhere)."""
        if self.has_peers:
            dist.broadcast(x, src=0)
        return x

    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's `value`, in global rank order."""
        if not self.has_peers:
            return [value]
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(x) for _ in range(self.num_ranks)]
        dist.all_gather(parts, x)
        return [int(p.item()) for p in parts]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV cache blocks: every rank must
        hold the same block ids)."""
        if not self.has_peers:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `size` (ValueError naming `what`
        when the ranks cannot share it evenly)."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) does not split evenly over tensor_parallel_size={self.world_size}"
            )
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part


def _head_store(init_method: str, rank: int, world_size: int) -> dist.Store:
    """This rank's view of the head's store: a client, keys under the run's prefix, once
    every rank has arrived (waiting up to JOIN_TIMEOUT_S: ranks on other hosts may be
    started by hand)."""
    address, _, run_id = init_method.removeprefix(HEAD_SCHEME).partition("/")
    host, _, port = address.rpartition(":")
    client = dist.TCPStore(host, int(port), None, False, timedelta(seconds=JOIN_TIMEOUT_S))
    store = dist.PrefixStore(f"{run_id}/group", client)
    store.set(f"arrived/{rank}", b"1")
    store.wait([f"arrived/{r}" for r in range(world_size)])
    return store


def join_group(parallel: ParallelConfig, device: str, rank: int) -> TensorParallelGroup:
    """This process as global rank `rank` of `parallel.world_size` (no group at all with
    one rank). A GPU rank takes GPU `rank` of its host's; CPU ranks share the host's
    cores (each takes its share unless OMP_NUM_THREADS says otherwise)."""
    world = parallel.world_size
    if world == 1:
        return TensorParallelGroup()
    if str(device).startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return TensorParallelGroup.initialize(
        rank,
        parallel.tensor_parallel_size,
        parallel.init_method,
        device=device,
        expert_parallel=parallel.enable_expert_parallel,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        micro_batches=parallel.pipeline_micro_batches,
        context_parallel_size=parallel.context_parallel_size,
        expert_all_to_all=parallel.expert_dispatch == "all_to_all",
    )
