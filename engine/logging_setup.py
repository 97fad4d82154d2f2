"""Start-up logs for a user who never configured logging (as vLLM does for its own).

`configure_logging()` (called by `LLM(...)`) gives the project's top-level loggers
(`engine`, `actors`, `web`, `cuda_ext`) a stderr handler and a level, unless the
application configured logging itself (the root logger has a handler, or one of those
loggers has a handler or level of its own) or opts out. Environment:
  PAGEDSERVE_CONFIGURE_LOGGING=0   leave logging alone
  PAGEDSERVE_LOGGING_LEVEL=LEVEL    DEBUG, INFO (default), WARNING, ERROR or CRITICAL
Records still propagate: once the application gives the root logger a handler (say a
later `logging.basicConfig`), ours stays silent, so no line is printed twice.
"""

from __future__ import annotations

import logging
import os

PACKAGES = ("engine", "actors", "web", "cuda_ext")
CONFIGURE_ENV = "PAGEDSERVE_CONFIGURE_LOGGING"
LEVEL_ENV = "PAGEDSERVE_LOGGING_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class _UntilRootHandles(logging.Filter):
    """Passes records only while the root logger has no handler of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


class _PackageHandler(logging.StreamHandler):
    """The stderr handler `configure_logging` adds (told apart from the app's own)."""


def configure_logging() -> None:
    """Idempotent: see the module docstring. Raises ValueError for an unknown level."""
    if os.environ.get(CONFIGURE_ENV, "1").strip() == "0":
        return
    level = _level()
    if logging.getLogger().handlers:
        return  # the application configured logging
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if logger.handlers or logger.level != logging.NOTSET:
            continue  # ours already, or the application's choice
        handler = _PackageHandler()  # stderr
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(_UntilRootHandles())
        logger.addHandler(handler)
        logger.setLevel(level)


def _level() -> int:
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    if name not in LEVELS:
        raise ValueError(f"{LEVEL_ENV} must be one of {', '.join(LEVELS)}; got {name!r}")
    return logging.getLevelName(name)
