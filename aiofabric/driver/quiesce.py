"""Stopping a function's DMA on the way out: bus mastering off and a function-level reset, after a close's FUNC_RESET
and, for NICs still open when the process exits, from an atexit hook (the crash path)."""
from __future__ import annotations

import atexit
import weakref
from typing import Protocol

from . import log
from ..errors import PCIError
from ..pci import PCIDevice


class Booted(Protocol):
    pci: PCIDevice


_open: weakref.WeakSet[Booted] = weakref.WeakSet()  # booted, not yet closed: the crash path stops them


def track(device: Booted) -> None:
    _open.add(device)


def untrack(device: Booted) -> None:
    _open.discard(device)


def stop_dma(pci: PCIDevice) -> None:
    """Bus mastering off and a function-level reset, best effort (a device already gone takes neither)."""
    for step in (pci.disable_bus_master, pci.reset):
        try:
            step()
        except (PCIError, OSError) as exc:
            log.info("%s: %s: %s", pci.address, step.__name__, exc)


@atexit.register
def _stop_at_exit() -> None:
    """A process that exits with NICs still open (an exception that escaped, sys.exit from a thread) must not leave
    them writing into memory it no longer owns: stop their DMA. A process killed outright runs nothing; the next open
    resets the function first, and the kernel's vfio-pci resets it when its file closes."""
    for device in list(_open):
        stop_dma(device.pci)
