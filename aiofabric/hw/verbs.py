"""Verbs-level facts of the firmware interface: QP states and their legal moves, path-MTU codes, access bits, PSNs.

QP states are MODIFY_QP's new_state codes (CMDQ_MODIFY_QP_NEW_STATE_*); the path MTU travels as a code
(CMDQ_MODIFY_QP_PATH_MTU_MTU_<bytes> in MODIFY_QP, CREQ_QUERY_QP_RESP_SB_PATH_MTU_MTU_<bytes> in QUERY_QP's answer),
and the largest one a port carries follows from the port's MTU (`path_mtu_for_port`).
Access rights come in two bit orders: MODIFY_QP's (`QPAccess`) and REGISTER_MR's (`MRAccess`), which swap REMOTE_READ
and REMOTE_WRITE. PSNs are 24 bits wide (the MSN table's and BTH's), compared modulo 2^24 (`psn_diff`).
"""
from __future__ import annotations

import enum

from .names import constants
from ..autogen import bnxt


class QPState(enum.IntEnum):
    RESET = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RESET
    INIT = bnxt.CMDQ_MODIFY_QP_NEW_STATE_INIT
    RTR = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RTR
    RTS = bnxt.CMDQ_MODIFY_QP_NEW_STATE_RTS
    SQD = bnxt.CMDQ_MODIFY_QP_NEW_STATE_SQD
    SQE = bnxt.CMDQ_MODIFY_QP_NEW_STATE_SQE
    ERR = bnxt.CMDQ_MODIFY_QP_NEW_STATE_ERR


# The IB QP state machine: any state may go to RESET or ERR; otherwise only these moves are legal.
QP_TRANSITIONS: dict[QPState, frozenset[QPState]] = {
    QPState.RESET: frozenset({QPState.INIT}),
    QPState.INIT: frozenset({QPState.INIT, QPState.RTR}),
    QPState.RTR: frozenset({QPState.RTS}),
    QPState.RTS: frozenset({QPState.RTS, QPState.SQD}),
    QPState.SQD: frozenset({QPState.RTS, QPState.SQD}),
    QPState.SQE: frozenset({QPState.RTS}),
    QPState.ERR: frozenset(),
}


def legal_transition(current: QPState, new: QPState) -> bool:
    return new in (QPState.RESET, QPState.ERR) or new in QP_TRANSITIONS[current]


def _mtu_codes(prefix: str) -> dict[int, int]:
    return {int(name[4:]): code for name, code in constants(prefix).items() if name.startswith("MTU_")}


PATH_MTU_CODES = _mtu_codes("CMDQ_MODIFY_QP_PATH_MTU_")  # bytes -> MODIFY_QP path_mtu code (256 .. 8192)
PATH_MTU_BYTES = {code: mtu for mtu, code in PATH_MTU_CODES.items()}
QUERY_QP_PATH_MTU_CODES = _mtu_codes("CREQ_QUERY_QP_RESP_SB_PATH_MTU_")  # bytes -> QUERY_QP's path_mtu code
ROCE_MAX_PATH_MTU = 4096  # the largest IB MTU (IB_MTU_4096); MODIFY_QP's 8192 is beyond what RoCE peers take
# What a RoCE packet adds to its payload, as Linux reserves it against a netdev's MTU (include/rdma/ib_addr.h
# iboe_get_mtu, sizes from ib_pack.h): GRH 40 (room for IPv6) + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 (the largest
# extension header) + ICRC 4.
ROCE_OVERHEAD = 40 + 8 + 12 + 4 + 28 + 4


def path_mtu_for_port(port_mtu: int) -> int:
    """The largest path MTU (256 .. 4096) whose packets fit a port of MTU `port_mtu`, as Linux picks the active MTU
    of a RoCE port (iboe_get_mtu of the netdev's MTU); 0 when not even 256 fits."""
    room = min(port_mtu - ROCE_OVERHEAD, ROCE_MAX_PATH_MTU)
    return max((mtu for mtu in PATH_MTU_CODES if mtu <= room), default=0)


class QPAccess(enum.IntFlag):
    """A QP's access bits, in MODIFY_QP's order (CMDQ_MODIFY_QP_ACCESS_*)."""
    LOCAL_WRITE = bnxt.CMDQ_MODIFY_QP_ACCESS_LOCAL_WRITE
    REMOTE_WRITE = bnxt.CMDQ_MODIFY_QP_ACCESS_REMOTE_WRITE
    REMOTE_READ = bnxt.CMDQ_MODIFY_QP_ACCESS_REMOTE_READ
    REMOTE_ATOMIC = bnxt.CMDQ_MODIFY_QP_ACCESS_REMOTE_ATOMIC


class MRAccess(enum.IntFlag):
    """A memory region's access bits, in REGISTER_MR's order (CMDQ_REGISTER_MR_ACCESS_*): not the QP's."""
    LOCAL_WRITE = bnxt.CMDQ_REGISTER_MR_ACCESS_LOCAL_WRITE
    REMOTE_READ = bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_READ
    REMOTE_WRITE = bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_WRITE
    REMOTE_ATOMIC = bnxt.CMDQ_REGISTER_MR_ACCESS_REMOTE_ATOMIC
    MW_BIND = bnxt.CMDQ_REGISTER_MR_ACCESS_MW_BIND
    ZERO_BASED = bnxt.CMDQ_REGISTER_MR_ACCESS_ZERO_BASED


PSN_MASK = bnxt.SQ_MSN_SEARCH_START_PSN_MASK
_PSN_HALF = (PSN_MASK + 1) >> 1


def psn_diff(a: int, b: int) -> int:
    """a - b for 24-bit wrapping PSNs, as a signed distance in -2^23 .. 2^23 - 1 (positive: a is after b)."""
    return ((a - b + _PSN_HALF) & PSN_MASK) - _PSN_HALF


def psn_count(length: int, mtu: int) -> int:
    """PSNs a message of `length` bytes takes at path MTU `mtu`: one per packet, and one for an empty message."""
    return -(-length // mtu) or 1
