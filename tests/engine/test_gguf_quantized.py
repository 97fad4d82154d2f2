"""`quantization='gguf'` (asked for; the default dequantizes): the file's matrices stay in
their blocks and the linear layers multiply them natively (cuda_ext/quant_gemm.py), so
the weights take the file's bytes; greedy tokens equal the dequantized path's and
log-probabilities follow it within stated bounds (activations are rounded to int8
twice). A fused layer
with a part in floats computes in floats; a rank's columns that split a block too;
methods the engine lacks, and mismatched checkpoints or devices, are refused by name."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from cuda_ext.quant_gemm import QuantType, dequantize, quantize  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import Quantization  # noqa: E402
from engine.worker.model_loader import resolve_quantization  # noqa: E402
from engine.worker.parallel.group import TensorParallelGroup  # noqa: E402
from engine.worker.parallel.layers import ColumnParallelLinear, Part, RowParallelLinear  # noqa: E402
from engine.worker.quantized_weight import QuantizedTensor, QuantizedWeight  # noqa: E402
from tests.engine.gguf_files import (  # noqa: E402
    byte_vocab_checkpoint,
    own_cache_sharing_built_kernels,
    write_gguf_and_twin,
)
from tests.engine.quantized_checks import assert_follows, mean_loglik  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPTS = ["Hello there", "Once upon a time", "The little dog ran", "A cat sat on", "Why is"]
TEXT = "The little dog ran to the park and played with a red ball all afternoon."
# Activations are rounded to int8 twice (the rounding error again), which moves these
# tiny models' token log-probabilities by 2e-4 at most (measured): greedy tokens equal
# the dequantized path's, and tests/engine/quantized_checks.py holds the rest.
LOGPROB_BOUND, MEAN_BOUND = 0.005, 0.001
LOGLIK_BOUND = 0.02  # the mean per-token log-likelihood of TEXT


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    own_cache_sharing_built_kernels(tmp_path, monkeypatch)


def model_file(tmp_path, qtype) -> str:
    hf_dir = byte_vocab_checkpoint("llama", tmp_path / "hf")
    write_gguf_and_twin(hf_dir, tmp_path / "m.gguf", tmp_path / "twin", qtype)
    return str(tmp_path / "m.gguf")


def engine(path: str, quantization: str | None) -> LLM:
    return LLM(path, seed=0, kv_cache_memory=16 << 20, max_model_len=128, quantization=quantization)


def assert_follows_dequantized(blocks: LLM, floats: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours, theirs = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (blocks, floats))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert_follows(blocks, floats, PROMPTS, 24, LOGPROB_BOUND, MEAN_BOUND)
    assert mean_loglik(blocks, TEXT) == pytest.approx(mean_loglik(floats, TEXT), abs=LOGLIK_BOUND)


@pytest.mark.timeout(240)
def test_q8_0_blocks_follow_the_dequantized_path(tmp_path) -> None:
    path = model_file(tmp_path, Q.Q8_0)
    blocks, floats = engine(path, None), engine(path, "none")
    assert blocks.config.model.quantization is Quantization.GGUF  # the default for a GGUF
    assert_follows_dequantized(blocks, floats)
    ours, theirs = blocks.stats(), floats.stats()
    assert (ours.quantization, theirs.quantization) == ("gguf", "none")
    assert ours.weights_bytes < theirs.weights_bytes
    assert ours.kv_cache_bytes == theirs.kv_cache_bytes > 0
    assert ours.kv_cache_dtype == "float32"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_four_and_five_bit_blocks_follow_the_dequantized_path(tmp_path, qtype) -> None:
    path = model_file(tmp_path, qtype)
    assert_follows_dequantized(engine(path, "gguf"), engine(path, "none"))


def test_the_method_device_and_checkpoint_are_checked_by_name() -> None:
    assert resolve_quantization(None, "m.gguf", True, "cpu") is Quantization.GGUF  # its blocks
    assert resolve_quantization(None, "m.gguf", True, "cuda") is Quantization.NONE  # floats
    assert resolve_quantization("gguf", "m.gguf", True, "cpu") is Quantization.GGUF
    assert resolve_quantization(None, "dir", False, "cpu") is Quantization.NONE
    with pytest.raises(
        ValueError, match=r"quantization must be one of \['none', 'gguf', 'int8', 'q4_0'\].*'awq'"
    ):
        resolve_quantization("awq", "dir", False, "cpu")
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a GGUF checkpoint; dir"):
        resolve_quantization("gguf", "dir", False, "cpu")
    with pytest.raises(ValueError, match=r"on CPUs only, not on cuda"):
        resolve_quantization("gguf", "m.gguf", True, "cuda")
    with pytest.raises(ValueError, match=r"m.gguf is a GGUF, quantized already"):
        resolve_quantization("int8", "m.gguf", True, "cpu")


def blocks_of(weight: torch.Tensor, qtype: QuantType) -> QuantizedTensor:
    return QuantizedTensor(quantize(weight, qtype), qtype, weight.shape[1])


def test_a_fused_layer_computes_in_blocks_of_each_parts_type_or_in_floats_with_a_float_part():
    torch.manual_seed(0)
    group = TensorParallelGroup()
    parts = (Part(64, 0, 64), Part(32, 0, 32))
    q, v = torch.randn(64, 96), torch.randn(32, 96)
    x = torch.randn(5, 96)
    mixed_types = ColumnParallelLinear(96, parts, False, group, separate_in_checkpoint=True)
    mixed_types.load("weight", blocks_of(q, QuantType.Q4_0), 0)
    mixed_types.load("weight", blocks_of(v, QuantType.Q8_0), 1)
    assert isinstance(mixed_types.packed, QuantizedWeight)
    assert mixed_types.packed.types == ("Q4_0", "Q8_0") and mixed_types.weight.numel() == 0
    want = torch.cat(
        [blocks_of(q, QuantType.Q4_0).dequantize(), blocks_of(v, QuantType.Q8_0).dequantize()]
    )
    # |x . w| is about 10 here; 8-bit activations move it by a few hundredths
    torch.testing.assert_close(mixed_types(x), x @ want.T, atol=0.4, rtol=0.02)
    with_float = ColumnParallelLinear(96, parts, False, group, separate_in_checkpoint=True)
    with_float.load("weight", blocks_of(q, QuantType.Q8_0), 0)
    with_float.load("weight", v, 1)
    assert with_float.packed is None  # computes in floats: the blocks were dequantized
    exact = torch.cat([dequantize(quantize(q, QuantType.Q8_0), QuantType.Q8_0, 96), v])
    torch.testing.assert_close(with_float.weight.detach(), exact)


def test_a_rank_keeps_blocks_when_its_columns_fall_on_block_boundaries() -> None:
    torch.manual_seed(1)
    weight = torch.randn(16, 128)
    stored = blocks_of(weight, QuantType.Q8_0)
    exact = stored.dequantize()
    for rank in (0, 1):
        layer = RowParallelLinear(128, 16, False, TensorParallelGroup(rank, 2))
        layer.load("weight", stored)
        assert isinstance(layer.packed, QuantizedWeight)  # 64 columns: two blocks each
        x = torch.randn(3, 64)
        torch.testing.assert_close(
            layer.packed(x, None), x @ exact[:, rank * 64 :][:, :64].T, atol=0.3, rtol=0.02
        )
    odd = RowParallelLinear(96, 16, False, TensorParallelGroup(1, 2))  # columns [48, 96)
    odd.load("weight", blocks_of(torch.randn(16, 96), QuantType.Q8_0))
    assert odd.packed is None and odd.weight.shape == (16, 48)  # in floats
