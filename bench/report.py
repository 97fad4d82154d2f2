"""Writing a benchmark's report: JSON on stdout and, with --out, a file and its plot."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def invocation(script: str) -> str:
    """The command line that ran `script` (its `__file__`), from the repository root."""
    return "python " + " ".join(
        [Path(script).resolve().relative_to(REPO).as_posix(), *sys.argv[1:]]
    )


def machine() -> dict[str, str]:
    """What a report records of the machine it ran on."""
    return dict(platform=platform.platform(), python=platform.python_version())


def write_report(
    report: dict, out: str | Path | None, plot: Callable[[Path], None] | None = None
) -> None:
    """Prints `report` as JSON; with `out`, also writes it there and calls `plot` (if
    any) with the PNG path beside it."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if plot is not None:
            plot(path.with_suffix(".png"))
