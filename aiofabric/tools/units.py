"""Sizes as perftest users type them ("64K", "1M": powers of 1024) and message-size sweeps. Pure functions."""
from __future__ import annotations

import re

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", re.IGNORECASE)
SWEEP_MIN, SWEEP_MAX = 2, 8 << 20  # perftest's -a: 2 bytes to 8 MiB in powers of two


def parse_size(text: str | int) -> int:
    """"4096", "64K", "1M", "2G" (also "64KB", "64KiB"; powers of 1024) -> bytes. ValueError names the bad text."""
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: use bytes with an optional K, M or G suffix (powers of 1024), "
                         f"e.g. 4096, 64K, 1M")
    return int(match.group(1)) * SUFFIXES[match.group(2).upper()]


def sweep(low: int, high: int, factor: int = 2) -> list[int]:
    """low, low*factor, ... up to high (inclusive when it lands on it), as perftest's -a walks sizes."""
    if low < 1 or high < low:
        raise ValueError(f"a sweep needs 1 <= --min-size <= --max-size, not {low} .. {high}")
    if factor < 2:
        raise ValueError(f"--factor must be at least 2, not {factor}")
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return sizes
