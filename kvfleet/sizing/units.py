"""Byte units. Binary units throughout: GPU memory and engine logs are in GiB (2**30)."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)
