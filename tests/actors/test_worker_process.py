"""A real worker process driven by StepPlans over ZeroMQ ipc gives the offline outputs."""

from __future__ import annotations

import asyncio
import os
import random
import shutil

import pytest
import zmq
import zmq.asyncio

from actors.actor import await_ready, send_message
from actors.codec import InboxDecoder
from actors.transport import ipc_address, new_run_dir, zmq_inbox, zmq_outbox
from actors.worker_actor import spawn_worker
from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.messages import INBOXES, Shutdown, StepResult, WorkerReady
from engine.model_runner import StepResult as RunnerResult
from engine.scheduler_output import SchedulerOutput
from engine.step_plan_builder import StepPlanBuilder
from tests.engine.tiny_models import SMALL_ENGINE, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-process")
    save_hf_model("llama", directory)
    return str(directory)


async def test_worker_process_matches_offline_engine(model_dir):
    kwargs = {**SMALL_ENGINE, "max_num_batched_tokens": 16}
    args = EngineArgs(model=model_dir, **kwargs)
    rng = random.Random(3)
    prompts = random_prompts(rng, 8)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(8)
    ]
    expected = LLM(model_dir, **kwargs).generate(prompts, params, use_tqdm=False)

    run_dir = new_run_dir()
    ctx = zmq.asyncio.Context()
    sched_address, worker_address = ipc_address(run_dir, "sched"), ipc_address(run_dir, "w0")
    inbox = zmq_inbox(ctx, sched_address)
    proc = spawn_worker(args, worker_address, sched_address, extra_env={"OMP_NUM_THREADS": "1"})
    to_worker = None
    try:
        decoder = InboxDecoder(INBOXES["scheduler"])
        ready, early = await await_ready(
            inbox, decoder, WorkerReady, timeout=120, sender="worker 0"
        )
        assert not early
        engine = LLMEngine(args.build())
        assert ready.num_blocks == engine.scheduler.kv_cache.num_blocks
        to_worker = zmq_outbox(ctx, worker_address)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"offline-{i}", p, sp)
        builder, finished, got = StepPlanBuilder(), [], {}
        while engine.has_unfinished_requests():
            plan = engine.scheduler.schedule()
            await send_message(to_worker, builder.build(plan, finished))
            result = decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=60))
            assert isinstance(result, StepResult) and result.error is None
            assert result.step_id == plan.step_id
            sampled = dict(zip(result.sampled_ids, result.sampled_token_ids, strict=True))
            done = engine._update(plan, RunnerResult(sampled, None, (), {}))
            finished = [o.request_id for o in done]
            got.update({o.request_id: o.outputs[0].token_ids for o in done})
        await send_message(to_worker, builder.build(SchedulerOutput(-1, (), ()), finished))
        await send_message(to_worker, Shutdown("test done"))
        assert proc.wait(timeout=30) == 0
        assert [got[f"offline-{i}"] for i in range(8)] == [o.outputs[0].token_ids for o in expected]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if to_worker is not None:
            to_worker.close()
        inbox.close()
        ctx.term()
    assert not os.path.exists(worker_address.removeprefix("ipc://"))  # worker cleaned up
    shutil.rmtree(run_dir)
