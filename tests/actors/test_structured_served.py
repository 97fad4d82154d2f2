"""Structured outputs on the served path (the worker in a process of its own, the
constraint crossing msgpack): the same outputs as the offline LLM, and a constraint
that cannot compile answered as an invalid request naming its field."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from actors.async_engine import AsyncEngine
from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.messages import ErrorKind
from engine.output_assembler import OutputAssembler

pytestmark = pytest.mark.timeout(180)

ENGINE = dict(model="builtin:tiny", block_size=4, kv_cache_memory=8 << 20, seed=0)
ASCII = {b: -100.0 for b in range(0x80, 0x100)}  # see tests/engine/test_structured_outputs.py
REGEX = r"[a-z]{1,5}(, [a-z]{1,5}){0,2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"enum": ["hi", "the", "hill"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["word", "n"],
}


def requests() -> list[tuple[str, SamplingParams]]:
    common = dict(max_tokens=64, logit_bias=ASCII)
    regex = {"regex": REGEX}
    schema = {"json": SCHEMA, "disable_any_whitespace": True}
    return [
        ("list:", SamplingParams(n=2, seed=3, structured_outputs=regex, **common)),
        ("json:", SamplingParams(temperature=0, structured_outputs=schema, **common)),
        ("pick:", SamplingParams(seed=4, structured_outputs={"choice": ["a", "b"]}, **common)),
        ("free:", SamplingParams(seed=5, max_tokens=12, ignore_eos=True)),
    ]


async def served(reqs) -> list:
    engine = await AsyncEngine.start(EngineArgs(**ENGINE))

    async def one(rid: str, prompt: str, params: SamplingParams):
        folder = OutputAssembler()
        folder.open(rid, prompt, [], params)
        async for out in engine.generate(prompt, params, rid):
            done = folder.add(out)
        return done

    async def refused():
        bad = SamplingParams(max_tokens=8, structured_outputs={"regex": "(unclosed"})
        return [out async for out in engine.generate("bad", bad, "bad")]

    try:
        jobs = [one(f"r{i}", p, sp) for i, (p, sp) in enumerate(reqs)]
        outs = await asyncio.wait_for(asyncio.gather(refused(), *jobs), timeout=120)
    finally:
        await engine.shutdown()
    return outs


async def test_served_structured_outputs_equal_offline_and_bad_ones_are_invalid():
    reqs = requests()
    with LLM(pipeline_depth=2, **ENGINE) as llm:
        prompts, params = zip(*reqs, strict=True)
        want = llm.generate(list(prompts), list(params), use_tqdm=False)
    [bad], *got = await served(reqs)
    assert bad.error_kind is ErrorKind.INVALID
    assert "structured_outputs.regex cannot be compiled" in bad.error
    for g, w in zip(got, want, strict=True):
        assert g.error is None
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in w.outputs
        ]
    assert all(re.fullmatch(REGEX, c.text) for c in want[0].outputs)
    assert json.loads(want[1].outputs[0].text)["word"] in ("hi", "the", "hill")
    assert want[2].outputs[0].text in ("a", "b")
