"""HWRM asynchronous events: the completion the firmware writes for one, and how a driver asks to be sent them.

An event is a 16-byte `hwrm_async_event_cmpl` (`ASYNC_EVENT`): `type` (low 6 bits ASYNC_EVENT_TYPE), `event_id`
(ASYNC_EVENT_CMPL_EVENT_ID_*: `EventId`), `event_data2`, `event_data1`, and its valid bit (ASYNC_EVENT_CMPL_V) in
`opaque_v`, the byte and bit where an NQ entry keeps its own: on P5 chips the firmware writes events to an NQ, between
its CQ notifications (Linux bnxt.c: bnxt_poll_p5 hands them to bnxt_hwrm_handler). `ASYNC_EVENT_ENTRY` says where
that bit is (ring.py).

A driver is sent only the events it registered with FUNC_DRV_RGTR: ENABLES_ASYNC_EVENT_FWD and a 256-bit bitmap of
event ids in `async_event_fwd` (`forwarding`, bnxt_hwrm_func_drv_rgtr's bnxt_async_events_arr).

The bindings carry the generic record, not the per-event ones, so the event_data1 fields read here are listed with
their hsi.h names: hwrm_async_event_cmpl_link_status_change's EVENT_DATA1_LINK_CHANGE (`LINK_UP`) and
EVENT_DATA1_PORT_ID, hwrm_async_event_cmpl_link_mtu_change's EVENT_DATA1_NEW_MTU, and
hwrm_async_event_cmpl_reset_notify's EVENT_DATA1_REASON_CODE (`ResetReason`).
"""
from __future__ import annotations

import ctypes
import enum
from typing import Iterable, Sequence

from .layout import Layout
from .ring import RingEntry
from ..autogen import bnxt

ASYNC_EVENT = Layout.of(bnxt.hwrm_async_event_cmpl, "type", "event_id", "event_data2", "event_data1")
ASYNC_EVENT_ENTRY = RingEntry(ctypes.sizeof(bnxt.hwrm_async_event_cmpl), bnxt.hwrm_async_event_cmpl.opaque_v.offset,
                              bnxt.ASYNC_EVENT_CMPL_V)
ASYNC_EVENT_TYPE = bnxt.ASYNC_EVENT_CMPL_TYPE_HWRM_ASYNC_EVENT
FORWARD_WORDS = bnxt.hwrm_func_drv_rgtr_input.async_event_fwd.size // 4  # 32-bit words of the bitmap

LINK_UP = 0x1  # ASYNC_EVENT_CMPL_LINK_STATUS_CHANGE_EVENT_DATA1_LINK_CHANGE_UP (DOWN is 0)
LINK_PORT_ID_SHIFT, LINK_PORT_ID_MASK = 4, 0xFFFF0  # ..._LINK_STATUS_CHANGE_EVENT_DATA1_PORT_ID_SFT / _MASK
RESET_REASON_SHIFT, RESET_REASON_MASK = 8, 0xFF00  # ..._RESET_NOTIFY_EVENT_DATA1_REASON_CODE_SFT / _MASK
NEW_MTU_MASK = 0xFFFF  # ..._LINK_MTU_CHANGE_EVENT_DATA1_NEW_MTU_MASK (shift 0)


class EventId(enum.IntEnum):
    """The events this driver registers for and acts on (ASYNC_EVENT_CMPL_EVENT_ID_*)."""
    LINK_STATUS_CHANGE = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_LINK_STATUS_CHANGE
    LINK_MTU_CHANGE = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_LINK_MTU_CHANGE
    LINK_SPEED_CHANGE = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_LINK_SPEED_CHANGE
    PORT_CONN_NOT_ALLOWED = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_PORT_CONN_NOT_ALLOWED
    PORT_PHY_CFG_CHANGE = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_PORT_PHY_CFG_CHANGE
    RESET_NOTIFY = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_RESET_NOTIFY
    ERROR_RECOVERY = bnxt.ASYNC_EVENT_CMPL_EVENT_ID_ERROR_RECOVERY


class ResetReason(enum.IntEnum):
    """RESET_NOTIFY's event_data1 REASON_CODE (after RESET_REASON_SHIFT)."""
    MANAGEMENT_RESET_REQUEST = 0x1
    FW_EXCEPTION_FATAL = 0x2
    FW_EXCEPTION_NON_FATAL = 0x3
    FAST_RESET = 0x4


def async_event(event_id: int, data1: int = 0, data2: int = 0) -> bytes:
    """Device side: the completion of one event (its valid bit is the ring lap's, set when it is published)."""
    return ASYNC_EVENT.pack(ASYNC_EVENT_TYPE, event_id, data2, data1)


def link_event_data(up: bool, port_id: int) -> int:
    """LINK_STATUS_CHANGE's event_data1."""
    return port_id << LINK_PORT_ID_SHIFT & LINK_PORT_ID_MASK | (LINK_UP if up else 0)


def reset_event_data(reason: ResetReason) -> int:
    """RESET_NOTIFY's event_data1 (driver action 0: the firmware decides)."""
    return reason << RESET_REASON_SHIFT & RESET_REASON_MASK


def reset_reason(data1: int) -> int:
    """RESET_NOTIFY's reason code, from its event_data1."""
    return (data1 & RESET_REASON_MASK) >> RESET_REASON_SHIFT


def forwarding(event_ids: Iterable[int]) -> tuple[int, ...]:
    """FUNC_DRV_RGTR's `async_event_fwd`: bit `id` set for each event id, as FORWARD_WORDS 32-bit words."""
    bits = sum(1 << event_id for event_id in set(event_ids))
    return tuple(bits >> 32 * word & 0xFFFFFFFF for word in range(FORWARD_WORDS))


def forwarded(words: Sequence[int], event_id: int) -> bool:
    """Whether the `async_event_fwd` bitmap `words` asks for `event_id`."""
    return 0 <= event_id < 32 * len(words) and bool(words[event_id // 32] >> event_id % 32 & 1)
