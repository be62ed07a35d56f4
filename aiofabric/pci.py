"""The one seam between the driver and a device: BAR MMIO, config space, DMA memory, interrupt fds.

Everything the driver knows about a NIC it learns through a `PCIDevice`. Two implementations exist: the real
hardware behind sysfs (`SysfsPCIDevice`, below) and the emulated NIC (`aiofabric.sim.host.SimPCIDevice`), which
presents the same shape VFIO gives real hardware: MMIO writes reach the device in order, interrupts are eventfds.
Doorbells go through `Bar.write64_doorbell`, which puts `memory_barrier()` before the write.
"""
from __future__ import annotations

import abc
import contextlib
import ctypes
import dataclasses
import errno
import mmap
import os
import platform
import re
import warnings
from typing import Any, Callable

from .errors import PCIError as PCIError  # the seam's error, defined with the others

PAGE_SIZE = 0x1000

# PCI config space (include/uapi/linux/pci_regs.h)
PCI_VENDOR_ID, PCI_DEVICE_ID, PCI_COMMAND = 0x00, 0x02, 0x04
PCI_COMMAND_MEMORY, PCI_COMMAND_MASTER = 0x2, 0x4
PCI_COMMAND_INTX_DISABLE = 0x400  # bit 10 (include/uapi/linux/pci_regs.h): no legacy interrupt line
BROADCOM_VENDOR_ID = 0x14E4


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
        """Allocate zeroed, pinned DMA memory rounded up to whole 4 KiB pages; MemoryError past `dma_budget`."""
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

    def debug_client(self) -> Any:
        """The emulator's debug channel (an `aiofabric.sim.debug.DebugClient`) when this device is an emulated NIC,
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


# ---------------------------------------------------------------------------------------------------------------------
# Real hardware through sysfs: BARs via resource<N> mmaps, config space via the `config` file, DMA memory translated to
# physical addresses through /proc/self/pagemap. Needs root, an unbound device and an IOMMU in passthrough/off mode
# (bus address == physical address).

HUGE_PAGE_SIZE = 2 << 20
MAP_LOCKED = getattr(mmap, "MAP_LOCKED", 0x2000)
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_ADDRESS_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_PFN_MASK = (1 << 55) - 1
_NEED_ROOT = "run as root (CAP_SYS_ADMIN is needed for BARs, config space and physical addresses)"


class SysfsBar(Bar):
    """A BAR mapped through `/sys/bus/pci/devices/<addr>/resource<N>`.

    Accesses go through memoryviews cast to 'I'/'Q', so each is one aligned load or store of that width (CPython
    copies a fixed-size item with memcpy, which compiles to a single move); the host is assumed little-endian.
    """

    def __init__(self, path: str, index: int, size: int | None = None) -> None:
        self.index = index
        try:
            fd = os.open(path, os.O_RDWR | os.O_SYNC)
        except PermissionError as e:
            raise PCIError(f"cannot open {path}: {_NEED_ROOT}") from e
        except FileNotFoundError as e:
            raise PCIError(f"BAR{index} does not exist ({path})") from e
        try:
            self.size = size or os.fstat(fd).st_size or _resource_size(os.path.dirname(path), index)
            if self.size <= 0:
                raise PCIError(f"BAR{index} is empty ({path})")
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise PCIError(f"cannot mmap BAR{index} ({path}): {e}") from e
        finally:
            os.close(fd)  # the mapping keeps its own reference
        raw = memoryview(self._mmap)
        self._u32 = raw[: self.size & ~3].cast("I")
        self._u64 = raw[: self.size & ~7].cast("Q")
        raw.release()

    def _slot(self, offset: int, width: int) -> int:
        if self._mmap.closed:
            raise ValueError(f"BAR{self.index} is closed")
        if offset % width:
            raise ValueError(f"misaligned {8 * width}-bit access at offset {offset:#x} of BAR{self.index}")
        if not 0 <= offset <= self.size - width:
            raise ValueError(f"offset {offset:#x} outside BAR{self.index} ({self.size:#x} bytes)")
        return offset // width

    def read32(self, offset: int) -> int:
        return self._u32[self._slot(offset, 4)]

    def write32(self, offset: int, value: int) -> None:
        self._u32[self._slot(offset, 4)] = value

    def read64(self, offset: int) -> int:
        return self._u64[self._slot(offset, 8)]

    def write64(self, offset: int, value: int) -> None:
        self._u64[self._slot(offset, 8)] = value

    def close(self) -> None:
        if not self._mmap.closed:
            self._u32.release()
            self._u64.release()
            self._mmap.close()


def _resource_size(device_dir: str, index: int) -> int:
    """BAR size from line `index` of the `resource` file ("start end flags", hex), 0 if unknown."""
    try:
        with open(os.path.join(device_dir, "resource")) as f:
            start, end, _flags = (int(x, 16) for x in f.read().splitlines()[index].split())
    except (OSError, IndexError, ValueError):
        return 0
    return end - start + 1 if end > start else 0


def _virt_addr(m: mmap.mmap) -> int:
    """Virtual address of an mmap; the ctypes object holds a buffer export, so drop it at once (else close() fails)."""
    c = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _phys_addr(pagemap_fd: int, virt: int) -> int:
    """Translate one virtual address through /proc/<pid>/pagemap (8 bytes per page: bit 63 present, 0-54 PFN)."""
    raw = os.pread(pagemap_fd, 8, virt // PAGE_SIZE * 8)
    if len(raw) != 8:
        raise PCIError(f"short read from pagemap for virtual address {virt:#x}")
    entry = int.from_bytes(raw, "little")
    if not entry >> 63:
        raise PCIError(f"page at virtual address {virt:#x} is not present in memory")
    pfn = entry & _PFN_MASK
    if pfn == 0:  # the kernel hides PFNs from processes without CAP_SYS_ADMIN
        raise PCIError("pagemap gives no physical addresses: run as root")
    return pfn * PAGE_SIZE + virt % PAGE_SIZE


def _release_mapping(view: memoryview, m: mmap.mmap) -> None:
    try:
        view.release()
        m.close()
    except BufferError:  # someone still holds a slice or an export of the view: the memory goes when they do
        pass


def check_bar_index(index: int) -> None:
    """A function has six BARs, 0..5."""
    if not 0 <= index <= 5:
        raise PCIError(f"BAR index {index} out of range 0..5")


class SysfsPCIDevice(PCIDevice):
    """A real NIC driven from userspace through sysfs, with no kernel driver bound.

    Plain sysfs cannot deliver MSI-X interrupts (that needs VFIO), so `num_vectors` is 0 and the driver polls its
    completion rings. DMA memory is mlocked anonymous memory whose physical pages are read from pagemap; this assumes
    the IOMMU is off or in passthrough, and that the kernel does not migrate locked pages (hugepages never move).
    """

    def __init__(
        self, address: str, sysfs_root: str = "/sys/bus/pci/devices", pagemap: str = "/proc/self/pagemap"
    ) -> None:
        self.address = address.lower()
        if not _ADDRESS_RE.fullmatch(self.address):
            raise PCIError(f"bad PCI address {address!r}: expected domain:bus:device.function, e.g. 0000:41:00.0")
        self._dir = os.path.join(sysfs_root, self.address)
        self._pagemap = pagemap
        self._bars: dict[int, SysfsBar] = {}
        self._dma: set[DmaBuffer] = set()
        self._config_fd = -1
        from .preflight import Host, claim  # preflight reads this module's constants, so it comes in here
        # present, a supported chip, no kernel driver, nobody else's (the lock, held until close); warns of the rest
        self._lock = claim(self.address, Host.with_devices(sysfs_root), "sysfs")
        try:
            self._config_fd = os.open(os.path.join(self._dir, "config"), os.O_RDWR)
        except PermissionError as e:
            self._lock.release()
            raise PCIError(f"cannot open config space of {self.address}: {_NEED_ROOT}") from e

    def _check_open(self) -> None:
        if self._config_fd < 0:
            raise PCIError(f"{self.address} is closed")

    # -- BARs and config space --

    def map_bar(self, index: int) -> Bar:
        self._check_open()
        check_bar_index(index)
        if index not in self._bars:
            self._bars[index] = SysfsBar(os.path.join(self._dir, f"resource{index}"), index)
        return self._bars[index]

    def _check_config(self, offset: int, size: int) -> None:
        self._check_open()
        if size not in (1, 2, 4) or offset % size or not 0 <= offset <= 4096 - size:
            raise ValueError(f"bad config access: {size} bytes at offset {offset:#x}")

    def read_config(self, offset: int, size: int) -> int:
        self._check_config(offset, size)
        raw = os.pread(self._config_fd, size, offset)
        if len(raw) != size:
            raise PCIError(f"short config read at {offset:#x} of {self.address} (only {len(raw)} bytes)")
        return int.from_bytes(raw, "little")

    def write_config(self, offset: int, value: int, size: int) -> None:
        self._check_config(offset, size)
        if os.pwrite(self._config_fd, value.to_bytes(size, "little"), offset) != size:
            raise PCIError(f"short config write at {offset:#x} of {self.address}")

    # -- DMA memory --

    def _alloc_dma(self, size: int, contiguous: bool) -> DmaBuffer:
        self._check_open()
        if size <= 0:
            raise ValueError(f"DMA size must be positive, not {size}")
        size = -(-size // PAGE_SIZE) * PAGE_SIZE
        huge = contiguous and size > PAGE_SIZE  # one 4 KiB page is contiguous by itself
        if huge and size > HUGE_PAGE_SIZE:
            raise PCIError(f"contiguous DMA buffers are limited to one 2 MiB hugepage ({size:#x} bytes asked)")
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | MAP_LOCKED | MAP_POPULATE | (MAP_HUGETLB if huge else 0)
        try:
            m = mmap.mmap(-1, HUGE_PAGE_SIZE if huge else size, flags=flags)
        except OSError as e:
            if huge:
                raise PCIError(f"no 2 MiB hugepage for a contiguous DMA buffer ({e.strerror}): reserve some with "
                               "`echo 64 > /proc/sys/vm/nr_hugepages`") from e
            locked = e.errno in (errno.EAGAIN, errno.EPERM)
            hint = ": raise the memlock limit (ulimit -l) or run as root" if locked else ""
            raise PCIError(f"cannot allocate {size:#x} bytes of locked DMA memory ({e.strerror}){hint}") from e
        try:
            for off in range(0, size, PAGE_SIZE):
                m[off] = 0  # fault every page in so pagemap has a frame for it
            virt = _virt_addr(m)
            try:
                fd = os.open(self._pagemap, os.O_RDONLY)
            except PermissionError as e:
                raise PCIError(f"cannot open {self._pagemap}: {_NEED_ROOT}") from e
            try:
                if huge:
                    base = _phys_addr(fd, virt)
                    bus_addrs = [base + off for off in range(0, size, PAGE_SIZE)]
                else:
                    bus_addrs = [_phys_addr(fd, virt + off) for off in range(0, size, PAGE_SIZE)]
            finally:
                os.close(fd)
        except BaseException:
            m.close()
            raise
        view = memoryview(m)[:size]
        buf = DmaBuffer(view=view, bus_addrs=bus_addrs, contiguous=contiguous)

        def release() -> None:
            self._dma.discard(buf)
            _release_mapping(view, m)

        buf._release = release
        self._dma.add(buf)
        return buf

    # -- interrupts (none through sysfs) --

    @property
    def num_vectors(self) -> int:
        return 0

    def interrupt_fd(self, vector: int) -> int:
        raise PCIError("no interrupts through sysfs; the driver polls")

    def reset(self) -> bool:
        """A function-level reset through the kernel (sysfs `reset`, which saves and restores config space)."""
        path = os.path.join(self._dir, "reset")
        if not os.path.exists(path):
            return False
        try:
            with open(path, "w") as f:
                f.write("1")
        except OSError as e:
            raise PCIError(f"cannot reset {self.address} ({path}: {e.strerror})") from e
        return True

    def close(self) -> None:
        if self._config_fd >= 0:  # the device must not write what is freed below: stop its DMA first
            for step in (self.disable_bus_master, self.reset):  # each on its own: one failing must not skip the other
                with contextlib.suppress(OSError, PCIError):
                    step()
        for buf in list(self._dma):
            buf.free()
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        if self._config_fd >= 0:
            os.close(self._config_fd)
            self._config_fd = -1
        self._lock.release()


# ---------------------------------------------------------------------------------------------------------------------
# The barrier before a doorbell. The driver writes WQEs and ring entries to DMA memory, then tells the device with an
# MMIO write; the device must not see the doorbell before those stores. x86 keeps stores in program order, stores to
# uncached MMIO (sysfs `resource<N>` maps are uncached) included, so nothing is needed there (Linux's writel() is a
# plain mov on x86 too). Weakly ordered CPUs need a real fence. Python has none and ctypes cannot inline one, so the
# fence is a two-instruction function in an executable page: the instruction rdma-core's udma_to_device_barrier()
# uses, then return. Encodings checked with llvm-mc (tests/test_pci_sysfs.py re-checks them where llvm-mc exists).
# A ctypes call costs ~0.1 us; it is paid only on those CPUs.

_STRONGLY_ORDERED = frozenset({"x86_64", "amd64", "i386", "i686"})
BARRIER_CODE: dict[str, bytes] = {
    "aarch64": bytes.fromhex("9f3e03d5" "c0035fd6"),  # dsb st; ret
    "ppc64le": bytes.fromhex("ac04007c" "2000804e"),  # sync; blr (ELFv2: a function pointer is its code address)
    "riscv64": bytes.fromhex("0f00f00f" "67800000"),  # fence iorw,iorw; ret
    "x86_64": bytes.fromhex("0faef0" "c3"),  # mfence; ret: never needed on x86, kept so the mechanism is testable
}
_PROT_READ_EXEC = mmap.PROT_READ | mmap.PROT_EXEC


def _no_barrier() -> None:
    """Nothing: this CPU keeps stores to memory and to MMIO in program order."""


def machine_code_barrier(machine: str) -> Callable[[], None]:
    """A callable that runs the full store fence of CPU `machine` (a `platform.machine()` name).

    Raises KeyError for an unknown CPU and OSError where the system forbids executable anonymous memory.
    """
    code = BARRIER_CODE[machine]
    page = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    page[:len(code)] = code
    address = _virt_addr(page)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(PAGE_SIZE), _PROT_READ_EXEC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot make the barrier page executable: {os.strerror(err)}")
    fence = ctypes.CFUNCTYPE(None)(address)
    setattr(fence, "_page", page)  # the code lives as long as the function
    return fence


def _choose_barrier(machine: str) -> Callable[[], None]:
    if machine in _STRONGLY_ORDERED:
        return _no_barrier
    try:
        return machine_code_barrier(machine)
    except (KeyError, OSError) as exc:
        reason = f"no barrier instruction known for {machine}" if isinstance(exc, KeyError) else str(exc)
        warned: list[bool] = []

        def unordered() -> None:
            if not warned:
                warned.append(True)
                warnings.warn(f"aiofabric: doorbells are not fenced on this CPU ({reason}); a real NIC may read "
                              "stale work requests", RuntimeWarning, stacklevel=3)

        return unordered


# memory_barrier(): every earlier store to DMA memory is ordered before the next MMIO write; call it before a doorbell
# (Bar.write64_doorbell does). Chosen once at import: _no_barrier on x86, the machine-code fence elsewhere.
memory_barrier: Callable[[], None] = _choose_barrier(platform.machine())
