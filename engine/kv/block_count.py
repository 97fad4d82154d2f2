"""How many blocks a number of tokens needs: the one ceiling division."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0: e.g. the blocks of `b` slots that `a` tokens fill."""
    return -(-a // b)
