"""Progress lines on stderr and elapsed seconds."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def since(t: float) -> float:
    """Seconds since time.monotonic() was `t`, to the millisecond."""
    return round(time.monotonic() - t, 3)
