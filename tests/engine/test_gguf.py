"""GGUF checkpoints: a file written here from a tiny random checkpoint (llama.cpp's layout,
quantized) loads to the same greedy tokens and logprobs as its safetensors twin, takes its
tokenizer, chat template and end token from the metadata, and refuses what it cannot
load by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.builtin_model import CHAT_TEMPLATE, builtin_model_dir  # noqa: E402
from engine.worker.gguf_checkpoint import hf_tensor_name, unpermute_rotary_rows  # noqa: E402
from tests.engine.gguf_files import (  # noqa: E402
    gguf_name,
    own_cache_sharing_built_kernels,
    permute_rotary_rows,
    write_gguf_and_twin,
    write_minimal_gguf,
)
from tests.engine.tiny_models import save_hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPTS = ["Hello there", "Once upon a time", "The little dog ran"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The loader's checks: its blocks dequantized at load (test_gguf_quantized.py computes in them)
ENGINE = dict(kv_cache_memory=16 << 20, max_model_len=128, quantization="none")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    own_cache_sharing_built_kernels(tmp_path, monkeypatch)


def checkpoint(tmp_path: Path, arch: str) -> Path:
    """A tiny random `arch` checkpoint with the built-in byte-level tokenizer."""
    import json

    directory = tmp_path / f"{arch}-hf"
    save_hf_model(arch, directory, seed=3, vocab_size=258)
    config = json.loads((directory / "config.json").read_text())
    config.update(bos_token_id=256, eos_token_id=257)
    (directory / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(builtin_model_dir() / name, directory / name)
    return directory


def greedy(model: str) -> list:
    llm = LLM(model, seed=0, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_generates_like_its_safetensors_twin(tmp_path, qtype) -> None:
    hf_dir = checkpoint(tmp_path, "llama")
    write_gguf_and_twin(hf_dir, tmp_path / "m.gguf", tmp_path / "twin", qtype)
    ours, twin = greedy(str(tmp_path / "m.gguf")), greedy(str(tmp_path / "twin"))
    for a, b in zip(ours, twin, strict=True):
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.timeout(120)
def test_qwen2_gguf_with_biases_and_no_rotary_permutation(tmp_path) -> None:
    hf_dir = checkpoint(tmp_path, "qwen2")
    write_gguf_and_twin(hf_dir, tmp_path / "q.gguf", tmp_path / "twin", Q.F32, arch="qwen2")
    ours, twin = greedy(str(tmp_path / "q.gguf")), greedy(str(tmp_path / "twin"))
    assert [a.token_ids for a in ours] == [b.token_ids for b in twin]


@pytest.mark.timeout(120)
def test_tokenizer_chat_template_and_end_token_come_from_the_metadata(tmp_path) -> None:
    hf_dir = checkpoint(tmp_path, "llama")
    write_gguf_and_twin(hf_dir, tmp_path / "m.gguf", tmp_path / "twin", Q.Q8_0)
    llm = LLM(str(tmp_path / "m.gguf"), **ENGINE)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.hf_tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.encode("hé") == [104, 195, 169]  # one token per UTF-8 byte
    assert llm.config.model.eos_token_ids == frozenset({257})
    chat = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert chat == "<s>user: hi\nassistant:"


def test_the_permutation_is_undone_exactly() -> None:
    import torch

    rows = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of 8
    permuted = torch.from_numpy(permute_rotary_rows(rows.numpy(), 4))
    assert not torch.equal(permuted, rows)
    assert torch.equal(unpermute_rotary_rows(permuted, 4), rows)


def test_names_map_both_ways() -> None:
    for hf in ("model.layers.7.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert hf_tensor_name(gguf_name(hf)) == hf
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ssm_in.weight"):
        hf_tensor_name("blk.0.ssm_in.weight")


@pytest.mark.timeout(60)
def test_an_unsupported_architecture_is_refused_by_name(tmp_path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        LLM(str(tmp_path / "x.gguf"), **ENGINE)


@pytest.mark.timeout(120)
def test_a_quant_type_the_package_cannot_dequantize_is_refused_by_name(tmp_path) -> None:
    import numpy as np

    hf_dir = checkpoint(tmp_path, "llama")
    write_gguf_and_twin(hf_dir, tmp_path / "m.gguf", tmp_path / "twin", Q.F32)
    bad = tmp_path / "bad.gguf"
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    writer = gguf.GGUFWriter(str(bad), "llama")
    for field in reader.fields.values():  # copy the metadata
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    _, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    for t in reader.tensors:
        if t.name == "output_norm.weight":  # 256 values of a type with no dequantizer
            writer.add_tensor(t.name, np.zeros((1, type_size), np.uint8), raw_dtype=Q.Q8_K)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=Q(t.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'output_norm.weight' is stored as Q8_K"):
        LLM(str(bad), **ENGINE)


def test_a_missing_gguf_file_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such GGUF file"):
        LLM(str(tmp_path / "absent.gguf"), **ENGINE)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "damage, says",
    [
        ("empty", r"GGUF file bad\.gguf is empty"),
        ("noise", r"bad\.gguf is not a GGUF file"),
        ("cut", r"GGUF file bad\.gguf is truncated"),
        ("typed", r"bad\.gguf: metadata key 'llama\.attention\.head_count' has an unexpected type"),
    ],
)
def test_a_damaged_gguf_file_is_refused_naming_it(tmp_path, damage, says) -> None:
    head_count = {"llama.attention.head_count": "four"} if damage == "typed" else {}
    whole = write_minimal_gguf(tmp_path / "whole.gguf", **head_count).read_bytes()
    data = {"empty": b"", "noise": b"\x89PNG" + bytes(range(256)), "cut": whole[:300]}
    (tmp_path / "bad.gguf").write_bytes(data.get(damage, whole))
    with pytest.raises(ValueError, match=says):
        LLM(str(tmp_path / "bad.gguf"), **ENGINE)
