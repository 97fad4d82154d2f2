"""Hypothesis strategies for fuzzing the server's inputs (used by tests/web/test_fuzz.py).

What they make:
- request bodies for POST /v1/completions and /v1/chat/completions;
- WebSocket frames for /v1/stream: `generate`, `session.open` (+ one turn), and the
  control frames (ping, cancel, session.close, auth, unknown types, non-objects, bytes
  that are neither JSON nor msgpack).

Every field the routes know gets small valid values most of the time (so an accepted
request ends fast) and otherwise edge scalars (ints up to +-2**100, NaN, +-inf, 1e308,
-0.0, lone UTF-16 surrogates, NUL) or arbitrary JSON. Besides plain Python values, a
body may hold two markers that the encoders write as text or bytes directly, so that
neither Hypothesis nor the encoder recurses or builds 100k-element lists:
`Deep(depth, kind)` (nesting 1 to 100,000 levels) and `Long(count, item)` (up to ~100k
items, under 1 MiB). `Raw(data)` is a whole payload sent as is; `FRESH` stands for an id
the test fills in at send time (unique in the test run).

Encoding: `to_json_text` is `json.dumps(..., ensure_ascii=True)` (lone surrogates become
\\ud800 escapes, NaN/inf the NaN/Infinity literals Python's json reads back);
`to_msgpack_bytes` packs strings with `unicode_errors="surrogatepass"` (so a frame with a
lone surrogate is not valid UTF-8 msgpack) and clamps ints to what msgpack can carry.
"""

from __future__ import annotations

import json
import math
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from engine.worker.builtin_model import BUILTIN_MODEL_NAME
from web.openai_fields import CHAT_RULES, COMPLETION_RULES, Support, accepted
from web.openai_routes import CHAT_FIELDS, COMPLETION_FIELDS
from web.params import SAMPLING_FIELDS
from web.responses_fields import RESPONSES_RULES
from web.ws_connection import GENERATE_KEYS

# The `params` object of a WebSocket generate (web/ws_connection.py, _check_params).
WS_PARAM_FIELDS = frozenset(
    {*SAMPLING_FIELDS, "max_tokens", "logprobs", "logit_bias", "structured_outputs"}
)
# The keys generate_frames() sets (kept in step with GENERATE_KEYS by a test).
GENERATE_FRAME_KEYS = frozenset(
    {"type", "id", "prompt", "prompt_token_ids", "messages", "session_id", "message", "params"}
    | {"fit_history"}
)
WS_CONTROL_TYPES = ("ping", "cancel", "session.close", "auth")
SESSION_OPEN_FIELDS = frozenset({"type", "id", "session_id", "system"})
# Every field a generate frame may name (its keys and its params' keys).
WS_GENERATE_FIELDS = frozenset(GENERATE_KEYS | WS_PARAM_FIELDS)
VOCAB = 258  # the built-in model: 256 bytes, <s>, </s>
MAX_VALID_TOKENS = 8  # max_tokens of the valid branch: accepted requests end fast
BODY_BUDGET = 900_000  # bytes a Long may take, so a body stays under 1 MiB
MSGPACK_INT_RANGE = (-(2**63), 2**64 - 1)


# -- markers -------------------------------------------------------------------------
@dataclass(frozen=True)
class Deep:
    """A value nested `depth` levels: `[[[...]]]` or `{"a": {"a": ... null}}`."""

    depth: int
    kind: str = "list"

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.kind!r})"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints examples with it
        printer.text(repr(self))

    def to_json(self) -> str:
        if self.kind == "list":
            return "[" * self.depth + "]" * self.depth
        return '{"a":' * self.depth + "null" + "}" * self.depth

    def to_msgpack(self) -> bytes:
        if self.kind == "list":
            return b"\x91" * (self.depth - 1) + b"\x90"
        return b"\x81\xa1a" * self.depth + b"\xc0"


@dataclass(frozen=True)
class Long:
    """A list of `count` copies of `item` (a small JSON value)."""

    count: int
    item: Any

    def __repr__(self) -> str:
        return f"Long({self.count}, {self.item!r})"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints examples with it
        printer.text(repr(self))

    def to_json(self) -> str:
        return "[" + ",".join([to_json_text(self.item)] * self.count) + "]"

    def to_msgpack(self) -> bytes:
        return _msgpack_header(self.count, 0x90, 0xDC, 0xDD) + to_msgpack_bytes(self.item) * (
            self.count
        )


@dataclass(frozen=True)
class Raw:
    """A payload sent as is: text (a text frame / body) or bytes (a binary frame)."""

    data: str | bytes

    def __repr__(self) -> str:
        if len(self.data) <= 80:
            return f"Raw({self.data!r})"
        return f"Raw({self.data[:40]!r} ... {len(self.data)} in all)"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints examples with it
        printer.text(repr(self))


class _Fresh:
    """Filled in at send time with an id unique in the test run."""

    def __repr__(self) -> str:
        return "FRESH"


FRESH = _Fresh()


def _make_long(count: int, item: Any) -> Long:
    per_item = len(to_json_text(item)) + 1
    return Long(max(1, min(count, BODY_BUDGET // per_item)), item)


# -- encoders ------------------------------------------------------------------------
def to_json_text(obj: Any) -> str:
    """JSON text (ASCII only) with Deep/Long written in place."""
    spliced: dict[str, str] = {}
    tag = uuid.uuid4().hex

    def swap(o: Any) -> Any:
        if isinstance(o, Deep | Long):
            key = f"{tag}-{len(spliced)}"
            spliced[json.dumps(key)] = o.to_json()
            return key
        if isinstance(o, dict):
            return {k: swap(v) for k, v in o.items()}
        if isinstance(o, list):
            return [swap(v) for v in o]
        return o

    text = json.dumps(swap(obj), ensure_ascii=True)
    for key, value in spliced.items():
        text = text.replace(key, value, 1)
    return text


_PACKER_ARGS = dict(use_bin_type=True, unicode_errors="surrogatepass")


def _msgpack_header(n: int, fix: int, b16: int, b32: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    if n < 2**16:
        return bytes([b16]) + struct.pack(">H", n)
    return bytes([b32]) + struct.pack(">I", n)


def clamp_int(value: int) -> int:
    lo, hi = MSGPACK_INT_RANGE
    return max(lo, min(hi, value))


def to_msgpack_bytes(obj: Any) -> bytes:
    """msgpack (str as UTF-8 with surrogates passed through, bytes as bin) with Deep/Long
    written in place and ints clamped to msgpack's range."""
    if isinstance(obj, Deep | Long):
        return obj.to_msgpack()
    if isinstance(obj, dict):
        head = _msgpack_header(len(obj), 0x80, 0xDE, 0xDF)
        return head + b"".join(to_msgpack_bytes(k) + to_msgpack_bytes(v) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, msgpack.ExtType):
        head = _msgpack_header(len(obj), 0x90, 0xDC, 0xDD)
        return head + b"".join(to_msgpack_bytes(v) for v in obj)
    if isinstance(obj, int) and not isinstance(obj, bool):
        obj = clamp_int(obj)
    return msgpack.packb(obj, **_PACKER_ARGS)


def contains(obj: Any, predicate) -> bool:
    """Whether `obj` or a part of it (a Long's item included) matches `predicate`."""
    if predicate(obj):
        return True
    if isinstance(obj, dict):
        return any(contains(k, predicate) or contains(v, predicate) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return any(contains(v, predicate) for v in obj)
    if isinstance(obj, Long):
        return contains(obj.item, predicate)
    return False


def has_surrogate(value: Any) -> bool:
    return isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value)


def with_fresh(obj: Any, fresh) -> Any:
    """`obj` with each top-level FRESH value replaced by `fresh()`."""
    if isinstance(obj, dict):
        return {k: (fresh() if v is FRESH else v) for k, v in obj.items()}
    return obj


# -- building blocks -----------------------------------------------------------------
def weighted(*pairs: tuple[int, SearchStrategy]) -> SearchStrategy:
    """One of the strategies, chosen with the given weights; shrinks toward the first."""
    choices = [s for w, s in pairs for _ in range(w)]
    return st.sampled_from(choices).flatmap(lambda s: s)


def sometimes(weight_yes: int = 1, weight_no: int = 1) -> SearchStrategy:
    """A bool; shrinks toward False (leave it out)."""
    return weighted((weight_no, st.just(False)), (weight_yes, st.just(True)))


SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]
SPECIAL_CHARS = [*SURROGATES, "\x00", "\ufffd", "\ufeff", "\uffff", "\U0010ffff", '"', "\\"]
CHARS = weighted((4, st.characters()), (1, st.sampled_from(SPECIAL_CHARS)))
TEXTS = st.text(CHARS, max_size=16)  # any text: lone surrogates and NUL included
TEXTS_NO_SURROGATES = st.text(
    weighted(
        (4, st.characters()),
        (1, st.sampled_from([c for c in SPECIAL_CHARS if c not in SURROGATES])),
    ),
    max_size=16,
)
VALID_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)  # encodable, short
NONEMPTY_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
EDGE_INTS += [-(2**63), -(2**63) - 1, 2**70, 2**100, -(2**100)]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 1.7976931348623157e308, -0.0]
EDGE_FLOATS += [0.0, 5e-324, 1e-7, 0.5, 1.5]
INTS = weighted(
    (2, st.integers(-10, 300)),
    (2, st.sampled_from(EDGE_INTS)),
    (1, st.integers(-(2**100), 2**100)),
)
FLOATS = weighted((2, st.sampled_from(EDGE_FLOATS)), (1, st.floats()))
EDGE_SCALARS = st.sampled_from(
    [None, True, False, "", *SURROGATES[:2], "\x00", "a\udfffb", "x" * 200, [], {}]
    + EDGE_INTS
    + EDGE_FLOATS
)


def _json_values(texts: SearchStrategy, *extra_leaves: SearchStrategy) -> SearchStrategy:
    leaves = st.one_of(st.none(), st.booleans(), INTS, FLOATS, texts, *extra_leaves)
    return st.recursive(
        leaves,
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts, kids, max_size=4),
        max_leaves=8,
    )


DEEP = st.builds(
    Deep,
    depth=weighted(
        (3, st.integers(1, 64)), (3, st.integers(900, 1100)), (2, st.integers(1100, 100_000))
    ),
    kind=st.sampled_from(["list", "object"]),
)
LONG_ITEMS = [0, 255, 1, "a", "\ud800", None, True, 1.5, [], {}, [1], {"role": "user"}]
LONG_ITEMS += [{"role": "user", "content": "a"}, "stop"]
LONG = st.builds(
    _make_long,
    count=weighted((2, st.integers(100, 5000)), (1, st.integers(50_000, 100_000))),
    item=st.sampled_from(LONG_ITEMS),
)
ANYTHING = weighted((6, _json_values(TEXTS)), (2, EDGE_SCALARS), (1, DEEP), (1, LONG))
# msgpack: a lone surrogate makes the whole frame undecodable, so fewer of them (they
# would hide everything else in the frame), and what JSON lacks: bin (bytes), ext types.
MSGPACK_TEXTS = weighted((9, TEXTS_NO_SURROGATES), (1, TEXTS))
EXT_TYPES = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
ANYTHING_MSGPACK = weighted(
    (6, _json_values(MSGPACK_TEXTS, st.binary(max_size=16), EXT_TYPES)),
    (2, EDGE_SCALARS),
    (1, DEEP),
    (1, LONG),
)


def texts_for(binary: bool) -> SearchStrategy:
    return MSGPACK_TEXTS if binary else TEXTS


NEAR_MISS_NAMES = [
    "Temperature",
    "max_token",
    "prompt ",
    " prompt",
    "top-p",
    "",
    "\x00",
    "stream\x00",
    "a\ud800",
    *SURROGATES,
    "__proto__",
    "ID",
    "Type",
    "param",
    "n ",
    "logprob",
    "params",
    "session",
    "id",
    "message",
    "messages",
    "prompt",
]


def field_names_not_in(known: frozenset, binary: bool = False) -> SearchStrategy:
    """Unknown field names (surrogates, NUL, near misses); bytes too for msgpack."""
    names = weighted((3, texts_for(binary)), (2, st.sampled_from(NEAR_MISS_NAMES)))
    if binary:
        names = weighted((4, names), (1, st.binary(max_size=8)))
    return names.filter(lambda k: k not in known)


def field_value(valid: SearchStrategy, anything: SearchStrategy = ANYTHING) -> SearchStrategy:
    """Mostly a valid value; otherwise an edge scalar or anything at all."""
    return weighted((7, valid), (2, EDGE_SCALARS), (2, anything))


def clean_or_fuzzed(draw) -> Callable[..., SearchStrategy]:
    """Per example: a clean one (every field valid, so most are accepted and the success
    paths get exercised) or a fuzzed one (each field may be an edge value or anything).
    Returns how to draw a field: `value(valid, anything)`."""
    if draw(sometimes(2, 3)):
        return lambda valid, anything=ANYTHING: valid
    return field_value


# -- valid values, per field -----------------------------------------------------------
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)
MESSAGE_CONTENT = weighted(
    (3, VALID_TEXT),
    (1, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": VALID_TEXT}), max_size=2)),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": MESSAGE_CONTENT}
    ),
    min_size=1,
    max_size=3,
)
SMALL_TOKENS = st.integers(1, MAX_VALID_TOKENS)
_COMMON_VALID: dict[str, SearchStrategy] = {
    "model": st.sampled_from([BUILTIN_MODEL_NAME, None]),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "max_tokens": SMALL_TOKENS,
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3
    ),
    "user": VALID_TEXT,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(NONEMPTY_TEXT, st.lists(NONEMPTY_TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 4),
    # no flag set: accepted by any server (one without --kv-transfer-config refuses flags)
    "kv_transfer_params": st.sampled_from([{}, {"do_remote_decode": False}]),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-2, 2),
    "early_stopping": st.sampled_from([False, True, "never"]),
    # structured outputs: small constraints (each compiles in milliseconds)
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
            },
        ]
    ),
    "structured_outputs": st.sampled_from(
        [
            {"regex": "[a-z]{1,4}"},
            {"choice": ["yes", "no"]},
            {"json_object": True},
            {"json": {"type": "string"}, "disable_any_whitespace": True},
        ]
    ),
    "guided_json": st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
    "guided_regex": st.just("[0-9]+"),
    "guided_choice": st.just(["a", "b"]),
    "guided_grammar": st.just('root ::= "a" | "b"'),
}


_A_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
_ANOTHER_TOOL = {"type": "function", "function": {"name": "g"}}
_NAMED_TOOL = {"type": "function", "function": {"name": "f"}}


RESPONSES_FIELDS = accepted(RESPONSES_RULES)


def _some_values(rules) -> dict[str, SearchStrategy]:
    """Fields taken with some values only: a value the table says is honoured."""
    some = Support.SOME_VALUES
    return {n: st.just(r.accepted_example) for n, r in rules.items() if r.support is some}


COMPLETION_VALID: dict[str, SearchStrategy] = {
    **_COMMON_VALID,
    **_some_values(COMPLETION_RULES),
    "prompt": weighted(
        (4, NONEMPTY_TEXT),
        (2, TOKEN_IDS),
        (1, st.lists(NONEMPTY_TEXT, min_size=1, max_size=3)),
        (1, st.lists(TOKEN_IDS, min_size=1, max_size=2)),
    ),
    "logprobs": st.integers(0, 5),
    "echo": st.just(False),
    "suffix": st.sampled_from([None, ""]),
    "best_of": st.integers(1, 4),
}
CHAT_VALID: dict[str, SearchStrategy] = {
    **_COMMON_VALID,
    **_some_values(CHAT_RULES),
    "messages": MESSAGES,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": SMALL_TOKENS,
    # tools: small schemas (a grammar compiles in milliseconds); auto is refused without
    # --enable-auto-tool-choice, which the fuzzed server does not have
    "tools": st.sampled_from([[], [_A_TOOL], [_A_TOOL, _ANOTHER_TOOL]]),
    "tool_choice": st.sampled_from(["none", "required", "auto", _NAMED_TOOL]),
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}]),
    "include_reasoning": st.booleans(),
}
WS_PARAMS_VALID: dict[str, SearchStrategy] = {k: COMPLETION_VALID[k] for k in WS_PARAM_FIELDS}
_RESPONSE_ITEMS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "developer"]), "content": VALID_TEXT}
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("user"),
                "content": st.lists(
                    st.fixed_dictionaries({"type": st.just("input_text"), "text": VALID_TEXT}),
                    min_size=1,
                    max_size=2,
                ),
            }
        ),
        st.just({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
        st.just({"type": "function_call_output", "call_id": "c1", "output": "ok"}),
    ),
    min_size=1,
    max_size=3,
)
_FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSES_VALID: dict[str, SearchStrategy] = {
    "model": st.sampled_from([BUILTIN_MODEL_NAME, None]),
    "input": weighted((2, NONEMPTY_TEXT), (2, _RESPONSE_ITEMS)),
    "instructions": VALID_TEXT,
    "max_output_tokens": SMALL_TOKENS,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "user": VALID_TEXT,
    "safety_identifier": VALID_TEXT,
    "tools": st.sampled_from([[], [_FLAT_TOOL]]),
    "tool_choice": st.sampled_from(["none", "required", {"type": "function", "name": "f"}]),
    "parallel_tool_calls": st.booleans(),
    "text": st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        ]
    ),
    "stream": st.booleans(),
    **_some_values(RESPONSES_RULES),
}


# -- HTTP bodies ---------------------------------------------------------------------
RAW_HTTP_BODIES = [
    b"",
    b"{oops",
    b'{"prompt": "\xff\xfe"}',
    b"\xef\xbb\xbf{}",
    b'{"prompt": "a"',
    b"[" * 100_000,
    b"{" * 50_000,
    b"\x00",
    b"null",
    b'{"prompt": "a"}}',
    b'{"prompt": "\\ud800", "max_tokens": 1}',
    b'{"prompt": "a", "max_tokens": 1e999}',
]


@st.composite
def _openai_object(
    draw,
    valid: dict[str, SearchStrategy],
    required: str,
    allowed: frozenset,
    length: str = "max_tokens",
):
    value = clean_or_fuzzed(draw)
    clean = value is not field_value
    body: dict[Any, Any] = {}
    if clean or draw(sometimes(9, 1)):
        body[required] = draw(value(valid[required]))
    if clean or draw(sometimes(4, 1)):
        body[length] = draw(value(valid[length]))
    optional = sorted(allowed - {required, length})
    for name in draw(st.lists(st.sampled_from(optional), max_size=5, unique=True)):
        body[name] = draw(value(valid[name]))
    if not clean and draw(sometimes(1, 6)):
        unknown = st.dictionaries(field_names_not_in(allowed), ANYTHING, min_size=1, max_size=2)
        body.update(draw(unknown))
    return body


def _body(
    valid: dict[str, SearchStrategy],
    required: str,
    allowed: frozenset,
    length: str = "max_tokens",
) -> SearchStrategy:
    return weighted(
        (30, _openai_object(valid, required, allowed, length)),
        (1, ANYTHING),  # a body that is not an object (or one of arbitrary keys)
        (1, st.sampled_from(RAW_HTTP_BODIES).map(Raw)),
        (1, st.binary(max_size=64).map(Raw)),
    )


def completion_bodies() -> SearchStrategy:
    """Bodies for POST /v1/completions."""
    return _body(COMPLETION_VALID, "prompt", COMPLETION_FIELDS)


def chat_bodies() -> SearchStrategy:
    """Bodies for POST /v1/chat/completions."""
    return _body(CHAT_VALID, "messages", CHAT_FIELDS)


def responses_bodies() -> SearchStrategy:
    """Bodies for POST /v1/responses."""
    return _body(RESPONSES_VALID, "input", RESPONSES_FIELDS, "max_output_tokens")


# -- WebSocket frames ----------------------------------------------------------------
def ws_ids(anything: SearchStrategy = ANYTHING, binary: bool = False) -> SearchStrategy:
    """Request ids: non-strings, empty, lone surrogates, NUL, 128 and 129+ characters."""
    repeated = st.builds(
        lambda c, n: c * n,
        st.sampled_from(["a", "\u00e9", "\ud800", "\x00", "\U0001f600"]),
        st.integers(100, 70_000),
    )
    return weighted(
        (2, texts_for(binary)),
        (1, st.sampled_from(["", "x" * 128, "x" * 129, "\ud800", "a\udfff", "\x00"])),
        (1, repeated),
        (2, EDGE_SCALARS),
        (1, anything),
    )


@st.composite
def ws_params(draw, anything: SearchStrategy = ANYTHING, binary: bool = False, clean=False):
    """A generate's `params` object (`clean`: valid fields only)."""
    value = (lambda valid, anything: valid) if clean else field_value
    params: dict[Any, Any] = {}
    if clean or draw(sometimes(9, 1)):
        params["max_tokens"] = draw(value(SMALL_TOKENS, anything))
    optional = sorted(WS_PARAM_FIELDS - {"max_tokens"})
    for name in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
        params[name] = draw(value(WS_PARAMS_VALID[name], anything))
    if clean:
        return params
    if draw(sometimes(1, 9)):  # OpenAI-only fields are unknown here
        name = draw(st.sampled_from(sorted(COMPLETION_FIELDS - WS_PARAM_FIELDS)))
        params[name] = draw(anything)
    if draw(sometimes(1, 9)):
        names = field_names_not_in(WS_PARAM_FIELDS, binary)
        params.update(draw(st.dictionaries(names, anything, min_size=1, max_size=2)))
    return params


@st.composite
def generate_frames(draw, binary: bool = False):
    """`generate` frames: one request each (binary: for msgpack, with bytes and ext values)."""
    anything = ANYTHING_MSGPACK if binary else ANYTHING
    if draw(sometimes(2, 3)):  # clean: accepted unless valid fields conflict
        frame = {"type": "generate", "id": FRESH}
        source = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages"]))
        frame[source] = draw(
            {"prompt": NONEMPTY_TEXT, "prompt_token_ids": TOKEN_IDS}.get(source, MESSAGES)
        )
        frame["params"] = draw(ws_params(anything, binary, clean=True))
        return frame
    frame: dict[Any, Any] = {}
    if draw(sometimes(19, 1)):
        frame["type"] = draw(
            weighted((18, st.just("generate")), (1, EDGE_SCALARS), (1, texts_for(binary)))
        )
    if draw(sometimes(19, 1)):
        frame["id"] = draw(weighted((7, st.just(FRESH)), (3, ws_ids(anything, binary))))
    source = draw(
        weighted(
            (5, st.just("prompt")),
            (2, st.just("prompt_token_ids")),
            (2, st.just("messages")),
            (1, st.just("session")),
            (1, st.just("none")),
            (1, st.just("several")),
        )
    )
    if source in ("prompt", "several"):
        frame["prompt"] = draw(field_value(NONEMPTY_TEXT, anything))
    if source == "prompt_token_ids":
        frame["prompt_token_ids"] = draw(field_value(TOKEN_IDS, anything))
    if source in ("messages", "several"):
        frame["messages"] = draw(field_value(MESSAGES, anything))
    if source == "session":
        frame["session_id"] = draw(weighted((2, NONEMPTY_TEXT), (1, anything)))
        frame["message"] = draw(field_value(NONEMPTY_TEXT, anything))
    params = draw(
        weighted(
            (8, ws_params(anything, binary)), (1, anything), (1, st.just(None)), (1, st.just(...))
        )
    )
    if params is not ...:
        frame["params"] = params
    if draw(sometimes(1, 9)):
        frame["fit_history"] = draw(weighted((3, st.booleans()), (1, anything)))
    if draw(sometimes(1, 9)):
        names = field_names_not_in(frozenset(GENERATE_KEYS), binary)
        frame.update(draw(st.dictionaries(names, anything, min_size=1, max_size=2)))
    return frame


@dataclass(frozen=True)
class SessionCase:
    """A `session.open` frame, then (when `message` is not None and a session came back)
    one turn with that message, then `session.close`."""

    open_frame: Any
    message: Any
    max_tokens: int


@st.composite
def session_cases(draw, binary: bool = False):
    anything = ANYTHING_MSGPACK if binary else ANYTHING
    value = clean_or_fuzzed(draw)
    clean = value is not field_value
    frame: dict[Any, Any] = {"type": "session.open"}
    if draw(sometimes(1, 1)):
        frame["session_id"] = draw(
            st.just(FRESH)
            if clean
            else weighted((6, st.just(FRESH)), (1, st.just(None)), (2, ws_ids(anything, binary)))
        )
    if draw(sometimes(1, 1)):
        frame["system"] = draw(value(VALID_TEXT, anything))
    if not clean and draw(sometimes(1, 9)):
        names = field_names_not_in(SESSION_OPEN_FIELDS, binary)
        frame.update(draw(st.dictionaries(names, anything, min_size=1, max_size=2)))
    turn = weighted((5, NONEMPTY_TEXT), (1, st.fixed_dictionaries({"content": NONEMPTY_TEXT})))
    if not clean:
        turn = weighted((7, turn), (2, st.none()), (2, EDGE_SCALARS), (1, anything))
    return SessionCase(frame, draw(turn), draw(st.integers(1, 4)))


RAW_TEXT_FRAMES = ["", "{oops", "[", '{"type": "ping"', "\ufeff{}", '{"type": "ping"}}', "1e999999"]
RAW_TEXT_FRAMES += ["[" * 100_000, "{" * 50_000, '{"type": "generate", "id": "\\ud800"']
RAW_BINARY_FRAMES = [b"", b"\xc1", b"\x93\xff\xfe", b"\x81", b"\xdf\xff\xff\xff\xff"]
RAW_BINARY_FRAMES += [b"\xdd\xff\xff\xff\xff", b"\xc7\x00\x05", b"\xd9\x05ab", b"\x91" * 100_000]


@st.composite
def control_frames(draw, binary: bool = False):
    """Frames other than generate and session.open: ping, cancel, session.close, auth,
    unknown types, non-objects, raw text and bytes."""
    anything = ANYTHING_MSGPACK if binary else ANYTHING
    shape = draw(weighted((6, st.just("object")), (2, st.just("value")), (2, st.just("raw"))))
    if shape == "value":
        return draw(anything)
    if shape == "raw":
        return Raw(
            draw(
                weighted(
                    (2, st.sampled_from(RAW_TEXT_FRAMES)),
                    (2, st.sampled_from(RAW_BINARY_FRAMES)),
                    (1, st.binary(max_size=32)),
                )
            )
        )
    frame: dict[Any, Any] = {}
    if draw(sometimes(9, 1)):
        frame["type"] = draw(
            weighted(
                (6, st.sampled_from(WS_CONTROL_TYPES)), (1, texts_for(binary)), (1, EDGE_SCALARS)
            )
        )
    for name, values in (
        ("id", ws_ids(anything, binary)),
        ("session_id", weighted((1, texts_for(binary)), (1, anything))),
        ("token", weighted((1, texts_for(binary)), (1, anything))),
    ):
        if draw(sometimes(1, 2)):
            frame[name] = draw(values)
    if draw(sometimes(1, 5)):
        names = field_names_not_in(frozenset({"type", "id", "session_id", "token"}), binary)
        frame.update(draw(st.dictionaries(names, anything, min_size=1, max_size=2)))
    return frame
