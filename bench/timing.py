"""Timing one call: the median wall-clock time of repeated calls after warm-up ones."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """`fn()` called `warmup` times untimed, then `repeats` times: the median, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
