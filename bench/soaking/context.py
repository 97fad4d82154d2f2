"""The run's shared state (Ctx): settings, the server's URLs, clients, pools, prompts."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from dataclasses import dataclass, field

import httpx
from workload import SHARED

from .conn import CheckoutPool, WsPool

ALPACA = SHARED / "data" / "alpaca_data_first1727.json"
STORY_OPENINGS = (
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park",
    "One day, a big bird",
    "Tom had a red ball. He",
    "The sun was shining and",
    "There was a girl named Sue who",
    "Mom said",
    "The cat sat on the mat and",
    "In a small town there lived a",
)


def load_prompts() -> list[str]:
    """STORY_OPENINGS and up to 300 short Alpaca instructions (when ../shared has them)."""
    prompts = list(STORY_OPENINGS)
    with contextlib.suppress(OSError, ValueError):
        records = json.loads(ALPACA.read_text())
        prompts += [r["instruction"] for r in records if len(r["instruction"]) <= 120][:300]
    return prompts


def route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def ws_url(base_url: str) -> str:
    return base_url.replace("http", "ws", 1) + "/v1/stream"


@dataclass
class Ctx:
    """What every request kind needs: URLs, clients, pools, prompts, settings; and the
    client-side counts the Sampler reads (requests in flight, requests answered)."""

    args: argparse.Namespace
    base_url: str
    prompts: list[str]
    http: httpx.AsyncClient
    pools: dict[bool, WsPool]  # by binary
    bad_pools: dict[bool, CheckoutPool]  # by binary
    ids: itertools.count = field(default_factory=itertools.count)
    in_flight: int = 0
    answered: int = 0

    @classmethod
    def open(cls, args: argparse.Namespace, base_url: str, http: httpx.AsyncClient) -> Ctx:
        """A context with the prompts loaded and empty pools (sockets open on first use)."""
        url = ws_url(base_url)
        return cls(
            args,
            base_url,
            load_prompts(),
            http,
            {b: WsPool(url, b, args.ws_connections) for b in (False, True)},
            {b: CheckoutPool(url, b) for b in (False, True)},
        )

    @property
    def ws_url(self) -> str:
        return ws_url(self.base_url)

    def completions_url(self, chat: bool) -> str:
        return self.base_url + route(chat)

    def new_id(self) -> str:
        return f"s{next(self.ids)}"

    async def close_pools(self) -> None:
        for pool in (*self.pools.values(), *self.bad_pools.values()):
            await pool.close()
