"""The 64-bit RoCE doorbell (bindings: `dbc_dbc`, DBC_DBC_*): the driver's `encode`, the emulator's `decode`.

Low dword (`dbc_dbc.index`): the slot index (DBC_DBC_INDEX_MASK), the epoch bit (DBC_DBC_EPOCH: lap parity of the
count the index names) and, for CQ arm doorbells, a 2-bit toggle (DBC_DBC_TOGGLE_MASK). High dword
(`dbc_dbc.type_path_xid`): the object (DBC_DBC_XID_MASK: QP number, CQ id, or the HWRM ring id of an NQ or the CREQ),
the path (DBC_DBC_PATH_ROCE for RoCE), DBC_DBC_VALID, and the kind (DBC_DBC_TYPE_SQ, _RQ, _CQ, _CQ_ARMALL, _NQ_ARM,
...: the bindings' values, already shifted into place). `arm_enable` is the CQ_ARMENA doorbell.
"""
from __future__ import annotations

from ..autogen import bnxt

HIGH_SHIFT = bnxt.dbc_dbc.type_path_xid.offset * 8  # where the high dword starts in the 64-bit value
INDEX_MASK = bnxt.DBC_DBC_INDEX_MASK
EPOCH_SHIFT = bnxt.DBC_DBC_EPOCH.bit_length() - 1
TOGGLE_SHIFT, TOGGLE_MASK = bnxt.DBC_DBC_TOGGLE_SFT, bnxt.DBC_DBC_TOGGLE_MASK
XID_MASK, PATH_MASK, TYPE_MASK = bnxt.DBC_DBC_XID_MASK, bnxt.DBC_DBC_PATH_MASK, bnxt.DBC_DBC_TYPE_MASK
VALID = bnxt.DBC_DBC_VALID


Doorbell = tuple[int, int, int, int, int, int, bool]  # (xid, kind, slot, epoch, toggle, path, valid): see decode


def encode(xid: int, kind: int, slot: int, epoch: int = 0, toggle: int = 0) -> int:
    """The 64-bit value of a RoCE doorbell: `kind` DBC_DBC_TYPE_*, `slot` the index field (already wrapped), `epoch`
    its lap parity, `toggle` only for CQ arm doorbells."""
    high = xid & XID_MASK | bnxt.DBC_DBC_PATH_ROCE | kind | VALID
    low = slot & INDEX_MASK | (epoch & 1) << EPOCH_SHIFT | toggle << TOGGLE_SHIFT & TOGGLE_MASK
    return high << HIGH_SHIFT | low


def decode(value: int) -> Doorbell:
    """The fields of a 64-bit doorbell value as the device reads them: (xid, kind, slot, epoch, toggle, path, valid),
    `kind` and `path` the bindings' DBC_DBC_TYPE_* and DBC_DBC_PATH_* values. A plain tuple: the emulator decodes one
    per doorbell."""
    high = value >> HIGH_SHIFT
    return (high & XID_MASK, high & TYPE_MASK, value & INDEX_MASK, value >> EPOCH_SHIFT & 1,
            (value & TOGGLE_MASK) >> TOGGLE_SHIFT, high & PATH_MASK, bool(high & VALID))


def arm_enable(xid: int, toggle: int) -> int:
    """The CQ_ARMENA doorbell of CQ `xid`, which lets it be armed: index 0 and the toggle of its last notification (0
    before any). Linux writes it to the privileged doorbell page (bnxt_qplib_armen_db)."""
    return encode(xid, bnxt.DBC_DBC_TYPE_CQ_ARMENA, 0, 0, toggle)
