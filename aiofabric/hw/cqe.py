"""What the device writes to host rings: completion queue entries, NQ notifications, CREQ entries; their status and
reason codes.

CQEs are 32 bytes (`cq_base`): byte `cqe_type_toggle` holds the valid bit (CQ_BASE_TOGGLE) and the type
(CQ_BASE_CQE_TYPE_MASK: REQ, RES_RC, ...), the next byte the status. `CQE_REQ` (cq_req) completes send-queue work:
`sq_cons_idx` is the index of the WQE after the completed one, modulo CREATE_QP's sq_size (one count per WQE), so
one CQE retires every unsignaled WQE before it; an error CQE of a variable-WQE QP names the slot the failed WQE starts
at instead (Linux bnxt_qplib_cq_process_req). `CQE_RES_RC` (cq_res_rc) completes a receive, or a WRITE with
immediate (flags CQ_RES_RC_FLAGS_*).
NQ entries are 16 bytes (`nq_cn`): a CQ notification carries the CQ's handle and a 2-bit toggle in `type`. CREQ
entries are 16 bytes (`creq_base`): command completions (`creq_qp_event`, matched by cookie) and asynchronous events.
`CQ_ENTRY`, `NQ_ENTRY` and `CREQ_ENTRY` say where each kind keeps its valid bit (see ring.py).

Reasons a QP went to error travel in `creq_qp_error_notification`: `res_err_state_reason` values are in the bindings;
the requester's `req_err_state_reason` values are missing from them (the generator found none), so the ones the
emulator reports are listed here (`RequesterErrorReason`, values from roce_hsi.h's
CREQ_QP_ERROR_NOTIFICATION_REQ_ERR_STATE_REASON_REQ_*).
"""
from __future__ import annotations

import ctypes
import enum

from .layout import Layout
from .names import constant_names
from .ring import RingEntry
from ..autogen import bnxt

CQ_ENTRY = RingEntry(ctypes.sizeof(bnxt.cq_base), bnxt.cq_base.cqe_type_toggle.offset, bnxt.CQ_BASE_TOGGLE)
NQ_ENTRY = RingEntry(ctypes.sizeof(bnxt.nq_base), bnxt.nq_cn.v.offset, bnxt.NQ_CN_V)
CREQ_ENTRY = RingEntry(ctypes.sizeof(bnxt.creq_base), bnxt.creq_base.v.offset, bnxt.CREQ_BASE_V)

CQE_TYPE_OFFSET, CQE_STATUS_OFFSET = bnxt.cq_base.cqe_type_toggle.offset, bnxt.cq_base.status.offset
SQ_CONS_IDX_MASK = (1 << 8 * bnxt.cq_req.sq_cons_idx.size) - 1  # what a 16-bit consumer index holds
CQE_REQ = Layout.of(bnxt.cq_req, "qp_handle", "sq_cons_idx", "cqe_type_toggle", "status")
CQE_RES_RC = Layout.of(bnxt.cq_res_rc, "length", "imm_data_or_inv_r_key", "qp_handle", "mr_handle", "cqe_type_toggle",
                       "status", "flags", "srq_or_rq_wr_id")
NQ_CQ_NOTIFICATION = Layout.of(bnxt.nq_cn, "type", "cq_handle_low", "v", "cq_handle_high")
CREQ_COMMAND_EVENT = Layout.of(bnxt.creq_qp_event, "type", "status", "cookie", "v", "event")
CREQ_TYPE_OFFSET, CREQ_EVENT_OFFSET = bnxt.creq_base.type.offset, bnxt.creq_base.event.offset

_HANDLE_SHIFT = bnxt.nq_cn.cq_handle_low.size * 8
_HANDLE_LOW = (1 << _HANDLE_SHIFT) - 1


def cqe_type(type_toggle: int) -> int:
    """The CQ_BASE_CQE_TYPE_* of a CQE from its `cqe_type_toggle` byte."""
    return type_toggle & bnxt.CQ_BASE_CQE_TYPE_MASK


def creq_type(type_byte: int) -> int:
    """The CREQ_BASE_TYPE_* of a CREQ entry from its `type` byte."""
    return type_byte & bnxt.CREQ_BASE_TYPE_MASK


def cq_notification(cq_handle: int, toggle: int) -> bytes:
    """The NQ entry that tells the driver CQ `cq_handle` has new CQEs (valid bit left 0: the NQ's lap sets it)."""
    kind = bnxt.NQ_CN_TYPE_CQ_NOTIFICATION | toggle << bnxt.NQ_CN_TOGGLE_SFT & bnxt.NQ_CN_TOGGLE_MASK
    return NQ_CQ_NOTIFICATION.pack(kind, cq_handle & _HANDLE_LOW, 0, cq_handle >> _HANDLE_SHIFT & _HANDLE_LOW)


def notification_fields(entry_type: int, cq_handle_low: int, cq_handle_high: int) -> tuple[int, int, int]:
    """(NQ_CN_TYPE_*, toggle, cq_handle) of an NQ entry unpacked with NQ_CQ_NOTIFICATION."""
    return (entry_type & bnxt.NQ_CN_TYPE_MASK, (entry_type & bnxt.NQ_CN_TOGGLE_MASK) >> bnxt.NQ_CN_TOGGLE_SFT,
            cq_handle_high << _HANDLE_SHIFT | cq_handle_low)


class RequesterErrorReason(enum.IntEnum):
    """creq_qp_error_notification.req_err_state_reason values the emulator reports (missing from the bindings)."""
    REQ_TIMEOUT_RETRY_LIMIT = 0x2
    REQ_RNR_TIMEOUT_RETRY_LIMIT = 0x3
    REQ_NAK_ARRIVAL = 0x4
    REQ_RX_MEMORY_ERROR = 0x8
    REQ_TX_MEMORY_ERROR = 0x9
    REQ_WQE_FORMAT_ERROR = 0x11


SEND_STATUS_NAMES = constant_names("CQ_REQ_STATUS_")  # cq_req.status
RECV_STATUS_NAMES = constant_names("CQ_RES_RC_STATUS_")  # cq_res_rc.status
QP_ERROR_REASON_NAMES = {  # by creq_qp_error_notification field
    "req_err_state_reason": {**constant_names("CREQ_QP_ERROR_NOTIFICATION_REQ_ERR_STATE_REASON_"),
                             **{reason.value: reason.name for reason in RequesterErrorReason}},
    "res_err_state_reason": constant_names("CREQ_QP_ERROR_NOTIFICATION_RES_ERR_STATE_REASON_")}
CQ_ERROR_REASON_NAMES = constant_names("CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_")
