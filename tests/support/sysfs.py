"""A fake sysfs tree of one PCI function, for the seams and pre-flight checks that read sysfs: its vendor, device and
config files, and BARs 0 and 2 as plain files that record what the driver writes; and, for the PCIe AtomicOps walk,
the same function as a PCIe endpoint below the bridges of a path, laid out as /sys/devices nests them."""
from pathlib import Path
from typing import NamedTuple, Sequence

from aiofabric.hw.pci import (PCI_EXP_DEVCAP2_ATOMIC_COMP32, PCI_EXP_DEVCAP2_ATOMIC_COMP64,
                              PCI_EXP_DEVCAP2_ATOMIC_ROUTE, PCI_EXP_TYPE_DOWNSTREAM, PCI_EXP_TYPE_ENDPOINT,
                              PCI_EXP_TYPE_ROOT_PORT, PCI_EXP_TYPE_UPSTREAM, pcie_config)

ADDR, PEER = "0000:41:00.0", "0000:41:00.1"  # the function, and another in its slot
BAR_SIZE = 64 * 1024
CAPABILITY = 0x40  # where make_path puts the function's PCI Express capability


class Port(NamedTuple):
    """A bridge of a path: its address, PCIe port type, DEVCAP2 and DEVCTL2."""
    address: str
    kind: int
    devcap2: int = 0
    devctl2: int = 0


ROOT = Port("0000:3e:01.0", PCI_EXP_TYPE_ROOT_PORT, PCI_EXP_DEVCAP2_ATOMIC_COMP32 | PCI_EXP_DEVCAP2_ATOMIC_COMP64)
UP = Port("0000:3f:00.0", PCI_EXP_TYPE_UPSTREAM, PCI_EXP_DEVCAP2_ATOMIC_ROUTE)
DOWN = Port("0000:40:00.0", PCI_EXP_TYPE_DOWNSTREAM, PCI_EXP_DEVCAP2_ATOMIC_ROUTE)


def make_tree(root: Path, vendor: str = "0x14e4\n") -> Path:
    """ADDR under `root` (a BCM57508 by default): its directory."""
    dev = root / ADDR
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor)
    (dev / "device").write_text("0x1750\n")
    (dev / "config").write_bytes(bytes(256))
    for n in (0, 2):
        (dev / f"resource{n}").write_bytes(bytes(BAR_SIZE))
    return dev


def make_path(devices: Path, ports: Sequence[Port], devctl2: int = 0, virtfn: bool = False) -> Path:
    """ADDR as make_tree makes it, but a PCIe endpoint (DEVCTL2 `devctl2`) below `ports` (the root port first), in a
    tree nested as /sys/devices is (beside `devices`, under pci0000:3e), `devices`/ADDR linking to it (a virtual
    function's has a `physfn` link). Returns the link."""
    parent = devices.parent / "sys-devices" / "pci0000:3e"
    for port in ports:
        parent = parent / port.address
        parent.mkdir(parents=True)
        (parent / "config").write_bytes(bytes(pcie_config(0x1B36, 0x000C, port.kind, port.devcap2, port.devctl2)))
    function = make_tree(parent)
    (function / "config").write_bytes(bytes(pcie_config(0x14E4, 0x1750, PCI_EXP_TYPE_ENDPOINT, devctl2=devctl2,
                                                        capability=CAPABILITY)))
    if virtfn:
        (function / "physfn").symlink_to(function)
    devices.mkdir(parents=True, exist_ok=True)
    (devices / ADDR).symlink_to(function)
    return devices / ADDR
