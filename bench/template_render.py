"""What isolating chat templates costs: one render in-process against one in a killable
child process (actors/template_renderer.py), on a ChatML template like SmolLM2's and a
three-turn conversation of about 1,500 characters.

    python bench/template_render.py --out bench/results/template_render.json

Both renderers alternate in `--rounds` rounds of `--renders` renders each; the report
keeps each round's median and 99th percentile (microseconds) and the extra median cost
of the child process. A PNG beside --out shows the medians per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from report import invocation, machine, write_report  # noqa: E402

from actors.template_renderer import IsolatedRenderer  # noqa: E402
from engine.text.chat_template import ChatRenderer, ChatTemplate, InlineRenderer  # noqa: E402

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "Tell me a story about a dragon. " * 20},
    {"role": "assistant", "content": "Once upon a time " * 30},
    {"role": "user", "content": "Go on."},
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--renders", type=int, default=2000, help="renders per round and renderer")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def timed(renderer: ChatRenderer, n: int) -> dict[str, float]:
    """Median and 99th percentile of `n` renders, in microseconds."""
    renderer.render(MESSAGES, True)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        renderer.render(MESSAGES, True)
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return {
        "median_us": round(statistics.median(times), 1),
        "p99_us": round(times[n * 99 // 100], 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    template = ChatTemplate(CHATML, "a ChatML template", {"eos_token": "<|im_end|>"})
    inline, isolated = InlineRenderer(template), IsolatedRenderer(template)
    rounds = []
    try:
        for _ in range(args.rounds):
            rounds.append(
                {"inline": timed(inline, args.renders), "isolated": timed(isolated, args.renders)}
            )
    finally:
        isolated.close()
    median = {
        k: statistics.median(r[k]["median_us"] for r in rounds) for k in ("inline", "isolated")
    }
    report = {
        "command": invocation(__file__),
        "machine": machine(),
        "rounds": rounds,
        "median_us": median,
        "extra_median_us": round(median["isolated"] - median["inline"], 1),
    }
    write_report(report, args.out, lambda png: plot(rounds, png))
    return 0


def plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for name in ("inline", "isolated"):
        ax.plot([r[name]["median_us"] for r in rounds], marker="o", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("median render (µs)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
