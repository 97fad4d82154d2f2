"""GGUF files of Gemma 2, Gemma 3, Phi-3, Qwen3-MoE and Mixtral: each written from a tiny
random checkpoint in llama.cpp's layout (gguf_files.py: its names, stacked experts,
Gemma's w + 1 norms, Phi-3's fused tensors and longrope factor tensors), F32 and
quantized, generates through our engine the greedy tokens its safetensors twin does, and
transformers does on the twin; and an architecture we do not load is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

import transformers as hf  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from tests.engine.gguf_files import (  # noqa: E402
    byte_vocab_checkpoint,
    own_cache_sharing_built_kernels,
    write_gguf_and_twin,
    write_minimal_gguf,
)
from tests.engine.tiny_models import ARCHITECTURES, hf_greedy  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPTS = [[72, 101, 108, 108, 111], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [27]]
MAX_NEW = 12
# The loader's checks: its blocks dequantized at load (test_gguf_quantized.py computes in them)
ENGINE = dict(
    kv_cache_memory=16 << 20,
    max_model_len=128,
    skip_tokenizer_init=True,
    seed=0,
    quantization="none",
)

# test id -> (tiny model, llama.cpp's architecture, fields changed to what a GGUF states).
FAMILIES = {
    # llama.cpp scales scores by head_dim ** -0.5 (no metadata key holds another scale).
    "gemma2": ("gemma2", "gemma2", {"query_pre_attn_scalar": 24}),
    # ... and gives Gemma 3 a full-attention layer every sixth.
    "gemma3": (
        "gemma3",
        "gemma3",
        {
            "query_pre_attn_scalar": 32,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    ),
    "phi3": ("phi3", "phi3", {}),
    # llama.cpp's qwen3moe has experts on every layer; 64 fills MXFP4's 32-value blocks.
    "qwen3-moe": ("qwen3-moe", "qwen3moe", {"mlp_only_layers": [], "moe_intermediate_size": 64}),
    "mixtral": ("mixtral", "llama", {}),  # llama.cpp writes Mixtral as `llama` with experts
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    own_cache_sharing_built_kernels(tmp_path, monkeypatch)


def family_checkpoint(tmp_path: Path, monkeypatch, family: str) -> Path:
    name, _, changes = FAMILIES[family]
    config_cls, model_cls, fields = ARCHITECTURES[name]
    monkeypatch.setitem(ARCHITECTURES, name, (config_cls, model_cls, {**fields, **changes}))
    return byte_vocab_checkpoint(name, tmp_path / f"{family}-hf")


def greedy(model: Path) -> list:
    llm = LLM(str(model), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def transformers_greedy(model_dir: Path) -> list[list[int]]:
    model = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32").eval()
    model.set_experts_implementation("eager")  # as tiny_models builds them
    return [hf_greedy(model, prompt, MAX_NEW) for prompt in PROMPTS]


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    # Gemma's norms went through (w + 1) - 1 in float32: equal up to its rounding
    return left.keys() == right.keys() and all(
        torch.allclose(left[k], right[k], rtol=0, atol=1e-6) for k in left
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_generates_like_its_twin_and_transformers(tmp_path, monkeypatch, family, qtype):
    hf_dir = family_checkpoint(tmp_path, monkeypatch, family)
    gguf_path, twin = tmp_path / f"{family}.gguf", tmp_path / "twin"
    write_gguf_and_twin(hf_dir, gguf_path, twin, qtype, arch=FAMILIES[family][1])
    # F32 decodes to the checkpoint itself (the writer undoes llama.cpp's steps exactly);
    # Q8_0 to other weights, which the twin holds
    assert same_weights(hf_dir, twin) == (qtype == Q.F32)

    ours, twins = greedy(gguf_path), greedy(twin)
    assert [o.token_ids for o in ours] == [t.token_ids for t in twins]
    for o, t in zip(ours, twins, strict=True):
        assert o.cumulative_logprob == pytest.approx(t.cumulative_logprob, abs=1e-3)
    assert [o.token_ids for o in ours] == transformers_greedy(twin)


@pytest.mark.timeout(180)
def test_qwen3_moe_gguf_with_mxfp4_experts(tmp_path, monkeypatch) -> None:
    """llama-quantize's MXFP4_MOE: the experts in MXFP4, the rest in Q8_0."""
    hf_dir = family_checkpoint(tmp_path, monkeypatch, "qwen3-moe")
    gguf_path, twin = tmp_path / "q.gguf", tmp_path / "twin"
    write_gguf_and_twin(hf_dir, gguf_path, twin, Q.Q8_0, arch="qwen3moe", expert_qtype=Q.MXFP4)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == Q.MXFP4
    assert types["blk.0.attn_q.weight"] == Q.Q8_0
    ours = [o.token_ids for o in greedy(gguf_path)]
    assert ours == [t.token_ids for t in greedy(twin)]
    assert ours == transformers_greedy(twin)


@pytest.mark.timeout(120)
def test_gpt_oss_is_refused_naming_why(tmp_path, monkeypatch) -> None:
    hf_dir = byte_vocab_checkpoint("gpt-oss", tmp_path / "gpt-oss-hf")
    write_gguf_and_twin(hf_dir, tmp_path / "g.gguf", tmp_path / "twin", Q.Q8_0, arch="gpt-oss")
    with pytest.raises(
        ValueError,
        match=r"GGUF architecture 'gpt-oss' is not supported \(g\.gguf\): transformers cannot "
        r"read a GPT-OSS GGUF's config",
    ):
        LLM(str(tmp_path / "g.gguf"), **ENGINE)


@pytest.mark.timeout(120)
def test_why_gpt_oss_is_refused(tmp_path) -> None:
    """transformers 5's GPT-OSS GGUF reader takes `parts[0]` of each rope.scaling field,
    the key's length, for its value. When this test fails, transformers reads these files:
    add `gpt-oss` to gguf_names.FAMILIES (and a side-car fill for its window and head_dim,
    which its GGUF mapping leaves out)."""
    hf_dir = byte_vocab_checkpoint("gpt-oss", tmp_path / "gpt-oss-hf")
    write_gguf_and_twin(hf_dir, tmp_path / "g.gguf", tmp_path / "twin", Q.F32, arch="gpt-oss")
    with pytest.raises(TypeError, match="0-dimensional"):
        hf.AutoConfig.from_pretrained(str(tmp_path), gguf_file="g.gguf")


@pytest.mark.timeout(60)
def test_an_unsupported_architecture_is_refused_naming_it(tmp_path) -> None:
    path = write_minimal_gguf(tmp_path / "f.gguf", arch="qwen2moe")
    with pytest.raises(
        ValueError, match=r"GGUF architecture 'qwen2moe' is not supported \(f\.gguf\); pagedserve"
    ):
        LLM(str(path), **ENGINE)
