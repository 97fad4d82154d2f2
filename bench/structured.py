"""What a grammar costs: output tok/s under a JSON schema vs without, and compile times.

    python bench/structured.py --out bench/results/structured.json   # about 10 min on 2 cores
    python bench/structured.py --quick                               # smoke test, about 1 min

The model is the default one, SmolLM2-135M-Instruct (a 49,152-token vocabulary: the
grammar's cost grows with it), from the local cache (`pagedserve fetch`); without it,
the 58M random Llama of bench/systems.py with the Llama 2 tokenizer of ../shared (32,000
tokens), and the JSON's `model.source` says so. Float32, `--threads` torch threads.

- throughput: for each batch B, B chat prompts run greedily for `--max-tokens` tokens,
  unconstrained (`ignore_eos`) and constrained by USER_SCHEMA, on two identical offline
  `LLM`s in this process, one per mode, stepped in turn (a burst of other load on the
  machine hits both) and swapping modes every repeat; two warm-ups first (each engine
  runs each mode once, compiling its grammar). Output tok/s = tokens generated / the
  mode's own wall time (admission, its steps, the flush), medians of `--repeats`.
  Target: constrained >= 0.90 x unconstrained at batch 64.
- compile: the engine's grammar backend (engine/worker/grammar/) timed directly: its
  build (xgrammar's tokenizer info), each schema's first compile, a recompile (the
  backend keeps no cache of its own) and a hit in the engine's GrammarCache.
- first_request: a fresh engine's first constrained request, what it built and compiled
  and where (the text processor's GrammarChecker thread, or the worker inside a step).
- stall: `--stall-batch` unconstrained sequences decoding, then a request with a schema
  the engine has not seen: the step that admits it, against the steps around it.
- breakdown: at the largest batch, timers around the worker's grammar work per step
  (bitmask fill, apply, matcher accept) in one constrained and one unconstrained run,
  and the constrained run's bitmasks applied again three ways.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from report import invocation, machine, write_report  # noqa: E402

TARGET_RATIO = 0.90  # constrained / unconstrained output tok/s at batch 64
KV_CACHE_MEMORY = 768 << 20
MAX_MODEL_LEN = 2048

# The throughput schema: a user record, every string and the array bounded.
USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 5,
        },
        "bio": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "age", "email", "role", "skills", "bio"],
    "additionalProperties": False,
}
POINT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 50},
                "country": {"type": "string", "minLength": 2, "maxLength": 2},
            },
            "required": ["name", "country"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
            "minItems": 1,
            "maxItems": 10,
        },
        "gift": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 100},
    },
    "required": ["order_id", "status", "customer", "items", "gift"],
}
SCHEMAS = {"user": USER_SCHEMA, "point": POINT_SCHEMA, "order": ORDER_SCHEMA}
# the compile-time sweep of one string field (its cost drops past maxLength 128)
MAX_LENGTHS = (10, 20, 40, 80, 120, 128, 129, 160, 200)

TOPICS = ["chess", "hiking", "cooking", "astronomy", "jazz", "cycling", "poetry", "robotics"]


def log(msg: str) -> None:
    print(f"[structured] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ probes


class Probes:
    """Wall time of every call to the functions `wrap` names, patched in place (on the
    class or module that holds them) until `restore`. Each call: (key, thread, seconds,
    end time)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, float]] = []
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)
        calls = self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                calls.append((key, threading.current_thread().name, end - start, end))

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    @contextmanager
    def window(self):
        """Yields the list of calls made inside the block (filled when it exits)."""
        first, seen = len(self.calls), []
        yield seen
        seen.extend(self.calls[first:])


def summarize(calls: list, per: int = 1) -> dict:
    """Per key: calls, total ms, and ms per `per` (a step count, say)."""
    out: dict[str, dict] = {}
    for key, _thread, seconds, _end in calls:
        row = out.setdefault(key, dict(calls=0, total_ms=0.0))
        row["calls"] += 1
        row["total_ms"] += seconds * 1e3
    for row in out.values():
        row["per_call_us"] = round(row["total_ms"] * 1e3 / row["calls"], 1)
        row["ms_per_unit"] = round(row["total_ms"] / per, 3)
        row["total_ms"] = round(row["total_ms"], 1)
    return out


# ------------------------------------------------------------------------------- model


def pick_model(tmp: Path) -> tuple[dict, dict]:
    """(LLM keyword arguments, the report's `model`): the cached default model, else the
    58M random Llama with the Llama 2 tokenizer. SystemExit(2) when neither is here."""
    from cuda_ext.build import cache_root
    from engine.default_model import SMOLLM2, cached_default_model

    found = cached_default_model(cache_root())
    if found is not None:
        source = f"the cached default model {SMOLLM2.name} ({found.name}; float32 weights)"
        return dict(model=str(found), max_model_len=MAX_MODEL_LEN), dict(
            path=str(found), source=source
        )
    from systems import MODEL_SHAPE, write_model
    from workload import SHARED

    tokenizer = SHARED / "tokenizers" / "llama2"
    if not (tokenizer / "tokenizer.json").is_file():
        log(f"no cached {SMOLLM2.name} (run `pagedserve fetch`) and no {tokenizer}: nothing to run")
        raise SystemExit(2)
    write_model(tmp, seed=0, shape=dict(MODEL_SHAPE, eos_token_id=2))
    source = (
        f"fallback: {SMOLLM2.name} is not cached, so the 58M random Llama of "
        "bench/systems.py (eos 2) with the Llama 2 tokenizer (32,000 tokens)"
    )
    kwargs = dict(model=str(tmp), tokenizer=str(tokenizer), max_model_len=1024)  # its context
    return kwargs, dict(path=str(tmp), source=source)


def prompts(llm, count: int) -> list[list[int]]:
    """`count` distinct requests for a user record, as token ids (chat-rendered when the
    tokenizer has a template)."""
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(count):
        text = (
            f"Invent member number {i} of our {TOPICS[i % len(TOPICS)]} club and describe "
            "them as a JSON user record with name, age, email, role, skills and bio."
        )
        if tokenizer.chat_template is not None:
            out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        else:
            out.append(tokenizer.encode(text))
    return out


# -------------------------------------------------------------------------- throughput


def params(max_tokens: int, schema: dict | None):
    from engine import SamplingParams, StructuredOutputsParams

    if schema is None:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    constraint = StructuredOutputsParams(json=schema)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)


def timed_generate(llm, batch: list[list[int]], sampling) -> dict:
    start = time.perf_counter()
    outs = llm.generate(batch, sampling, use_tqdm=False)
    wall = time.perf_counter() - start
    seqs = [o.outputs[0] for o in outs]
    tokens = sum(len(s.token_ids) for s in seqs)
    return dict(
        wall_s=round(wall, 3),
        tokens=tokens,
        tok_s=round(tokens / wall, 2),
        finish_reasons=dict(Counter(s.finish_reason for s in seqs)),
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def throughput(llms: list, all_prompts, batch_size: int, max_tokens: int, repeats: int) -> dict:
    """Both modes at once on two identical engines, a step of each in turn (`interleaved`),
    so a burst of other load hits both; the engines swap modes every repeat. Two untimed
    warm-ups first (each engine runs each mode once, compiling its grammar); medians of
    `repeats` timed runs, and the ratio of each repeat's pair."""
    batch = all_prompts[:batch_size]
    modes = [
        ("unconstrained", params(max_tokens, None)),
        ("constrained", params(max_tokens, USER_SCHEMA)),
    ]
    runs: dict[str, list[dict]] = {name: [] for name, _ in modes}
    for r in range(repeats + 2):
        pairing = modes if r % 2 == 0 else modes[::-1]
        done = interleaved([llm.engine for llm in llms], batch, pairing, f"b{batch_size}r{r}")
        if r < 2:
            continue
        for name, run in done.items():
            runs[name].append(run)
        log(f"batch {batch_size}: " + ", ".join(f"{n} {x['tok_s']} tok/s" for n, x in done.items()))
    row: dict = dict(batch=batch_size)
    for name, rs in runs.items():
        tok_s = [x["tok_s"] for x in rs]
        row[name] = dict(
            tok_s=round(statistics.median(tok_s), 2),
            best_tok_s=max(tok_s),
            step_ms=round(statistics.median(x["median_step_ms"] for x in rs), 2),
            runs=rs,
        )
    con, unc = runs["constrained"], runs["unconstrained"]
    row["paired_ratios"] = [
        round(c["tok_s"] / u["tok_s"], 3) for c, u in zip(con, unc, strict=True)
    ]
    row["ratio"] = round(row["constrained"]["tok_s"] / row["unconstrained"]["tok_s"], 3)
    row["ratio_of_best"] = round(
        row["constrained"]["best_tok_s"] / row["unconstrained"]["best_tok_s"], 3
    )
    row["ratio_of_median_steps"] = round(
        row["unconstrained"]["step_ms"] / row["constrained"]["step_ms"], 3
    )
    per_cpu = {n: statistics.median(x["tok_per_cpu_s"] for x in rs) for n, rs in runs.items()}
    row["ratio_per_cpu_s"] = round(per_cpu["constrained"] / per_cpu["unconstrained"], 3)
    return row


def interleaved(engines: list, batch: list[list[int]], pairing: list, tag: str) -> dict:
    """`engines[i]` runs `batch` under the i-th (name, SamplingParams) of `pairing`, one
    step of each in turn. Each mode's wall time is its own engine's: admitting the
    requests, its steps, the final flush (what `LLM.generate` does)."""
    runs = []
    for index, (engine, (name, sampling)) in enumerate(zip(engines, pairing, strict=True)):
        run = dict(name=name, engine=index, wall=0.0, cpu=0.0, steps=[], outputs=[])
        for i, prompt in enumerate(batch):
            _timed(run, engine.add_request, f"{tag}-{name}-{i}", prompt, sampling)
        runs.append((engine, run))
    while any(engine.has_unfinished_requests() for engine, _ in runs):
        for engine, run in runs:
            if engine.has_unfinished_requests():
                run["outputs"] += _timed(run, engine.step)
                run["steps"].append(run["last"])
    for engine, run in runs:
        _timed(run, engine.flush)
    return {run["name"]: _report(run) for _, run in runs}


def _timed(run: dict, fn: Callable, *args):
    start, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    run["last"] = time.perf_counter() - start
    run["wall"] += run["last"]
    run["cpu"] += time.process_time() - cpu
    return result


def _report(run: dict) -> dict:
    seqs = [o.outputs[0] for o in run["outputs"]]
    tokens = sum(len(s.token_ids) for s in seqs)
    stopped = [s.text for s in seqs if s.finish_reason == "stop"]
    return dict(
        engine=run["engine"],
        wall_s=round(run["wall"], 3),
        tokens=tokens,
        tok_s=round(tokens / run["wall"], 2),
        median_step_ms=round(statistics.median(run["steps"]) * 1e3, 2),
        cpu_s=round(run["cpu"], 3),  # this process's CPU time in the mode's own calls
        tok_per_cpu_s=round(tokens / run["cpu"], 2),
        finish_reasons=dict(Counter(s.finish_reason for s in seqs)),
        stopped_valid_json=sum(_is_json(t) for t in stopped),
        sample=seqs[0].text[:160],
    )


# ----------------------------------------------------------------------------- compile


def compile_times(llm, quick: bool) -> dict:
    """The engine's backend for this model, built and timed apart from the engine's own."""
    from engine import StructuredOutputsParams
    from engine.worker.grammar.backend import build_backend
    from engine.worker.grammar.compile_cache import GrammarCache

    m = llm.config.model
    start = time.perf_counter()
    backend = build_backend(llm.get_tokenizer(), m.vocab_size, m.eos_token_ids)
    out: dict = dict(backend_build_s=round(time.perf_counter() - start, 3), schemas={})
    for name, schema in SCHEMAS.items():
        constraint = StructuredOutputsParams(json=schema)
        times = []
        for _ in range(2 if quick else 3):
            start = time.perf_counter()
            compiled = backend.compile(constraint)
            times.append(time.perf_counter() - start)
        cache = GrammarCache(backend)
        cache.put(constraint, compiled)
        start = time.perf_counter()
        for _ in range(1000):
            cache.get(constraint)
        hit = (time.perf_counter() - start) / 1000
        out["schemas"][name] = dict(
            cold_ms=round(times[0] * 1e3, 1),
            recompile_ms=round(statistics.median(times[1:]) * 1e3, 1),
            cached_us=round(hit * 1e6, 2),
        )
        log(f"compile {name}: {out['schemas'][name]}")
    if not quick:  # compile time against one string's maxLength
        out["max_length_sweep_ms"] = {}
        for n in MAX_LENGTHS:
            one = {"type": "object", "properties": {"s": {"type": "string", "maxLength": n}}}
            constraint = StructuredOutputsParams(json=one)
            start = time.perf_counter()
            backend.compile(constraint)
            out["max_length_sweep_ms"][n] = round((time.perf_counter() - start) * 1e3, 1)
        log(f"compile vs maxLength: {out['max_length_sweep_ms']}")
    return out


# ----------------------------------------------------------------- first request, stall


def first_request(llm, probes: Probes, prompt: list[int], max_tokens: int) -> dict:
    """The fresh engine's first constrained request, then the same request again; the
    grammar work each did, and where: admission (the text processor's GrammarChecker)
    or a worker step."""
    sampling = params(max_tokens, USER_SCHEMA)
    out = {}
    for label in ("first", "again"):
        with probes.window() as calls:
            start = time.perf_counter()
            llm.generate([prompt], sampling, use_tqdm=False)
            wall = time.perf_counter() - start
        enclosing = ("grammar check", "worker step")
        sides = [(k, end - s, end) for k, _, s, end in calls if k in enclosing]
        out[label] = dict(
            wall_s=round(wall, 3),
            work=[
                dict(what=key, where=_where(sides, end - s, end), ms=round(s * 1e3, 1))
                for key, _, s, end in calls
                if key in ("backend build", "tokenizer load", "compile")
            ],
        )
    out["extra_s"] = round(out["first"]["wall_s"] - out["again"]["wall_s"], 3)
    return out


def _where(sides: list[tuple[str, float, float]], start: float, end: float) -> str:
    """The call among `sides` (key, start, end) that encloses [start, end]."""
    for key, side_start, side_end in sides:
        if side_start <= start and end <= side_end:
            return "admission (GrammarChecker)" if key == "grammar check" else "worker step"
    return "elsewhere"


def stall(llm, probes: Probes, all_prompts, batch_size: int, schema: dict, tag: str) -> dict:
    """`batch_size` unconstrained sequences decode; then a request constrained by
    `schema` arrives. Each step's wall time, and the compiles inside it."""
    engine = llm.engine
    steady = params(80, None)
    for i in range(batch_size):
        engine.add_request(f"stall-{tag}-{i}", all_prompts[i], steady)
    steps: list[float] = []
    compiles: list[float] = []

    def step() -> None:
        with probes.window() as calls:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        compiles.append(sum(s for key, _, s, _ in calls if key == "compile"))

    for _ in range(12):  # prefill, then decode
        step()
    arrival = len(steps)
    with probes.window() as calls:
        start = time.perf_counter()
        engine.add_request(f"stall-{tag}-new", all_prompts[batch_size], params(24, schema))
        admit = time.perf_counter() - start
    for _ in range(12):
        step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    before = statistics.median(steps[arrival - 6 : arrival])
    after = statistics.median(steps[arrival + 2 :])
    return dict(
        running=batch_size,
        admit_ms=round(admit * 1e3, 1),
        admit_compile_ms=round(sum(s for key, _, s, _ in calls if key == "compile") * 1e3, 1),
        step_before_ms=round(before * 1e3, 1),
        arrival_step_ms=round(steps[arrival] * 1e3, 1),
        arrival_step_worker_compile_ms=round(compiles[arrival] * 1e3, 1),
        next_step_ms=round(steps[arrival + 1] * 1e3, 1),
        step_after_ms=round(after * 1e3, 1),
        stall_ms=round((steps[arrival] - before) * 1e3, 1),
    )


# --------------------------------------------------------------------------- breakdown


def breakdown(llm, probes: Probes, all_prompts, batch_size: int, max_tokens: int) -> dict:
    """Per-step timers in one unconstrained and one constrained run of `batch_size`;
    then the constrained run's bitmasks applied again three ways (`_apply_variants`)."""
    from engine.worker.grammar import xgrammar_backend

    batch = all_prompts[:batch_size]
    out: dict = dict(batch=batch_size)
    masks: list[tuple[torch.Tensor, list[int]]] = []  # each step's (bitmask, rows)
    original_apply = xgrammar_backend.XGrammarBackend.apply_bitmask

    def keep(self, logits, bitmask, rows):  # a step's bitmask is never written again
        masks.append((bitmask, list(rows)))
        return original_apply(self, logits, bitmask, rows)

    for name, schema in (("unconstrained", None), ("constrained", USER_SCHEMA)):
        if schema is not None:
            xgrammar_backend.XGrammarBackend.apply_bitmask = keep
        try:
            with probes.window() as calls:
                run = timed_generate(llm, batch, params(max_tokens, schema))
        finally:
            xgrammar_backend.XGrammarBackend.apply_bitmask = original_apply
        num_steps = sum(1 for key, *_ in calls if key == "worker step")
        per_step = summarize(calls, max(num_steps, 1))
        grammar = ("step bitmask (alloc + fills)", "apply bitmask", "matcher accept (one row)")
        grammar_ms = sum(per_step[k]["ms_per_unit"] for k in grammar if k in per_step)
        out[name] = dict(
            run=run, steps=num_steps, grammar_ms_per_step=round(grammar_ms, 2), per_step=per_step
        )
    step_ms = out["constrained"]["per_step"]["worker step"]["ms_per_unit"]
    out["grammar_share_of_constrained_step"] = round(
        out["constrained"]["grammar_ms_per_step"] / step_ms, 4
    )
    out["apply_variants"] = _apply_variants(masks, llm.config.model.vocab_size)
    return out


def _apply_variants(masks: list[tuple[torch.Tensor, list[int]]], vocab: int) -> dict:
    """Every step's bitmask of the constrained run applied to random logits again: the
    engine's way (xgrammar's CPU kernel with `indices`), the same kernel without
    `indices` (right when every row is constrained), and torch unpacking the bits for
    `masked_fill_`. ms per step (mean over the steps; the median of 3 passes), the
    engine's per-step spread, and the share of tokens the masks allow."""
    import xgrammar as xgr

    shifts = torch.arange(32, dtype=torch.int32)

    def engine_apply(x, bitmask, rows):
        xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=vocab, indices=rows)

    def no_indices(x, bitmask, rows):
        xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=vocab)

    def torch_unpack(x, bitmask, rows):
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]  # [B, V]
        x.masked_fill_(bits == 0, float("-inf"))

    variants = {"engine": engine_apply, "no_indices": no_indices, "torch": torch_unpack}
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(masks[0][0].shape[0], vocab, generator=generator)  # [B, V]
    passes: dict[str, list[list[float]]] = {name: [] for name in variants}
    same = True
    for _ in range(3):
        for name, fn in variants.items():
            per_step = []
            for bitmask, rows in masks:
                x = logits.clone()
                start = time.perf_counter()
                fn(x, bitmask, rows)
                per_step.append(time.perf_counter() - start)
            passes[name].append(per_step)
    for bitmask, rows in masks:
        results = []
        for fn in variants.values():
            x = logits.clone()
            fn(x, bitmask, rows)
            results.append(x)
        same = same and all(torch.equal(results[0], r) for r in results)
    out: dict = {}
    for name, runs in passes.items():
        out[f"{name}_ms_per_step"] = round(
            statistics.median(sum(r) for r in runs) / len(masks) * 1e3, 2
        )
    engine_steps = [statistics.median(step) * 1e3 for step in zip(*passes["engine"], strict=True)]
    out["engine_step_ms_min_median_max"] = [
        round(min(engine_steps), 2),
        round(statistics.median(engine_steps), 2),
        round(max(engine_steps), 2),
    ]
    allowed = [
        float(((b.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].float().mean())
        for b, _ in masks
    ]
    out["allowed_share_median"] = round(statistics.median(allowed), 3)
    out["steps"] = len(masks)
    out["same_result"] = same
    return out


# -------------------------------------------------------------------------------- main


def install_probes(probes: Probes) -> None:
    """Before the engine is built, so the worker's backend factory sees them too."""
    import engine.wiring
    from engine.worker import model_runner, sampler, worker
    from engine.worker.grammar import checker, xgrammar_backend

    x = xgrammar_backend
    probes.wrap(x.XGrammarBackend, "__init__", "backend build")
    probes.wrap(x.XGrammarBackend, "compile", "compile")
    probes.wrap(x.XGrammarBackend, "apply_bitmask", "apply bitmask")
    probes.wrap(x.XGrammarMatcher, "fill_bitmask", "fill bitmask (one row)")
    probes.wrap(x.XGrammarMatcher, "accept", "matcher accept (one row)")
    probes.wrap(model_runner.ModelRunner, "_grammar_bitmask", "step bitmask (alloc + fills)")
    probes.wrap(sampler.Sampler, "__call__", "sampler")
    probes.wrap(worker.Worker, "execute", "worker step")
    probes.wrap(checker.GrammarChecker, "check", "grammar check")
    probes.wrap(engine.wiring, "load_engine_tokenizer", "tokenizer load")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 16 64")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="default 7 (quick: 2)")
    p.add_argument("--stall-batch", type=int, default=None, help="default 16 (quick: 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="batch 1 and 16, 16 tokens, 2 repeats")
    p.add_argument("--out", type=Path, help="JSON path (a PNG beside it)")
    a = p.parse_args(argv)
    batches = a.batch or ([1, 16] if a.quick else [1, 16, 64])
    max_tokens = a.max_tokens or (16 if a.quick else 64)
    repeats = a.repeats or (2 if a.quick else 7)
    stall_batch = a.stall_batch or (4 if a.quick else 16)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_before = [round(x, 2) for x in os.getloadavg()]

    from engine import LLM

    probes = Probes()
    install_probes(probes)
    with tempfile.TemporaryDirectory() as tmp:
        kwargs, model = pick_model(Path(tmp))
        log(f"model: {model['source']}")
        settings = dict(
            seed=0,
            dtype="float32",
            kv_cache_memory=KV_CACHE_MEMORY,
            max_num_seqs=max(256, *batches),
        )
        llms = [LLM(**kwargs, **settings) for _ in range(2)]  # one per mode, swapped
        llm = llms[0]
        m = llm.config.model
        model.update(vocab_size=m.vocab_size, eos_token_ids=sorted(m.eos_token_ids))
        model["tokenizer_tokens"] = len(llm.get_tokenizer().hf_tokenizer)
        all_prompts = prompts(llm, max(*batches, stall_batch) + 1)
        log("first constrained request of the fresh engine")
        first = first_request(llm, probes, all_prompts[0], max_tokens)
        log(f"first request: {first}")
        rows = [throughput(llms, all_prompts, b, max_tokens, repeats) for b in batches]
        log("compile times")
        compiled = compile_times(llm, a.quick)
        log("a new schema arriving while a batch decodes")
        stalls = dict(
            cold=stall(llm, probes, all_prompts, stall_batch, ORDER_SCHEMA, "cold"),
            cached=stall(llm, probes, all_prompts, stall_batch, ORDER_SCHEMA, "cached"),
        )
        log(f"stall: {stalls}")
        log(f"breakdown at batch {max(batches)}")
        parts = breakdown(llm, probes, all_prompts, max(batches), max_tokens)
        probes.restore()
    top = max(rows, key=lambda r: r["batch"])
    result = dict(
        command=invocation(__file__),
        model=model,
        threads=a.threads,
        dtype="float32",
        max_tokens=max_tokens,
        repeats=repeats,
        schema=USER_SCHEMA,
        target=dict(
            batch=top["batch"],
            min_ratio=TARGET_RATIO,
            ratio=top["ratio"],
            met=top["ratio"] >= TARGET_RATIO,
        ),
        throughput=rows,
        compile=compiled,
        first_request=first,
        stall=stalls,
        breakdown=parts,
        load_avg_before=load_before,
        load_avg_after=[round(x, 2) for x in os.getloadavg()],
        versions=dict(torch=torch.__version__, xgrammar=version("xgrammar")),
        machine=dict(machine(), cpus=str(os.cpu_count())),
    )
    write_report(result, a.out, lambda path: plot(result, path))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]
    fig, (ax, cx) = plt.subplots(1, 2, figsize=(11, 4.4), width_ratios=[3, 2])
    x = range(len(rows))
    width = 0.38
    for offset, name in ((-width / 2, "unconstrained"), (width / 2, "constrained")):
        ax.bar([i + offset for i in x], [r[name]["tok_s"] for r in rows], width, label=name)
    for i, r in enumerate(rows):
        top = max(r["unconstrained"]["tok_s"], r["constrained"]["tok_s"])
        ax.annotate(f"x{r['ratio']:.3f}", (i, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tok/s (median)")
    ax.set_title("JSON schema vs none (ratio: constrained / unconstrained)", fontsize=9)
    ax.legend(fontsize=8)
    schemas = result["compile"]["schemas"]
    names = list(schemas)
    bars = (
        ("cold_ms", 1, "first compile"),
        ("recompile_ms", 1, "again"),
        ("cached_us", 1e-3, "cache hit"),
    )
    for k, (key, scale, label) in enumerate(bars):
        xs = [i + (k - 1) * 0.27 for i in range(len(names))]
        cx.bar(xs, [schemas[n][key] * scale for n in names], 0.27, label=label)
    cx.set_xticks(range(len(names)), [f"{n} schema" for n in names])
    cx.set_yscale("log")
    cx.set_ylabel("ms")
    cx.set_title("grammar compile time", fontsize=9)
    cx.legend(fontsize=8)
    fig.text(0.01, 0.01, result["command"], fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
