"""Prefill/decode disaggregation through the engine, in one process: a `kv_producer`
engine computes prompts (max_tokens=1, `do_remote_decode`) and saves their KV blocks,
a `kv_consumer` engine loads them (`do_remote_prefill`, the producer's answer) into
blocks of its own, computes no prompt token (the first output is sampled from the
hidden state sent with the blocks) and decodes. The connector is
the in-memory one (the served tests run the ZeroMQ one). Outputs equal one engine's,
through prompts of any length against the block size, seeded sampling and preemption
after the load; a failed load fails its request and leaves nothing in the prefix
cache."""

from __future__ import annotations

import contextlib

import pytest

from engine import LLM, SamplingParams
from engine.kv_transfer.blocks import KVLayout
from engine.kv_transfer.endpoint import KVEndpoint
from engine.kv_transfer.in_memory import InMemoryConnector, InMemoryFabric
from engine.worker.kv_transfer_steps import KVTransferSteps
from tests.engine.tiny_models import save_hf_model

ENGINE = dict(skip_tokenizer_init=True, block_size=4, max_model_len=64, seed=0)
PRODUCER = {"kv_connector": "PagedServeConnector", "kv_role": "kv_producer", "kv_port": 1}
CONSUMER = {"kv_connector": "PagedServeConnector", "kv_role": "kv_consumer"}
PROMPTS = [[7, 3], [7, 3, 9, 12], [5, 1, 4, 1, 5], [2] * 9, list(range(1, 17)), list(range(3, 20))]
HANDOFF = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})


def attach(llm: LLM, fabric: InMemoryFabric) -> None:
    """The engine's worker saves and loads through `fabric` (the worker actor wires the
    ZeroMQ connector the same way)."""
    worker = llm.engine.worker
    runner = worker.runner
    layout = KVLayout.of(runner.backend.kv_cache_shape)
    endpoint = KVEndpoint(llm.config.kv_transfer, runner.kv_cache, layout)
    worker.kv_transfer = KVTransferSteps(
        InMemoryConnector(endpoint, fabric), llm.config.cache.block_size
    )


@contextlib.contextmanager
def handoff_pair(directory, consumer_memory: int = 8 << 20, **consumer):
    """A producer and a consumer engine on one in-memory fabric (`consumer`: settings
    of the consumer beyond ENGINE's)."""
    fabric = InMemoryFabric()
    with (
        LLM(
            str(directory), kv_cache_memory=8 << 20, kv_transfer_config=PRODUCER, **ENGINE
        ) as prefill,
        LLM(
            str(directory),
            kv_cache_memory=consumer_memory,
            kv_transfer_config=CONSUMER,
            **{**ENGINE, **consumer},
        ) as decode,
    ):
        attach(prefill, fabric)
        attach(decode, fabric)
        yield prefill, decode


def decode_params(handoff, params: SamplingParams) -> SamplingParams:
    """`params` carrying the producer's answer for one prompt."""
    import dataclasses

    return dataclasses.replace(params, kv_transfer_params=handoff.kv_transfer_params)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2"])
def test_handed_off_prompts_decode_as_one_engine(name, tmp_path):
    save_hf_model(name, tmp_path)
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=1),
    ]
    wanted = [params[i % 2] for i in range(len(PROMPTS))]
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        expected = tokens(lone.generate(PROMPTS, wanted, use_tqdm=False))
    with handoff_pair(tmp_path) as (prefill, decode):
        handoffs = prefill.generate(PROMPTS, HANDOFF, use_tqdm=False)
        assert all(h.kv_transfer_params["do_remote_prefill"] for h in handoffs)
        moved = [decode_params(h, p) for h, p in zip(handoffs, wanted, strict=True)]
        got = decode.generate(PROMPTS, moved, use_tqdm=False)
        stats = decode.stats()
        decode.engine.check_integrity()
    assert tokens(got) == expected
    assert stats.num_prompt_tokens_computed == 0
    assert stats.kv_transfer_loaded_tokens == sum(len(p) for p in PROMPTS)


@pytest.mark.timeout(180)
def test_a_transferred_prompt_first_token_needs_no_forward_pass(tmp_path, monkeypatch):
    """The decode side samples each prompt's first token from the hidden state sent with
    its KV: its model never runs (one token asked), whatever the prompt's length."""
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        expected = lone.generate(PROMPTS, params, use_tqdm=False)
    with handoff_pair(tmp_path) as (prefill, decode):
        model = decode.engine.worker.runner.model
        forwards = []
        monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(a))
        handoffs = prefill.generate(PROMPTS, HANDOFF, use_tqdm=False)
        moved = [decode_params(h, params) for h in handoffs]
        got = decode.generate(PROMPTS, moved, use_tqdm=False)
        decode.engine.check_integrity()
    assert forwards == []
    assert tokens(got) == tokens(expected)
    for ours, theirs in zip(got, expected, strict=True):
        [ours_row], [their_row] = ours.outputs[0].logprobs, theirs.outputs[0].logprobs
        assert ours_row.keys() == their_row.keys()
        for token, lp in ours_row.items():
            assert lp.logprob == pytest.approx(their_row[token].logprob, abs=1e-5)


@pytest.mark.timeout(180)
def test_a_consumer_that_preempts_after_the_load_recomputes_as_usual(tmp_path):
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        expected = tokens(lone.generate(PROMPTS, params, use_tqdm=False))
        per_block = lone.engine.worker.runner._block_bytes()
    with handoff_pair(tmp_path, 24 * per_block) as (prefill, decode):
        handoffs = prefill.generate(PROMPTS, HANDOFF, use_tqdm=False)
        moved = [decode_params(h, params) for h in handoffs]
        got = decode.generate(PROMPTS, moved, use_tqdm=False)
        stats = decode.stats()
        decode.engine.check_integrity()
    assert tokens(got) == expected
    assert stats.num_preemptions > 0


@pytest.mark.timeout(180)
def test_a_failed_load_fails_its_request_and_caches_nothing(tmp_path):
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(1, 17))  # four full blocks: what a prefix cache would keep
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        [expected] = tokens(lone.generate([prompt], params, use_tqdm=False))
    nowhere = {
        "do_remote_prefill": True,
        "remote_engine_id": "gone",
        "remote_block_ids": [0, 1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "never-saved",
    }
    with LLM(
        str(tmp_path), kv_cache_memory=8 << 20, kv_transfer_config=CONSUMER, **ENGINE
    ) as decode:
        attach(decode, InMemoryFabric())
        moved = SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, kv_transfer_params=nowhere
        )
        [failed] = decode.generate([prompt], moved, use_tqdm=False)
        assert "loading its KV cache failed: no producer engine 'gone'" in failed.error
        [again] = tokens(decode.generate([prompt], params, use_tqdm=False))
        assert decode.stats().prefix_cache_hit_tokens == 0
        decode.engine.check_integrity()
    assert again == expected


def test_kv_transfer_params_are_refused_where_they_cannot_be_honoured(tmp_path):
    save_hf_model("llama", tmp_path)
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as plain:
        with pytest.raises(ValueError, match="do_remote_decode needs a server started with"):
            plain.generate([[1, 2, 3]], HANDOFF, use_tqdm=False)
    with LLM(
        str(tmp_path), kv_cache_memory=8 << 20, kv_transfer_config=CONSUMER, **ENGINE
    ) as decode:
        with pytest.raises(ValueError, match="do_remote_decode is not for a kv_consumer"):
            decode.generate([[1, 2, 3]], HANDOFF, use_tqdm=False)
        remote = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_block_ids": [0],
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "remote_request_id": "r",
        }
        n2 = SamplingParams(n=2, max_tokens=2, kv_transfer_params=remote)
        with pytest.raises(ValueError, match="one sequence per request"):
            decode.generate([[1, 2, 3]], n2, use_tqdm=False)
    with pytest.raises(ValueError, match="kv_port: a producer needs a fixed port"):
        LLM(str(tmp_path), kv_transfer_config={**PRODUCER, "kv_port": 0}, **ENGINE)
    with pytest.raises(ValueError, match="one rank per instance"):
        LLM(str(tmp_path), tensor_parallel_size=2, kv_transfer_config=CONSUMER, **ENGINE)


@pytest.mark.timeout(120)
def test_kv_both_instances_hand_prompts_to_each_other(tmp_path):
    """`kv_both`: each engine prefills for the other and decodes for it."""
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        expected = tokens(lone.generate(PROMPTS[:3], params, use_tqdm=False))
    both = {"kv_connector": "PagedServeConnector", "kv_role": "kv_both", "kv_port": 1}
    fabric = InMemoryFabric()
    with (
        LLM(str(tmp_path), kv_cache_memory=8 << 20, kv_transfer_config=both, **ENGINE) as a,
        LLM(str(tmp_path), kv_cache_memory=8 << 20, kv_transfer_config=both, **ENGINE) as b,
    ):
        attach(a, fabric)
        attach(b, fabric)
        for first, second in ((a, b), (b, a)):
            handoffs = first.generate(PROMPTS[:3], HANDOFF, use_tqdm=False)
            moved = [decode_params(h, params) for h in handoffs]
            assert tokens(second.generate(PROMPTS[:3], moved, use_tqdm=False)) == expected


class HeldConnector:
    """An in-memory connector whose fetched payloads arrive only once `release()` is
    called: until then nothing is written and `poll` reports nothing, as over a slow
    link."""

    def __init__(self, inner: InMemoryConnector) -> None:
        self.inner = inner
        self.on_the_way: list[tuple] = []
        self.arrive = inner.endpoint.arrived
        inner.endpoint.arrived = lambda *payload: self.on_the_way.append(payload)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def release(self) -> None:
        for payload in self.on_the_way:
            self.arrive(*payload)
        self.on_the_way.clear()


def hold_loads(llm: LLM) -> HeldConnector:
    """The engine's loads, held on their way until `release()`."""
    steps = llm.engine.worker.kv_transfer
    steps.connector = HeldConnector(steps.connector)
    return steps.connector


@pytest.mark.timeout(180)
@pytest.mark.parametrize("depth", [1, 2])
def test_other_requests_decode_while_a_prompt_kv_is_on_its_way(depth, tmp_path):
    """The load runs beside the steps: a running request keeps decoding while another
    waits for its KV (counted as waiting), which then decodes as one engine would."""
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    busy, moved_prompt = PROMPTS[4], PROMPTS[5]
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        expected = tokens(lone.generate([busy, moved_prompt], params, use_tqdm=False))
    with handoff_pair(tmp_path, pipeline_depth=depth) as (prefill, decode):
        held = hold_loads(decode)
        [handoff] = prefill.generate([moved_prompt], HANDOFF, use_tqdm=False)
        engine, scheduler = decode.engine, decode.engine.core.scheduler
        engine.add_request("busy", busy, params)
        engine.add_request("moved", moved_prompt, decode_params(handoff, params))
        done = {}
        for _ in range(6):
            done.update({o.request_id: o for o in engine.step()})
        assert "moved" in scheduler.loading
        assert decode.stats().num_waiting == 1
        assert scheduler.requests["busy"].num_computed_tokens > len(busy) + 3  # it went on
        held.release()
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step()})
        engine.flush()
        stats = decode.stats()
        decode.engine.check_integrity()
    assert [list(done[r].outputs[0].token_ids) for r in ("busy", "moved")] == expected
    assert stats.kv_transfer_loaded_tokens == len(moved_prompt)
    assert stats.num_prompt_tokens_computed == len(busy)


@pytest.mark.timeout(180)
def test_a_request_aborted_while_its_kv_is_on_its_way_writes_nothing(tmp_path):
    """Its blocks go back at once; the KV that arrives later is dropped, not written
    over the blocks another request took meanwhile."""
    save_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), kv_cache_memory=8 << 20, **ENGINE) as lone:
        [expected] = tokens(lone.generate([PROMPTS[5]], params, use_tqdm=False))
        per_block = lone.engine.worker.runner._block_bytes()
    # 8 blocks: the next request needs 7 of them, so it reuses the freed ones
    with handoff_pair(tmp_path, 9 * per_block, max_model_len=32) as (prefill, decode):
        held = hold_loads(decode)
        [handoff] = prefill.generate([PROMPTS[4]], HANDOFF, use_tqdm=False)
        engine, blocks = decode.engine, decode.engine.core.blocks
        engine.add_request("moved", PROMPTS[4], decode_params(handoff, params))
        engine.step()
        taken = set(blocks.block_table("moved"))
        engine.abort_request("moved")
        engine.add_request("next", PROMPTS[5], params)
        done = {}
        while not taken & set(blocks.block_table("next")):  # until it takes a freed block
            done.update({o.request_id: o for o in engine.step()})
            assert "next" not in done
        held.release()  # the producer's KV arrives now, for a request that is gone
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step()})
        engine.flush()
        decode.engine.check_integrity()
    assert list(done["next"].outputs[0].token_ids) == expected
