"""The engine's actor graph (scheduler + block manager) and a worker actor over
in-process transports, sync and one step ahead; and a scheduler alone whose block
manager never answers."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.actor import send_message
from actors.engine_graph import EngineGraph
from actors.scheduler_actor import BlockManagerTimeout, SchedulerActor
from actors.transport import inproc_pair
from actors.worker_actor import WorkerActor
from engine import LLM, SamplingParams
from engine.codec import InboxDecoder
from engine.config import SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.engine_args import EngineArgs
from engine.kv.block_ledger import BlockLedger
from engine.messages import INBOXES, AbortRequest, AddRequest, TokenDeltas
from engine.wiring import build_engine
from engine.worker.worker import build_worker
from tests.engine.tiny_models import SMALL_ENGINE, random_prompts, save_hf_model
from tests.eventually import eventually


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-sched")
    save_hf_model("llama", directory)
    return str(directory)


async def _collect(inbox, want: set[str]) -> dict[str, tuple[list[int], str]]:
    decoder, got = InboxDecoder(INBOXES["tokenizer"]), {}
    done: set[str] = set()
    while done != want:
        message = decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=30))
        assert isinstance(message, TokenDeltas)
        for d in message.deltas():
            tokens, _ = got.get(d.request_id, ([], None))
            got[d.request_id] = (tokens + list(d.token_ids), d.finish_reason)
            if d.finish_reason:
                done.add(d.request_id)
    return got


@pytest.mark.parametrize("depth", [1, 2])
async def test_actors_reproduce_offline_outputs_and_free_every_block(model_dir, depth):
    kwargs = {**SMALL_ENGINE, "max_num_batched_tokens": 24}
    args = EngineArgs(model=model_dir, **kwargs)
    rng = random.Random(21)
    prompts = random_prompts(rng, 12)
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=15, ignore_eos=True)
        for i in range(12)
    ]
    expected = LLM(model_dir, **kwargs).generate(prompts, params, use_tqdm=False)

    config = args.build()
    worker, ready = build_worker(args, 0, config)
    parts = build_engine(config, ready, with_block_manager=True)
    core, blocks = parts.core, parts.block_manager
    to_sched, sched_inbox = inproc_pair()
    to_worker, worker_inbox = inproc_pair()
    worker_actor = WorkerActor(worker, worker_inbox, to_sched)
    graph = EngineGraph(core, blocks, sched_inbox, [to_worker], pipeline_depth=depth)
    scheduler = graph.scheduler
    await worker_actor.start()
    await graph.start()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        await send_message(to_sched, AddRequest(f"r{i}", tuple(p), sp, 0.0))
    await send_message(
        to_sched,
        AddRequest(
            "aborted", tuple(prompts[0]), SamplingParams(max_tokens=40, ignore_eos=True), 0.0
        ),
    )
    await send_message(to_sched, AbortRequest("aborted"))
    got = await _collect(graph.tokenizer_inbox, {f"r{i}" for i in range(12)})
    assert [got[f"r{i}"][0] for i in range(12)] == [o.outputs[0].token_ids for o in expected]
    assert all(got[f"r{i}"][1] == "length" for i in range(12))
    await eventually(lambda: scheduler.in_flight == 0, 5, "the last results back")
    core.scheduler.check_integrity()
    blocks.check_integrity()
    assert blocks.num_free_blocks == ready.num_blocks
    # One exchange per step at most (decode steps inside their blocks need none), plus
    # the frees of requests that ended between steps.
    assert 0 < blocks.num_exchanges == scheduler.num_exchanges
    await graph.stop()
    await worker_actor.stop()
    assert scheduler.num_errors == 0 and worker_actor.num_errors == 0


async def test_a_silent_block_manager_stops_the_scheduler_instead_of_hanging():
    core = EngineCore(SchedulerConfig(4, 32, 64), BlockLedger(8, 4), frozenset())
    to_sched, sched_inbox = inproc_pair()
    to_worker, _worker_inbox = inproc_pair()
    to_tok, _tok_inbox = inproc_pair()
    to_blocks, _blocks_inbox = inproc_pair()  # nobody answers
    _replies_out, replies_inbox = inproc_pair()
    scheduler = SchedulerActor(
        core, sched_inbox, [to_worker], to_tok, to_blocks, replies_inbox, reply_timeout=0.2
    )
    await scheduler.start()
    await send_message(to_sched, AddRequest("r", (1, 2, 3), SamplingParams(max_tokens=2), 0.0))
    await eventually(lambda: not scheduler.is_alive, 5, "the scheduler stopped")
    assert isinstance(scheduler.crash, BlockManagerTimeout)
    await scheduler.stop()
