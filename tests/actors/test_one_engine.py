"""One engine: the offline LLM (depth 1 and 2) and AsyncEngine (a worker process, the
actors) give identical outputs for one mixed set of requests: greedy, seeded, stop
strings spanning deltas, min_tokens with stop strings, n, best_of, beam search,
logprobs and prompt logprobs; with plenty of memory and prefix caching, and under
preemption by recompute and by swap with caching off; for a dense model and a hybrid
one (a full-attention and a sliding-window layer: two KV cache groups)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from actors.async_engine import AsyncEngine
from engine import LLM, RequestOutput, SamplingParams
from engine.engine_args import EngineArgs
from engine.output_assembler import OutputAssembler
from tests.engine.tiny_models import kv_memory, save_hf_model
from tests.engine.tiny_tokenizers import sentencepiece_like

PROMPTS = ["hello there", "the hill", "hi hello", "ab the", "hello", "lo the hi"]
BS = 4


@pytest.fixture(scope="module", params=["llama", "qwen2-hybrid"])
def model_dir(request, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-one-engine")
    tokenizer = sentencepiece_like()
    save_hf_model(request.param, directory, vocab_size=tokenizer.vocab_size)
    tokenizer.hf_tokenizer.save_pretrained(directory)
    return str(directory)


@dataclass(frozen=True)
class Memory:
    """An engine setting: KV blocks, CPU swap blocks (swap preemption), prefix caching."""

    name: str
    num_blocks: int
    swap_blocks: int
    prefix_caching: bool

    def kwargs(self, model_dir: str) -> dict:
        per_block = kv_memory(model_dir, 1, BS)
        kw = dict(
            block_size=BS,
            max_model_len=64,
            max_num_batched_tokens=32,
            kv_cache_memory=per_block * self.num_blocks,
            enable_prefix_caching=self.prefix_caching,
            seed=0,
        )
        if self.swap_blocks:
            swap = per_block * self.swap_blocks / 1024**3
            kw |= dict(swap_space=swap, preemption_mode="swap")
        return kw


SETTINGS = [
    Memory("plenty-cached", 400, 0, True),
    Memory("recompute", 36, 0, False),
    Memory("swap", 36, 64, False),
]


def mixed_requests(model_dir: str) -> list[tuple[str, SamplingParams]]:
    """The set. A random model mostly samples byte-fallback pieces (text held back as
    U+FFFD), so most requests bias the text pieces up; stop strings are cut out of
    greedy texts so they really occur (one spans two tokens' text)."""
    probe = LLM(model_dir, max_model_len=64)
    vocab = probe.get_tokenizer().hf_tokenizer.get_vocab()
    bias = {i: 6.0 for piece, i in vocab.items() if not piece.startswith("<")}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    texts = [o.outputs[0].text for o in probe.generate(PROMPTS[:2], greedy, use_tqdm=False)]
    assert all(len(t) >= 10 for t in texts), texts
    stop_span, early_char = texts[0][4:7], texts[1][1]
    g = dict(temperature=0, logit_bias=bias)
    sampled = dict(temperature=1.0, max_tokens=14, ignore_eos=True, logit_bias=bias)
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, **g)),
        (PROMPTS[1], SamplingParams(seed=11, **sampled)),
        (PROMPTS[0], SamplingParams(max_tokens=16, stop=[stop_span, "zz"], **g)),
        (PROMPTS[1], SamplingParams(max_tokens=16, stop=[early_char], **g)),
        (PROMPTS[1], SamplingParams(max_tokens=16, stop=[early_char], min_tokens=8, **g)),
        (PROMPTS[2], SamplingParams(n=3, seed=5, **sampled)),
        (PROMPTS[3], SamplingParams(n=2, best_of=4, seed=6, **sampled)),
        (
            PROMPTS[4],
            SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0, max_tokens=10),
        ),
        (PROMPTS[5], SamplingParams(seed=9, logprobs=2, prompt_logprobs=1, **sampled)),
        (PROMPTS[2], SamplingParams(logprobs=0, max_tokens=12, stop=["e"], **g)),
        # unbiased: byte pieces held back to the end, where the stop string shows up
        (PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, stop=["\ufffd"])),
    ]
    requests += [(p, SamplingParams(seed=20 + i, **sampled)) for i, p in enumerate(PROMPTS)]
    return requests


def offline(model_dir: str, memory: Memory, depth: int, requests) -> tuple[list, LLM]:
    llm = LLM(model_dir, pipeline_depth=depth, **memory.kwargs(model_dir))
    prompts, params = zip(*requests, strict=True)
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    llm.engine.check_integrity()
    assert not llm.engine.worker.requests  # every ended request dropped there too
    return outputs, llm


async def served(model_dir: str, memory: Memory, requests) -> tuple[list, object]:
    """Each stream folded as the offline engine folds its deltas."""
    engine = await AsyncEngine.start(EngineArgs(model=model_dir, **memory.kwargs(model_dir)))

    async def one(rid: str, prompt: str, params: SamplingParams) -> RequestOutput:
        folder = OutputAssembler()
        folder.open(rid, prompt, [], params)
        async for out in engine.generate(prompt, params, rid):
            done = folder.add(out)
        return done

    try:
        jobs = [one(f"r{i}", p, sp) for i, (p, sp) in enumerate(requests)]
        outputs = await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)
        stats = engine.stats()
    finally:
        await engine.shutdown()
    return outputs, stats


def same(got: RequestOutput, want: RequestOutput, params: SamplingParams) -> None:
    assert got.error is None and want.error is None
    assert len(got.outputs) == len(want.outputs) == params.n
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.token_ids, g.text) == (w.index, w.token_ids, w.text)
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        if params.logprobs is not None and params.num_sequences == params.n:
            assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
            for gd, wd in zip(g.logprobs, w.logprobs, strict=True):
                for t, lp in gd.items():
                    assert (lp.rank, lp.decoded_token) == (wd[t].rank, wd[t].decoded_token)
                    assert lp.logprob == pytest.approx(wd[t].logprob, abs=1e-4)
    if params.prompt_logprobs is not None:
        assert [None if d is None else list(d) for d in got.prompt_logprobs] == [
            None if d is None else list(d) for d in want.prompt_logprobs
        ]


@pytest.mark.parametrize("memory", SETTINGS, ids=lambda m: m.name)
async def test_offline_and_served_give_identical_outputs(model_dir, memory):
    requests = mixed_requests(model_dir)
    reference, llm = offline(model_dir, memory, 1, requests)
    ahead, llm2 = offline(model_dir, memory, 2, requests)
    streamed, served_stats = await served(model_dir, memory, requests)
    for (_, params), want, a, s in zip(requests, reference, ahead, streamed, strict=True):
        same(a, want, params)
        same(s, want, params)

    spanning = reference[2].outputs[0]
    assert spanning.finish_reason == "stop" and spanning.stop_reason == requests[2][1].stop[0]
    guarded, unguarded = reference[4].outputs[0], reference[3].outputs[0]
    assert unguarded.finish_reason == "stop" and len(unguarded.token_ids) < 8
    assert len(guarded.token_ids) >= 8  # min_tokens guards stop strings too
    flushed = reference[10].outputs[0]  # found only in the text flushed at the end
    assert (flushed.finish_reason, flushed.stop_reason) == ("stop", "\ufffd")
    beams = reference[7].outputs
    assert all(c.beam_score is not None for c in beams)
    assert beams[0].beam_score >= beams[1].beam_score
    best_of = reference[6].outputs
    assert best_of[0].cumulative_logprob >= best_of[1].cumulative_logprob
    assert best_of[0].logprobs is None  # ranked by logprobs that were not asked for
    for stats in (llm.stats(), llm2.stats(), served_stats):
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_blocks
        if memory.name != "plenty-cached":
            assert stats.num_preemptions > 0
        if memory.name == "swap":
            assert stats.num_swaps > 0
        if memory.prefix_caching:
            assert stats.prefix_cache_hit_tokens > 0
