"""The tokenizer actor over in-process transports, with an in-test tokenizer."""

from __future__ import annotations

import asyncio
import threading

from actors.actor import send_message
from actors.tokenizer_actor import MAX_QUEUED_TOKENIZE, TokenizerActor
from actors.transport import inproc_pair
from engine.codec import InboxDecoder
from engine.messages import (
    INBOXES,
    AbortRequest,
    AddRequest,
    ErrorKind,
    GenerateRequest,
    TokenDeltas,
    TokenizeRequest,
)
from engine.sampling_params import SamplingParams
from engine.text.request_validation import RequestLimits
from engine.text.text_processor import TextProcessor
from tests.engine.tiny_tokenizers import sentencepiece_like


async def _next(inbox, decoder):
    return decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=5))


async def test_requests_flow_to_the_scheduler_and_text_to_the_client():
    tok = sentencepiece_like()
    to_tok, tok_inbox = inproc_pair()
    to_sched, sched_inbox = inproc_pair()
    to_client, client_inbox = inproc_pair()
    actor = TokenizerActor(
        TextProcessor(tok, RequestLimits(tok.vocab_size, 4096)),
        tok_inbox,
        to_sched,
        {"c1": to_client},
    )
    await actor.start()
    sched, client = InboxDecoder(INBOXES["scheduler"]), InboxDecoder(INBOXES["client"])

    params = SamplingParams(max_tokens=8, stop=["time"])
    await send_message(to_tok, GenerateRequest.of("r1", "c1", "Once upon", params))
    add = await _next(sched_inbox, sched)
    assert isinstance(add, AddRequest) and list(add.prompt_token_ids) == tok.encode("Once upon")

    # A bad request gets an error delta; the scheduler hears nothing about it.
    bad = SamplingParams(logit_bias={10**6: 1.0})
    await send_message(to_tok, GenerateRequest.of("r2", "c1", "x", bad))
    err = await _next(client_inbox, client)
    assert err.request_id == "r2" and err.finish_reason == "error" and "logit_bias" in err.error

    await to_tok.send(b"\x00 not msgpack")  # dropped, counted, the actor goes on
    ids = tuple(tok.encode(" a time", add_special_tokens=False))
    for step, token in enumerate(ids):  # one token per step, as the scheduler sends them
        await send_message(
            to_tok,
            TokenDeltas(
                step_id=step,
                request_ids=("r1",),
                token_ids=(token,),
                finished=(),
                logprobs=(),
                prompt_logprobs=(),
            ),
        )
    abort = await _next(sched_inbox, sched)
    assert abort == AbortRequest("r1")  # the stop string ended it here
    outs = [await _next(client_inbox, client)]
    while outs[-1].finish_reason is None:
        outs.append(await _next(client_inbox, client))
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "time"
    assert "time" not in "".join(o.text for o in outs) and actor.num_dropped == 1

    await send_message(to_tok, AbortRequest("r9"))  # forwarded even if unknown here
    assert await _next(sched_inbox, sched) == AbortRequest("r9")
    await actor.stop()
    assert not actor.is_alive and actor.num_errors == 0


async def test_tokenize_calls_past_the_queue_bound_are_refused_busy_and_admission_goes_on():
    """With MAX_QUEUED_TOKENIZE tokenize calls stuck, the next is refused BUSY at once,
    and a generation request is still admitted (its own thread)."""
    tok = sentencepiece_like()
    processor = TextProcessor(tok, RequestLimits(tok.vocab_size, 4096))
    release = threading.Event()
    tokenize = processor.tokenize

    def stuck(request):
        release.wait(10)
        return tokenize(request)

    processor.tokenize = stuck
    to_tok, tok_inbox = inproc_pair()
    to_sched, sched_inbox = inproc_pair()
    to_client, client_inbox = inproc_pair()
    actor = TokenizerActor(processor, tok_inbox, to_sched, {"c1": to_client})
    await actor.start()
    sched, client = InboxDecoder(INBOXES["scheduler"]), InboxDecoder(INBOXES["client"])
    try:
        for i in range(MAX_QUEUED_TOKENIZE + 1):
            await send_message(to_tok, TokenizeRequest.of_prompt(f"t{i}", "c1", "Once"))
        busy = await _next(client_inbox, client)
        assert busy.request_id == f"t{MAX_QUEUED_TOKENIZE}" and busy.error_kind is ErrorKind.BUSY
        params = SamplingParams(max_tokens=2)
        await send_message(to_tok, GenerateRequest.of("g", "c1", "Once", params))
        assert isinstance(await _next(sched_inbox, sched), AddRequest)
    finally:
        release.set()
    answers = [await _next(client_inbox, client) for _ in range(MAX_QUEUED_TOKENIZE)]
    assert all(a.error is None and a.token_ids for a in answers)
    await actor.stop()
