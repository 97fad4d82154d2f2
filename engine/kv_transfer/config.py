"""`kv_transfer_config`: which side of a prefill/decode pair this instance is, and where
its KV blocks are served (vLLM's shape and spelling).

    {"kv_connector": "PagedServeConnector", "kv_role": "kv_producer",
     "kv_ip": "10.0.0.5", "kv_port": 14579, "engine_id": "prefill-0"}

`KVTransferConfig.parse` takes the dict a user gives (`--kv-transfer-config` JSON,
`KVTransferConfig.from_json`) and refuses, by name, any key, role or connector this engine
does not implement rather than ignoring it. Our connector, `PagedServeConnector`, moves
blocks over TCP with ZeroMQ; vLLM's connectors are refused with the reason, except where
the library one needs is installed (`FOREIGN_CONNECTORS`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

CONNECTOR = "PagedServeConnector"
DEFAULT_PORT = 14579  # vLLM's default kv_port
DEFAULT_BUFFER_BYTES = 1_000_000_000  # vLLM's default kv_buffer_size
DEFAULT_FETCH_TIMEOUT_S = 5.0
MAX_FETCH_TIMEOUT_S = 600.0
DEFAULT_HOLD_TIMEOUT_S = 60.0

# vLLM's connector names -> the module each needs (None: not implemented here at all).
FOREIGN_CONNECTORS: dict[str, str | None] = {
    "NixlConnector": "nixl",
    "LMCacheConnectorV1": "lmcache",
    "MooncakeConnector": "mooncake",
    "P2pNcclConnector": None,
    "SharedStorageConnector": None,
    "MultiConnector": None,
    "OffloadingConnector": None,
}

_KEYS = {
    "kv_connector",
    "kv_role",
    "kv_ip",
    "kv_port",
    "engine_id",
    "kv_buffer_size",
    "kv_connector_extra_config",
}
_EXTRA_KEYS = {"fetch_timeout_s", "hold_timeout_s"}


class KVRole(StrEnum):
    """Which half of the transfer an instance does."""

    PRODUCER = "kv_producer"  # computes prompts, saves and serves their blocks
    CONSUMER = "kv_consumer"  # loads blocks computed elsewhere, then decodes
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        return self is not KVRole.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not KVRole.PRODUCER


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated kv_transfer_config (built once, frozen).

    - `kv_connector`: `PagedServeConnector`, or a vLLM name whose library imports.
    - `kv_role`: `KVRole`.
    - `kv_ip`, `kv_port`: where a producer serves its blocks, and what it tells the
      decode side (`remote_host`, `remote_port`): a routable address, not 0.0.0.0.
      Port 0 takes a free port (the connector reports the one bound).
    - `engine_id`: this instance's name in `remote_engine_id` (default: a fresh uuid).
    - `kv_buffer_size`: bytes of saved blocks a producer holds at most; the oldest
      are dropped to make room.
    - `fetch_timeout_s` (`kv_connector_extra_config`): a consumer fails a load whose
      producer has not answered within this many seconds.
    - `hold_timeout_s` (`kv_connector_extra_config`): a producer drops saved blocks
      not fetched within this many seconds.
    """

    kv_connector: str
    kv_role: KVRole
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_PORT
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_buffer_size: int = DEFAULT_BUFFER_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S

    def __post_init__(self) -> None:
        _check_connector(self.kv_connector)
        if not isinstance(self.kv_role, KVRole):
            raise ValueError(_not_one_of("kv_role", self.kv_role, [r.value for r in KVRole]))
        for key in ("kv_ip", "engine_id"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"kv_transfer_config: {key} must be a non-empty string; got {value!r}"
                )
        _check_int("kv_port", self.kv_port, 0, 65535)
        _check_int("kv_buffer_size", self.kv_buffer_size, 1, 1 << 50)
        _check_seconds("fetch_timeout_s", self.fetch_timeout_s, MAX_FETCH_TIMEOUT_S)
        _check_seconds("hold_timeout_s", self.hold_timeout_s, math.inf)

    @classmethod
    def parse(cls, config: dict[str, Any]) -> KVTransferConfig:
        """From the user's dict; ValueError naming the key and what it may be."""
        if not isinstance(config, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object; got {config!r}")
        _refuse_unknown(config, _KEYS, "")
        for key in ("kv_connector", "kv_role"):
            if config.get(key) is None:
                raise ValueError(f"kv_transfer_config: {key!r} is required")
        role = config["kv_role"]
        if role not in {r.value for r in KVRole}:
            raise ValueError(_not_one_of("kv_role", role, [r.value for r in KVRole]))
        extra = config.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(
                f"kv_transfer_config: kv_connector_extra_config must be an object; got {extra!r}"
            )
        _refuse_unknown(extra, _EXTRA_KEYS, "kv_connector_extra_config.")
        given = {k: v for k, v in config.items() if v is not None}
        given.pop("kv_connector_extra_config", None)
        if isinstance(given.get("kv_buffer_size"), float) and given["kv_buffer_size"].is_integer():
            given["kv_buffer_size"] = int(given["kv_buffer_size"])  # vLLM writes 1e9
        given["kv_role"] = KVRole(role)
        return cls(**given, **{k: _seconds(k, v) for k, v in extra.items()})

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """From `--kv-transfer-config` JSON text."""
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        return cls.parse(config)

    @property
    def address(self) -> str:
        """Where a producer serves: `tcp://kv_ip:kv_port`."""
        host = f"[{self.kv_ip}]" if ":" in self.kv_ip else self.kv_ip
        return f"tcp://{host}:{self.kv_port}"


def _check_connector(name: object) -> None:
    if name == CONNECTOR:
        return
    allowed = [CONNECTOR, *FOREIGN_CONNECTORS]
    if name not in FOREIGN_CONNECTORS:
        raise ValueError(_not_one_of("kv_connector", name, allowed))
    module = FOREIGN_CONNECTORS[name]
    if module is None:
        raise ValueError(
            f"kv_transfer_config: kv_connector {name!r} is vLLM's and is not implemented here; "
            f"use {CONNECTOR!r} (KV blocks over TCP with ZeroMQ)"
        )
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"kv_transfer_config: kv_connector {name!r} needs the {module!r} package, which "
            f"is not installed; use {CONNECTOR!r} (KV blocks over TCP with ZeroMQ)"
        )


def _refuse_unknown(config: dict, allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(config) - allowed, key=str)
    if unknown:
        names = ", ".join(repr(prefix + str(k)) for k in unknown)
        raise ValueError(
            f"kv_transfer_config: {names} not supported; allowed keys: "
            f"{[prefix + k for k in sorted(allowed)]}"
        )


def _not_one_of(key: str, value: object, allowed: list[str]) -> str:
    return f"kv_transfer_config: {key} must be one of {allowed}; got {value!r}"


def _check_int(key: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"kv_transfer_config: {key} must be an int in [{lo}, {hi}]; got {value!r}")


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"kv_transfer_config: {key} must be a number of seconds; got {value!r}")
    return float(value)


def _check_seconds(key: str, value: object, limit: float) -> None:
    seconds = _seconds(key, value)
    if not 0 < seconds <= limit:
        raise ValueError(
            f"kv_transfer_config: {key} must be > 0 and <= {limit:g} seconds; got {value!r}"
        )
