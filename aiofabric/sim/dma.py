"""What the RC engine shares: scatter/gather lists over host memory, CQE layouts, PSN arithmetic, error reasons.

A message's memory (the local SGEs of a WQE, or the target range of an RETH) is translated once, when the engine first
needs it, into memoryviews of host memory; per packet the engine only slices them. Translation failures surface as
`MemoryProtectionError` (bad key, PD, access or bounds) or `DmaFault` (a page outside host memory); the requester and
responder turn both into completion errors and NAKs, never into exceptions that escape the engine.
"""
from __future__ import annotations

import bisect
import struct

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
    """A message's memory as memoryviews, addressed by message offset (one view in the common case)."""

    __slots__ = ("views", "starts", "length", "single")

    def __init__(self, views: list[memoryview]) -> None:
        self.views, self.starts, position = views, [], 0
        for view in views:
            self.starts.append(position)
            position += len(view)
        self.length = position
        self.single = views[0] if len(views) == 1 else None

    def read(self, offset: int, length: int) -> memoryview | bytes:
        single = self.single
        if single is not None:
            return single[offset:offset + length]
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

    def write(self, offset: int, data: bytes | memoryview) -> None:
        length = len(data)
        single = self.single
        if single is not None:
            single[offset:offset + length] = data
            return
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


EMPTY = ScatterGather([])


def map_sges(mem: BusMemory, mrs: dict[int, MemoryRegion], sges: list[tuple[int, int, int]], pd: int,
             access: int) -> ScatterGather:
    """Translate (va, lkey, size) SGEs through the MR table; MemoryProtectionError or DmaFault when one is bad."""
    views: list[memoryview] = []
    for va, key, size in sges:
        if not size:
            continue
        region = mrs.get(key)
        if region is None:
            raise MemoryProtectionError(f"lkey {key:#x} does not exist")
        for address, length in region.translate(va, size, access, pd):
            views.append(mem.view(address, length))
    return ScatterGather(views) if views else EMPTY


def map_remote(mem: BusMemory, mrs: dict[int, MemoryRegion], va: int, key: int, length: int, pd: int,
               access: int) -> ScatterGather:
    """Translate an RETH target; a zero-length access needs no valid key (IBA 9.4.1.1)."""
    if not length:
        return EMPTY
    region = mrs.get(key)
    if region is None:
        raise MemoryProtectionError(f"rkey {key:#x} does not exist")
    return ScatterGather([mem.view(address, size) for address, size in region.translate(va, length, access, pd)])
