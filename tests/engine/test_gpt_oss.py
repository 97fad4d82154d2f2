"""GPT-OSS's checkpoint formats: MXFP4 experts dequantized at load exactly as
transformers dequantizes them, and other quantization methods refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM, SamplingParams
from engine.worker.attention import ReferenceBackend
from engine.worker.models.gpt_oss import GptOssForCausalLM, dequantize_mxfp4
from tests.engine.tiny_models import (
    ARCHITECTURES,
    GPT_OSS_FIELDS,
    VOCAB,
    build_hf_model,
    hf_greedy,
)

# MXFP4 packs 32 values per scale along each row: hidden and intermediate are multiples.
MXFP4_FIELDS = {**GPT_OSS_FIELDS, "intermediate_size": 64}


def random_mxfp4(gen: torch.Generator, experts: int, rows: int, cols: int):
    """(blocks [E, rows, cols / 32, 16], scales [E, rows, cols / 32]) with values of
    magnitude up to 6 * 2^-4, near the tiny models' weights."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen)
    scales = torch.randint(121, 124, (experts, rows, cols // 32), generator=gen)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_dequantize_mxfp4_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4(gen, 3, 10, 64)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 255  # the extremes of the exponent range
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)  # as the loader hands it over
    torch.testing.assert_close(ours, convert_moe_packed_tensors(blocks, scales), rtol=0, atol=0)


def test_an_mxfp4_checkpoint_generates_what_transformers_does_dequantized(
    tmp_path, monkeypatch
) -> None:
    """A checkpoint whose experts are MXFP4 blocks and scales (as released) loads, and
    greedy decoding equals transformers' on the dequantized weights."""
    mxfp4 = (hf.GptOssConfig, hf.GptOssForCausalLM, MXFP4_FIELDS)
    monkeypatch.setitem(ARCHITECTURES, "gpt-oss-mxfp4", mxfp4)
    model = build_hf_model("gpt-oss-mxfp4")
    cfg = model.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, param in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = param.contiguous()
            continue
        rows, cols = (2 * i, h) if name.endswith("gate_up_proj") else (h, i)
        blocks, scales = random_mxfp4(gen, e, rows, cols)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = cfg.to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [27]]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert len(set(expected[0])) > 2  # not a degenerate repetition


def test_other_quantization_methods_are_refused_by_name() -> None:
    config = hf.GptOssConfig(**MXFP4_FIELDS, vocab_size=VOCAB)
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match=r"GptOssForCausalLM: .*quantized \('fp8'\)"):
        GptOssForCausalLM(config, ReferenceBackend())
