"""The tokenizer actor's engine object: admission checks, text deltas, stop strings."""

from __future__ import annotations

import random

import pytest

from engine.messages import GenerateRequest, RankedSequence, TokenDelta
from engine.sampling_params import SamplingParams
from engine.text.request_validation import RequestLimits
from engine.text.text_processor import TextProcessor
from tests.engine.tiny_tokenizers import byte_level, sentencepiece_like


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def tokenizer(request):
    return sentencepiece_like() if request.param == "sentencepiece" else byte_level()


def _request(rid, prompt="Hello there", **params):
    return GenerateRequest(
        request_id=rid,
        client_id="client-1",
        prompt=prompt,
        prompt_token_ids=None,
        messages=None,
        params=SamplingParams(**params),
    )


def delta(rid, token_ids, finish_reason) -> TokenDelta:
    return TokenDelta(
        request_id=rid, token_ids=token_ids, finish_reason=finish_reason, stop_reason=None
    )


def ranked(rid, index, token_ids, finish_reason, logprob, score) -> RankedSequence:
    return RankedSequence(
        request_id=rid,
        index=index,
        token_ids=token_ids,
        finish_reason=finish_reason,
        cumulative_logprob=logprob,
        score=score,
    )


def _stream(proc, rid, ids, rng, finish="length"):
    """Feeds ids in random chunks; returns (concatenated text, deltas, aborts)."""
    deltas, aborts, i = [], [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        chunk, i = ids[i : i + n], i + n
        outs, abort = proc.on_token_delta(
            delta(rid, tuple(chunk), finish if i >= len(ids) else None)
        )
        out = outs[0] if outs else None
        if out is not None:
            deltas.append(out)
        if abort is not None:
            aborts.append(abort)
        if out is not None and out.finish_reason is not None:
            break
    return "".join(d.text for d in deltas), deltas, aborts


def test_deltas_concatenate_to_the_decoded_output(tokenizer):
    rng = random.Random(0)
    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    add = proc.admit(_request("r1"), 0.0)
    assert list(add.prompt_token_ids) == tokenizer.encode("Hello there")
    ids = tokenizer.encode(" once upon a time, a café served 🍵 tea", add_special_tokens=False)
    text, deltas, aborts = _stream(proc, "r1", ids, rng)
    full = tokenizer.decode(list(add.prompt_token_ids) + ids)
    assert text == full[len(tokenizer.decode(list(add.prompt_token_ids))) :]
    assert deltas[-1].finish_reason == "length" and not aborts
    assert deltas[-1].num_output_tokens == len(ids) and "r1" not in proc.states


def test_stop_string_truncates_aborts_and_never_leaks(tokenizer):
    rng = random.Random(1)
    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    proc.admit(_request("r2", stop=["a time"]), 0.0)
    ids = tokenizer.encode(" once upon a time there was", add_special_tokens=False)
    text, deltas, aborts = _stream(proc, "r2", ids, rng)
    assert text.endswith("upon ") and "a time" not in text and "there" not in text
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "a time"
    assert [a.request_id for a in aborts] == ["r2"]
    # Later deltas for the stopped request (already in flight) are ignored.
    assert proc.on_token_delta(delta("r2", (1,), None)) == ([], None)


def test_include_stop_str_keeps_it(tokenizer):
    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    proc.admit(_request("r3", stop=["time"], include_stop_str_in_output=True), 0.0)
    ids = tokenizer.encode(" a time later", add_special_tokens=False)
    text, deltas, _ = _stream(proc, "r3", ids, random.Random(2))
    assert text.rstrip().endswith("time")


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(prompt=None), "exactly one"),
        (dict(max_tokens=5, logit_bias={10**6: 1.0}), "logit_bias"),
    ],
)
def test_bad_requests_are_refused_with_a_message(tokenizer, request_kwargs, message):
    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    request_kwargs = dict(request_kwargs)  # parametrized dicts are shared between runs
    prompt = request_kwargs.pop("prompt", "hi")
    with pytest.raises(ValueError, match=message):
        proc.admit(_request("bad", prompt, **request_kwargs), 0.0)
    assert not proc.states


def test_over_long_prompt_and_duplicate_ids_are_refused(tokenizer):
    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        proc.admit(_request("long", "a b c d e f g h"), 0.0)
    proc2 = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    proc2.admit(_request("dup"), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        proc2.admit(_request("dup"), 0.0)


def test_chat_messages_use_the_template():
    from engine.text.tokenizer import Tokenizer
    from tests.conftest import shared_path

    tok = Tokenizer.from_pretrained(str(shared_path("models", "stories260K")))
    proc = TextProcessor(tok, RequestLimits(tok.vocab_size, 512))
    req = GenerateRequest.of("c", "client", [{"role": "user", "content": "hi"}], SamplingParams())
    add = proc.admit(req, 0.0)
    assert list(add.prompt_token_ids) == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def test_beam_search_outputs_go_out_whole_then_the_request_is_forgotten(tokenizer):
    """A beam search streams nothing: its ranked outputs are each decoded whole (after
    the prompt, as a stream would be), under their index; the request's prompt logprobs
    ride on output 0; then the request is gone (a late abort is harmless)."""
    from engine.messages import RequestLogprobs, TokenLogprob

    proc = TextProcessor(tokenizer, RequestLimits(tokenizer.vocab_size, 4096))
    beams = dict(use_beam_search=True, n=2, best_of=3, temperature=0, max_tokens=8)
    add = proc.admit(_request("b1", **beams), 0.0)
    assert add.params.use_beam_search and list(proc.sequences["b1"]) == ["b1"]
    prompt = list(add.prompt_token_ids)
    first = tokenizer.encode(" once upon", add_special_tokens=False)
    second = tokenizer.encode(" a café", add_special_tokens=False)
    row = (TokenLogprob(prompt[1], -0.5, 1, None),)
    outs = proc.on_ranked(
        (
            ranked("b1", 0, tuple(first), "stop", -1.0, -0.5),
            ranked("b1", 1, tuple(second), "length", -2.0, -0.7),
        ),
        (RequestLogprobs("b1", (row,)),),
    )
    assert [client for client, _ in outs] == ["client-1", "client-1"]
    deltas = [d for _, d in outs]
    assert [d.index for d in deltas] == [0, 1]
    assert [d.finish_reason for d in deltas] == ["stop", "length"]
    decoded = tokenizer.decode(prompt)
    for d, ids in zip(deltas, (first, second), strict=True):
        assert d.text == tokenizer.decode(prompt + ids)[len(decoded) :]
        assert d.num_output_tokens == len(ids) and d.num_prompt_tokens == len(prompt)
    assert deltas[0].prompt_logprobs[0][0].decoded_token is not None
    assert deltas[1].prompt_logprobs is None
    assert "b1" not in proc.states and "b1" not in proc.sequences
    proc.drop("b1")


def _one_by_one(proc, rid, ids, finish="length"):
    """Feeds ids one per delta (as a step gives them); returns the last OutputDelta and
    how many tokens went in."""
    last = None
    for i, token in enumerate(ids):
        outs, _ = proc.on_token_delta(delta(rid, (token,), finish if i == len(ids) - 1 else None))
        last = outs[-1] if outs else last
        if last is not None and last.finish_reason is not None:
            return last, i + 1
    return last, len(ids)


def test_min_tokens_guards_stop_strings_as_it_guards_stop_tokens():
    """vLLM's rule: a stop string is looked for only once min_tokens are out."""
    tok = sentencepiece_like()
    ids = [tok.encode(c, add_special_tokens=False)[-1] for c in "abobcdefoghij"]
    proc = TextProcessor(tok, RequestLimits(tok.vocab_size, 4096))
    proc.admit(_request("free", stop=["o"]), 0.0)
    proc.admit(_request("guarded", stop=["o"], min_tokens=8), 0.0)
    free, n_free = _one_by_one(proc, "free", ids)
    guarded, n_guarded = _one_by_one(proc, "guarded", ids)
    assert (free.finish_reason, free.stop_reason, n_free) == ("stop", "o", 3)
    assert (guarded.finish_reason, guarded.stop_reason, n_guarded) == ("stop", "o", 9)


def test_a_stop_string_in_the_text_flushed_at_the_end_is_a_stop():
    """Byte pieces are held back until the sequence ends; a stop string that shows up
    only in that flushed text still ends it with "stop" (as it would mid-stream)."""
    tok = sentencepiece_like()
    ids = tok.encode("ab é", add_special_tokens=False)  # é: two byte-fallback pieces
    proc = TextProcessor(tok, RequestLimits(tok.vocab_size, 4096))
    proc.admit(_request("r", stop=["é"]), 0.0)
    last, _ = _one_by_one(proc, "r", ids, finish="length")
    assert (last.finish_reason, last.stop_reason) == ("stop", "é")
