"""The built-in tiny model: `--model builtin:tiny` (tests and offline smoke runs).

A 2-layer Llama with random weights from a fixed seed and a byte-level tokenizer (one
token per UTF-8 byte, plus `<s>`, `</s>`), written once as an ordinary Hugging Face
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with
a chat template) and then loaded like any other model. Nothing is downloaded, so it
starts on an offline machine; its replies are random bytes, not language.
"""

from __future__ import annotations

import json
from pathlib import Path

from cuda_ext.build import cache_root
from engine.worker.cache_files import write_once

BUILTIN_MODEL_NAME = "pagedserve-builtin-tiny"
BUILTIN_MODEL_SPEC = "builtin:tiny"  # what --model / LLM(model=...) call it
BUILTIN_VERSION = 1  # bump when the files below change: a new cache directory is written
SEED = 1234
NUM_BYTES = 256
BOS, EOS = "<s>", "</s>"  # ids 256 and 257
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def builtin_model_dir(cache_dir: Path | None = None) -> Path:
    """The model's directory, written on first use (atomically: a half-written directory
    is never seen by a concurrent start)."""
    target = (cache_dir or cache_root()) / f"{BUILTIN_MODEL_NAME}-v{BUILTIN_VERSION}"
    return write_once(target, "model.safetensors", write_builtin_model)


def write_builtin_model(directory: Path) -> None:
    """config.json + model.safetensors + tokenizer files into `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=NUM_BYTES + 2,
        bos_token_id=NUM_BYTES,
        eos_token_id=NUM_BYTES + 1,
        tie_word_embeddings=False,
        **SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()  # byte value -> the printable character ByteLevel uses
    vocab = {alphabet[b]: b for b in range(NUM_BYTES)} | {BOS: NUM_BYTES, EOS: NUM_BYTES + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": SHAPE["max_position_embeddings"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    special = {"bos_token": BOS, "eos_token": EOS}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=1))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> unicode map (printable bytes map to themselves)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTES + extra)
            extra += 1
    return chars
