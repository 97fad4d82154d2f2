"""ReplicaSet end to end: two data-parallel replicas of the built-in model (two worker
processes). Chats stay on the replica of their first turn and hit its prefix cache;
independent requests split evenly; a replica that fails its start, or later, takes
the set down cleanly."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio

from actors.actor import ActorStartupError
from actors.engine_status import EngineStatus
from actors.replica_launch import launch_replicas
from actors.replica_set import ReplicaSet
from engine.engine_args import EngineArgs
from engine.sampling_params import SamplingParams
from engine.worker.builtin_model import builtin_model_dir
from tests.eventually import eventually

ARGS = dict(kv_cache_memory=8 << 20, max_num_seqs=32, block_size=4)
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
REPLY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
pytestmark = pytest.mark.asyncio(loop_scope="module")  # the replicas' actors live on it


def engine_args() -> EngineArgs:
    return EngineArgs(model=str(builtin_model_dir()), **ARGS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas():
    replicas = await ReplicaSet.start(engine_args(), 2)
    yield replicas
    await replicas.shutdown()


async def run(replicas: ReplicaSet, prompt, params, rid: str) -> tuple[str, int, str]:
    """The request's text, the replica that served it, and its finish reason."""
    text, replica, reason = "", None, None
    async for out in replicas.generate(prompt, params, rid):
        replica = replicas.replica_of(rid) if replica is None else replica
        text, reason = text + out.text, out.finish_reason or reason
    return text, replica, reason


def hits(replicas: ReplicaSet) -> list[tuple[int, int]]:
    """(prefix-cache hit tokens, queried tokens) of each replica so far."""
    stats = [r.stats() for r in replicas.replicas]
    return [(s.prefix_cache_hit_tokens, s.prefix_cache_queried_tokens) for s in stats]


@pytest.mark.timeout(120)
async def test_chat_turns_stay_on_their_first_replica_and_hit_its_prefix_cache(replicas):
    """Four chats, three turns each (every turn: the earlier messages, the reply, a new
    user message), each turn of all four at once, sent in a new order each turn (so that
    alternating alone would move them). Every chat's turns land on the replica of its
    first turn, two chats per replica, and from turn 2 on most of each prompt is found
    in that replica's prefix cache (the shared system prompt alone is a quarter)."""
    chats = {
        c: [SYSTEM, {"role": "user", "content": f"Chat {c} asks: " + "why is the sky blue? " * 3}]
        for c in range(4)
    }
    placed: dict[int, list[int]] = {c: [] for c in chats}
    for turn in range(3):
        before = hits(replicas)
        order = [(c + turn) % len(chats) for c in chats]
        results = await asyncio.gather(
            *(run(replicas, chats[c], REPLY, f"chat{c}-turn{turn}") for c in order)
        )
        after = hits(replicas)
        for c, (text, replica, reason) in zip(order, results, strict=True):
            assert reason == "length"
            placed[c].append(replica)
            follow_up = {"role": "user", "content": f"And then, in chat {c}, turn {turn + 1}?"}
            chats[c] = [*chats[c], {"role": "assistant", "content": text}, follow_up]
        if turn > 0:
            for r in range(2):
                hit = after[r][0] - before[r][0]
                queried = after[r][1] - before[r][1]
                assert hit > 0.5 * queried, f"turn {turn}, replica {r}: {hit}/{queried} hit"
    assert all(len(set(p)) == 1 for p in placed.values()), placed
    assert sorted(p[0] for p in placed.values()) == [0, 0, 1, 1]
    assert replicas.loads == [0, 0]


@pytest.mark.timeout(120)
async def test_independent_requests_split_evenly_over_the_replicas(replicas):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [f"{i}: an unrelated prompt of its own" for i in range(16)]
    results = await asyncio.gather(
        *(run(replicas, p, params, f"independent-{i}") for i, p in enumerate(prompts))
    )
    served = [replica for _, replica, _ in results]
    assert served.count(0) == served.count(1) == 8
    assert all(reason == "length" for _, _, reason in results)
    assert replicas.loads == [0, 0] and replicas.replica_of("independent-0") is None


@pytest.mark.timeout(120)
async def test_abort_reaches_the_replica_that_has_the_request(replicas):
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    outs = replicas.generate("a long story", long, "to-abort")
    first = await anext(outs)
    assert not first.finish_reason and replicas.replica_of("to-abort") is not None
    await replicas.abort("to-abort")
    await replicas.abort("never-sent")  # unknown: ignored
    rest = [out async for out in outs]
    assert rest[-1].finish_reason == "abort"
    assert replicas.replica_of("to-abort") is None

    def all_free() -> bool:
        s = replicas.stats()
        return s.num_free_blocks == s.num_blocks and not s.num_running

    await eventually(all_free, 10, "every block of every replica free")


@pytest.mark.timeout(120)
async def test_the_set_answers_like_one_engine(replicas):
    """Tokenizing, stats summed over the replicas, health, the start-up values."""
    tokens = await replicas.tokenize("hi")
    assert (await replicas.detokenize(tokens.token_ids)).text.endswith("hi")
    assert await replicas.count_prompt_tokens([{"role": "user", "content": "hi"}]) > 2
    per_replica = [r.stats() for r in replicas.replicas]
    merged = replicas.stats()
    assert merged.num_blocks == sum(s.num_blocks for s in per_replica) > 0
    assert merged.num_steps == sum(s.num_steps for s in per_replica)
    assert replicas.is_healthy and replicas.error is None
    assert replicas.ready.max_model_len == replicas.replicas[1].ready.max_model_len
    assert replicas.watch_stats().num_timed_out == 0
    first = replicas.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
    await anext(first)
    with pytest.raises(ValueError, match="already in flight"):
        await anext(replicas.generate("y", None, "dup"))
    await first.aclose()  # leaving early aborts it
    for bad in ([[1, 2]], [{"role": "user"}, 5], [1, "x"]):  # refused as one engine does
        with pytest.raises(ValueError, match="prompt must be"):
            await anext(replicas.generate(bad, None))
    assert replicas.loads == [0, 0]


@pytest.mark.timeout(120)
async def test_a_replica_that_fails_its_start_fails_the_whole_start_cleanly():
    """Replica 1's worker dies before it is ready: the start fails at once with its error,
    naming the replica, and replica 0's worker (still loading) is stopped too."""
    args = engine_args()
    launches = launch_replicas(args, 2, "cpu")
    launches[1].process.kill()
    with pytest.raises(ActorStartupError, match="exited with code") as failure:
        await ReplicaSet.start(args, 2, launches=launches)
    assert "replica 1 of 2" in " ".join(failure.value.__notes__)
    for launch in launches:
        assert launch.process.poll() is not None
        assert not os.path.exists(launch.run_dir)


@pytest.mark.timeout(120)
async def test_a_replica_that_dies_leaves_the_set_degraded_and_shutdown_leaves_nothing():
    """Without restarts, a dead replica stays down: the set serves on the other one
    (DEGRADED, still healthy), and only when none serves is it unhealthy."""
    replicas = await ReplicaSet.start(engine_args(), 2)
    workers = [r.engine.launch.process for r in replicas.replicas]
    run_dirs = [r.engine.launch.run_dir for r in replicas.replicas]
    try:
        os.kill(workers[1].pid, signal.SIGKILL)
        await eventually(lambda: not replicas.replicas[1].is_healthy, 10, "replica 1 down")
        assert replicas.status is EngineStatus.DEGRADED and replicas.is_healthy
        assert replicas.replicas[1].error.startswith("worker process 0 exited")
        with pytest.raises(RuntimeError, match="not healthy"):
            async for _ in replicas.replicas[1].generate("hi", REPLY, "after-death"):
                pass
        _, replica, reason = await run(replicas, "hi", REPLY, "routed-around")
        assert (replica, reason) == (0, "length")
        os.kill(workers[0].pid, signal.SIGKILL)
        await eventually(lambda: not replicas.is_healthy, 10, "the set unhealthy")
        assert replicas.status is EngineStatus.UNHEALTHY
        assert replicas.error.startswith("replica 0: worker process 0 exited")
    finally:
        await replicas.shutdown()
    assert all(w.poll() is not None for w in workers)
    assert not any(os.path.exists(d) for d in run_dirs)
