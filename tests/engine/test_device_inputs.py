"""GPU-native input preparation (engine/worker/device_inputs.py) against the host batch
builder on random step sequences: requests arrive, compute prompts in chunks, decode,
verify drafts, get new blocks, have a table rewritten from a block on (copy-on-write)
or trimmed, are preempted (a new table, computed again), have their newest token
replaced (a beam search's choice), finish and free their slots for new ones. Every
field of the model input must be the host builder's. The Triton kernel runs under the
interpreter here (tests/conftest.py), compiled on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import ModelInput, build_model_input
from engine.worker.worker_request import WorkerRequest

pytest.importorskip("triton", reason="triton is not installed (bash .ci/setup installs it)")
from cuda_ext.triton_kernels.kernel import interpreting  # noqa: E402
from engine.worker.device_inputs import DeviceInputBatch  # noqa: E402

pytestmark = pytest.mark.timeout(120)
DEVICE = "cpu" if interpreting() else "cuda"
MAX_LEN, BLOCK = 96, 4


class Simulation:
    """Live requests with their tables, driven step by step by `rng`."""

    def __init__(self, rng: random.Random, groups: int) -> None:
        self.rng, self.groups = rng, groups
        self.live: dict[str, tuple[WorkerRequest, list[int]]] = {}
        self.count = 0

    def add(self) -> None:
        self.count += 1
        rid = f"r{self.count}"
        prompt = [self.rng.randrange(1, 1000) for _ in range(self.rng.randint(1, 40))]
        logprobs = 1 if self.rng.random() < 0.2 else None
        params = SamplingParams(max_tokens=MAX_LEN, prompt_logprobs=logprobs)
        self.live[rid] = (WorkerRequest(rid, prompt, params, frozenset(), [], 0), [])

    def block(self) -> int:
        return self.rng.randrange(1, 10_000)

    def plan(self) -> list[ScheduledRequest]:
        rows = []
        for request, table in self.live.values():
            known = request.num_tokens
            if request.num_computed_tokens >= known or self.rng.random() < 0.2:
                continue  # waiting this step
            computed = request.num_computed_tokens
            n = min(known - computed, self.rng.choice([1, 3, 8, 64]))
            if computed + 1 == known and self.rng.random() < 0.4:
                room = MAX_LEN - known
                request.draft_token_ids = [self.rng.randrange(1, 1000)] * min(3, room)
                n += len(request.draft_token_ids)
            need = -(-(computed + n) // BLOCK) * self.groups
            table += [self.block() for _ in range(need - len(table))]
            if len(table) > self.groups and self.rng.random() < 0.1:  # copy-on-write
                table[-1] = self.block()
            rows.append(ScheduledRequest(request, computed, n, list(table)))
        return rows

    def advance(self, rows: list[ScheduledRequest]) -> list[str]:
        """Results: each row computes its tokens (drafts rejected), samples; then some
        requests finish, are preempted, have a token replaced or a table trimmed."""
        for row in rows:
            request = row.request
            request.num_computed_tokens += row.num_scheduled_tokens - len(request.draft_token_ids)
            request.draft_token_ids = []
            if row.samples and request.num_tokens < MAX_LEN:
                request.output_token_ids.append(self.rng.randrange(1, 1000))
        ended = []
        for rid, (request, table) in list(self.live.items()):
            roll = self.rng.random()
            if roll < 0.08 or request.num_tokens >= MAX_LEN:
                ended.append(rid)
                del self.live[rid]
            elif roll < 0.12:  # preempted: recomputed on a new table
                request.num_computed_tokens = 0
                table[:] = []
            elif roll < 0.16 and request.output_token_ids:
                request.output_token_ids[-1] = self.rng.randrange(1, 1000)
                request.num_computed_tokens = min(
                    request.num_computed_tokens, request.num_tokens - 1
                )
            elif roll < 0.2 and len(table) > 2 * self.groups:  # trimmed slack
                keep = -(-request.num_computed_tokens // BLOCK) * self.groups
                del table[max(keep, self.groups) :]
        return ended


def assert_same(host: ModelInput, device: ModelInput, groups: int) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(device, name).cpu(), getattr(host, name)), name
    assert device.rows == host.rows and device.sample_rows == host.sample_rows
    assert device.num_drafts == host.num_drafts
    assert device.prompt_logprob_spans == host.prompt_logprob_spans
    pairs = (
        zip(host.metadata.groups, device.metadata.groups, strict=True)
        if groups > 1
        else [(host.metadata, device.metadata)]
    )
    for h, d in pairs:
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(d, name).cpu(), getattr(h, name)), name
        for name in ("query_lens_cpu", "seq_lens_cpu", "num_decodes", "block_size"):
            assert getattr(d, name) == getattr(h, name), name


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_device_inputs_equal_the_host_builders_step_after_step(seed, groups):
    rng = random.Random(seed)
    layout = KVCacheLayout.from_windows([None, 8]) if groups == 2 else None
    assert layout is None or layout.num_groups == 2
    builder = DeviceInputBatch(MAX_LEN, 4, BLOCK, DEVICE, layout)  # 4 entries: it widens
    sim = Simulation(rng, groups)
    steps = 0
    while steps < 40:
        for _ in range(rng.randint(0, 3)):
            sim.add()
        rows = sim.plan()
        if rows:
            host = build_model_input(rows, BLOCK, "cpu", layout)
            assert_same(host, builder.build(rows), groups)
            steps += 1
        builder.release(sim.advance(rows))
    assert set(builder._slot) <= set(sim.live)  # ended requests gave their slots back


def test_slots_are_reused_and_grow_past_the_first_buffer():
    builder = DeviceInputBatch(MAX_LEN, 8, BLOCK, DEVICE)
    requests = [
        WorkerRequest(f"r{i}", [i + 1, i + 2], SamplingParams(), frozenset(), [], 0)
        for i in range(70)
    ]
    rows = [ScheduledRequest(r, 0, 2, [i]) for i, r in enumerate(requests)]
    batch = builder.build(rows)
    assert builder.num_slots == 128
    assert batch.input_ids.cpu().tolist() == [t for r in requests for t in r.prompt_token_ids]
    builder.release([r.request_id for r in requests[:60]])
    fresh = WorkerRequest("new", [7, 8, 9], SamplingParams(), frozenset(), [], 0)
    rows = [ScheduledRequest(fresh, 0, 3, [3])]
    assert_same(build_model_input(rows, BLOCK, "cpu"), builder.build(rows), 1)
    assert builder.num_slots == 128 and len(builder._slot) == 11


@pytest.mark.timeout(300)
def test_an_engine_on_device_inputs_answers_as_on_host_inputs(tmp_path):
    """Chunked prompts, preemption, prefix hits, n > 1, beams, prompt logprobs,
    penalties and prompt-lookup drafts: the same tokens and logprobs either way."""
    from engine import LLM
    from engine.worker.kv_cache import block_bytes
    from tests.engine.tiny_models import save_hf_model

    save_hf_model("llama", tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 17, 30, 9, 30)]
    prompts.append(prompts[2][:20] + [7, 7, 7, 7, 7, 7])  # a prefix hit, text that repeats
    plain = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    params = [
        plain,
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, n=2, ignore_eos=True),
        SamplingParams(
            max_tokens=8, use_beam_search=True, best_of=2, n=2, temperature=0, ignore_eos=True
        ),
        SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            ignore_eos=True,
        ),
        plain,
    ]
    outputs = {}
    for mode in ("host", "device"):
        probe = LLM(  # a budget of its own: on CUDA the default takes 0.9 of the card
            str(tmp_path),
            skip_tokenizer_init=True,
            block_size=4,
            max_model_len=64,
            kv_cache_memory=1 << 24,
        )
        budget = block_bytes(probe.config.model, 4) * 22  # tight: preemption happens
        llm = LLM(
            str(tmp_path),
            skip_tokenizer_init=True,
            block_size=4,
            max_model_len=64,
            kv_cache_memory=budget,
            max_num_batched_tokens=11,
            input_preparation=mode,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )
        assert (llm.engine.worker.runner.device_inputs is not None) == (mode == "device")
        got = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_integrity()
        outputs[mode] = [
            (
                [list(c.token_ids) for c in o.outputs],
                [c.logprobs for c in o.outputs],
                o.prompt_logprobs,
            )
            for o in got
        ]
        preemptions = llm.stats().num_preemptions
    assert preemptions > 0
    assert outputs["device"] == outputs["host"]


def test_sampling_parameters_kept_per_slot_build_the_same_metadata():
    """Each request's per-row sampling parameters go up once and are gathered per step:
    the sampler's tensors equal the ones built from the rows."""
    from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow

    rng = random.Random(9)
    vocab = 300
    builder = DeviceInputBatch(MAX_LEN, 8, BLOCK, DEVICE)

    def params():
        if rng.random() < 0.3:
            return SamplingParams(temperature=0)
        return SamplingParams(
            temperature=rng.choice([0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 5, 1000]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.1]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, -0.3]),
            seed=rng.choice([None, 4]),
        )

    requests = [
        WorkerRequest(f"r{i}", [1, 2, 3], params(), frozenset(), [4] * i, 0) for i in range(12)
    ]
    for _ in range(5):
        chosen = rng.sample(requests, 7)
        rows = [ScheduledRequest(r, r.num_tokens - 1, 1, [0]) for r in chosen]
        sampling = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids) for r in chosen]
        host = SamplingMetadata.from_rows(sampling, vocab, "cpu")
        table = builder.sampling_table(rows, vocab)
        device = SamplingMetadata.from_rows(sampling, vocab, DEVICE, table=table)
        for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty"):
            assert torch.equal(getattr(device, name).cpu(), getattr(host, name)), name
        for name in ("presence_penalty", "frequency_penalty"):
            assert torch.equal(getattr(device, name).cpu(), getattr(host, name)), name
        assert (device.all_greedy, device.any_top_k, device.any_penalties) == (
            host.all_greedy,
            host.any_top_k,
            host.any_penalties,
        )
        builder.release([chosen[0].request_id])  # its slot is reused with other params


def test_penalty_state_kept_per_slot_counts_as_the_rows_do():
    """Output counts and prompt masks from per-slot state, over steps where outputs
    grow, a newest token is replaced, slots are released and reused, and rows without
    penalties sit beside penalized ones: equal to the tensors built from the rows."""
    from engine.worker.sampling_metadata import SamplingRow, _penalty_tensors, has_penalty

    rng = random.Random(11)
    vocab = 50
    builder = DeviceInputBatch(MAX_LEN, 8, BLOCK, DEVICE)
    live: dict[str, WorkerRequest] = {}
    for step in range(30):
        while len(live) < 6:
            rid = f"r{step}-{len(live)}"
            penalty = rng.choice([1.0, 1.3]), rng.choice([0.0, 0.4]), rng.choice([0.0, 0.2])
            params = SamplingParams(
                repetition_penalty=penalty[0],
                presence_penalty=penalty[1],
                frequency_penalty=penalty[2],
            )
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            live[rid] = WorkerRequest(rid, prompt, params, frozenset(), [], 0)
        chosen = rng.sample(sorted(live), 4)
        rows = [ScheduledRequest(live[r], 0, 1, [0]) for r in chosen]
        penalized = [has_penalty(live[r].params) for r in chosen]
        sampling = [
            SamplingRow(live[r].params, live[r].prompt_token_ids, live[r].output_token_ids)
            for r in chosen
        ]
        want = _penalty_tensors(sampling, penalized, vocab, "cpu")
        got = builder.penalty_tensors(rows, penalized, vocab)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
        for rid in chosen:  # results: a token each; now and then the newest replaced
            outputs = live[rid].output_token_ids
            if outputs and rng.random() < 0.2:
                outputs[-1] = rng.randrange(vocab)
            outputs.append(rng.randrange(vocab))
        for rid in rng.sample(sorted(live), 2):  # two finish: their slots go back
            del live[rid]
            builder.release([rid])


def test_auto_builds_on_the_host():
    from engine import LLM

    llm = LLM("builtin:tiny", skip_tokenizer_init=True, device="cpu")
    assert llm.config.device.input_preparation == "auto"
    assert llm.engine.worker.runner.device_inputs is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a CPU")
def test_device_inputs_on_a_cpu_without_the_interpreter_are_refused_by_name():
    """Compiled Triton kernels need CUDA tensors: the engine says so at start-up rather
    than failing every request."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from engine import LLM\n"
        "try:\n"
        "    LLM('builtin:tiny', skip_tokenizer_init=True, input_preparation='device')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100
    )
    assert "refused: input_preparation='device': the Triton kernels run on CUDA" in out.stdout
