"""The server's API keys: where they come from, how a candidate is checked, and the
fingerprint that stands for a key (session owners) without keeping it around."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from pathlib import Path

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def bearer_key(authorization: Sequence[str]) -> str | None:
    """The key of a request's `Authorization: Bearer KEY` header, from all the request's
    Authorization header values (None: no header, or another scheme). Several headers
    raise ValueError naming the header: which one counts would depend on the proxies
    in between (most keep the last, some the first), so none does."""
    if len(authorization) > 1:
        raise ValueError(
            f"{len(authorization)} Authorization headers; send exactly one "
            "(Authorization: Bearer KEY)"
        )
    if authorization and authorization[0].lower().startswith("bearer "):
        return authorization[0][7:].strip()
    return None


class ApiKeys:
    """A frozen set of keys (empty: no authentication). `matches` compares in constant
    time, so response timing tells nothing about a key's characters."""

    def __init__(self, keys: frozenset[str] = frozenset()) -> None:
        if any(not k or k != k.strip() for k in keys):
            raise ValueError("API keys must be non-empty and have no surrounding whitespace")
        self._keys = tuple(k.encode("utf-8") for k in sorted(keys))

    @classmethod
    def gather(cls, given: list[str], files: list[str], env: dict[str, str]) -> ApiKeys:
        """Keys from --api-key (visible in the process list: prefer the others), from
        --api-key-file (one key per line, # comments), and from $PAGEDSERVE_API_KEY."""
        keys = set(given)
        for name in files:
            try:
                lines = Path(name).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise ValueError(f"cannot read --api-key-file {name}: {exc.strerror}") from None
            keys |= {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
        if env.get(API_KEY_ENV, "").strip():
            keys.add(env[API_KEY_ENV].strip())
        return cls(frozenset(keys))

    @classmethod
    def from_environment(cls, given: list[str], files: list[str]) -> ApiKeys:
        return cls.gather(given, files, dict(os.environ))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def matches(self, candidate: object) -> bool:
        if not isinstance(candidate, str):
            return False
        given = candidate.encode("utf-8", "surrogatepass")
        found = False
        for key in self._keys:  # every key compared: the time does not say which matched
            found |= hmac.compare_digest(given, key)
        return found

    @staticmethod
    def fingerprint(key: str) -> str:
        """A stand-in for a key (its SHA-256, shortened) that reveals nothing of it."""
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
