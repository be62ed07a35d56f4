"""PCI configuration space as both sides of the seam read it (include/uapi/linux/pci_regs.h)."""
from __future__ import annotations

import struct
from typing import Callable

PCI_VENDOR_ID, PCI_DEVICE_ID, PCI_COMMAND = 0x00, 0x02, 0x04
PCI_COMMAND_MEMORY, PCI_COMMAND_MASTER = 0x2, 0x4
PCI_COMMAND_INTX_DISABLE = 0x400  # bit 10: no legacy interrupt line
BROADCOM_VENDOR_ID = 0x14E4
PCI_STATUS, PCI_STATUS_CAP_LIST = 0x06, 0x10
PCI_HEADER_TYPE, PCI_HEADER_TYPE_BRIDGE = 0x0E, 0x01
PCI_CAPABILITY_LIST = 0x34
PCI_CAP_ID_EXP = 0x10  # the PCI Express capability
PCI_FIND_CAP_TTL = 48  # Linux's bound on a capability list's length (a loop in it must end)

# The PCI Express capability's registers, from its start
PCI_EXP_FLAGS, PCI_EXP_FLAGS_TYPE = 0x02, 0x00F0
PCI_EXP_TYPE_ENDPOINT, PCI_EXP_TYPE_LEG_END, PCI_EXP_TYPE_ROOT_PORT = 0x0, 0x1, 0x4
PCI_EXP_TYPE_UPSTREAM, PCI_EXP_TYPE_DOWNSTREAM = 0x5, 0x6
PCI_EXP_DEVCAP2, PCI_EXP_DEVCTL2 = 0x24, 0x28
PCI_EXP_DEVCAP2_ATOMIC_ROUTE = 0x40  # a switch port routes AtomicOps
PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64 = 0x80, 0x100  # a completer of 32/64-bit AtomicOps
PCI_EXP_DEVCTL2_ATOMIC_REQ = 0x40  # AtomicOp Requester Enable: the function may issue AtomicOps
PCI_EXP_DEVCTL2_ATOMIC_EGRESS_BLOCK = 0x80  # an upstream port drops AtomicOps leaving it
PCIE_TYPE_NAMES = {PCI_EXP_TYPE_ENDPOINT: "endpoint", PCI_EXP_TYPE_LEG_END: "legacy endpoint",
                   PCI_EXP_TYPE_ROOT_PORT: "root port", PCI_EXP_TYPE_UPSTREAM: "switch upstream port",
                   PCI_EXP_TYPE_DOWNSTREAM: "switch downstream port"}

ConfigRead = Callable[[int, int], int]  # (offset, size) -> the little-endian value there


def find_capability(read: ConfigRead, cap_id: int) -> int | None:
    """The offset of capability `cap_id` in a function's config space, None without it (Linux's
    pci_find_capability: the list from PCI_CAPABILITY_LIST, each entry dword-aligned at 0x40 or above)."""
    if not read(PCI_STATUS, 2) & PCI_STATUS_CAP_LIST:
        return None
    position = read(PCI_CAPABILITY_LIST, 1)
    for _ in range(PCI_FIND_CAP_TTL):
        position &= ~3
        if position < 0x40:
            return None
        found = read(position, 1)
        if found == 0xFF:
            return None
        if found == cap_id:
            return position
        position = read(position + 1, 1)
    return None


def pcie_config(vendor: int, device: int, port_type: int, devcap2: int = 0, devctl2: int = 0,
                capability: int = 0x40) -> bytearray:
    """256 bytes of config space: the IDs, a type-1 header for a port (type 0 for an endpoint), and one
    capability, PCI Express version 2 of `port_type` at `capability` with these DEVCAP2 and DEVCTL2."""
    config = bytearray(256)
    bridge = port_type not in (PCI_EXP_TYPE_ENDPOINT, PCI_EXP_TYPE_LEG_END)
    struct.pack_into("<HH", config, PCI_VENDOR_ID, vendor, device)
    struct.pack_into("<H", config, PCI_STATUS, PCI_STATUS_CAP_LIST)
    config[PCI_HEADER_TYPE] = PCI_HEADER_TYPE_BRIDGE if bridge else 0
    config[PCI_CAPABILITY_LIST] = capability
    struct.pack_into("<BBH", config, capability, PCI_CAP_ID_EXP, 0, 2 | port_type << 4)
    struct.pack_into("<I", config, capability + PCI_EXP_DEVCAP2, devcap2)
    struct.pack_into("<H", config, capability + PCI_EXP_DEVCTL2, devctl2)
    return config
