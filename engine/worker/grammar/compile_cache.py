"""An LRU cache of compiled grammars, keyed by the constraint."""

from __future__ import annotations

import threading
from collections import OrderedDict

from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from engine.worker.grammar.backend import CompiledGrammar, GrammarBackend

DEFAULT_CACHE_SIZE = 128


class GrammarCache:
    """`get(params)` compiles through `backend` at most once per distinct constraint
    while it stays among the `size` most recently used; a constraint that did not
    compile (or was `refuse`d) is remembered too, and raises the same
    `StructuredOutputsError` again. Safe to call from several threads (two may compile
    one new constraint at once)."""

    def __init__(self, backend: GrammarBackend, size: int = DEFAULT_CACHE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"the grammar cache size must be >= 1, got {size}")
        self.backend = backend
        self.size = size
        self._entries: OrderedDict[StructuredOutputsParams, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def get(self, params: StructuredOutputsParams) -> CompiledGrammar:
        with self._lock:
            entry = self._entries.get(params)
            if entry is not None:
                self._entries.move_to_end(params)
        if entry is None:
            self.num_compiles += 1
            try:
                entry = self.backend.compile(params)
            except StructuredOutputsError as exc:
                entry = _Refused(str(exc))
            self.put(params, entry)
        if isinstance(entry, _Refused):
            raise StructuredOutputsError(entry.error)
        return entry

    def put(self, params: StructuredOutputsParams, compiled: CompiledGrammar) -> None:
        """Keeps `compiled` (compiled elsewhere) as the grammar of `params`."""
        with self._lock:
            self._entries[params] = compiled
            self._entries.move_to_end(params)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def refuse(self, params: StructuredOutputsParams, error: str) -> None:
        """From now on (while it stays cached) `get(params)` raises `error`."""
        self.put(params, _Refused(error))

    def __contains__(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class _Refused:
    """A cache entry for a constraint that did not compile: the error it raised."""

    def __init__(self, error: str) -> None:
        self.error = error
