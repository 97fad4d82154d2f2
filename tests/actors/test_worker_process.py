"""A real worker process driven by StepPlans over ZeroMQ ipc gives the in-process worker's
outputs (the offline LLM's)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil

import pytest
import zmq
import zmq.asyncio

from actors.actor import await_ready, send_message
from actors.transport import ipc_address, new_run_dir, zmq_inbox, zmq_outbox
from actors.worker_launch import spawn_worker
from engine import LLM, SamplingParams
from engine.codec import InboxDecoder
from engine.engine_args import EngineArgs
from engine.messages import INBOXES, AddRequest, Shutdown, StepResult, WorkerReady
from engine.wiring import build_engine
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
        core = build_engine(args.build(), ready).core  # block tables in-process
        to_worker = zmq_outbox(ctx, worker_address)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(AddRequest(f"offline-{i}", tuple(p), sp, 0.0))
        got: dict[str, list[int]] = {}
        while core.has_unfinished:
            plan = core.plan()
            await send_message(to_worker, plan)
            result = decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=60))
            assert isinstance(result, StepResult) and result.error is None
            assert result.step_id == plan.step_id
            for delta in core.on_result(result).deltas():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
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
