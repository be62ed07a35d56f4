"""Scatter/gather over host memory: how the RC engine reaches a message's memory.

A message's memory (the local SGEs of a WQE, or the target range of an RETH) is translated once, when the engine first
needs it, into a memoryview of host memory (a `ScatterGather` when it is in pieces); per packet the engine only
slices it. Translation failures surface as `MemoryProtectionError` (bad key, PD, access or bounds) or `DmaFault` (a
page outside host memory); the requester and responder turn both into completion errors and NAKs, never into
exceptions that escape the engine.
"""
from __future__ import annotations

import bisect
from typing import Union

from .memory import BusMemory, DmaFault
from .objects import MemoryProtectionError, MemoryRegion

ACCESS_ERRORS = (MemoryProtectionError, DmaFault)


class ScatterGather:
    """A message's memory in several pieces, sliced like one memoryview: sg[a:b] reads, sg[a:b] = data writes.

    Most messages live in one piece, and the data path then holds a plain memoryview instead: both support len(),
    slicing and slice assignment, so the per-packet code does not care which it has.
    """

    __slots__ = ("views", "starts", "length")

    def __init__(self, views: list[memoryview]) -> None:
        self.views, self.starts, position = views, [], 0
        for view in views:
            self.starts.append(position)
            position += len(view)
        self.length = position

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, span: slice) -> memoryview | bytes:
        offset, end, _ = span.indices(self.length)
        length = max(0, end - offset)
        if not length:
            return b""
        i = bisect.bisect_right(self.starts, offset) - 1
        view, within = self.views[i], offset - self.starts[i]
        if within + length <= len(view):
            return view[within:within + length]
        parts = []
        while length:
            view = self.views[i]
            take = min(length, len(view) - within)
            parts.append(view[within:within + take])
            length -= take
            i, within = i + 1, 0
        return b"".join(parts)

    def __setitem__(self, span: slice, data: bytes | memoryview) -> None:
        offset, end, _ = span.indices(self.length)
        length = len(data)
        if end - offset != length:
            raise ValueError(f"{length} bytes do not fit [{offset}, {end})")
        if not length:
            return
        i = bisect.bisect_right(self.starts, offset) - 1
        within, done = offset - self.starts[i], 0
        data = memoryview(data)
        while done < length:
            view = self.views[i]
            take = min(length - done, len(view) - within)
            view[within:within + take] = data[done:done + take]
            done += take
            i, within = i + 1, 0


EMPTY = memoryview(bytearray())  # a zero-length message's memory
Buffer = Union[memoryview, ScatterGather]


def gather(views: list[memoryview]) -> Buffer:
    return views[0] if len(views) == 1 else ScatterGather(views) if views else EMPTY


def map_sges(mem: BusMemory, mrs: dict[int, MemoryRegion], sges: list[tuple[int, int, int]], pd: int,
             access: int) -> Buffer:
    """Translate (va, lkey, size) SGEs through the MR table; MemoryProtectionError or DmaFault when one is bad."""
    views: list[memoryview] = []
    for va, key, size in sges:
        if not size:
            continue
        region = mrs.get(key)
        if region is None:
            raise MemoryProtectionError(f"lkey {key:#x} does not exist")
        views += region.views(mem, va, size, access, pd)
    return gather(views)


def map_remote(mem: BusMemory, mrs: dict[int, MemoryRegion], va: int, key: int, length: int, pd: int,
               access: int) -> Buffer:
    """Translate an RETH target; a zero-length access needs no valid key (IBA 9.4.1.1)."""
    if not length:
        return EMPTY
    region = mrs.get(key)
    if region is None:
        raise MemoryProtectionError(f"rkey {key:#x} does not exist")
    view = region.view(va, length, access, pd)
    return view if view is not None else gather(region.views(mem, va, length, access, pd))
