"""Writes a synthetic SentencePiece tokenizer into a model directory (run in the scratch
venv: it needs sentencepiece and protobuf).

    python sp_tokenizer.py --out MODEL_DIR --vocab 32000

The model is a BPE vocabulary with Llama 2's layout (0 <unk>, 1 <s>, 2 </s>, 3..258 the
byte pieces <0x00>..<0xFF>, then filler pieces), so llama.cpp's `convert_hf_to_gguf.py`
accepts the checkpoint and `pagedserve serve` can detokenize. The benchmarks send token
ids, so what the pieces are does not matter. Besides `tokenizer.model` it saves the HF
tokenizer files (`LlamaTokenizer` converts the SentencePiece model).
"""

from __future__ import annotations

import argparse
import itertools
import string
from pathlib import Path


def filler_pieces():
    """Deterministic candidates: single characters, then "▁"+character, then 2- and
    3-letter strings with and without "▁"."""
    yield "\u2581"
    yield from string.ascii_letters + string.digits + string.punctuation
    yield from ("\u2581" + c for c in string.ascii_letters + string.digits)
    for n in (2, 3):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            yield "\u2581" + "".join(letters)
            yield "".join(letters)


def write_sp_model(path: Path, vocab_size: int) -> None:
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece = pb.ModelProto.SentencePiece
    pieces = [("<unk>", piece.UNKNOWN), ("<s>", piece.CONTROL), ("</s>", piece.CONTROL)]
    pieces += [(f"<0x{b:02X}>", piece.BYTE) for b in range(256)]
    seen = {p for p, _ in pieces}
    for text in filler_pieces():
        if len(pieces) == vocab_size:
            break
        if text not in seen:
            seen.add(text)
            pieces.append((text, piece.NORMAL))
    if len(pieces) != vocab_size:
        raise ValueError(f"only {len(pieces)} pieces available for a vocabulary of {vocab_size}")
    model = pb.ModelProto()
    score = 0.0
    for text, kind in pieces:
        p = model.pieces.add()
        p.piece, p.type = text, kind
        if kind == piece.NORMAL:
            score -= 1.0
            p.score = score
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = vocab_size
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = True
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    path.write_bytes(model.SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    write_sp_model(args.out / "tokenizer.model", args.vocab)
    from transformers import LlamaTokenizer

    tok = LlamaTokenizer.from_pretrained(str(args.out))
    if len(tok) != args.vocab:
        raise SystemExit(f"the HF tokenizer has {len(tok)} entries, expected {args.vocab}")
    tok.save_pretrained(str(args.out))


if __name__ == "__main__":
    main()
