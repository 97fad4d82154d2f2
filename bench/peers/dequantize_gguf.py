"""Dequantizes a GGUF checkpoint into an HF directory (float32 safetensors, config,
tokenizer) with transformers' GGUF loader; run in the scratch venv (gguf, accelerate).

    python dequantize_gguf.py --gguf DIR/FILE.gguf --out HF_DIR

transformers refuses to save a model it loaded from GGUF, so the weights are moved into a
plain `LlamaForCausalLM` built from the same config (without its quantization entry).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    where, name = str(args.gguf.parent), args.gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype="float32")
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    if config.get("model_type") != "llama":
        raise SystemExit(f"{args.gguf} holds a {config.get('model_type')!r} model, not a Llama")
    config["architectures"] = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(LlamaConfig(**config)).float()
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(str(args.out))
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(str(args.out))


if __name__ == "__main__":
    main()
