"""PCIe AtomicOps: whether the path from a NIC function to the root port completes them, and turning them on.

A NIC executes an RDMA atomic on host memory as a PCIe AtomicOp, which the function may issue only with AtomicOp
Requester Enable (DEVCTL2 ATOMIC_REQ) set, and only a path that routes it to a root port that completes it makes it
work. Linux's bnxt_re asks at bring-up (`bnxt_qplib_determine_atomics`): `pci_enable_atomic_ops_to_root` for 32-bit,
then for 64-bit completion (`check_path`, `enable_atomic_ops_to_root` here):

- a virtual function, or a function that is not a PCIe endpoint, is refused;
- with no root port visible (a virtual machine), it succeeds only if ATOMIC_REQ is already set (by the hypervisor);
- otherwise the root port's DEVCAP2 must have the completer bits asked, every switch port on the way ATOMIC_ROUTE,
  and no switch upstream port ATOMIC_EGRESS_BLOCK in its DEVCTL2; only then is ATOMIC_REQ set in the function.

What the NIC offers follows DEVCTL2 alone (`bnxt_qplib_is_atomic_cap`): atomics while ATOMIC_REQ is set, else none
(bnxt_re reports IB_ATOMIC_NONE). `determine_atomics` returns that as `AtomicOps`, whose `check` refuses an atomic
work request or a region open to remote atomics on a NIC without them, naming the port that lacks them.
`aiofabric doctor` runs the same checks read-only (`check_atomic_ops`). The bridges are read through sysfs
(upstream.py), the function itself through the seam (with VFIO, its config region).
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Protocol

from .preflight import Finding, Target
from .upstream import ConfigSpace, SysfsConfig, UpstreamPath, sysfs_upstream
from ..errors import PCIError, UnsupportedError
from ..hw.pci import (PCI_CAP_ID_EXP, PCI_EXP_DEVCAP2, PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64,
                      PCI_EXP_DEVCAP2_ATOMIC_ROUTE, PCI_EXP_DEVCTL2, PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK,
                      PCI_EXP_DEVCTL2_ATOMIC_REQ, PCI_EXP_FLAGS, PCI_EXP_FLAGS_TYPE, PCI_EXP_TYPE_DOWNSTREAM,
                      PCI_EXP_TYPE_ENDPOINT, PCI_EXP_TYPE_LEG_END, PCI_EXP_TYPE_ROOT_PORT, PCI_EXP_TYPE_UPSTREAM,
                      PCIE_TYPE_NAMES, find_capability)

COMPLETER_BITS = {PCI_EXP_DEVCAP2_ATOMIC_COMP32: "32-bit", PCI_EXP_DEVCAP2_ATOMIC_COMP64: "64-bit"}
BOTH = PCI_EXP_DEVCAP2_ATOMIC_COMP32 | PCI_EXP_DEVCAP2_ATOMIC_COMP64


class Function(ConfigSpace, Protocol):
    """The NIC function: read and written through its seam."""

    def write_config(self, offset: int, value: int, size: int) -> None: ...


class Verdict(NamedTuple):
    """Whether the function may issue AtomicOps, and what the walk found (the port that lacks them, if one does)."""
    ok: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class AtomicOps:
    """What a NIC offers: atomics (`enabled`: its DEVCTL2 has ATOMIC_REQ) or none, and why."""

    enabled: bool
    detail: str

    def check(self, what: str) -> None:
        """Raise UnsupportedError for `what` (an atomic, a region open to them) when the NIC offers no atomics."""
        if not self.enabled:
            raise UnsupportedError(f"{what}: this NIC offers no atomics (Linux's bnxt_re reports IB_ATOMIC_NONE): "
                                   f"{self.detail}")


def _pcie(space: ConfigSpace) -> tuple[int, int] | None:
    """(the PCI Express capability's offset, the port type) of a function, None if it has no such capability."""
    capability = find_capability(space.read_config, PCI_CAP_ID_EXP)
    if capability is None:
        return None
    return capability, (space.read_config(capability + PCI_EXP_FLAGS, 2) & PCI_EXP_FLAGS_TYPE) >> 4


def _bits(mask: int) -> str:
    return " and ".join(name for bit, name in COMPLETER_BITS.items() if mask & bit)


def check_path(function: ConfigSpace, path: UpstreamPath, cap_mask: int) -> Verdict:
    """pci_enable_atomic_ops_to_root's checks for completion of the AtomicOp sizes in `cap_mask`, reading only. A
    bridge that cannot be read (no privileges) is a failure that says so."""
    name = function.address
    if path.virtfn:
        return Verdict(False, f"{name} is a virtual function: its AtomicOp Requester Enable is reserved (its "
                              "physical function's applies)")
    try:
        own = _pcie(function)
        if own is None:
            return Verdict(False, f"{name} has no PCI Express capability")
        capability, kind = own
        if kind not in (PCI_EXP_TYPE_ENDPOINT, PCI_EXP_TYPE_LEG_END):
            return Verdict(False, f"{name} is a {PCIE_TYPE_NAMES.get(kind, f'type {kind:#x} function')}, not an "
                                  "endpoint: only endpoints are AtomicOp requesters")
        ports = [(bridge, pcie) for bridge in path.bridges if (pcie := _pcie(bridge)) is not None]  # others: skipped
        kinds = [kind for _, (_, kind) in ports]
        if PCI_EXP_TYPE_ROOT_PORT not in kinds:
            if function.read_config(capability + PCI_EXP_DEVCTL2, 2) & PCI_EXP_DEVCTL2_ATOMIC_REQ:
                return Verdict(True, f"no root port is visible above {name} (a virtual machine); its AtomicOp "
                                     "Requester Enable was already set, by the hypervisor")
            seen = f"bridges {', '.join(b.address for b in path.bridges)}" if path.bridges else "no bridge"
            return Verdict(False, f"no root port is visible above {name} ({seen}: a virtual machine?) and its "
                                  "AtomicOp Requester Enable (DEVCTL2 bit 0x40) is not set: then only the "
                                  "hypervisor can enable AtomicOps")
        root = kinds.index(PCI_EXP_TYPE_ROOT_PORT)
        port, (port_capability, _) = ports[root]
        have = port.read_config(port_capability + PCI_EXP_DEVCAP2, 4)
        if have & cap_mask != cap_mask:
            return Verdict(False, f"root port {port.address} does not complete {_bits(cap_mask & ~have)} PCIe "
                                  f"AtomicOps (its DEVCAP2 {have:#x} lacks {cap_mask & ~have:#x})")
        for bridge, (at, kind) in ports[:root]:  # nearest first, up to the root port
            if kind not in (PCI_EXP_TYPE_UPSTREAM, PCI_EXP_TYPE_DOWNSTREAM):
                continue
            what = f"{PCIE_TYPE_NAMES[kind]} {bridge.address}"
            if kind == PCI_EXP_TYPE_UPSTREAM and \
                    bridge.read_config(at + PCI_EXP_DEVCTL2, 2) & PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK:
                return Verdict(False, f"{what} blocks PCIe AtomicOps on egress (DEVCTL2 ATOMIC_EGRESS_BLOCK 0x80 "
                                      "set)")
            if not bridge.read_config(at + PCI_EXP_DEVCAP2, 4) & PCI_EXP_DEVCAP2_ATOMIC_ROUTE:
                return Verdict(False, f"{what} does not route PCIe AtomicOps (its DEVCAP2 lacks ATOMIC_ROUTE "
                                      "0x40)")
    except PCIError as exc:
        return Verdict(False, str(exc))
    switches = [bridge.address for bridge, _ in ports[:root]]
    via = f" through {', '.join(switches)}" if switches else ""
    return Verdict(True, f"{name} reaches root port {port.address}{via}, which completes its PCIe AtomicOps")


def enable_atomic_ops_to_root(function: Function, path: UpstreamPath) -> Verdict:
    """`check_path` for 32-bit, then 64-bit completion, as bnxt_qplib_determine_atomics asks (the first refusal is
    the verdict), then ATOMIC_REQ set in the function's DEVCTL2. Linux sets it after each size passes, so a root port
    completing 32-bit AtomicOps but not 64-bit ones leaves it set (and bnxt_re then offers atomics, which are
    64-bit); here it is set only once both passed."""
    verdict = check_path(function, path, PCI_EXP_DEVCAP2_ATOMIC_COMP32)
    if verdict.ok:
        verdict = check_path(function, path, PCI_EXP_DEVCAP2_ATOMIC_COMP64)
    own = _pcie(function) if verdict.ok else None
    if own is not None:
        at = own[0] + PCI_EXP_DEVCTL2
        control = function.read_config(at, 2)
        if not control & PCI_EXP_DEVCTL2_ATOMIC_REQ:
            function.write_config(at, control | PCI_EXP_DEVCTL2_ATOMIC_REQ, 2)
    return verdict


def determine_atomics(function: Function, path: UpstreamPath) -> AtomicOps:
    """bnxt_qplib_determine_atomics (32-bit, then 64-bit completion asked of the path), then
    bnxt_qplib_is_atomic_cap: what the function's DEVCTL2 says."""
    verdict = enable_atomic_ops_to_root(function, path)
    if not verdict.ok:
        return AtomicOps(False, verdict.detail)
    own = _pcie(function)
    if own is None or not function.read_config(own[0] + PCI_EXP_DEVCTL2, 2) & PCI_EXP_DEVCTL2_ATOMIC_REQ:
        return AtomicOps(False, f"AtomicOp Requester Enable did not stay set in {function.address}'s DEVCTL2")
    return AtomicOps(True, verdict.detail)


def check_atomic_ops(t: Target) -> Finding:
    """`aiofabric doctor`'s word on atomics: the walk read-only, from sysfs. A warning when it fails: the NIC still
    runs, without atomics."""
    function = SysfsConfig(t.address, os.path.join(t.dir, "config"))
    verdict = check_path(function, sysfs_upstream(t.host.devices, t.address), BOTH)
    detail = (f"the NIC will offer atomics: {verdict.detail}" if verdict.ok else
              f"the NIC will offer no atomics (fetch-add, compare-swap, regions open to them): {verdict.detail}")
    fix = "" if verdict.ok else "sudo aiofabric doctor  # as root" if "run as root" in verdict.detail else \
        "put the NIC in a slot whose root port completes AtomicOps (and switches route them), or go without atomics"
    return Finding("atomic_ops", verdict.ok, detail, fix, blocking=False, address=t.address)
