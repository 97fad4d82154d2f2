"""Writing a benchmark's report: JSON on stdout and, with --out, a file and its plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_report(report: dict, out: str | None, plot: Callable[[Path], None]) -> None:
    """Prints `report` as JSON; with `out`, also writes it there and calls `plot` with
    the PNG path beside it."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        plot(path.with_suffix(".png"))
