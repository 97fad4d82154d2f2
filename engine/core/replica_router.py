"""`ReplicaRouter`: which data-parallel replica serves a request (pure logic).

Prefix affinity first, load second: a replica that served a prompt's earlier prefix
(a chat's earlier turns, a long shared document) likely still holds its KV blocks in
its prefix cache, so sending the request there skips recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ChatPairs = Sequence[tuple[str, str]]  # (role, content) per message
RoutedPrompt = str | Sequence[int] | ChatPairs
SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class RoutingPolicy:
    """The router's knobs. Prefixes are hashed per `text_chunk_chars` characters of a
    text prompt, per `ids_chunk` token ids, per message of a chat; each replica remembers
    at most `max_hashes_per_replica` (least recently routed forgotten first). A prefix
    match is followed unless its replica has more than `max_imbalance` open requests
    beyond the least-loaded replica AND more than `max_imbalance_ratio` times its load."""

    text_chunk_chars: int = 256
    ids_chunk: int = 16
    max_hashes_per_replica: int = 100_000
    max_imbalance: int = 8
    max_imbalance_ratio: float = 1.5

    def __post_init__(self) -> None:
        for name in ("text_chunk_chars", "ids_chunk", "max_hashes_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        if not self.max_imbalance_ratio >= 1:
            raise ValueError(f"max_imbalance_ratio must be >= 1, got {self.max_imbalance_ratio}")


@dataclass(frozen=True)
class Prefixes:
    """A prompt's chained prefix hashes (hash i covers units 0..i: chunks or messages)
    and how deep a match must go to count: deeper than `min_depth` units."""

    hashes: tuple[int, ...]
    min_depth: int = 0


class ReplicaRouter:
    """Picks one of `num_replicas` replicas for each prompt, given each one's load (its
    open requests), and remembers the prompt's prefixes on the replica it picked.

    The rule, in order:
    1. Prefix affinity. Each replica's match is how many of the prompt's leading prefix
       hashes it has recorded. A match counts only when it is deeper than the prompt's
       `min_depth`: for a chat, its leading system (or developer) messages, so a chat
       must match at least one whole user turn beyond a system prompt that every
       session shares. The deepest counting match wins; equal matches go to the least
       loaded of them.
    2. Load guard. The affinity pick is kept unless its load exceeds the least load by
       more than `max_imbalance` and by more than `max_imbalance_ratio` times. This
       stops a common prefix that is not a system message (a shared few-shot text, the
       same first user line in many chats) from piling every request on the replica
       that saw it first: once that replica is ahead, the next request goes to the
       least-loaded one, which records the prefix too, and from then on the two match
       equally and load decides.
    3. Otherwise (no counting match, or the guard tripped): the least-loaded replica;
       ties go to the replica that has been sent the fewest requests so far, then to
       the lowest index, so a sequence of independent requests alternates even when
       each finishes before the next arrives.

    Text prompts hash each full `text_chunk_chars` chunk, token-id prompts each full
    `ids_chunk` ids (a partial tail is not hashed), chats one hash per message prefix,
    so turn k+1 (turn k's messages, the reply, a new message) matches turn k's prompt
    in full. Hashes are Python's, chained; a collision only misroutes a request."""

    def __init__(self, num_replicas: int, policy: RoutingPolicy | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.policy = policy or RoutingPolicy()
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.num_routed = [0] * num_replicas

    @property
    def num_replicas(self) -> int:
        return len(self._seen)

    def route(
        self,
        prompt: RoutedPrompt,
        loads: Sequence[int],
        available: Sequence[bool] | None = None,
    ) -> int:
        """The replica for `prompt` (see the class doc), among the `available` ones
        (default: all; ValueError when none is); its prefixes are recorded there."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads given for {self.num_replicas} replicas")
        prefixes = self.prefixes(prompt)
        replica = self.choose(prefixes, loads, available)
        self.record(replica, prefixes)
        self.num_routed[replica] += 1
        return replica

    def choose(
        self, prefixes: Prefixes, loads: Sequence[int], available: Sequence[bool] | None = None
    ) -> int:
        """The replica the rule picks among the available ones, recording nothing."""
        replicas = [r for r in range(self.num_replicas) if available is None or available[r]]
        if not replicas:
            raise ValueError("no replica is available")
        least = min(replicas, key=lambda r: (loads[r], self.num_routed[r], r))
        depths = {r: self.match_depth(r, prefixes.hashes) for r in replicas}
        best = max(depths.values())
        if best <= prefixes.min_depth:
            return least
        pick = min((r for r in replicas if depths[r] == best), key=lambda r: (loads[r], r))
        return least if self._too_busy(loads[pick], loads[least]) else pick

    def _too_busy(self, load: int, least_load: int) -> bool:
        p = self.policy
        return load - least_load > p.max_imbalance and load > least_load * p.max_imbalance_ratio

    def match_depth(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, `replica` has recorded."""
        seen = self._seen[replica]
        depth = 0
        for h in hashes:
            if h not in seen:
                break
            depth += 1
        return depth

    def record(self, replica: int, prefixes: Prefixes) -> None:
        """Remembers `prefixes` on `replica` as most recently routed; forgets its least
        recently routed hashes beyond the policy's bound."""
        seen = self._seen[replica]
        for h in prefixes.hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.policy.max_hashes_per_replica:
            seen.popitem(last=False)

    def prefixes(self, prompt: RoutedPrompt) -> Prefixes:
        """The chained prefix hashes of a text, token-id or chat prompt."""
        if isinstance(prompt, str):
            size = self.policy.text_chunk_chars
            return Prefixes(_chained("text", _full_chunks(prompt, size)))
        if prompt and isinstance(prompt[0], tuple):
            chat = [(str(role), str(content)) for role, content in prompt]
            roles = [role for role, _ in chat]
            leading = next((i for i, r in enumerate(roles) if r not in SYSTEM_ROLES), len(chat))
            return Prefixes(_chained("chat", chat), min_depth=leading)
        ids = [tuple(chunk) for chunk in _full_chunks(prompt, self.policy.ids_chunk)]
        return Prefixes(_chained("ids", ids))


def _full_chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]


def _chained(kind: str, units: Sequence[object]) -> tuple[int, ...]:
    """hash_i = hash(hash_{i-1}, unit_i), seeded by the prompt's kind (a text never
    matches a chat or ids)."""
    hashes, previous = [], hash(kind)
    for unit in units:
        previous = hash((previous, unit))
        hashes.append(previous)
    return tuple(hashes)
