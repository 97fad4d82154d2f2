"""A digest of a worker's block tables that is the same in every process (CRC-32 over
the request ids in order and their block ids: Python's own `hash` of a str differs
between processes)."""

from __future__ import annotations

import zlib
from array import array


def block_table_digest(tables: dict[str, list[int]]) -> int:
    crc = 0
    for request_id in sorted(tables):
        crc = zlib.crc32(request_id.encode(), crc)
        crc = zlib.crc32(array("q", tables[request_id]).tobytes(), crc)
    return crc
