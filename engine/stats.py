"""Engine statistics: KV block usage, slot utilization, preemptions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. `kv_slot_utilization` = token slots holding real tokens / slots
    allocated, now; `mean_kv_slot_utilization` is the same ratio summed over all steps."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    kv_slot_utilization: float
    mean_kv_slot_utilization: float
    num_preemptions: int
    num_steps: int
    num_running: int
    num_waiting: int


class SlotUtilization:
    """Accumulates (tokens stored, slots allocated) once per step."""

    def __init__(self) -> None:
        self.tokens = 0
        self.slots = 0
        self.last = 1.0

    def record(self, tokens: int, slots: int) -> None:
        if slots:
            self.tokens += tokens
            self.slots += slots
            self.last = tokens / slots

    @property
    def mean(self) -> float:
        return self.tokens / self.slots if self.slots else 1.0
