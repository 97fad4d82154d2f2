"""Per-request sampling parameters, with vLLM's field names and defaults, validated once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.kv_transfer.params import KVTransferParams
from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from engine.text.text_checks import check_text

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for, per token
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_SEQUENCES = 256  # the most sequences (n, best_of) one request may ask for
MAX_BEAM_WIDTH = 16
MAX_STOP_STRINGS = 32  # stop strings are matched against every token's text: bounded
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_COUNT = 2**31 - 1  # token counts (max_tokens, min_tokens, top_k)
SEED_RANGE = (-(2**63), 2**64 - 1)  # a seed is a 64-bit value, signed or not (as torch's)
_GREEDY_EPS = 1e-5  # temperatures below this mean greedy decoding


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; the message names it."""


def _fail(name: str, rule: str, value: Any) -> None:
    kind = f" ({type(value).__name__})" if isinstance(value, bool) else ""
    raise SamplingParamsError(f"{name} must be {rule}, got {_shown(value)}{kind}")


def _shown(value: Any, limit: int = 80) -> str:
    """A value for an error message: its repr, cut short (a request may be huge)."""
    if isinstance(value, list | tuple | dict) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # ints past 4,300 digits; deep nesting
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int, hi: int, *, none_ok: bool = False) -> None:
    """Reject bools, non-ints and values outside [lo, hi]; None only when `none_ok`."""
    if value is None and none_ok:
        return
    rule = f"an int in [{lo}, {hi}]" + (" or None" if none_ok else "")
    if not _is_int(value) or value < lo or value > hi:
        _fail(name, rule, value)


def _as_float(name: str, value: Any, rule: str) -> float:
    """A finite float from an int or float (bools and strings rejected)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(name, f"a finite number {rule}".rstrip(), value)
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, "a bool", value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; valid by construction, immutable afterwards.

    Contract: after `__post_init__` every field is in range and normalized: floats are
    `float`, `top_k` is 0 (disabled) or >= 1, `stop` and `stop_token_ids` are tuples,
    `logit_bias` is None or a fresh `dict[int, float]`. Token-id bounds need the model's
    vocabulary, so callers also run `check_vocab(vocab_size)` once the model is known.
    Any invalid value raises `SamplingParamsError` naming the field, the value and the
    allowed range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    best_of: int | None = None  # sample this many, return the n best by cumulative logprob
    use_beam_search: bool = False  # beam width: best_of, else n; returns the n best beams
    length_penalty: float = 1.0  # beam score = sum logprob / generated length ** this
    early_stopping: bool | str = False  # True, False (a heuristic) or "never", as in HF
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match
    # prefill/decode disaggregation (vLLM's kv_transfer_params): save this prompt's KV for
    # a decode instance, or load it from a prefill instance (a dict of its keys is converted)
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        self._check_floats()
        self._check_ints()
        self._check_bools()
        self._set("stop", _normalize_stop(self.stop))
        self._set("stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))
        self._set("logit_bias", _normalize_logit_bias(self.logit_bias))
        self._set("structured_outputs", _normalize_structured(self.structured_outputs))
        self._set("kv_transfer_params", _normalize_kv_transfer(self.kv_transfer_params))
        self._check_beam_search()
        self._check_structured()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_floats(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                _fail(name, "in [-2, 2]", value)
            self._set(name, value)
        checks = {
            "repetition_penalty": ("> 0", lambda v: v > 0.0),
            "temperature": (">= 0", lambda v: v >= 0.0),
            "top_p": ("in (0, 1]", lambda v: 0.0 < v <= 1.0),
            "min_p": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        }
        for name, (rule, ok) in checks.items():
            value = _as_float(name, getattr(self, name), rule)
            if not ok(value):
                _fail(name, rule, value)
            self._set(name, value)

    def _check_ints(self) -> None:
        _check_int("n", self.n, 1, MAX_SEQUENCES)
        _check_int("best_of", self.best_of, self.n, MAX_SEQUENCES, none_ok=True)
        _check_int("top_k", self.top_k, -1, MAX_COUNT)
        if self.top_k == -1:
            self._set("top_k", 0)
        _check_int("seed", self.seed, *SEED_RANGE, none_ok=True)
        _check_int("max_tokens", self.max_tokens, 1, MAX_COUNT, none_ok=True)
        _check_int("min_tokens", self.min_tokens, 0, MAX_COUNT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, none_ok=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, none_ok=True)

    def _check_bools(self) -> None:
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "use_beam_search",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            _check_bool(name, getattr(self, name))

    def _check_beam_search(self) -> None:
        self._set("length_penalty", _as_float("length_penalty", self.length_penalty, ""))
        if not (self.early_stopping is True or self.early_stopping is False) and (
            self.early_stopping != "never"
        ):
            _fail("early_stopping", 'True, False or "never"', self.early_stopping)
        if not self.use_beam_search:
            return
        sampling = {
            "temperature": (self.temperature, 0.0),
            "top_p": (self.top_p, 1.0),
            "top_k": (self.top_k, 0),
            "min_p": (self.min_p, 0.0),
            "presence_penalty": (self.presence_penalty, 0.0),
            "frequency_penalty": (self.frequency_penalty, 0.0),
            "repetition_penalty": (self.repetition_penalty, 1.0),
            "seed": (self.seed, None),
            "logit_bias": (self.logit_bias, None),
            "stop": (self.stop, ()),
            "min_tokens": (self.min_tokens, 0),
        }
        for name, (value, default) in sampling.items():
            if value != default:
                _fail(name, f"{default!r} with use_beam_search (beams rank raw logprobs)", value)
        if self.structured_outputs is not None:
            rule = "None with use_beam_search (beams would each need their own grammar state)"
            _fail("structured_outputs", rule, self.structured_outputs.kind.value)
        if self.logprobs is not None:
            rule = "None with use_beam_search (beam outputs carry no per-token logprobs)"
            _fail("logprobs", rule, self.logprobs)
        if self.beam_width > MAX_BEAM_WIDTH:
            rule = f"<= {MAX_BEAM_WIDTH} with use_beam_search (the beam width)"
            _fail("best_of", rule, self.beam_width)

    def _check_structured(self) -> None:
        """A grammar ends its output with the end-of-sequence token, the only token it
        allows once complete: ignore_eos would sample past it, and min_tokens could
        forbid it when the grammar is complete sooner."""
        if self.structured_outputs is None:
            return
        if self.ignore_eos:
            rule = "False with structured_outputs (the output ends on EOS once it matches)"
            _fail("ignore_eos", rule, self.ignore_eos)
        if self.min_tokens:
            rule = "0 with structured_outputs (the grammar decides where the output ends)"
            _fail("min_tokens", rule, self.min_tokens)

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `SamplingParamsError` if a stop token id or logit_bias key is >= vocab_size."""
        for token_id in self.stop_token_ids or ():
            if token_id >= vocab_size:
                _fail("stop_token_ids", f"token ids < vocab size {vocab_size}", token_id)
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                _fail("logit_bias", f"keyed by token ids < vocab size {vocab_size}", token_id)

    @property
    def num_sequences(self) -> int:
        """How many sequences the request samples (best_of, else n)."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def with_updates(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple):
        _fail("stop", "a str, a list of str or None", stop)
    if len(items) > MAX_STOP_STRINGS:
        _fail("stop", f"at most {MAX_STOP_STRINGS} strings", items)
    for s in items:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
            _fail("stop", f"a list of strings of 1 to {MAX_STOP_STRING_CHARS} characters", s)
        _check_text("stop", s)
    return tuple(items)


def _check_text(name: str, text: str) -> None:
    try:
        check_text(name, text)
    except ValueError as exc:
        raise SamplingParamsError(str(exc)) from None


def _normalize_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple):
        _fail("stop_token_ids", "a list of non-negative ints or None", ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        _fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids", ids)
    for token_id in ids:
        _check_int("stop_token_ids", token_id, 0, MAX_COUNT)
    return tuple(ids)


def _normalize_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        _fail("logit_bias", "a dict of token id -> bias or None", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _token_id_key(key)
        rule = f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"
        bias_value = _as_float(f"logit_bias[{token_id}]", value, rule)
        if abs(bias_value) > MAX_ABS_LOGIT_BIAS:
            _fail(f"logit_bias[{token_id}]", rule, bias_value)
        out[token_id] = bias_value
    return out


def _token_id_key(key: Any) -> int:
    """A logit_bias key: an int, or a string of digits as JSON objects deliver it."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        key = int(key)
    if not _is_int(key) or not 0 <= key <= MAX_COUNT:
        rule = f"keyed by token ids (ints in [0, {MAX_COUNT}] or strings of their digits)"
        _fail("logit_bias", rule, key)
    return key


def _normalize_kv_transfer(value: Any) -> KVTransferParams | None:
    """None, or KVTransferParams (a dict of vLLM's keys is converted and checked)."""
    if value is None or isinstance(value, KVTransferParams):
        return value
    if not isinstance(value, dict):
        _fail("kv_transfer_params", "an object of vLLM's kv_transfer_params keys", value)
    try:
        params = KVTransferParams.from_dict(value)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not message.startswith("kv_transfer_params"):
            message = f"kv_transfer_params: {message}"
        raise SamplingParamsError(message) from None
    return None if not (params.do_remote_decode or params.do_remote_prefill) else params


def _normalize_structured(value: Any) -> StructuredOutputsParams | None:
    """None, or a StructuredOutputsParams (an object of its fields is converted)."""
    if value is None:
        return None
    try:
        return StructuredOutputsParams.from_dict(value)
    except StructuredOutputsError as exc:
        raise SamplingParamsError(str(exc)) from None
    except TypeError as exc:  # a field of the wrong kind for a keyword
        raise SamplingParamsError(f"structured_outputs: {exc}") from None
