"""The name a model is served under: a local directory or GGUF file by its base name
(no client learns where the server keeps it), a hub id as given, --served-model-name
over both."""

from __future__ import annotations

import argparse

import pytest

from web.model_choice import resolve_model, served_name

pytestmark = pytest.mark.timeout(10)


def args(model: str, **extra) -> argparse.Namespace:
    return argparse.Namespace(model=model, model_arg=None, **extra)


def test_a_local_directory_or_gguf_file_is_served_by_its_base_name(tmp_path, monkeypatch):
    directory = tmp_path / "models" / "my-llama"
    directory.mkdir(parents=True)
    gguf = tmp_path / "models" / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(args(str(directory))) == (str(directory), "my-llama")
    assert served_name(f"{directory}/") == "my-llama"
    assert served_name(str(gguf)) == "tiny.Q8_0.gguf"
    monkeypatch.chdir(directory)
    assert served_name(".") == "my-llama"
    assert served_name("../tiny.Q8_0.gguf") == "tiny.Q8_0.gguf"


def test_a_hub_id_is_served_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such local path
    assert (
        served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert resolve_model(args("org/name")) == ("org/name", "org/name")
