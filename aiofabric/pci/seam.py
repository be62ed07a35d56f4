"""The one seam between the driver and a device: BAR MMIO, config space, DMA memory, interrupt fds.

Everything the driver knows about a NIC it learns through a `PCIDevice`. Three implementations exist: a real NIC
through VFIO (`vfio.VfioPCIDevice`, the default), a real NIC through plain sysfs (`sysfs.SysfsPCIDevice`, no IOMMU)
and the emulated NIC (`emulated.SimPCIDevice`), which presents the same shape VFIO gives real hardware: MMIO writes
reach the device in order, interrupts are eventfds. Doorbells go through `Bar.write64_doorbell`, which puts
`memory_barrier()` before the write.
"""
from __future__ import annotations

import abc
import dataclasses
import re
from typing import Any, Callable

from .barrier import memory_barrier
from .linux import PAGE_SIZE
from .upstream import UpstreamPath
from ..errors import PCIError
from ..hw.pci import PCI_COMMAND, PCI_COMMAND_INTX_DISABLE, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY

# a function's PCI address: domain:bus:device.function, lower case
ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class Bar(abc.ABC):
    """One memory BAR. Offsets are bytes; accesses are little-endian and naturally aligned."""

    size: int

    @abc.abstractmethod
    def read32(self, offset: int) -> int: ...

    @abc.abstractmethod
    def write32(self, offset: int, value: int) -> None: ...

    @abc.abstractmethod
    def read64(self, offset: int) -> int: ...

    @abc.abstractmethod
    def write64(self, offset: int, value: int) -> None: ...

    def write64_doorbell(self, offset: int, value: int) -> None:
        """Ring a doorbell: a 64-bit MMIO write that the device must see after every earlier store to DMA memory
        (the WQEs or ring entries it announces), hence the barrier first."""
        memory_barrier()
        self.write64(offset, value)

    def write64_doorbells(self, offset: int, values: list[int]) -> None:
        """Ring several doorbells at `offset`, in order, behind one barrier (a seam may deliver them at once)."""
        memory_barrier()
        for value in values:
            self.write64(offset, value)

    def write_block(self, offset: int, data: bytes) -> None:
        """Write `data` (a multiple of 4 bytes) as consecutive 32-bit MMIO writes, lowest address first."""
        words = memoryview(bytes(data)).cast("I")
        for i, word in enumerate(words):
            self.write32(offset + 4 * i, word)


@dataclasses.dataclass(eq=False)
class DmaBuffer:
    """Pinned host memory the device can reach.

    `view` is the CPU's view; `bus_addrs[i]` is the bus address of the i-th 4 KiB page. When `contiguous` is true the
    pages are consecutive on the bus, so `bus_addr + offset` is valid for any offset below `size`.
    """

    view: memoryview
    bus_addrs: list[int]
    contiguous: bool
    _release: Callable[[], None] | None = dataclasses.field(default=None, repr=False)
    _size: int = dataclasses.field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        self._size = len(self.view)  # kept: the view is released on free()

    @property
    def size(self) -> int:
        return self._size

    @property
    def bus_addr(self) -> int:
        return self.bus_addrs[0]

    def bus_address_of(self, offset: int) -> int:
        """Bus address of byte `offset`, valid whether or not the buffer is contiguous."""
        if not 0 <= offset < self.size:
            raise ValueError(f"offset {offset:#x} outside DMA buffer of {self.size:#x} bytes")
        return self.bus_addrs[offset // PAGE_SIZE] + offset % PAGE_SIZE

    def free(self) -> None:
        """Give the memory back. `view` is released, so a use after free raises instead of touching memory the
        device may already have been given for something else. Idempotent."""
        self.release_view()
        release, self._release = self._release, None
        if release is not None:
            release()

    def release_view(self) -> None:
        try:
            self.view.release()
        except BufferError:  # the caller exported it (numpy, ctypes): that export keeps the memory mapped
            pass


class DmaBudget:
    """A cap on the DMA memory some devices hold at once (a server's limit per client): bytes `in_use` of `limit`;
    `name` says whose limit it is in the error."""

    def __init__(self, limit: int, name: str = "DMA memory limit") -> None:
        self.limit, self.name, self.in_use = limit, name, 0

    def take(self, length: int, who: str) -> None:
        if self.in_use + length > self.limit:
            raise MemoryError(f"{who}: {length} more bytes of DMA memory would make {self.in_use + length}, over the "
                              f"{self.name} of {self.limit}")
        self.in_use += length

    def give(self, length: int) -> None:
        self.in_use -= length


class PCIDevice(abc.ABC):
    """A PCI function as the driver sees it. Not thread-safe; used from one event loop."""

    address: str

    @abc.abstractmethod
    def map_bar(self, index: int) -> Bar: ...

    @abc.abstractmethod
    def read_config(self, offset: int, size: int) -> int: ...

    @abc.abstractmethod
    def write_config(self, offset: int, value: int, size: int) -> None: ...

    dma_budget: DmaBudget | None = None  # shared by the devices one budget caps (open_nic(dma_budget=...))

    def alloc_dma(self, size: int, contiguous: bool = False) -> DmaBuffer:
        """Allocate zeroed, pinned DMA memory rounded up to whole 4 KiB pages; MemoryError past `dma_budget`.
        `contiguous`: its pages are consecutive on the bus and the first is aligned to the size rounded up to a power
        of two, as dma_alloc_coherent gives Linux's drivers (the CMDQ); PCIError where the platform has no such
        memory (no IOMMU, and no hugepage that holds it)."""
        budget = self.dma_budget
        if budget is None:
            return self._alloc_dma(size, contiguous)
        length = -(-max(size, 1) // PAGE_SIZE) * PAGE_SIZE
        budget.take(length, self.address)
        try:
            buffer = self._alloc_dma(size, contiguous)
        except BaseException:
            budget.give(length)
            raise
        release = buffer._release

        def give_back() -> None:
            budget.give(length)
            if release is not None:
                release()
        buffer._release = give_back
        return buffer

    @abc.abstractmethod
    def _alloc_dma(self, size: int, contiguous: bool) -> DmaBuffer: ...

    @property
    @abc.abstractmethod
    def num_vectors(self) -> int:
        """How many MSI-X vectors `interrupt_fd` serves (0 when the platform gives no interrupts)."""

    @abc.abstractmethod
    def interrupt_fd(self, vector: int) -> int:
        """An fd that becomes readable when MSI-X `vector` fires; read 8 bytes to acknowledge (eventfd semantics)."""

    def removal_fd(self) -> int | None:
        """An fd that becomes readable when the device is gone (emulator died); None if the platform has none."""
        return None

    def removal_reason(self) -> str:
        """Why the device went away, if the platform can tell (blocking; call it once, after removal)."""
        return ""

    def upstream_path(self) -> UpstreamPath:
        """The bridges between the function and the root complex, nearest first, and whether it is a virtual
        function: what the PCIe AtomicOps walk reads (atomic_ops.py). The default platform shows no bridge."""
        return UpstreamPath()

    def debug_client(self) -> Any:
        """The emulator's debug channel (an `aiofabric.pci.emulated_debug.DebugClient`) when this device is an emulated NIC,
        else None. Not part of the seam (the driver never asks): the engines count packets and placements and inject
        faults through it where it exists, and say what they could not measure where it does not."""
        return None

    @abc.abstractmethod
    def close(self) -> None: ...

    def enable_bus_master(self) -> None:
        """Memory decoding and DMA on, the legacy INTx line off (MSI-X, or polling, is all the driver uses)."""
        command = self.read_config(PCI_COMMAND, 2)
        self.write_config(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE, 2)

    def disable_bus_master(self) -> None:
        """Stop the function's DMA (PCI_COMMAND's bus-master bit): what a close and the crash path do before they
        free memory the device could still write."""
        command = self.read_config(PCI_COMMAND, 2)
        self.write_config(PCI_COMMAND, command & ~PCI_COMMAND_MASTER, 2)

    def reset(self) -> bool:
        """Reset the function (a function-level reset: every queue, context and DMA stops) if the platform can;
        whether it did. The default platform cannot."""
        return False


def check_address(address: str) -> str:
    """`address` in lower case (as sysfs, VFIO and the device locks name a function); PCIError unless it is
    domain:bus:device.function."""
    lowered = address.lower()
    if not ADDRESS.fullmatch(lowered):
        raise PCIError(f"bad PCI address {address!r}: expected domain:bus:device.function, e.g. 0000:41:00.0")
    return lowered


def check_config_access(offset: int, size: int, config_size: int) -> None:
    """A config-space access is 1, 2 or 4 bytes, naturally aligned, within the first `config_size` bytes."""
    if size not in (1, 2, 4) or offset % size or not 0 <= offset <= config_size - size:
        raise ValueError(f"bad config access: {size} bytes at offset {offset:#x}")


def config_value(raw: bytes, offset: int, size: int, address: str) -> int:
    """The value a config read of `size` bytes at `offset` returned (little-endian); PCIError if it came short."""
    if len(raw) != size:
        raise PCIError(f"short config read at {offset:#x} of {address} (only {len(raw)} bytes)")
    return int.from_bytes(raw, "little")


def check_bar_index(index: int) -> None:
    """A function has six BARs, 0..5."""
    if not 0 <= index <= 5:
        raise PCIError(f"BAR index {index} out of range 0..5")
