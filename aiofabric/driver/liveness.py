"""Whether the device is still there: the seam's removal fd (the emulator's exit) or, without one, config space
reading all ones. Once it is gone, `lost` holds the error and everyone who asked to be told (`on_lost`) is."""
from __future__ import annotations

from typing import Callable

import anyio

from . import log
from .interrupts import readable
from ..errors import DeviceLostError
from ..pci import PCI_VENDOR_ID, PCIDevice

REMOVAL_POLL = 1.0  # without a removal fd: how often the watch reads config space


class Liveness:
    def __init__(self, pci: PCIDevice) -> None:
        self.pci = pci
        self.lost: DeviceLostError | None = None
        self.watching = False  # the watch task runs; else command waits look for themselves (`look`)
        self._listeners: list[Callable[[DeviceLostError], None]] = []

    @property
    def alive(self) -> bool:
        return self.lost is None

    def on_lost(self, listener: Callable[[DeviceLostError], None]) -> None:
        self._listeners.append(listener)

    def check(self) -> None:
        """Raise the loss, if the device is gone."""
        if self.lost is not None:
            raise self.lost

    async def watch(self) -> None:
        """Run until the device is gone (one of the NIC's background tasks), then declare it lost."""
        fd = self.pci.removal_fd()
        self.watching = True
        try:
            while self.lost is None:
                if fd is not None:
                    await anyio.wait_readable(fd)
                else:
                    await anyio.sleep(REMOVAL_POLL)
                    if not self._reads_all_ones():
                        continue
                await self._declare_removed()
        finally:
            self.watching = False

    async def look(self, raising: bool = True) -> None:
        """For a command waiting on the firmware: while no watch task runs (a cancelled block has lost it), look
        whether the device is gone, so the wait ends now rather than at its timeout. Raises the loss if `raising`."""
        if self.lost is None and not self.watching:
            fd = self.pci.removal_fd()
            if readable(fd) if fd is not None else self._reads_all_ones():
                await self._declare_removed()
        if raising:
            self.check()

    def _reads_all_ones(self) -> bool:
        """Whether config space reads all ones, as a device no longer on the bus does."""
        return self.pci.read_config(PCI_VENDOR_ID, 2) == 0xFFFF

    async def _declare_removed(self) -> None:
        with anyio.CancelScope(shield=True):  # the reason (an exit status) is read once, in a worker thread
            reason = await anyio.to_thread.run_sync(self.pci.removal_reason)
        if self.lost is None:
            self.declare(DeviceLostError(f"{self.pci.address} is gone" + (f" ({reason})" if reason else "")))

    def declare(self, error: DeviceLostError) -> None:
        self.lost = error
        log.error("%s", error)
        for listener in self._listeners:
            listener(error)
