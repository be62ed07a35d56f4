"""`aiofabric doctor`: every pre-flight check of one PCI function, or of every supported function on the bus, with
whether its PCIe path completes AtomicOps (a warning when not: the NIC then offers no atomics), the lock, whether its
last holder left it running when nobody holds it, and its link where bnxt_en shows it; as a `Report` printed as text
or JSON.
"""
from __future__ import annotations

import dataclasses
import os
import textwrap
from typing import Any

from .atomic_ops import check_atomic_ops
from .device_lock import check_lock
from .preflight import (IDENTITY, SUPPORTED_CHIPS, SUPPORTED_NAMES, Access, Finding, Host, Target, bus_functions,
                        check_function, check_quiesced, read_number, read_text)
from ..hw.pci import BROADCOM_VENDOR_ID

IFF_UP = 0x1  # a netdev's flags: administratively up (include/uapi/linux/if.h)


@dataclasses.dataclass(frozen=True)
class Report:
    """What `aiofabric doctor` found: the findings, and `error`, one line saying why nothing can be driven ("" when
    something can)."""

    address: str | None
    access: Access
    findings: list[Finding]
    error: str

    def as_dict(self) -> dict[str, Any]:
        result = {"address": self.address, "access": self.access,
                  "findings": [{**dataclasses.asdict(f), "status": f.status} for f in self.findings]}
        return {**result, "error": self.error} if self.error else result

    def format(self, width: int = 118) -> str:
        """One finding a paragraph: its status, name and what it saw, then on a failure the fix."""
        lines, address, indent = [], "", " " * 24
        for f in self.findings:
            if f.address != address and f.address:
                lines.append(f"{f.address} (through {self.access}):")
            address = f.address
            lines.append(textwrap.fill(f.detail, width, initial_indent=f"  {f.status:<5} {f.name:<15} ",
                                       subsequent_indent=indent))
            if not f.ok and f.fix:
                lines.append(f"{indent}fix: {f.fix}")
        return "\n".join(lines)


def drivable(findings: list[Finding]) -> bool:
    return all(f.ok or not f.blocking for f in findings)


def diagnose(address: str, host: Host, access: Access) -> list[Finding]:
    """Every check of one function, its AtomicOps path, the lock and, when nobody holds it, whether the last holder
    left it running; then its link, when bnxt_en shows it (`check_link`)."""
    findings = check_function(address, host, access)
    if len(findings) <= len(IDENTITY):  # check_function stopped at a failed identity check
        return findings
    target = Target.of(address, host, access)
    lock = check_lock(address, host)
    link = check_link(target)
    return findings + [check_atomic_ops(target), lock] + ([check_quiesced(target)] if lock.ok else []) + \
        ([link] if link else [])


def check_link(t: Target) -> Finding | None:
    """The link as bnxt_en sees it while it holds the function: its netdev's flags, operstate and carrier in sysfs.
    None when no netdev shows it (bound to vfio-pci, or to nothing): then only the firmware knows, and `aiofabric
    info` reports it once the driver has opened the function. A warning, never a refusal: the driver brings the link
    up itself (driver/link.py), but not one that no partner answers."""
    net = os.path.join(t.dir, "net")
    try:
        name = sorted(os.listdir(net))[0]
    except (OSError, IndexError):
        return None

    def read(item: str) -> str | None:
        return read_text(os.path.join(net, name, item))
    interface = f"{name} (bnxt_en)"
    if not (read_number(read("flags"), 16) or 0) & IFF_UP:
        return Finding("link", True, f"{interface} is administratively down: the link is as the firmware keeps it, "
                                     "unknown here; the driver's open brings it up", blocking=False, address=t.address)
    operstate, speed = read("operstate") or "unknown", read_number(read("speed"))
    if read("carrier") == "1":
        at = f" at {speed} Mb/s" if speed and speed > 0 else ""
        return Finding("link", True, f"{interface} is up with its link up{at} (operstate {operstate}): unbinding "
                                     "bnxt_en forces the link down (bnxt_close), and the driver's open brings it back "
                                     "up (FUNC_DRV_IF_CHANGE, PORT_PHY_CFG), in the time a link takes to train",
                       blocking=False, address=t.address)
    return Finding("link", False, f"{interface} is up but its link is down (operstate {operstate}, no carrier): no "
                                  "link partner answers, and the driver cannot bring up a link bnxt_en cannot",
                   f"ethtool {name}  # what the PHY sees; check the cable, the transceiver and the switch port",
                   blocking=False, address=t.address)


def _why_not(address: str, access: Access, findings: list[Finding]) -> str:
    failed = [f for f in findings if not f.ok and f.blocking]
    more = f" (and {', '.join(f.name for f in failed[1:])})" if failed[1:] else ""
    return f"{address} cannot be driven through {access}: {failed[0].line()}{more}" if failed else ""


def scan(host: Host, access: Access) -> Report:
    """Every supported function on the bus, diagnosed; when there is none, what the bus holds instead."""
    functions = bus_functions(host)
    broadcom = [f for f in functions if f.vendor == BROADCOM_VENDOR_ID]
    supported = [f for f in broadcom if f.device in SUPPORTED_CHIPS]
    if not supported:
        what = (f"{len(broadcom)} Broadcom, none of them a supported chip" if broadcom
                else f"none of them Broadcom (vendor {BROADCOM_VENDOR_ID:#06x})")
        error = (f"no supported BNXT RoCE function on this machine ({SUPPORTED_NAMES}): {len(functions)} PCI "
                 f"functions, {what}")
        seen = ", ".join(map(str, functions)) or "nothing"
        return Report(None, access, [Finding("bus", False, f"{error}: {seen}",
                                             "aiofabric bench write  # the emulated NIC needs no hardware")], error)
    found = Finding("bus", True, "supported functions: " + ", ".join(f"{f.address} {SUPPORTED_CHIPS[f.device]}"
                                                                     for f in supported))
    each = {f.address: diagnose(f.address, host, access) for f in supported}
    blocked = [_why_not(a, access, findings) for a, findings in each.items() if not drivable(findings)]
    error = "" if len(blocked) < len(each) else "; ".join(blocked)
    return Report(None, access, [found] + [f for findings in each.values() for f in findings], error)


def doctor(address: str | None, host: Host = Host(), access: Access = "vfio") -> Report:
    """`aiofabric doctor`: one function's findings, or without an address the bus's."""
    if address is None:
        return scan(host, access)
    findings = diagnose(address, host, access)
    return Report(address, access, findings, _why_not(address, access, findings))
