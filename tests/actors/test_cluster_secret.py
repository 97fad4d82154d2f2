"""The cluster secret: read from a private file or the environment, refused when short or
when the file is open to others, never quoted in an error; new ones are written private."""

from __future__ import annotations

import os
import stat

import pytest

from actors.cluster_secret import (
    ENV_VAR,
    load_cluster_secret,
    main,
    new_cluster_secret,
    write_cluster_secret,
)
from actors.frame_auth import FrameAuth

SECRET = "0123456789abcdef-the-cluster-secret"


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def secret_file(tmp_path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "cluster.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_none_without_a_file_or_the_variable():
    assert load_cluster_secret(None) is None


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"])
def test_a_private_file_gives_its_bytes_less_the_trailing_newline(tmp_path, ending):
    path = secret_file(tmp_path, SECRET.encode() + ending)
    assert load_cluster_secret(path) == SECRET.encode()


def test_the_variable_is_used_when_no_file_is_named(monkeypatch):
    monkeypatch.setenv(ENV_VAR, SECRET)
    assert load_cluster_secret(None) == SECRET.encode()


def test_a_named_file_wins_over_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "the variable's secret, long enough")
    assert load_cluster_secret(secret_file(tmp_path, SECRET.encode())) == SECRET.encode()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644, 0o660])
def test_a_file_open_to_group_or_others_is_refused_with_the_fix(tmp_path, mode):
    path = secret_file(tmp_path, SECRET.encode(), mode)
    with pytest.raises(ValueError, match=f"chmod 600 {path}") as refused:
        load_cluster_secret(path)
    assert f"{mode:03o}" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the cluster secret file .*missing"):
        load_cluster_secret(str(tmp_path / "missing"))


def test_a_short_secret_is_refused_without_quoting_it(tmp_path, monkeypatch):
    short = "fifteen chars!!"
    with pytest.raises(ValueError, match="has 15 bytes; at least 16") as from_file:
        load_cluster_secret(secret_file(tmp_path, short.encode() + b"\n"))
    monkeypatch.setenv(ENV_VAR, short)
    with pytest.raises(ValueError, match=f"\\${ENV_VAR} has 15 bytes") as from_env:
        load_cluster_secret(None)
    for refused in (from_file, from_env):
        assert short not in str(refused.value)


def test_an_empty_variable_is_refused_not_taken_for_no_secret(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")
    with pytest.raises(ValueError, match="has 0 bytes"):
        load_cluster_secret(None)


def test_new_secrets_are_random_hex_that_frame_auth_takes():
    first, second = new_cluster_secret(), new_cluster_secret()
    assert first != second
    assert len(first) == 64 and int(first, 16) >= 0
    FrameAuth(first.encode())


def test_a_written_secret_file_is_private_loads_and_is_never_replaced(tmp_path):
    path = str(tmp_path / "cluster.secret")
    assert main([path]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = load_cluster_secret(path)
    assert secret is not None and len(secret) == 64
    with pytest.raises(FileExistsError):
        write_cluster_secret(path)
    assert main([path]) == 1
    assert load_cluster_secret(path) == secret


def test_main_prints_a_secret_without_a_file(capsys):
    assert main([]) == 0
    assert len(capsys.readouterr().out.strip()) == 64
