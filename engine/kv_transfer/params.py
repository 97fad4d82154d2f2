"""`kv_transfer_params`: what a request and its response carry between a prefill and a
decode instance (vLLM's keys, so a vLLM proxy can pass them through unchanged).

1. The proxy sends the prompt to the prefill instance with `{"do_remote_decode": true}`
   (`KVTransferParams.remote_decode()`): compute the prompt, keep its blocks for a
   decode instance.
2. The prefill instance answers with `{"do_remote_prefill": true, "remote_engine_id":
   ..., "remote_host": ..., "remote_port": ..., "remote_block_ids": [...],
   "remote_request_id": ...}`: where the blocks wait.
3. The proxy sends the same prompt, with those params, to the decode instance, which
   loads the blocks instead of computing the prompt.

`KVTransferParams.from_dict` checks every key (unknown ones are refused by name) and
the keys a direction needs; `to_dict` gives the JSON/msgpack-friendly dict back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_KEYS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
)
_REMOTE_KEYS = _KEYS[2:]


@dataclass(frozen=True)
class KVTransferParams:
    """One request's kv_transfer_params, checked.

    - `do_remote_decode`: (to a producer) decoding happens elsewhere: save this prompt's
      blocks and answer with where they are.
    - `do_remote_prefill`: (to a consumer) the prompt was computed elsewhere: load its
      blocks from `remote_host:remote_port`, engine `remote_engine_id`, where they are
      held under `remote_request_id` as the blocks `remote_block_ids` (the producer's
      ids, in the prompt's order). All five are required with it.
    At most one of the two flags is set.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None

    def __post_init__(self) -> None:
        for key in ("do_remote_decode", "do_remote_prefill"):
            _check(key, getattr(self, key), lambda v: v is True or v is False, "true or false")
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError(
                "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be "
                "true (a request is either computed here for a decode elsewhere, or loaded here)"
            )
        for key in ("remote_engine_id", "remote_host", "remote_request_id"):
            _check(
                key,
                getattr(self, key),
                _optional(lambda v: type(v) is str and v != ""),
                "a non-empty string",
            )
        _check(
            "remote_port",
            self.remote_port,
            _optional(lambda v: type(v) is int and 1 <= v <= 65535),
            "an int in [1, 65535]",
        )
        _check(
            "remote_block_ids",
            self.remote_block_ids,
            _optional(_is_block_ids),
            "a list of block ids (ints >= 0)",
        )
        if self.do_remote_prefill:
            missing = [k for k in _REMOTE_KEYS if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"kv_transfer_params: do_remote_prefill needs {', '.join(map(repr, missing))}"
                    " (the prefill instance's response carries them)"
                )

    @classmethod
    def remote_decode(cls) -> KVTransferParams:
        """What a proxy sends the prefill instance."""
        return cls(do_remote_decode=True)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> KVTransferParams:
        """From a request's `kv_transfer_params` (JSON or msgpack); ValueError naming the
        key that is unknown, missing or of the wrong type."""
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object; got {params!r}")
        unknown = sorted(set(params) - set(_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"kv_transfer_params: {', '.join(map(repr, unknown))} not supported; "
                f"allowed keys: {list(_KEYS)}"
            )
        given = {k: v for k, v in params.items() if v is not None}
        ids = given.get("remote_block_ids")
        if type(ids) is list:
            given["remote_block_ids"] = tuple(ids)
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        """vLLM's dict: every key, block ids as a list."""
        out = dataclasses.asdict(self)
        if self.remote_block_ids is not None:
            out["remote_block_ids"] = list(self.remote_block_ids)
        return out

    @property
    def remote_address(self) -> str:
        """`tcp://remote_host:remote_port` (for a do_remote_prefill request)."""
        if self.remote_host is None or self.remote_port is None:
            raise ValueError("kv_transfer_params: no remote_host and remote_port to connect to")
        host = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host
        return f"tcp://{host}:{self.remote_port}"


def _is_block_ids(value: object) -> bool:
    return type(value) is tuple and all(type(b) is int and b >= 0 for b in value)


def _optional(test):
    return lambda v: v is None or test(v)


def _check(key: str, value: object, test, what: str) -> None:
    if not test(value):
        shown = list(value) if type(value) is tuple else value
        raise ValueError(f"kv_transfer_params: {key} must be {what}; got {shown!r}")
