"""What lies between a PCI function and the root complex, as the AtomicOps walk (atomic_ops.py) reads it: the
bridges above the function, nearest first, each with a readable config space, and whether the function is a virtual
function.

On a real machine that is sysfs: /sys/bus/pci/devices/ADDR links to the function's directory under /sys/devices, and
every directory above it that holds a `config` file is a bridge on the way up (a root port sits on a root bus, whose
directory, pci0000:00, has none). Linux lets only CAP_SYS_ADMIN read past a bridge's 64-byte header, where its PCI
Express capability is; anyone else reads short, which the walk reports. An emulated NIC shows its own path
(ConfigImage: config bytes the emulator made).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Protocol

from ..errors import PCIError


class ConfigSpace(Protocol):
    """Something whose config space can be read: a bridge above a function, or the function itself."""

    address: str

    def read_config(self, offset: int, size: int) -> int: ...


class SysfsConfig:
    """A function's config space through its sysfs `config` file, read-only."""

    def __init__(self, address: str, path: str) -> None:
        self.address, self.path = address, path

    def read_config(self, offset: int, size: int) -> int:
        try:
            with open(self.path, "rb") as f:
                raw = os.pread(f.fileno(), size, offset)
        except OSError as e:
            raise PCIError(f"cannot read the config space of {self.address} ({self.path}: {e.strerror})") from e
        if len(raw) != size:
            raise PCIError(f"cannot read the config space of {self.address} past byte {offset + len(raw)} "
                           f"({self.path}): Linux shows only the header to a process without CAP_SYS_ADMIN; run as "
                           "root")
        return int.from_bytes(raw, "little")


class ConfigImage:
    """Config space held as bytes: an emulated port."""

    def __init__(self, address: str, config: bytes) -> None:
        self.address, self.config = address, bytes(config)

    def read_config(self, offset: int, size: int) -> int:
        return int.from_bytes(self.config[offset:offset + size], "little")


@dataclasses.dataclass(frozen=True)
class UpstreamPath:
    """The bridges above a function, nearest first (empty: none visible, as in a virtual machine), and whether the
    function is a virtual function."""

    bridges: tuple[ConfigSpace, ...] = ()
    virtfn: bool = False


def sysfs_upstream(devices: str, address: str) -> UpstreamPath:
    """The path above `address` as sysfs under `devices` (/sys/bus/pci/devices, or a fake tree's) shows it."""
    link = os.path.join(devices, address)
    bridges = []
    parent = os.path.dirname(os.path.realpath(link))
    while os.path.isfile(os.path.join(parent, "config")) and parent != os.path.dirname(parent):
        bridges.append(SysfsConfig(os.path.basename(parent), os.path.join(parent, "config")))
        parent = os.path.dirname(parent)
    return UpstreamPath(tuple(bridges), os.path.lexists(os.path.join(link, "physfn")))
