"""What the RC engine shares: scatter/gather lists over host memory, CQE layouts, PSN arithmetic, error reasons.

A message's memory (the local SGEs of a WQE, or the target range of an RETH) is translated once, when the engine first
needs it, into a memoryview of host memory (a `ScatterGather` when it is in pieces); per packet the engine only
slices it. Translation failures surface as
`MemoryProtectionError` (bad key, PD, access or bounds) or `DmaFault` (a page outside host memory); the requester and
responder turn both into completion errors and NAKs, never into exceptions that escape the engine.
"""
from __future__ import annotations

import bisect
import struct
from typing import Union

from ..autogen import bnxt
from .memory import BusMemory, DmaFault
from .objects import MemoryProtectionError, MemoryRegion

PSN_MASK = 0xFFFFFF
MSN_MASK = 0xFFFFFF
SLOT = 16
SGE = struct.Struct("<QII")  # sq_sge / rq sge: va_or_pa, l_key, size

# cq_req: qp_handle, sq_cons_idx, 14 reserved bytes, cqe_type_toggle, status, 6 reserved bytes
REQ_CQE = struct.Struct("<QH14xBB6x")
# cq_res_rc: length, imm_data_or_inv_r_key, qp_handle, mr_handle, cqe_type_toggle, status, flags, srq_or_rq_wr_id
RES_CQE = struct.Struct("<IIQQBBHI")
CQE_REQ, CQE_RES_RC = bnxt.CQ_BASE_CQE_TYPE_REQ, bnxt.CQ_BASE_CQE_TYPE_RES_RC

# REGISTER_MR access bits (an MR's) and MODIFY_QP access bits (a QP's): the two orders differ
MR_LOCAL_WRITE = bnxt.CMDQ_REGISTER_MR_ACCESS_LOCAL_WRITE
MR_REMOTE_READ = bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ
MR_REMOTE_WRITE = bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_WRITE
QP_REMOTE_READ = bnxt.CMDQ_MODIFY_QP_ACCESS_REMOTE_READ
QP_REMOTE_WRITE = bnxt.CMDQ_MODIFY_QP_ACCESS_REMOTE_WRITE

# creq_qp_error_notification.req_err_state_reason (roce_hsi.h; missing from the generated bindings)
REQ_TIMEOUT_RETRY_LIMIT, REQ_RNR_TIMEOUT_RETRY_LIMIT, REQ_NAK_ARRIVAL = 0x2, 0x3, 0x4
REQ_RX_MEMORY_ERROR, REQ_TX_MEMORY_ERROR, REQ_WQE_FORMAT_ERROR = 0x8, 0x9, 0x11
R = "CREQ_QP_ERROR_NOTIFICATION_RES_ERR_STATE_REASON_RES_"
RES_RX_INVALID_R_KEY, RES_EXCEEDS_WQE, RES_OPCODE_ERROR, RES_MEMORY_ERROR, RES_WQE_FORMAT_ERROR = (
    getattr(bnxt, R + name) for name in ("RX_INVALID_R_KEY", "EXCEEDS_WQE", "OPCODE_ERROR", "MEMORY_ERROR",
                                         "WQE_FORMAT_ERROR"))
ACCESS_ERRORS = (MemoryProtectionError, DmaFault)


def psn_diff(a: int, b: int) -> int:
    """a - b as a signed 24-bit distance (positive: a is after b)."""
    return ((a - b + 0x800000) & PSN_MASK) - 0x800000


def producer_count(consumed: int, index: int, epoch: int, length: int) -> int | None:
    """The free-running producer count a producer doorbell names, given what the device already consumed.

    The producer is at most one ring ahead of the consumer: of the counts in [consumed, consumed + length] with that
    slot, the epoch (lap parity) picks one. None when the doorbell names nothing plausible (a stale or corrupt index).
    """
    if not 0 <= index < length:
        return None
    count = consumed + (index - consumed) % length
    if (count // length) & 1 != epoch:
        if count != consumed:
            return None
        count += length  # the driver filled the whole ring
    return count


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
