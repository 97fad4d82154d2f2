"""The msgpack codec: every message round-trips; field order is pinned; bad frames are
rejected with DecodeError (never an exception of another kind)."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from engine import messages as m
from engine.codec import DecodeError, InboxDecoder, encode
from engine.kv_transfer.params import KVTransferParams
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams

ROW = (m.TokenLogprob(42, -0.25, 1, None), m.TokenLogprob(7, -1.5, 2, None))
DECODED = (m.TokenLogprob(12, -0.5, 3, " once"),)
PARAMS = SamplingParams(temperature=0.7, top_p=0.9, stop=["\n\n"], logit_bias={5: -2.0}, seed=3)

SAMPLES = [
    m.GenerateRequest(
        request_id="r1",
        client_id="c1",
        prompt="hello",
        prompt_token_ids=None,
        messages=None,
        params=PARAMS,
    ),
    m.GenerateRequest(
        request_id="r2",
        client_id="c1",
        prompt=None,
        prompt_token_ids=(1, 2, 3),
        messages=None,
        params=SamplingParams(),
    ),
    m.GenerateRequest(
        request_id="r3",
        client_id="c2",
        prompt=None,
        prompt_token_ids=None,
        messages=(m.ChatMessage("user", "hi"),),
        params=PARAMS,
    ),
    m.GenerateRequest(
        request_id="r4",
        client_id="c2",
        prompt="pick",
        prompt_token_ids=None,
        messages=None,
        params=SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
    ),
    m.GenerateRequest.of(
        "r6",
        "c2",
        m.ChatPrompt.of(
            [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            ],
            tools=[{"type": "function", "function": {"name": "get_weather"}}],
            chat_template_kwargs={"enable_thinking": False},
        ),
        SamplingParams(),
    ),
    m.AddRequest(
        "r5",
        (1, 2),
        SamplingParams(structured_outputs={"json": {"type": "object"}}),
        2.0,
    ),
    m.AbortRequest("r1"),
    m.Shutdown("test"),
    m.TokenDeltas(
        step_id=7,
        request_ids=("r1", "r2"),
        token_ids=(4, 9),
        finished=(m.RequestFinish("r2", "stop", 9),),
        logprobs=(),
        prompt_logprobs=(),
    ),
    m.AddRequest("r1", (1, 2), PARAMS, 1.5),
    m.StepResult(
        step_id=3,
        worker_id=0,
        sampled_ids=("r1", "r2"),
        sampled_token_ids=(42, 7),
        logprobs=(),
        prompt_logprobs=(),
        error=None,
        busy_seconds=0.01,
    ),
    m.StepResult(
        step_id=4,
        worker_id=1,
        sampled_ids=(),
        sampled_token_ids=(),
        logprobs=(),
        prompt_logprobs=(),
        error="worker crashed",
        busy_seconds=0.0,
    ),
    m.StepResult(
        step_id=5,
        worker_id=0,
        sampled_ids=("r1",),
        sampled_token_ids=(42,),
        logprobs=(m.RequestLogprobs("r1", (ROW,)),),
        prompt_logprobs=(m.RequestLogprobs("r1", (ROW, ROW)),),
        error=None,
        busy_seconds=0.5,
    ),
    m.TokenDeltas(
        step_id=8,
        request_ids=("r1",),
        token_ids=(42,),
        finished=(m.RequestFinish("r1", "length", None),),
        logprobs=(m.RequestLogprobs("r1", (ROW,)),),
        prompt_logprobs=(m.RequestLogprobs("r1", (ROW, ROW)),),
    ),
    m.TokenDeltas(  # a prefill instance's answer: where the prompt's KV waits
        step_id=8,
        request_ids=("r1",),
        token_ids=(42,),
        finished=(
            m.RequestFinish(
                "r1",
                "length",
                None,
                KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id="prefill-0",
                    remote_block_ids=(3, 4),
                    remote_host="10.0.0.5",
                    remote_port=14579,
                    remote_request_id="r1",
                ),
            ),
        ),
        logprobs=(),
        prompt_logprobs=(),
    ),
    m.TokenDeltas(  # a beam search's ranked outputs
        step_id=9,
        request_ids=(),
        token_ids=(),
        finished=(),
        logprobs=(),
        prompt_logprobs=(m.RequestLogprobs("b1", (ROW,)),),
        ranked=(
            m.RankedSequence(
                request_id="b1",
                index=0,
                token_ids=(5, 6, 2),
                finish_reason="stop",
                cumulative_logprob=-1.5,
                score=-0.5,
            ),
            m.RankedSequence(
                request_id="b1",
                index=1,
                token_ids=(5, 7, 8),
                finish_reason="length",
                cumulative_logprob=-2.25,
                score=-0.75,
            ),
        ),
    ),
    m.WorkerReady(
        worker_id=0, num_blocks=1024, block_size=16, max_model_len=2048, vocab_size=32000
    ),
    m.WorkerReady(
        worker_id=0,
        num_blocks=1024,
        block_size=16,
        max_model_len=2048,
        vocab_size=32000,
        num_cpu_blocks=8,
        attention_backend="native",
        attention_backend_reason="native CPU kernels loaded",
        weights_bytes=98 << 20,
        kv_cache_bytes=2 << 30,
        kv_cache_dtype="bfloat16",
        quantization="gguf",
    ),
    m.BlockOpsApplied(2, (3, 4), 17, 5, None),
    m.ApplyBlockOps(
        2, (m.BlockOp("grow", "r1", 40), m.BlockOp("match", "r2", 0, "", (-(2**63), 2**63 - 1)))
    ),
    m.StepPlan(
        step_id=5,
        new_requests=(
            m.NewRequestData(
                request_id="r1",
                prompt_token_ids=(1, 2, 3),
                params=PARAMS,
                block_ids=(0, 1),
                num_computed_tokens=0,
            ),
            m.NewRequestData(  # a forked beam
                request_id="b1#2",
                prompt_token_ids=(1, 2, 3),
                params=PARAMS,
                block_ids=(0, 4),
                num_computed_tokens=4,
                output_token_ids=(7,),
            ),
        ),
        cached_requests=(
            m.CachedRequestData(
                request_id="r0",
                new_block_ids=(9,),
                num_computed_tokens=17,
                resumed_from_preemption=False,
            ),
            m.CachedRequestData(  # chosen token, CoW'd block
                request_id="b1#0",
                new_block_ids=(8,),
                num_computed_tokens=4,
                resumed_from_preemption=False,
                last_token_id=11,
                first_block_index=1,
            ),
        ),
        scheduled_ids=("r1", "b1#2", "r0", "b1#0"),
        num_scheduled_tokens=(3, 1, 1, 1),
        finished_ids=("r9",),
        grammars=(StructuredOutputsParams(regex="[a-z]+"),),
    ),
    m.PrepareGrammar(StructuredOutputsParams(json={"type": "object"})),
    m.OutputDelta(
        request_id="r1",
        text=" once",
        token_ids=(12,),
        finish_reason=None,
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=1,
        error=None,
    ),
    m.OutputDelta(
        request_id="r1",
        text=" once",
        token_ids=(12,),
        finish_reason="stop",
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=1,
        error=None,
        logprobs=(DECODED,),
        prompt_logprobs=(),
    ),
    m.OutputDelta.failed("r1", "ValueError: bad", m.ErrorKind.INVALID),
    m.RequestFailed("r1", "TypeError: cannot encode"),
    m.StepResult(
        step_id=6,
        worker_id=0,
        sampled_ids=("r2",),
        sampled_token_ids=(5,),
        logprobs=(),
        prompt_logprobs=(),
        error=None,
        busy_seconds=0.1,
        failed=(m.RequestFailed("r1", "boom"),),
    ),
    m.WorkerHeartbeat(0, 12345.5),
    m.GenerateRequest(
        request_id="r4",
        client_id="c1",
        prompt="hello",
        prompt_token_ids=None,
        messages=None,
        params=PARAMS,
        strict_max_tokens=True,
    ),
    m.TokenizeRequest.of_prompt("t1", "c1", "hello", add_special_tokens=False),
    m.TokenizeRequest.of_chat(
        "t2", "c1", (m.ChatMessage("user", "hi"),), add_generation_prompt=False
    ),
    m.DetokenizeRequest("t3", "c1", (1, 2, 3)),
    m.DetokenizeRequest("t4", "c1", (1, 2, 3), True),
    m.TokenizeResult(request_id="t1", token_ids=(1, 2), token_strs=("he", "llo"), text=""),
    m.TokenizeResult.refused("t3", "tokens: token ids must be in [0, 512)", m.ErrorKind.INVALID),
]

# The wire format: field names in order. Changing this table means a protocol change.
FIELD_ORDER = {
    "ChatMessage": ["role", "content", "tool_calls", "tool_call_id", "name"],
    "ChatToolCall": ["id", "name", "arguments"],
    "ChatTemplateArgs": ["tools_json", "kwargs_json"],
    "ChatPrompt": ["messages", "template_args"],
    "AbortRequest": ["request_id"],
    "Shutdown": ["reason"],
    "GenerateRequest": [
        "request_id",
        "client_id",
        "prompt",
        "prompt_token_ids",
        "messages",
        "params",
        "strict_max_tokens",
        "template_args",
    ],
    "TokenizeRequest": [
        "request_id",
        "client_id",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "template_args",
    ],
    "DetokenizeRequest": ["request_id", "client_id", "token_ids", "skip_special_tokens"],
    "TokenizeResult": ["request_id", "token_ids", "token_strs", "text", "error", "error_kind"],
    "TokenLogprob": ["token_id", "logprob", "rank", "decoded_token"],
    "TokenDelta": [
        "request_id",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "logprobs",
        "prompt_logprobs",
        "kv_transfer_params",
    ],
    "RequestFinish": ["request_id", "finish_reason", "stop_reason", "kv_transfer_params"],
    "TokenDeltas": [
        "step_id",
        "request_ids",
        "token_ids",
        "finished",
        "logprobs",
        "prompt_logprobs",
        "ranked",
    ],
    "RankedSequence": [
        "request_id",
        "index",
        "token_ids",
        "finish_reason",
        "cumulative_logprob",
        "score",
    ],
    "AddRequest": ["request_id", "prompt_token_ids", "params", "arrival_time"],
    "RequestLogprobs": ["request_id", "rows"],
    "StepResult": [
        "step_id",
        "worker_id",
        "sampled_ids",
        "sampled_token_ids",
        "logprobs",
        "prompt_logprobs",
        "error",
        "busy_seconds",
        "failed",
        "drafts",
        "loaded_ids",
    ],
    "DraftCount": ["request_id", "num_drafts", "num_accepted"],
    "RequestFailed": ["request_id", "error"],
    "WorkerHeartbeat": ["worker_id", "sent_at", "expert_load"],
    "WorkerReady": [
        "worker_id",
        "num_blocks",
        "block_size",
        "max_model_len",
        "vocab_size",
        "num_cpu_blocks",
        "attention_backend",
        "attention_backend_reason",
        "weights_bytes",
        "kv_cache_bytes",
        "kv_cache_dtype",
        "quantization",
    ],
    "BlockOpsApplied": [
        "exchange_id",
        "block_ids",
        "num_free_blocks",
        "num_cached_blocks",
        "error",
    ],
    "BlockOp": ["kind", "seq_id", "num", "parent_id", "hashes"],
    "ApplyBlockOps": ["exchange_id", "ops"],
    "NewRequestData": [
        "request_id",
        "prompt_token_ids",
        "params",
        "block_ids",
        "num_computed_tokens",
        "output_token_ids",
    ],
    "CachedRequestData": [
        "request_id",
        "new_block_ids",
        "num_computed_tokens",
        "resumed_from_preemption",
        "last_token_id",
        "first_block_index",
        "num_lookahead_tokens",
    ],
    "StepPlan": [
        "step_id",
        "new_requests",
        "cached_requests",
        "scheduled_ids",
        "num_scheduled_tokens",
        "finished_ids",
        "copy_src",
        "copy_dst",
        "swap_out_src",
        "swap_out_dst",
        "swap_in_src",
        "swap_in_dst",
        "grammars",
        "num_lookahead_tokens",
        "load_ids",
    ],
    "PrepareGrammar": ["params"],
    "OutputDelta": [
        "request_id",
        "text",
        "token_ids",
        "finish_reason",
        "stop_reason",
        "num_prompt_tokens",
        "num_output_tokens",
        "error",
        "logprobs",
        "prompt_logprobs",
        "index",
        "error_kind",
        "kv_transfer_params",
    ],
    "SamplingParams": [
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "logit_bias",
        "best_of",
        "use_beam_search",
        "length_penalty",
        "early_stopping",
        "structured_outputs",
        "kv_transfer_params",
    ],
    "KVTransferParams": [
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
    ],
    "StructuredOutputsParams": [
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "disable_any_whitespace",
        "disable_additional_properties",
        "structural_tag",
    ],
}


def _inbox_of(message) -> InboxDecoder:
    for types in m.INBOXES.values():
        if type(message) in types:
            return InboxDecoder(types)
    raise AssertionError(f"{type(message).__name__} belongs to no inbox")


@pytest.mark.parametrize("message", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(message):
    assert _inbox_of(message).decode(encode(message)) == message


def test_every_inbox_message_has_a_sample():
    sampled = {type(s) for s in SAMPLES}
    for types in m.INBOXES.values():
        assert set(types) <= sampled


def test_field_order_is_pinned():
    classes = {
        cls.__name__: cls
        for cls in vars(m).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls)
    }
    classes["SamplingParams"] = SamplingParams
    classes["StructuredOutputsParams"] = StructuredOutputsParams
    classes["KVTransferParams"] = KVTransferParams
    assert set(classes) == set(FIELD_ORDER)
    for name, cls in classes.items():
        assert [f.name for f in dataclasses.fields(cls)] == FIELD_ORDER[name], name


def test_wrong_inbox_is_rejected():
    decoder = InboxDecoder(m.INBOXES["worker"])
    with pytest.raises(DecodeError, match="not accepted here"):
        decoder.decode(encode(m.AbortRequest("r1")))


def _frame(name, fields):
    return msgpack.packb([name, fields], use_bin_type=True)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "msgpack"),
        (b"\xc1\xff\x00", "msgpack"),
        (msgpack.packb({"a": 1}), "type_name"),
        (msgpack.packb(["AbortRequest"]), "type_name"),
        (_frame("Nope", []), "not accepted"),
        (_frame("AbortRequest", []), "expected 1 fields"),
        (_frame("AbortRequest", [7]), "request_id"),
        (_frame("AddRequest", ["r", [1, "x"], [], 0.0]), "prompt_token_ids"),
        (_frame("AddRequest", ["r", [1, True], [], 0.0]), "prompt_token_ids"),
        (_frame("AddRequest", ["r", [1], [1] * 5, 0.0]), "params"),
        (
            _frame("StepResult", [1, 0, ["r"], [1.5], [], [], None, 0.0, [], [], []]),
            "sampled_token_ids",
        ),
        (
            _frame("StepResult", [1, 0, ["r"], [True], [], [], None, 0.0, [], [], []]),
            "sampled_token_ids",
        ),
        (
            _frame(
                "StepResult",
                [1, 0, [], [], [["r", [[[1, -0.5, "x", None]]]]], [], None, 0.0, [], [], []],
            ),
            "rank",
        ),
        (_frame("StepResult", [1, 0, [], None]), "expected 11 fields"),
    ],
)
def test_garbage_and_wrong_types_are_rejected(frame, reason):
    decoder = InboxDecoder(m.INBOXES["scheduler"])
    with pytest.raises(DecodeError, match=reason):
        decoder.decode(frame)


def test_invalid_sampling_params_are_rejected_by_their_own_validation():
    fields = [getattr(PARAMS, f.name) for f in dataclasses.fields(SamplingParams)]
    fields[4] = -1.0  # temperature
    frame = _frame(
        "AddRequest", ["r", [1], [list(x) if isinstance(x, tuple) else x for x in fields], 0.0]
    )
    with pytest.raises(DecodeError, match="temperature"):
        InboxDecoder(m.INBOXES["scheduler"]).decode(frame)


def test_truncated_frames_never_raise_anything_but_decode_error():
    rng = random.Random(0)
    decoder = InboxDecoder(m.INBOXES["worker"])
    frame = encode(SAMPLES[12])
    for cut in range(len(frame)):
        with pytest.raises(DecodeError):
            decoder.decode(frame[:cut])
    for _ in range(300):  # random byte flips: a valid message or a DecodeError
        data = bytearray(frame)
        data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decoder.decode(bytes(data))
        except DecodeError:
            pass
