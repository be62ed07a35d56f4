"""Firmware commands by name: their request and response bindings, and requests built from keyword fields."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

from ..autogen import bnxt
from ..hw.firmware import CMDQ_HEADER, HWRM_REQUEST_HEADER

HWRM_HEADER_FIELDS = frozenset(field.name for field in HWRM_REQUEST_HEADER.fields)  # the channels fill them
CMDQ_HEADER_FIELDS = frozenset(field.name for field in CMDQ_HEADER.fields) - {"flags"}
OWN_FID = 0xFFFF  # an HWRM command's fid for the function that sends it (Linux: fid = cpu_to_le16(0xffff))


@functools.cache
def hwrm_types(name: str) -> tuple[type[ctypes.Structure], type[ctypes.Structure], int]:
    """HWRM command `name` ("func_qcaps"): its input and output structures and its request type."""
    try:
        return (getattr(bnxt, f"hwrm_{name}_input"), getattr(bnxt, f"hwrm_{name}_output"),
                getattr(bnxt, f"HWRM_{name.upper()}"))
    except AttributeError:
        raise ValueError(f"unknown HWRM command {name!r}") from None


@functools.cache
def rcfw_types(name: str) -> tuple[type[ctypes.Structure], type[ctypes.Structure], type[ctypes.Structure] | None, int]:
    """RCFW command `name` ("create_qp"): its CMDQ request, CREQ reply and side-buffer structures, and its opcode."""
    try:
        request, response = getattr(bnxt, f"cmdq_{name}"), getattr(bnxt, f"creq_{name}_resp")
        opcode = getattr(bnxt, f"CMDQ_BASE_OPCODE_{name.upper()}")
    except AttributeError:
        raise ValueError(f"unknown RCFW command {name!r}") from None
    return request, response, getattr(bnxt, f"creq_{name}_resp_sb", None), opcode


def build(struct_type: type[ctypes.Structure], what: str, fields: dict[str, Any],
          reserved: frozenset[str]) -> ctypes.Structure:
    """Instantiate a binding, refusing field names it does not have (ctypes would silently accept them) and the
    header fields the channel fills (`reserved`)."""
    known = {name for name, *_ in struct_type._fields_}
    for name in fields:
        if name not in known or name in reserved:
            raise ValueError(f"{what} has no field {name!r} (fields: {', '.join(sorted(known - reserved))})")
    try:
        return struct_type(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: bad field value ({exc})") from None
