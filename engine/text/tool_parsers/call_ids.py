"""Tool-call ids: how each call in an output is named for the client.

A call-id function takes the call's index within one output (0, 1, ...) and returns its
id. The default is random, as OpenAI's (`call_` and 24 hex digits); a caller that wants
ids it can predict (tests, replays) passes `counting_call_ids(prefix)`, whose ids are
`prefix + index` and so unique only within one output unless the prefix is (put the
request id and choice index in it)."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable

CallIdFunction = Callable[[int], str]

_ALPHANUMERIC = string.ascii_letters + string.digits


def random_call_id(index: int) -> str:
    """`call_` and 24 random hex digits; `index` is ignored."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id(index: int) -> str:
    """Nine random letters and digits: Mistral's chat templates refuse any other id shape
    when the call comes back in the conversation; `index` is ignored."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def counting_call_ids(prefix: str = "call_") -> CallIdFunction:
    """Deterministic ids: `prefix` followed by the call's index in the output."""
    return lambda index: f"{prefix}{index}"
