"""The default model offline: pagedserve's greedy tokens equal transformers' on chat
prompts (transformers reading the same file with its own GGUF loader), and a ChatML
reply stops on `<|im_end|>`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
    ],
    [
        {"role": "user", "content": "Hi! My name is Ada."},
        {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name?"},
    ],
]
MAX_TOKENS = 40
END = "<|im_end|>"


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> LLM:
    """The model code against transformers: the file's blocks dequantized at load, as
    transformers' loader does (test_smollm2_quantized.py computes in them)."""
    return LLM(
        str(smollm2_path),
        seed=0,
        kv_cache_memory=256 << 20,
        max_model_len=2048,
        quantization="none",
    )


def transformers_model(path: Path, llm: LLM):
    """The reference: transformers' own loader on the same checkpoint, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(llm.config.model.model_dir)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    model = LlamaForCausalLM(config).float().eval()
    model.load_state_dict(loaded["tensors"], strict=False)  # lm_head is tied to the embedding
    model.tie_weights()
    return model


def test_greedy_tokens_equal_transformers_on_chat_prompts(llm: LLM, smollm2_path: Path) -> None:
    tokenizer = llm.get_tokenizer()
    reference = transformers_model(smollm2_path, llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.chat(CHATS, params)
    eos = sorted(llm.config.model.eos_token_ids)
    for chat, out in zip(CHATS, outputs, strict=True):
        prompt = tokenizer.apply_chat_template(chat)
        assert out.prompt_token_ids == prompt
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected, chat[-1]["content"]


def test_a_chatml_reply_stops_on_im_end(llm: LLM) -> None:
    out = llm.chat([CHATS[0]], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    end_id = llm.get_tokenizer().hf_tokenizer.convert_tokens_to_ids(END)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == end_id and end_id in llm.config.model.eos_token_ids
    assert END not in out.text and len(out.token_ids) < 64
