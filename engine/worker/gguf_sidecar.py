"""A GGUF file's metadata as an ordinary Hugging Face directory (its "side-car").

The config, tokenizer, special tokens and chat template of a GGUF file live in its
metadata. Turning them into transformers objects takes seconds (the 49k-entry vocabulary
and merges are parsed field by field), and every process of a served engine needs them,
so `gguf_sidecar_dir(path)` does it once and writes the result where the rest of
pagedserve expects a model: a directory with config.json (with `architectures`),
generation_config.json and the tokenizer files. The weights stay in the GGUF file
(`weights.gguf.json` names it and holds its tensor index) and are read by
`GgufCheckpoint`.

The directory is keyed by the file's absolute path, size and modification time, and is
written atomically, so a changed file gets a new side-car and a concurrent start never
sees a half-written one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.worker.cache_files import write_once
from engine.worker.gguf_checkpoint import GgufCheckpoint, GgufIndex

POINTER_FILE = "weights.gguf.json"  # {"gguf": "/abs/path/model.gguf", "index": GgufIndex}
SIDECAR_VERSION = 1  # bump when the files written below change


def is_gguf_file(model: str) -> bool:
    return model.endswith(".gguf") and Path(model).expanduser().is_file()


def gguf_sidecar_dir(path: str | Path, cache_dir: Path) -> Path:
    """The side-car directory of the GGUF file at `path`, written on first use."""
    gguf_path = Path(path).expanduser().resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{SIDECAR_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{digest}"
    return write_once(target, POINTER_FILE, lambda scratch: write_sidecar(gguf_path, scratch))


def gguf_weights(model_dir: str | Path) -> GgufCheckpoint | None:
    """The GGUF checkpoint a side-car directory points at; None for an ordinary one."""
    pointer = Path(model_dir) / POINTER_FILE
    if not pointer.is_file():
        return None
    data = json.loads(pointer.read_text())
    return GgufCheckpoint(data["gguf"], GgufIndex.from_json(data["index"]))


def write_sidecar(gguf_path: Path, directory: Path) -> None:
    """config.json, generation_config.json, tokenizer files and the pointer file."""
    from transformers import AutoConfig, AutoTokenizer

    index = GgufIndex.read(gguf_path)  # checks the file and the architecture first
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - metadata transformers cannot take: name the file
        raise ValueError(
            f"GGUF file {name}: its config or tokenizer metadata cannot be read "
            f"({type(exc).__name__}: {exc}); download or convert it again"
        ) from exc
    config.architectures = [index.hf_architecture]
    config.tie_word_embeddings = "output.weight" not in index.tensor_names()
    config.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    eos = getattr(config, "eos_token_id", None)
    generation = {"eos_token_id": eos} if eos is not None else {}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    pointer = {"gguf": str(gguf_path), "index": index.to_json()}
    (directory / POINTER_FILE).write_text(json.dumps(pointer))
