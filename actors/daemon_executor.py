"""An executor whose threads never keep the process alive.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so
one call that never returns (a tokenizer stuck on a pathological input) kept a server
that had logged its shutdown alive until kill -9. Work handed to a `DaemonExecutor`
runs on daemon threads: at exit whatever is still running is abandoned with the process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_STOP = object()


class DaemonExecutor(Executor):
    """`num_threads` daemon threads taking calls first in, first out. `submit` after
    `shutdown` raises RuntimeError; `shutdown(cancel_futures=True)` cancels what has not
    started. Never waits for running calls at exit."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in self._threads:
            self._work.put(_STOP)
        if wait:
            for thread in self._threads:
                thread.join()

    def _run(self) -> None:
        while (item := self._work.get()) is not _STOP:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
