"""How many generation requests each client has open at once, capped
(`--max-concurrent-per-key`): one client's burst cannot take the whole engine while the
others wait behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from starlette.datastructures import Address

from web.api_keys import ApiKeys, bearer_key
from web.errors import ApiError


class ClientKind(StrEnum):
    """What names a client: its API key when the server has keys, else its address."""

    API_KEY = "API key"
    ADDRESS = "client address"


@dataclass(frozen=True)
class Client:
    """One client, as its open requests are counted: `name` is its key's fingerprint
    (the key itself is never kept) or the IP address it connects from."""

    kind: ClientKind
    name: str

    @classmethod
    def of_key(cls, key: str) -> Client:
        return cls(ClientKind.API_KEY, ApiKeys.fingerprint(key))

    @classmethod
    def of_address(cls, address: Address | None) -> Client:
        return cls(ClientKind.ADDRESS, address.host if address is not None else "unknown")

    @classmethod
    def of_http(
        cls, api_keys: ApiKeys, authorization: Sequence[str], address: Address | None
    ) -> Client:
        """An HTTP request's client, from its Authorization header values: its bearer
        key when the server has keys (the key middleware has checked it by then), else
        its address."""
        key = bearer_key(authorization) if api_keys else None
        return cls.of_address(address) if key is None else cls.of_key(key)


class ClientConcurrency:
    """Counts each client's open requests (an HTTP completion or chat completion, a
    WebSocket `generate`) and refuses one more than `limit` with `too_many_requests`
    (HTTP 429) until one of that client's requests ends. `limit` None: no cap, nothing
    counted. Contract: each `acquire` that returns is matched by exactly one `release`
    of the same client."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # checked by ServerConfig
        self.open: dict[Client, int] = {}  # clients with requests open, and how many

    def check(self, client: Client) -> None:
        """Raises ApiError (429) if `client` is at the cap; counts nothing."""
        count = self.open.get(client, 0)
        if self.limit is not None and count >= self.limit:
            noun = "request" if count == 1 else "requests"
            raise ApiError(
                "too_many_requests",
                f"this {client.kind} already has {count} {noun} open, as many as this server "
                f"allows at once (--max-concurrent-per-key {self.limit}); retry when one ends",
            )

    def acquire(self, client: Client) -> None:
        """Counts one more request of `client`, or raises ApiError (429) at the cap."""
        self.check(client)
        if self.limit is not None:
            self.open[client] = self.open.get(client, 0) + 1

    def release(self, client: Client) -> None:
        """One request of `client` ended."""
        if self.limit is None:
            return
        count = self.open.pop(client) - 1
        if count:
            self.open[client] = count
