"""The emulated function's PCI Express side: its config space and the path above it to the root complex (the
`pcie_path` option), which together decide whether it may execute atomics on host memory (sans-IO).

A NIC executes an RDMA atomic as a PCIe AtomicOp on host memory. It may issue one only while its DEVCTL2 has
AtomicOp Requester Enable (ATOMIC_REQ), which Linux's `pci_enable_atomic_ops_to_root` sets only after checking the
path: the root port completes the sizes asked, every switch port routes AtomicOps, no switch upstream port blocks
them on egress. The emulated function is a PCIe endpoint with ATOMIC_REQ clear (set only on "hidden-enabled", as a
hypervisor leaves it), below the ports a path lists; the driver reads them as it reads a real function's bridges
(pci/upstream.py), and writes DEVCTL2 through the seam (a config-space kick, decoded by mmio.py into
`PcieFunction`). The responder asks `PcieFunction.refusal()` before it executes an atomic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..hw.pci import (BROADCOM_VENDOR_ID, PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64,
                      PCI_EXP_DEVCAP2_ATOMIC_ROUTE, PCI_EXP_DEVCTL2, PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK,
                      PCI_EXP_DEVCTL2_ATOMIC_REQ, PCI_EXP_TYPE_DOWNSTREAM, PCI_EXP_TYPE_ENDPOINT,
                      PCI_EXP_TYPE_ROOT_PORT, PCI_EXP_TYPE_UPSTREAM, pcie_config)

PCIE_CAPABILITY = 0x40  # where the function's PCI Express capability sits
DEVCTL2 = PCIE_CAPABILITY + PCI_EXP_DEVCTL2
COMPLETER = PCI_EXP_DEVCAP2_ATOMIC_COMP32 | PCI_EXP_DEVCAP2_ATOMIC_COMP64
# The ports' IDs: QEMU's PCIe root port and its emulated switch (XIO3130), labels only
PORT_IDS = {PCI_EXP_TYPE_ROOT_PORT: (0x1B36, 0x000C), PCI_EXP_TYPE_UPSTREAM: (0x104C, 0x8232),
            PCI_EXP_TYPE_DOWNSTREAM: (0x104C, 0x8233)}


@dataclass(frozen=True)
class Port:
    address: str
    kind: int  # PCI_EXP_TYPE_*
    devcap2: int = 0
    devctl2: int = 0


ROOT = Port("0000:00:01.0", PCI_EXP_TYPE_ROOT_PORT, COMPLETER)
UP = Port("0000:01:00.0", PCI_EXP_TYPE_UPSTREAM, PCI_EXP_DEVCAP2_ATOMIC_ROUTE)
DOWN = Port("0000:02:00.0", PCI_EXP_TYPE_DOWNSTREAM, PCI_EXP_DEVCAP2_ATOMIC_ROUTE)


@dataclass(frozen=True)
class PciePath:
    """A path from the function to the root complex: its ports, nearest first; whether ATOMIC_REQ is already set
    (`preset`); whether the platform completes the function's 64-bit AtomicOps (`completes`)."""
    name: str
    summary: str  # one line, for option errors and docs/emulator.md
    ports: tuple[Port, ...]
    completes: bool
    preset: bool = False


PCIE_PATHS = {path.name: path for path in (
    PciePath("root-port", "right below a root port that completes 32- and 64-bit AtomicOps", (ROOT,), True),
    PciePath("switch", "below a switch whose ports route AtomicOps, under such a root port", (DOWN, UP, ROOT), True),
    PciePath("no-completer", "below a root port that completes no AtomicOps",
             (Port(ROOT.address, PCI_EXP_TYPE_ROOT_PORT),), False),
    PciePath("comp32-only", "below a root port that completes 32-bit AtomicOps only",
             (Port(ROOT.address, PCI_EXP_TYPE_ROOT_PORT, PCI_EXP_DEVCAP2_ATOMIC_COMP32),), False),
    PciePath("no-routing", "below a switch whose downstream port does not route AtomicOps",
             (Port(DOWN.address, PCI_EXP_TYPE_DOWNSTREAM), UP, ROOT), False),
    PciePath("egress-blocked", "below a switch whose upstream port blocks AtomicOps on egress",
             (DOWN, Port(UP.address, UP.kind, UP.devcap2, PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK), ROOT), False),
    PciePath("hidden", "with no root port visible (a virtual machine) and AtomicOp Requester Enable clear", (),
             False),
    PciePath("hidden-enabled", "with no root port visible and AtomicOp Requester Enable set by the hypervisor", (),
             True, preset=True),
)}
DEFAULT_PCIE_PATH = "root-port"


def function_config(device_id: int, path: str) -> bytearray:
    """The function's config space: a Broadcom PCIe endpoint, ATOMIC_REQ set only where the path presets it."""
    return pcie_config(BROADCOM_VENDOR_ID, device_id, PCI_EXP_TYPE_ENDPOINT,
                       devctl2=PCI_EXP_DEVCTL2_ATOMIC_REQ if PCIE_PATHS[path].preset else 0,
                       capability=PCIE_CAPABILITY)


def port_configs(path: str) -> list[tuple[str, bytes]]:
    """(address, config space) of each port above the function, nearest first."""
    return [(port.address, bytes(pcie_config(*PORT_IDS[port.kind], port.kind, port.devcap2, port.devctl2)))
            for port in PCIE_PATHS[path].ports]


class PcieFunction:
    """What the function's PCIe side lets the data path do: ATOMIC_REQ as the driver last wrote DEVCTL2, and
    whether the path completes AtomicOps. Config space survives a function reset here, as Linux and vfio-pci
    restore it around one."""

    def __init__(self, path: str = DEFAULT_PCIE_PATH, note: Callable[[str, object], None] | None = None) -> None:
        self.path, self.note = PCIE_PATHS[path], note  # note: the firmware's note_error
        self.atomic_requests = self.path.preset

    def write_devctl2(self, value: int) -> None:
        self.atomic_requests = bool(value & PCI_EXP_DEVCTL2_ATOMIC_REQ)

    def refusal(self) -> str | None:
        """Why an atomic cannot reach host memory now (noted as the firmware's last error), or None."""
        why = None
        if not self.atomic_requests:
            why = "AtomicOp Requester Enable (DEVCTL2 ATOMIC_REQ) is clear: the function may issue no PCIe AtomicOp"
        elif not self.path.completes:
            why = f"the PCIe path ({self.path.name}: {self.path.summary}) does not complete AtomicOps"
        if why is not None and self.note is not None:
            self.note("atomic refused", why)
        return why
