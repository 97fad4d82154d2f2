"""The grammar package (engine/worker/grammar/): compiling each kind of constraint,
errors naming the field, the compile cache, matchers, step bitmasks, the checker's
time bound and the mask in the sampler. On the builtin tiny model's byte tokenizer:
token id = byte value, 257 = </s>."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from engine.text.tokenizer import Tokenizer
from engine.worker.builtin_model import builtin_model_dir
from engine.worker.grammar.backend import build_backend
from engine.worker.grammar.checker import GrammarChecker
from engine.worker.grammar.compile_cache import GrammarCache
from engine.worker.grammar.matchers import GrammarMatchers
from engine.worker.grammar.schema_fixes import bounded_strings_as_patterns
from engine.worker.grammar.step_bitmask import step_bitmask
from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow
from tests.eventually import eventually_sync

pytestmark = pytest.mark.timeout(120)

EOS = 257
EOS_IDS = frozenset({EOS})
VOCAB = 320  # wider than the tokenizer's 258, as a model's padded vocabulary may be


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(str(builtin_model_dir()))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return build_backend(tokenizer, VOCAB, EOS_IDS)


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def accepts(backend, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar takes `text` whole and then ends on EOS."""
    matcher = backend.matcher(backend.compile(params))
    ok = all(matcher.accept(b) for b in text.encode())
    return ok and matcher.accept(EOS) and matcher.is_terminated


def allowed(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    backend.apply_bitmask(logits, bitmask, [0])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


@pytest.mark.parametrize(
    ("params", "good", "bad"),
    [
        (so(json={"type": "object", "properties": {"a": {"type": "integer"}}}), '{"a": 1}', "[1]"),
        (so(json={"type": "object"}, disable_any_whitespace=True), "{}", "{ }"),
        (so(json_object=True), '{"x": [1, {"y": null}]}', "[1]"),
        (so(regex=r"[a-c]{2}\d"), "ab7", "abc"),
        (so(choice=["yes", 'say "no"', "a\\b", "é\n"]), 'say "no"', "ye"),
        (so(choice=["yes", 'say "no"', "a\\b", "é\n"]), "é\n", "é"),
        (so(choice=["yes", 'say "no"', "a\\b", "é\n"]), "a\\b", "ab"),
        (so(grammar='root ::= "x" [0-9]+'), "x12", "x"),
    ],
)
def test_each_kind_compiles_and_matches(backend, params, good, bad):
    assert accepts(backend, params, good)
    assert not accepts(backend, params, bad)


def test_a_schema_keeps_to_its_properties(backend):
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert not accepts(backend, so(json=closed), '{"a": 1, "b": 2}')
    assert not accepts(
        backend, so(json=closed, disable_additional_properties=True), '{"a": 1, "b": 2}'
    )
    opened = closed | {"additionalProperties": True}
    assert accepts(backend, so(json=opened), '{"a": 1, "b": 2}')


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (so(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}), "json"),
        (so(regex="(ab"), "regex"),
        (so(grammar="root ::= "), "grammar"),
        (so(grammar='start ::= "a"'), "grammar"),
        (so(structural_tag={"type": "nonsense"}), "structural_tag"),
    ],
)
def test_what_does_not_compile_is_refused_naming_the_field(backend, params, field):
    with pytest.raises(
        StructuredOutputsError, match=rf"^structured_outputs\.{field} cannot be compiled: \S"
    ):
        backend.compile(params)


def test_no_tokenizer_or_no_end_token_is_refused():
    with pytest.raises(StructuredOutputsError, match="needs the tokenizer"):
        build_backend(None, VOCAB, EOS_IDS)
    with pytest.raises(StructuredOutputsError, match="end-of-sequence"):
        build_backend(object(), VOCAB, frozenset())


def test_a_complete_grammar_allows_only_the_end_token(backend):
    matcher = backend.matcher(backend.compile(so(choice=["ab", "abc"])))
    assert allowed(backend, matcher) == {ord("a")}
    assert matcher.accept(ord("a")) and matcher.accept(ord("b"))
    assert allowed(backend, matcher) == {ord("c"), EOS}
    assert matcher.accept(ord("c"))
    assert allowed(backend, matcher) == {EOS}
    assert not matcher.accept(ord("c"))
    assert matcher.accept(EOS) and matcher.is_terminated
    assert not matcher.accept(ord("a"))


class _CountingBackend:
    """Compiles to the constraint's kind; fails for regexes; counts compiles."""

    vocab_size = VOCAB

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.compiles = 0
        self.gate = gate

    def compile(self, params):
        self.compiles += 1
        if self.gate is not None:
            self.gate.wait(30)
        if params.regex is not None:
            raise StructuredOutputsError("structured_outputs.regex cannot be compiled: no")
        return params.kind


def test_the_cache_keeps_the_most_recently_used_and_remembers_failures():
    fake = _CountingBackend()
    cache = GrammarCache(fake, size=2)
    a, b, c = so(choice=["a"]), so(choice=["b"]), so(json={"type": "object"})
    cache.get(a), cache.get(b), cache.get(a)  # a is now the most recent
    assert fake.compiles == 2
    cache.get(c)  # evicts b
    assert a in cache and c in cache and b not in cache
    cache.get(b)
    assert fake.compiles == 4
    for _ in range(2):
        with pytest.raises(StructuredOutputsError, match="regex"):
            cache.get(so(regex="x"))
    assert fake.compiles == 5
    assert so(choice=("b",)) in cache  # keyed by value: an equal constraint is a hit


def test_matchers_replay_known_outputs_and_share_compiles(tokenizer):
    matchers = GrammarMatchers(lambda: build_backend(tokenizer, VOCAB, EOS_IDS), cache_size=4)
    params = so(choice=["abc", "abd"])
    fresh = matchers.matcher(params)
    replayed = matchers.matcher(params, list(b"ab"))
    assert allowed(matchers.backend, fresh) == {ord("a")}
    assert allowed(matchers.backend, replayed) == {ord("c"), ord("d")}
    assert matchers.cache.num_compiles == 1
    with pytest.raises(StructuredOutputsError, match=r"choice: output token 1 \(id 120\)"):
        matchers.matcher(params, list(b"ax"))


def test_matchers_load_the_tokenizer_on_first_use_only(tokenizer):
    calls = []
    matchers = GrammarMatchers(lambda: calls.append(1) or build_backend(tokenizer, VOCAB, EOS_IDS))
    assert calls == [] and matchers.step_bitmask([None, None], "cpu") is None
    assert calls == []
    matchers.matcher(so(regex="a+"))
    matchers.matcher(so(regex="b+"))
    assert calls == [1]


def test_a_step_bitmask_covers_only_live_constrained_rows(backend):
    live = backend.matcher(backend.compile(so(regex="a")))
    ended = backend.matcher(backend.compile(so(regex="b")))
    assert ended.accept(ord("b")) and ended.accept(EOS)
    assert step_bitmask(backend, [None, ended], "cpu") is None
    mask = step_bitmask(backend, [None, live, ended], "cpu")
    assert mask.rows == [1]
    logits = torch.zeros(3, VOCAB)
    mask.apply(logits)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()) == {ord("a")}


def test_the_sampler_masks_after_bias_and_keeps_raw_logprobs(backend):
    matcher = backend.matcher(backend.compile(so(choice=["x", "y"])))
    mask = step_bitmask(backend, [matcher, None], "cpu")
    greedy = SamplingParams(temperature=0.0, logprobs=1, logit_bias={ord("z"): 50.0})
    rows = [SamplingRow(greedy, [1], []), SamplingRow(greedy, [1], [])]
    md = SamplingMetadata.from_rows(rows, VOCAB, "cpu", mask)
    logits = torch.zeros(2, VOCAB)
    logits[:, ord("y")] = 1.0
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [ord("y"), ord("z")]
    raw = torch.log_softmax(logits[0], dim=-1)[ord("y")]
    assert out.logprobs.token_logprobs[0].item() == pytest.approx(raw.item())


def test_the_checker_refuses_by_field_and_caches(tokenizer):
    checker = GrammarChecker(lambda: build_backend(tokenizer, VOCAB, EOS_IDS))
    checker.check(so(json={"type": "object"}))
    with pytest.raises(StructuredOutputsError, match=r"structured_outputs\.regex"):
        checker.check(so(regex="[z-a]"))
    with pytest.raises(StructuredOutputsError, match=r"structured_outputs\.regex"):
        checker.check(so(regex="[z-a]"))  # from the cache
    assert so(regex="[z-a]") in checker.cache and len(checker.cache) == 2
    with pytest.raises(StructuredOutputsError, match="needs the tokenizer"):
        GrammarChecker(lambda: build_backend(None, VOCAB, EOS_IDS)).check(so(regex="a"))


def test_the_checker_waits_for_a_compile_at_most_its_timeout():
    gate = threading.Event()
    checker = GrammarChecker(lambda: _CountingBackend(gate), timeout_s=0.2)
    slow, other = so(json={"type": "object"}), so(choice=["a"])
    with pytest.raises(StructuredOutputsError, match=r"json takes more than 0.2 s to compile"):
        checker.check(slow)
    with pytest.raises(StructuredOutputsError, match=r"choice was not checked: .* busy"):
        checker.check(other)
    gate.set()

    def admitted() -> bool:
        try:
            checker.check(other)
        except StructuredOutputsError:
            return False
        return True

    eventually_sync(admitted, timeout=10, what="the slow compile ends, freeing the compiler")
    with pytest.raises(StructuredOutputsError, match="takes more than"):
        checker.check(slow)  # refused for good: the worker would take as long


def test_json_schema_text_is_compact_and_keeps_the_property_order(backend):
    """The output follows the schema's property order, so the text keeps it."""
    schema = {"type": "object", "properties": {"b": {"const": 1}, "a": {"const": 2}}}
    schema["required"] = ["b", "a"]
    one = so(json=json.dumps(schema, indent=2), disable_any_whitespace=True)
    assert one == so(json=schema, disable_any_whitespace=True)
    assert list(json.loads(one.json)["properties"]) == ["b", "a"]
    assert accepts(backend, one, '{"b": 1, "a": 2}')
    assert not accepts(backend, one, '{"a": 2, "b": 1}')


def test_length_bounded_strings_become_patterns_everywhere_in_a_schema():
    name = {"type": "string", "maxLength": 4}
    schema = {
        "type": "object",
        "properties": {"default": name, "tags": {"type": "array", "items": name}},
        "$defs": {"d": {"type": "string", "minLength": 1}},
        "anyOf": [name, {"type": "string", "maxLength": 2, "pattern": "^a+$"}],
        "default": {"type": "string", "maxLength": 9},  # data, not a schema
    }
    fixed = json.loads(bounded_strings_as_patterns(json.dumps(schema)))
    as_pattern = {"type": "string", "pattern": "^[\\s\\S]{0,4}$"}
    assert fixed["properties"] == {
        "default": as_pattern,
        "tags": {"type": "array", "items": as_pattern},
    }
    assert fixed["$defs"]["d"] == {"type": "string", "pattern": "^[\\s\\S]{1,}$"}
    assert fixed["anyOf"] == [as_pattern, schema["anyOf"][1]]
    assert fixed["default"] == schema["default"]
    untouched = json.dumps({"type": "object"}, indent=1)
    assert bounded_strings_as_patterns(untouched) is untouched


def test_a_length_bounded_string_is_valid_json(backend):
    """mlc-ai/xgrammar#800: without the rewrite a raw control character gets in."""
    params = so(json={"type": "string", "minLength": 1, "maxLength": 3})
    assert accepts(backend, params, '"aé"')
    assert not accepts(backend, params, '"a\x1d"')
    assert not accepts(backend, params, '""')
    assert not accepts(backend, params, '"abcd"')


def test_the_grammar_cache_size_is_an_engine_arg() -> None:
    from engine.engine_args import EngineArgs

    assert EngineArgs(model="builtin:tiny", grammar_cache_size=3).build().grammar_cache_size == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="grammar_cache_size"):
            EngineArgs(model="builtin:tiny", grammar_cache_size=bad).build()


def test_a_prepared_constraint_compiles_in_the_background_once():
    """PrepareGrammar: the worker starts compiling before the request arrives; the
    request's matcher waits for that compile instead of starting another, a prepared
    constraint that does not compile fails its request alone, and past MAX_PREPARING
    hints are dropped rather than queued."""
    from engine.worker.grammar.matchers import MAX_PREPARING

    class Backend(_CountingBackend):
        def matcher(self, compiled):
            return compiled

    gate = threading.Event()
    backend = Backend(gate)
    matchers = GrammarMatchers(lambda: backend)
    params = so(json={"type": "object"})
    matchers.prepare(params)
    matchers.prepare(params)  # announced twice: one compile
    gate.set()  # the background compile may finish now
    matchers.matcher(params)
    matchers.matcher(params)
    assert backend.compiles == 1
    extra = [so(choice=[str(i)]) for i in range(MAX_PREPARING + 3)]
    gate.clear()
    for p in extra:
        matchers.prepare(p)
    assert len(matchers._compiling) == MAX_PREPARING  # the rest were dropped
    gate.set()
    for p in extra:
        matchers.matcher(p)  # prepared or not, each compiles once
    assert backend.compiles == 1 + len(extra)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 2), (16, 4), (None, 1)])
def test_a_compile_takes_at_most_half_the_cores(monkeypatch, cores, threads) -> None:
    from engine.worker.grammar import xgrammar_backend

    monkeypatch.setattr(xgrammar_backend.os, "cpu_count", lambda: cores)
    assert xgrammar_backend.compile_threads() == threads
