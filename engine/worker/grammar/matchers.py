"""The worker's grammar matchers: one per constrained sequence, over one compile cache."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from engine.worker.grammar.backend import GrammarBackend, GrammarMatcher
from engine.worker.grammar.compile_cache import DEFAULT_CACHE_SIZE, GrammarCache
from engine.worker.grammar.step_bitmask import GrammarBitmask, step_bitmask

if TYPE_CHECKING:
    import torch

MAX_PREPARING = 8  # prepared constraints waiting or compiling at once


class GrammarMatchers:
    """Gives each constrained sequence its matcher and each step its bitmask.

    Held by the rank that samples (rank 0 under tensor parallelism; the others append
    the tokens it broadcasts and need no grammar). The backend (`make_backend`:
    `backend.build_backend` over the engine's tokenizer, which it loads) is built on the
    first structured request, so a worker that never sees one loads nothing. Compiled
    grammars are shared by all sequences with the same constraint (the `n` samples of
    a request, repeated schemas) through an LRU cache of `cache_size`. A constraint the
    scheduler announces (`prepare`, from PrepareGrammar) compiles in the background, so
    the step that brings its request rarely waits for it."""

    def __init__(
        self, make_backend: Callable[[], GrammarBackend], cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        self._make_backend = make_backend
        self.cache_size = cache_size
        self._cache: GrammarCache | None = None
        self._building = threading.Lock()
        self._compiling: dict[StructuredOutputsParams, Future] = {}  # prepared, not yet used
        self._compiler: ThreadPoolExecutor | None = None  # one background compile at a time

    def prepare(self, params: StructuredOutputsParams) -> None:
        """Starts compiling `params` in the background (xgrammar releases the GIL), for a
        request on its way; `matcher` waits for it rather than compiling again. At most
        MAX_PREPARING wait their turn: past that, a hint is dropped (its request compiles
        when it arrives), so a flood of distinct schemas cannot queue up work here."""
        if params in self._compiling or (self._cache is not None and params in self._cache):
            return
        if len(self._compiling) >= MAX_PREPARING:
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling[params] = self._compiler.submit(self._compile, params)

    def _compile(self, params: StructuredOutputsParams) -> None:
        try:
            self.cache.get(params)
        except StructuredOutputsError:
            pass  # remembered by the cache; the request that needs it fails with it

    @property
    def cache(self) -> GrammarCache:
        """Built on first use (the backend loads the tokenizer), by whichever thread
        comes first: a background compile or the step loop."""
        with self._building:
            if self._cache is None:
                self._cache = GrammarCache(self._make_backend(), self.cache_size)
        return self._cache

    @property
    def backend(self) -> GrammarBackend:
        return self.cache.backend

    def matcher(
        self, params: StructuredOutputsParams, output_token_ids: Sequence[int] = ()
    ) -> GrammarMatcher:
        """A matcher for `params` that has accepted `output_token_ids` (a sequence sent
        with outputs already: they are replayed). StructuredOutputsError when the
        constraint does not compile or forbids one of those outputs."""
        pending = self._compiling.pop(params, None)
        if pending is not None:
            pending.result()  # compiled by now, or soon: never twice
        matcher = self.backend.matcher(self.cache.get(params))
        for position, token in enumerate(output_token_ids):
            if matcher.is_terminated:
                break
            if not matcher.accept(token):
                raise StructuredOutputsError(
                    f"structured_outputs.{params.kind.value}: output token {position} "
                    f"(id {token}) does not match the grammar"
                )
        return matcher

    def step_bitmask(
        self, matchers: Sequence[GrammarMatcher | None], device: torch.device | str
    ) -> GrammarBitmask | None:
        """The step's mask (`step_bitmask.step_bitmask`); None when no row is constrained."""
        if all(m is None for m in matchers):
            return None
        return step_bitmask(self.backend, matchers, device)
