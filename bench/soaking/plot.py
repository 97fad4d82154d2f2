"""The PNG of a run."""

from __future__ import annotations

import math
from pathlib import Path


def plot(report: dict, path: Path) -> None:
    """RSS of server and worker (top), requests in flight and running (bottom), over
    time, with the phase marks (the kill in red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["samples"]
    t = [x["t"] for x in s]

    def col(key: str) -> list[float]:
        return [math.nan if x[key] is None else x[key] for x in s]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    top.plot(t, col("server_rss_mib"), label="server RSS")
    top.plot(t, col("worker_rss_mib"), label="worker RSS")
    top.set_ylabel("RSS (MiB)")
    bottom.plot(t, col("in_flight"), label="in flight (client)", lw=1)
    bottom.plot(t, col("running"), label="running (server)", lw=1, alpha=0.7)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("time (s)")
    styles = {"drained": "tab:green", "probes": "tab:purple", "kill": "tab:red", "sigterm": "k"}
    for ax in (top, bottom):
        for name, at in report["marks"].items():
            ax.axvline(at, color=styles.get(name, "tab:gray"), ls="--", lw=1, label=name)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, None)
    top.legend(fontsize=8, loc="lower right")
    bottom.legend(fontsize=8, loc="upper right")
    c = report["config"]
    fig.suptitle(
        f"pagedserve soak: {c['requests']} requests, concurrency {c['concurrency']}, "
        f"{Path(c['model']).name}; {'PASSED' if report['passed'] else 'FAILED'} "
        f"({len(report['failures'])} failure(s))",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
