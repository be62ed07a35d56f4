"""The verbs' value types: access rights (`Access`), what a peer needs to connect to a QP (`QPInfo`), how a peer names
registered memory (`RemoteRegion`), a raw scatter/gather element (`LocalBuffer`), and the range check every argument
that reaches the NIC goes through (`check_range`)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from .workqueue import ADDRESS_MAX, KEY_MAX
from ..hw.verbs import PSN_MASK, MRAccess, QPAccess, QPState

__all__ = ["ALL_ACCESS", "ATOMIC_ACCESS", "Access", "LocalBuffer", "QPInfo", "QPState", "RemoteRegion", "check_qp_info",
           "check_range", "mac_bytes"]  # QPState: the firmware's QP states (aiofabric.hw.verbs)
QPN_MAX = 0xFFFFFF  # BTH carries 24-bit QP numbers


class Access(enum.IntFlag):
    """Access rights in ibverbs' bit order (IBV_ACCESS_*), converted to each firmware command's own order."""
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8

    def for_mr(self) -> int:
        """REGISTER_MR's bits (their order differs from MODIFY_QP's)."""
        return sum(MRAccess[str(flag.name)] for flag in Access if flag in self)

    def for_qp(self) -> int:
        """MODIFY_QP's bits."""
        return sum(QPAccess[str(flag.name)] for flag in Access if flag in self)


ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
ATOMIC_ACCESS = ALL_ACCESS | Access.REMOTE_ATOMIC  # a region or responder QP that atomics may also reach


@dataclasses.dataclass(frozen=True)
class QPInfo:
    """What a peer needs to connect to a QP (what perftest exchanges out of band)."""
    qpn: int
    gid: bytes
    mac: str
    psn: int

    def __post_init__(self) -> None:
        check_qp_info(self)

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "gid": self.gid.hex(), "mac": self.mac, "psn": self.psn}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QPInfo:
        return cls(int(data["qpn"]), bytes.fromhex(data["gid"]), data["mac"], int(data["psn"]))


def check_qp_info(info: QPInfo) -> None:
    """Refuse what the wire cannot carry: BTH holds 24-bit QP numbers and PSNs, and a wider value would be
    truncated into another QP's number (or another PSN) instead of failing."""
    check_range("qpn", info.qpn, 0, QPN_MAX)
    check_range("psn", info.psn, 0, PSN_MASK)
    if not isinstance(info.gid, bytes) or len(info.gid) != 16:
        raise ValueError(f"gid must be 16 bytes, not {info.gid!r}")
    mac_bytes(info.mac)


def mac_bytes(mac: str) -> bytes:
    """The 6 bytes of a MAC address written as hex ("02:00:00:00:00:01", colons optional)."""
    try:
        raw = bytes.fromhex(mac.replace(":", ""))
    except (AttributeError, ValueError):
        raw = b""
    if len(raw) != 6:
        raise ValueError(f"mac must be 6 bytes in hex (02:00:00:00:00:01), not {mac!r}")
    return raw


@dataclasses.dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory as the wire names it: remote address, rkey, and (if known) its length."""
    addr: int
    rkey: int
    length: int | None = None

    def __post_init__(self) -> None:  # what a WQE can carry (a peer's dict may hold anything)
        check_range("addr", self.addr, 0, ADDRESS_MAX)
        check_range("rkey", self.rkey, 0, KEY_MAX)
        if self.length is not None:
            check_range("length", self.length, 0, ADDRESS_MAX)

    def to_dict(self) -> dict[str, Any]:
        return {"addr": self.addr, "rkey": self.rkey, "length": self.length}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RemoteRegion:
        return cls(int(data["addr"]), int(data["rkey"]), data.get("length"))


@dataclasses.dataclass(frozen=True)
class LocalBuffer:
    """A raw scatter/gather element (address, lkey, length): only what an SGE can hold is checked here, the rest
    the NIC validates, as hardware does."""
    addr: int
    lkey: int
    length: int

    def __post_init__(self) -> None:
        check_range("addr", self.addr, 0, ADDRESS_MAX)
        check_range("lkey", self.lkey, 0, KEY_MAX)
        check_range("length", self.length, 0, KEY_MAX)


def check_range(name: str, value: int, low: int, high: int) -> None:
    """A ValueError naming `name` unless `value` is an int in [low, high]; a bool is not one (True is no size)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], not {value!r}")
