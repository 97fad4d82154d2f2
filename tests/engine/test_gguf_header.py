"""A damaged GGUF file is refused with a ValueError that names the file and says what is
wrong (empty, not a GGUF file, truncated, a corrupt header, a metadata key of the wrong
type), wherever it is cut, never with the `gguf` package's IndexError or a hang."""

from __future__ import annotations

import os

import pytest

gguf = pytest.importorskip("gguf")

from engine.worker.gguf_header import GgufHeader  # noqa: E402
from tests.engine.gguf_files import write_minimal_gguf  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_well_formed_file_reads(tmp_path) -> None:
    header = GgufHeader(write_minimal_gguf(tmp_path / "ok.gguf"))
    assert header.value("general.architecture", str) == "llama"
    assert header.value("llama.attention.head_count", int) == 4
    assert header.value("llama.rope.freq_base", float, required=False) is None
    assert [t.name for t in header.tensors] == ["token_embd.weight"]


def test_an_empty_file_is_named(tmp_path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"GGUF file empty\.gguf is empty \(0 bytes\)"):
        GgufHeader(tmp_path / "empty.gguf")


def test_random_bytes_are_not_a_gguf_file(tmp_path) -> None:
    (tmp_path / "noise.gguf").write_bytes(b"\x89PNG" + os.urandom(4096))
    with pytest.raises(ValueError, match=r"noise\.gguf is not a GGUF file: it starts with"):
        GgufHeader(tmp_path / "noise.gguf")


def test_a_file_cut_anywhere_is_truncated_and_named(tmp_path) -> None:
    whole = write_minimal_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(1, len(whole)):  # every cut: header, metadata, tensor list, data
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=r"cut\.gguf is truncated") as refused:
            GgufHeader(cut)
        if size >= 8:
            assert f"it has {size:,} bytes" in str(refused.value)


def test_an_array_longer_than_the_file_is_truncated_not_a_hang(tmp_path) -> None:
    whole = bytearray(write_minimal_gguf(tmp_path / "whole.gguf").read_bytes())
    types = whole.index(b"tokenizer.ggml.token_type") + len(b"tokenizer.ggml.token_type")
    length = types + 4 + 4  # after the value type (ARRAY) and the item type (UINT32)
    assert int.from_bytes(whole[length : length + 8], "little") == 16
    whole[length : length + 8] = (2**62).to_bytes(8, "little")
    (tmp_path / "long.gguf").write_bytes(whole)
    with pytest.raises(ValueError, match=r"long\.gguf is truncated"):
        GgufHeader(tmp_path / "long.gguf")


def test_a_corrupt_header_is_named(tmp_path) -> None:
    whole = bytearray(write_minimal_gguf(tmp_path / "whole.gguf").read_bytes())
    whole[4:8] = (99).to_bytes(4, "little")  # a format version no reader knows
    (tmp_path / "future.gguf").write_bytes(whole)
    with pytest.raises(ValueError, match=r"GGUF file future\.gguf has a corrupt header"):
        GgufHeader(tmp_path / "future.gguf")


def test_a_metadata_key_of_the_wrong_type_or_missing_is_named(tmp_path) -> None:
    path = write_minimal_gguf(tmp_path / "odd.gguf", **{"llama.attention.head_count": "four"})
    header = GgufHeader(path)
    with pytest.raises(
        ValueError,
        match=r"odd\.gguf: metadata key 'llama\.attention\.head_count' has an unexpected "
        r"type \(STRING\); expected int",
    ):
        header.value("llama.attention.head_count", int)
    with pytest.raises(ValueError, match=r"odd\.gguf has no metadata key 'llama\.block_count'"):
        header.value("llama.block_count", int)
