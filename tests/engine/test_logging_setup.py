"""`LLM(...)` logs its start-up to stderr with no logging configured, once per line, and
leaves an application's own logging alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.logging_setup import LEVEL_ENV, configure_logging

REPO = Path(__file__).resolve().parents[2]


def run(script: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    full_env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )


def lines_with(text: str, words: str) -> list[str]:
    return [line for line in text.splitlines() if words in line]


START_UP = """
import logging
from engine import LLM
from engine.worker.builtin_model import builtin_model_dir
LLM(str(builtin_model_dir()), kv_cache_memory=16 << 20)
logging.basicConfig(format="APP %(name)s: %(message)s")  # the app configures logging late
logging.getLogger("engine.core").warning("after basicConfig")
"""


@pytest.mark.timeout(240)
def test_llm_logs_its_start_up_to_stderr_without_logging_configured():
    err = run(START_UP).stderr
    for words in ("LLM: ", "attention backend: ", "KV cache: ", "LLM ready: "):
        found = lines_with(err, words)
        assert len(found) == 1 and found[0].startswith("INFO "), (words, err)
    assert "LlamaForCausalLM, float32" in lines_with(err, "LLM: ")[0]
    # once the application has a root handler, records go there only: no duplicates
    assert lines_with(err, "after basicConfig") == ["APP engine.core: after basicConfig"], err


AFTER_BASIC_CONFIG = """
import logging
logging.basicConfig(level=logging.WARNING, format="APP %(name)s: %(message)s")
from engine.logging_setup import configure_logging
configure_logging()
logging.getLogger("engine.llm").info("hidden: the app asked for WARNING")
logging.getLogger("web.app").warning("shown once")
"""

PLAIN = """
import logging
from engine.logging_setup import configure_logging
configure_logging()
configure_logging()  # idempotent
logging.getLogger("actors.actor").debug("debug line")
logging.getLogger("web.app").info("info line")
logging.getLogger("elsewhere").info("not ours")
"""


@pytest.mark.timeout(60)
def test_an_application_that_configured_logging_keeps_its_own_configuration():
    err = run(AFTER_BASIC_CONFIG).stderr
    assert "hidden" not in err
    assert lines_with(err, "shown once") == ["APP web.app: shown once"], err


@pytest.mark.timeout(60)
def test_level_and_opt_out_come_from_the_environment():
    err = run(PLAIN).stderr
    assert len(lines_with(err, "info line")) == 1 and "debug line" not in err, err
    assert "not ours" not in err  # only the project's loggers are configured
    err = run(PLAIN, PAGEDSERVE_LOGGING_LEVEL="debug").stderr
    assert len(lines_with(err, "debug line")) == 1, err
    err = run(PLAIN, PAGEDSERVE_CONFIGURE_LOGGING="0").stderr
    assert "info line" not in err, err


def test_an_unknown_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "LOUD")
    with pytest.raises(ValueError, match="PAGEDSERVE_LOGGING_LEVEL must be one of DEBUG"):
        configure_logging()
