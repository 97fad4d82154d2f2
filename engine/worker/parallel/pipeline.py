"""Pipeline parallelism: which layers a stage holds, and the hop between stages.

The layers split into `count` contiguous shares (the first stages take one more when
they do not divide evenly). Stage 0 holds the embedding, the last stage the final norm,
the LM head and the sampler. Rank numbering runs the other way: global rank 0, the rank
that samples and answers the scheduler in every launch, is the last stage's first
tensor-parallel rank, so stage s's tensor-parallel rank t is global rank
(count - 1 - s) * tp_size + t.

A step runs every stage in turn: stage s receives the residual stream [T, hidden] from
stage s - 1 (its tensor-parallel peer: each rank of a stage holds the whole stream), runs
its layers and sends the stream on; the last stage samples and broadcasts the tokens to
every rank, as one tensor-parallel group does. Point-to-point sends on torch.distributed
(gloo on CPUs, NCCL on GPUs); shapes need no handshake, since every rank runs the same
plan and knows T.

Micro-batches keep the stages busy together: a step's rows split into `micro_batches`
contiguous parts of about equal tokens (`split_rows`, the same on every rank), each
part runs through the stages in turn and its stream is sent without waiting, so stage
s computes part i while stage s + 1 computes part i - 1. Within a step the pipeline
still fills and drains: with M parts and S stages each stage idles (S - 1) / (M + S - 1)
of the step (GPipe's bubble), against (S - 1) / S without parts. The last stage samples
all parts' rows at once, in the order one batch would have them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.worker.parallel.collectives import share_bounds


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `count`, for tensor-parallel rank `tp_rank` of `tp_size`."""

    index: int = 0
    count: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    micro_batches: int = 1  # parts a step's rows split into

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"stage must be in [0, {self.count}), got {self.index}")

    @classmethod
    def of_rank(
        cls, global_rank: int, tp_size: int, count: int, micro_batches: int = 0
    ) -> PipelineStage:
        """The stage global rank `global_rank` runs (rank 0: the last stage's first);
        `micro_batches` parts per step (0: one per stage)."""
        index, tp_rank = count - 1 - global_rank // tp_size, global_rank % tp_size
        return cls(index, count, tp_rank, tp_size, micro_batches or count)

    @property
    def is_split(self) -> bool:
        return self.count > 1

    @property
    def receives(self) -> bool:
        """Its input is the previous stage's stream, not the embedding's."""
        return self.index > 0

    @property
    def sends(self) -> bool:
        """Its output goes to the next stage, not to the final norm and head."""
        return self.index < self.count - 1

    def layer_range(self, num_layers: int) -> range:
        """The layers this stage holds: a contiguous share."""
        if num_layers < self.count:
            raise ValueError(
                f"pipeline_parallel_size={self.count} needs at least as many layers; the "
                f"model has {num_layers}"
            )
        cuts = share_bounds(num_layers, self.count)
        return range(cuts[self.index], cuts[self.index + 1])

    def global_rank(self, index: int) -> int:
        """The global rank of stage `index`'s peer of this rank."""
        return (self.count - 1 - index) * self.tp_size + self.tp_rank


SINGLE_STAGE = PipelineStage()


class StageLink:
    """This rank's hops: `receive(T)` the stream from the previous stage, `send(x)` it to
    the next. `hidden_size` and `dtype` are the stream's (the model's)."""

    def __init__(self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype, device) -> None:
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.sending: list[tuple[dist.Work, torch.Tensor]] = []  # sends not yet waited on
        self.waited_s = 0.0

    @property
    def receives(self) -> bool:
        return self.stage.receives

    @property
    def sends(self) -> bool:
        return self.stage.sends

    def receive(self, num_tokens: int) -> torch.Tensor:  # [T, hidden_size]
        """The previous stage's stream; the time spent waiting for it adds to `waited_s`
        (this stage's share of the bubble, on a CPU where the wait blocks)."""
        stream = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        dist.recv(stream, src=self.stage.global_rank(self.stage.index - 1))
        self.waited_s += time.perf_counter() - start
        return stream

    def send(self, stream: torch.Tensor) -> torch.Tensor:  # [T, hidden_size]
        """Starts sending `stream` on; `flush()` waits for every send started."""
        stream = stream.contiguous()
        work = dist.isend(stream, dst=self.stage.global_rank(self.stage.index + 1))
        self.sending.append((work, stream))  # the tensor lives until its send is done
        return stream

    def flush(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()


class NoLink:
    """One stage: nothing to receive or send."""

    receives = False
    sends = False

    def flush(self) -> None:
        pass


NO_LINK = NoLink()


class MissingModule(nn.Module):
    """What stands where another stage holds a module: no weights, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


def split_rows(rows: Sequence, tokens: Sequence[int], parts: int) -> list[list]:
    """`rows` cut into at most `parts` contiguous, non-empty runs of about equal
    `tokens` (each row's count), in order: each cut falls where the tokens before it
    come closest to its share of the total."""
    before = list(itertools.accumulate(tokens, initial=0))  # before[i]: rows[:i]'s tokens
    total, cuts = before[-1], [0]
    for j in range(1, parts):
        share = total * j / parts
        candidates = range(cuts[-1] + 1, len(rows))
        if candidates:
            cuts.append(min(candidates, key=lambda i: abs(before[i] - share)))
    cuts.append(len(rows))
    return [list(rows[a:b]) for a, b in itertools.pairwise(cuts) if b > a]


def present(layers: Sequence[nn.Module], kv_caches: Sequence) -> Iterator[tuple[nn.Module, object]]:
    """This stage's layers, each with its KV cache (`kv_caches` holds only theirs)."""
    held = [layer for layer in layers if not isinstance(layer, MissingModule)]
    return zip(held, kv_caches, strict=True)


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model class keeps what the stages split (module paths, HF names):
    `loop` runs the layers (it holds the stage's link as `pp`), `layers` is the layer
    list, `first` the modules only stage 0 holds (embeddings), `last` those only the
    last stage holds (final norm, projections after it, the LM head)."""

    loop: str
    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
