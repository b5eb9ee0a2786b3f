"""Byte counts: GiB, and sizes given as numbers or strings ("80GiB", "80 GB")."""

from __future__ import annotations

import re

GiB = 2**30


def parse_bytes(value, name: str = "memory") -> int:
    """Bytes from an int or a string such as "80GiB", "80 GB", "81920MiB" (GB = 10**9)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a number of bytes or a string like '80GiB', got {type(value).__name__}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
    if not match:
        raise ValueError(f"{name} must look like '80GiB', '80GB' or '85899345920', got {value!r}")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(number * scale)
