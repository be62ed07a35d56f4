"""What a QP placed in memory (`PlacedCounts`, the debug "placed" report) and the deliberate placement bugs that prove
a verification can fail (`PlacementFaults`, the debug "fault" request), both kept per data path and reached by the
responder and requester through their QpPort (qpport.py)."""
from __future__ import annotations

import collections
from typing import Union

from .dma import ACCESS_ERRORS, Buffer, map_remote
from .memory import BusMemory
from .native import address
from .objects import MemoryRegion, QueuePair
from .packets import Packet
from ..hw.verbs import MRAccess

MR_REMOTE_WRITE = int(MRAccess.REMOTE_WRITE)


class _Discard:
    """A WRITE target that drops what is written to it: the "skip_placement" fault."""

    def __setitem__(self, index: slice, data: object) -> None:
        pass


DISCARD = _Discard()
Target = Union[Buffer, _Discard]  # where a message's payload lands


class KnownRegion:
    """A region the compiled core reaches on the data path's behalf, a responder's WRITEs landing in it (writeruns.py)
    or a requester's messages sent from it (wqeblock.py): one piece of host memory the QP's PD may use as asked, its
    address in this process, and what the region was when learned."""

    __slots__ = ("key", "region", "pages", "access", "pd", "va", "size", "whole", "at")

    def __init__(self, key: int, region: MemoryRegion, whole: memoryview) -> None:
        self.key, self.region, self.whole, self.at = key, region, whole, address(whole)
        self.pages, self.access, self.pd, self.va, self.size = (region.pages, region.access, region.pd, region.va,
                                                                 region.size)

    @classmethod
    def learn(cls, mrs: dict[int, MemoryRegion], mem: BusMemory, key: int, pd: int,
              access: int = MR_REMOTE_WRITE) -> KnownRegion | None:
        """The region `key` names, if `pd` may use all of it with `access` and it is one piece of host memory (what
        map_remote or map_sges find in it: slices of `whole`)."""
        region = mrs.get(key)
        if region is None or region.pages is None or not region.size:
            return None
        whole = region.view(region.va, region.size, access, pd)
        if whole is None:
            region.views(mem, region.va, 0)  # its first use works out whether it is one piece (map_remote does too)
            whole = region.view(region.va, region.size, access, pd)
        return cls(key, region, whole) if whole is not None else None

    def holds(self, mrs: dict[int, MemoryRegion]) -> bool:
        """The region is still what map_remote would find under this key, unchanged."""
        region = self.region
        return (mrs.get(self.key) is region and region.pages is self.pages and region.access == self.access
                and region.pd == self.pd and region.va == self.va and region.size == self.size)


class PlacedCounts:
    """What one QP placed in memory since it was created, each message counted once, when its last packet landed
    (duplicates and retransmissions never count twice). Responder side: WRITE (with or without immediate) and SEND
    payloads, and the atomics it executed (8 bytes each; a duplicate answered from its saved result is not executed
    again); requester side: READ response payloads."""

    FIELDS = ("write_messages", "write_bytes", "send_messages", "send_bytes", "read_messages", "read_bytes",
              "atomic_messages", "atomic_bytes")
    __slots__ = ("qp", *FIELDS)

    def __init__(self, qp: QueuePair | None = None) -> None:
        self.qp = qp
        self.write_messages = self.write_bytes = self.send_messages = self.send_bytes = 0
        self.read_messages = self.read_bytes = self.atomic_messages = self.atomic_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


PLACEMENT_FAULTS = ("skip_placement", "misplace")


class PlacementFaults:
    """Deliberate placement bugs, so tests can prove a verification fails when it should: the next `count` WRITE
    messages carrying data are acknowledged as usual but not placed ("skip_placement"), or placed `misplace_offset`
    bytes off ("misplace"). Each one taken counts in stats as faulted_<kind>."""

    def __init__(self, stats: collections.Counter[str]) -> None:
        self.stats = stats
        self.counts = dict.fromkeys(PLACEMENT_FAULTS, 0)
        self.misplace_offset = 0
        self.armed = False  # any count left: an attribute, as the responder looks at it per WRITE message

    def inject(self, kind: str, count: int, offset: int = 0) -> None:
        """Arm `count` faults of `kind` (replacing any pending count of that kind; 0 cancels it)."""
        if kind not in PLACEMENT_FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}; choose one of {', '.join(PLACEMENT_FAULTS)}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"fault count must be a non-negative integer, not {count!r}")
        if kind == "misplace":
            if not isinstance(offset, int) or not offset:
                raise ValueError(f"misplace needs a non-zero integer offset, not {offset!r}")
            self.misplace_offset = offset
        self.counts[kind] = count
        self.armed = any(self.counts.values())

    def take(self) -> str | None:
        """The fault the WRITE message starting now suffers, if any (and one fewer is left)."""
        for kind in PLACEMENT_FAULTS:
            if self.counts[kind]:
                self.counts[kind] -= 1
                self.armed = any(self.counts.values())
                self.stats[f"faulted_{kind}"] += 1
                return kind
        return None

    def target(self, p: Packet, target: Buffer, mem: BusMemory, mrs: dict[int, MemoryRegion],
               pd: int) -> tuple[Target, bool]:
        """Where the WRITE message `p` starts lands under the fault armed for it, if any, and whether it counts as
        placed: nowhere ("skip_placement"), or misplace_offset bytes away from the RETH's address, clamped to stay
        inside the region so that it never faults ("misplace"); else `target` (mapped for the RETH), placed."""
        kind = self.take()
        if kind == "skip_placement":
            return DISCARD, False
        if kind == "misplace":
            region = mrs[p.rkey]  # map_remote found it for the true address
            va = max(region.va, min(p.remote_addr + self.misplace_offset, region.va + region.size - p.dma_length))
            try:
                return map_remote(mem, mrs, va, p.rkey, p.dma_length, pd, MR_REMOTE_WRITE), True
            except ACCESS_ERRORS:
                pass  # the true target stays
        return target, True
