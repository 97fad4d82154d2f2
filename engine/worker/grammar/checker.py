"""Refuses a constraint that cannot compile before its request is scheduled."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from engine.worker.grammar.backend import GrammarBackend
from engine.worker.grammar.compile_cache import DEFAULT_CACHE_SIZE, GrammarCache

DEFAULT_COMPILE_TIMEOUT_S = 5.0


class GrammarChecker:
    """`check(params)` compiles the constraint for this engine's vocabulary (through an
    LRU cache) and raises `StructuredOutputsError` naming the field when it cannot: a
    syntax error, a schema feature the backend lacks, no tokenizer or end token.

    Injected into the text processor (which never imports the backend); the backend
    (`make_backend`: `backend.build_backend` for the engine's tokenizer and model) is
    built on the first structured request. Bounded in time: besides the size limit on
    each constraint's text, an uncached compile runs on a daemon thread that `check`
    waits for at most `timeout_s`; past that the request is refused. A compile cannot be
    stopped: it finishes in the background, its constraint refused whatever it gives;
    while one such compile still runs, new constraints are refused rather than queued.
    """

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._make_backend = make_backend
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._cache: GrammarCache | None = None
        self._overdue: threading.Thread | None = None  # a compile past its deadline
        self._lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        cache = self.cache
        if params in cache:
            cache.get(params)  # raises again for a constraint that did not compile
            return
        self._compile_within(cache, params)

    @property
    def cache(self) -> GrammarCache:
        """The compile cache (its backend built on first use)."""
        with self._lock:
            if self._cache is None:
                self._cache = GrammarCache(self._make_backend(), self.cache_size)
            return self._cache

    def _compile_within(self, cache: GrammarCache, params: StructuredOutputsParams) -> None:
        """Compiles on a thread of its own, waiting at most `timeout_s`; a constraint
        that takes longer is refused now and later, however its compile ends (a
        request admitted with it would stall the worker's steps as long)."""
        field = f"structured_outputs.{params.kind.value}"
        with self._lock:
            if self._overdue is not None and self._overdue.is_alive():
                raise StructuredOutputsError(
                    f"{field} was not checked: the grammar compiler is still busy with a "
                    f"constraint that took more than {self.timeout_s:g} s; retry shortly"
                )
            done: list = []  # the compiled grammar, or the StructuredOutputsError
            thread = threading.Thread(
                target=_compile, args=(cache.backend, params, done), name="grammar-check"
            )
            thread.daemon = True
            thread.start()
            thread.join(self.timeout_s)
            if thread.is_alive():
                self._overdue = thread
                error = f"{field} takes more than {self.timeout_s:g} s to compile; simplify it"
                cache.refuse(params, error)
                raise StructuredOutputsError(error)
        if isinstance(done[0], StructuredOutputsError):
            cache.refuse(params, str(done[0]))
            raise done[0]
        cache.put(params, done[0])


def _compile(backend: GrammarBackend, params: StructuredOutputsParams, done: list) -> None:
    try:
        done.append(backend.compile(params))
    except StructuredOutputsError as exc:
        done.append(exc)
    except Exception as exc:  # noqa: BLE001 - a bug in the backend, told to the caller
        done.append(
            StructuredOutputsError(f"structured_outputs: the grammar backend failed: {exc!r}")
        )
