"""Every Python example in README.md, docs/structured_outputs.md and docs/tool_calling.md
runs as written (against a server on a free port instead of 8000), on the default
model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/structured_outputs.md", "docs/tool_calling.md")
BLOCKS = [
    block
    for page in PAGES
    for block in re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S)
]
README_BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def runnable(code: str, port: int) -> str:
    """The example with the server's port; an `await` example inside `async def`, as the
    README says to run it."""
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    if re.search(r"\bawait\b|\basync (with|for)\b", code):
        body = textwrap.indent(code, "    ")
        code = f"import asyncio\n\nasync def main():\n{body}\n\nasyncio.run(main())\n"
    return code


def test_the_readme_has_examples() -> None:
    """One offline example, one through an OpenAI client, one through our SDK."""
    for marker in ("from engine import LLM", "from openai import OpenAI", "from web.client import"):
        assert any(marker in block for block in README_BLOCKS), f"no README example has {marker!r}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, smollm2_server) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, "-c", runnable(BLOCKS[index], smollm2_server.port)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the example printed nothing"
    if "capital of France" in BLOCKS[index]:
        assert "Paris" in done.stdout
