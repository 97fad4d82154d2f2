"""`PlanRelay`: the offline `LLM`'s step plans, from rank 0 to the other ranks, over
the tensor-parallel group itself.

The served engine's scheduler pushes each plan to every rank over ZeroMQ. The offline
`LLM` has no scheduler actor and no sockets: its rank 0 runs in the caller's process
and relays each message to the other ranks through torch.distributed, which the ranks
share anyway. A message travels as its msgpack frame (`engine.codec`, no pickle): a
broadcast of its length, then of its bytes.
"""

from __future__ import annotations

import torch

from engine.codec import InboxDecoder, encode
from engine.messages import INBOXES, Shutdown, StepPlan
from engine.worker.parallel.group import TensorParallelGroup


class PlanRelay:
    """`send(message)` on rank 0, `recv()` on every other rank, in the same order."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.decoder = InboxDecoder(INBOXES["worker"])

    def send(self, message: StepPlan | Shutdown) -> None:
        device = self.group.device
        frame = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8).to(device)
        self.group.broadcast(torch.tensor([frame.numel()], dtype=torch.int64, device=device))
        self.group.broadcast(frame)

    def recv(self) -> StepPlan | Shutdown:
        device = self.group.device
        size = self.group.broadcast(torch.zeros(1, dtype=torch.int64, device=device))
        frame = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        return self.decoder.decode(self.group.broadcast(frame).cpu().numpy().tobytes())
