"""Test helpers: two tiny tokenizers built in memory (no files, no hub), one per kind
of detokenization trouble."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import Tokenizer


def sentencepiece_like() -> Tokenizer:
    """A tiny Llama-style tokenizer: '▁' pieces, byte fallback, BOS added, start strip."""
    specials = ["<unk>", "<s>", "</s>"]
    merges = [("▁", "h"), ("▁h", "i"), ("h", "e"), ("l", "l"), ("ll", "o"), ("▁", "t")]
    merges += [("▁t", "he"), ("▁h", "e"), ("▁he", "llo")]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    pieces += list("abcdefghijklmnopqrstuvwxyzé.!?\n") + ["".join(m) for m in merges]
    model = models.BPE(
        {p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True
    )
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    rust.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    rust.add_special_tokens(specials)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return Tokenizer(
        PreTrainedTokenizerFast(
            tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    )


def byte_level() -> Tokenizer:
    """A tiny GPT-2-style byte-level BPE: one token per byte, U+FFFD while incomplete."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    rust = RustTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(["<|endoftext|>"])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>"))
