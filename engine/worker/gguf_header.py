"""A GGUF file's header, read with the `gguf` package, whose every failure names the file
and what is wrong with it.

The package's reader fails on a damaged file with what it hit on the way: "GGUF magic
invalid", an IndexError from a read past the end, "cannot mmap an empty file", or
worse, a loop that never ends (an array whose length runs past the end of the file reads
empty values for ever). `GgufHeader(path)` checks the start of the file itself and reads
the rest strictly (a read past the end stops at once), so a user sees which file to
replace and why. Needs no torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
_REPLACE = "download or convert it again"


class TruncatedFile(Exception):
    """A read of the GGUF header (or of a tensor it lists) went past the end of the file."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed  # the byte offset the read needed to reach


@functools.cache
def _strict_reader_class():
    import gguf
    import numpy as np

    class StrictReader(gguf.GGUFReader):
        """GGUFReader whose reads past the end of the file raise TruncatedFile."""

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise TruncatedFile(end)
            return super()._get(offset, dtype, count, override_order)

    return StrictReader


class GgufHeader:
    """The metadata and tensor list of the GGUF file at `path` (`reader`: the `gguf`
    package's GGUFReader). Every error is a ValueError naming the file (its base name):
    empty, not a GGUF file (wrong magic), truncated, a corrupt header, or (from `value`)
    a metadata key that is missing or has an unexpected type."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self._check_start()
        try:
            self.reader = _strict_reader_class()(str(self.path))
        except TruncatedFile as exc:
            size = self.path.stat().st_size
            raise ValueError(
                f"GGUF file {self.name} is truncated: it has {size:,} bytes, but its header "
                f"and tensors need at least {exc.needed:,}; {_REPLACE}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - whatever the reader hit, name the file
            raise ValueError(
                f"GGUF file {self.name} has a corrupt header ({type(exc).__name__}: {exc}); "
                f"{_REPLACE}"
            ) from None

    def _check_start(self) -> None:
        try:
            with self.path.open("rb") as f:
                start = f.read(8)
        except OSError as exc:
            raise ValueError(f"cannot read GGUF file {self.name}: {exc.strerror}") from None
        if not start:
            raise ValueError(f"GGUF file {self.name} is empty (0 bytes); {_REPLACE}")
        if not GGUF_MAGIC.startswith(start[:4]):
            raise ValueError(
                f"{self.name} is not a GGUF file: it starts with {start[:4]!r}, not the "
                f"magic {GGUF_MAGIC!r}"
            )
        if len(start) < 8:
            raise ValueError(
                f"GGUF file {self.name} is truncated: {len(start)} bytes, less than its "
                f"header's first 8; {_REPLACE}"
            )

    def value(self, key: str, kind: type, required: bool = True) -> Any:
        """Metadata `key`, checked to be a `kind` (int, str, float, list); None when it
        is absent and not `required`."""
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise ValueError(f"GGUF file {self.name} has no metadata key {key!r}")
            return None
        try:
            value = field.contents()
        except Exception:  # noqa: BLE001 - undecodable: as wrong as a wrong type
            value = None
        wrong_bool = isinstance(value, bool) and kind is not bool
        if value is None or wrong_bool or not isinstance(value, kind):
            stored = "/".join(t.name for t in field.types) or "unknown"
            raise ValueError(
                f"GGUF file {self.name}: metadata key {key!r} has an unexpected type "
                f"({stored}); expected {kind.__name__}"
            )
        return value

    @property
    def tensors(self) -> list:
        return self.reader.tensors
