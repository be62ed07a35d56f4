"""The barriers between the CPU and the device's DMA: before a doorbell (`memory_barrier`), and between a ring entry's
valid bit and the rest of it (`read_barrier`)."""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import warnings
from typing import Callable

from .linux import PAGE_SIZE, virt_addr

# The barrier before a doorbell. The driver writes WQEs and ring entries to DMA memory, then tells the device with an
# MMIO write; the device must not see the doorbell before those stores. x86 keeps stores in program order, stores to
# uncached MMIO (sysfs `resource<N>` maps are uncached) included, so nothing is needed there (Linux's writel() is a
# plain mov on x86 too). Weakly ordered CPUs need a real fence. Python has none and ctypes cannot inline one, so the
# fence is a two-instruction function in an executable page: the instruction rdma-core's udma_to_device_barrier()
# uses, then return. Encodings checked with llvm-mc (tests/driver/test_pci_sysfs.py re-checks them where llvm-mc
# exists). A ctypes call costs ~0.1 us; it is paid only on those CPUs.

_STRONGLY_ORDERED = frozenset({"x86_64", "amd64", "i386", "i686"})
BARRIER_CODE: dict[str, bytes] = {
    "aarch64": bytes.fromhex("9f3e03d5" "c0035fd6"),  # dsb st; ret
    "ppc64le": bytes.fromhex("ac04007c" "2000804e"),  # sync; blr (ELFv2: a function pointer is its code address)
    "riscv64": bytes.fromhex("0f00f00f" "67800000"),  # fence iorw,iorw; ret
    "x86_64": bytes.fromhex("0faef0" "c3"),  # mfence; ret: never needed on x86, kept so the mechanism is testable
}
# The barrier after a valid bit. The device writes an entry's body, then its valid bit; a CPU that sees the bit must
# not have read the body before it (Linux's dma_rmb() after each CQE, NQE, CREQ entry and HWRM answer). x86 never
# reorders loads with loads (dma_rmb() is a compiler barrier there); weakly ordered CPUs take rdma-core's
# udma_from_device_barrier() instruction.
READ_BARRIER_CODE: dict[str, bytes] = {
    "aarch64": bytes.fromhex("bf3103d5" "c0035fd6"),  # dmb oshld; ret
    "ppc64le": bytes.fromhex("ac04207c" "2000804e"),  # lwsync; blr
    "riscv64": bytes.fromhex("0f00a00a" "67800000"),  # fence ir,ir; ret
    "x86_64": bytes.fromhex("0faee8" "c3"),  # lfence; ret: never needed on x86, kept so the mechanism is testable
}
_PROT_READ_EXEC = mmap.PROT_READ | mmap.PROT_EXEC


def _no_barrier() -> None:
    """Nothing: this CPU keeps stores to memory and to MMIO in program order."""


def machine_code_barrier(machine: str, codes: dict[str, bytes] = BARRIER_CODE) -> Callable[[], None]:
    """A callable that runs the fence `codes` holds for CPU `machine` (a `platform.machine()` name): by default the
    full store fence before a doorbell, READ_BARRIER_CODE's after a valid bit.

    Raises KeyError for an unknown CPU and OSError where the system forbids executable anonymous memory.
    """
    code = codes[machine]
    page = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    page[:len(code)] = code
    address = virt_addr(page)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(PAGE_SIZE), _PROT_READ_EXEC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot make the barrier page executable: {os.strerror(err)}")
    fence = ctypes.CFUNCTYPE(None)(address)
    setattr(fence, "_page", page)  # the code lives as long as the function
    return fence


def _choose_barrier(machine: str, codes: dict[str, bytes], risk: str) -> Callable[[], None]:
    if machine in _STRONGLY_ORDERED:
        return _no_barrier
    try:
        return machine_code_barrier(machine, codes)
    except (KeyError, OSError) as exc:
        reason = f"no barrier instruction known for {machine}" if isinstance(exc, KeyError) else str(exc)
        warned: list[bool] = []

        def unordered() -> None:
            if not warned:
                warned.append(True)
                warnings.warn(f"aiofabric: {risk.format(reason=reason)}", RuntimeWarning, stacklevel=3)

        return unordered


# memory_barrier(): every earlier store to DMA memory is ordered before the next MMIO write; call it before a doorbell
# (Bar.write64_doorbell does). Chosen once at import: _no_barrier on x86, the machine-code fence elsewhere.
memory_barrier: Callable[[], None] = _choose_barrier(
    platform.machine(), BARRIER_CODE, "doorbells are not fenced on this CPU ({reason}); a real NIC may read stale work "
                                      "requests")
# read_barrier(): the reads of a ring entry after it are not satisfied before the read of its valid bit that came
# before; call it between the two. Free on x86 (a call to nothing), the machine-code fence elsewhere.
read_barrier: Callable[[], None] = _choose_barrier(
    platform.machine(), READ_BARRIER_CODE, "ring entries are not fenced on this CPU ({reason}); the driver may read an "
                                           "entry's body from before its valid bit")
