"""aiofabric: an async-first userspace driver for Broadcom BNXT RoCEv2 NICs, with an emulated NIC.

The names below are imported on first use (PEP 562), so `import aiofabric` stays cheap and the emulator process,
which imports `aiofabric.sim.process`, never loads the driver or anyio.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .util.lazy import lazy_attributes
from .version import __version__

_HOMES = {
    ".verbs.nic": ("NIC", "open_nic", "DmaBudget"),
    ".verbs.types": ("Access", "QPInfo", "QPState", "RemoteRegion", "LocalBuffer"),
    ".verbs.cq": ("CompletionQueue",),
    ".verbs.mr": ("MemoryRegion",),
    ".verbs.post": ("QueuePair",),
    ".verbs.completions": ("Completion",),
    ".verbs.events": ("EventStream", "DeviceEvent"),
    ".errors": ("FabricError", "FirmwareError", "FirmwareTimeoutError", "DeviceLostError", "ClosedError", "PCIError",
                "CompletionError", "QPStateError", "OperationTimeoutError", "LinkDownError", "PeerError"),
    ".peer.ssh": ("connect_peer",),
}
__all__ = [*(name for names in _HOMES.values() for name in names), "__version__"]
__getattr__ = lazy_attributes(globals(), _HOMES)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from .errors import (ClosedError, CompletionError, DeviceLostError, FabricError, FirmwareError,
                         FirmwareTimeoutError, LinkDownError, OperationTimeoutError, PCIError, PeerError,
                         QPStateError)
    from .peer.ssh import connect_peer
    from .verbs.completions import Completion
    from .verbs.cq import CompletionQueue
    from .verbs.events import DeviceEvent, EventStream
    from .verbs.mr import MemoryRegion
    from .verbs.nic import NIC, DmaBudget, open_nic
    from .verbs.post import QueuePair
    from .verbs.types import Access, LocalBuffer, QPInfo, QPState, RemoteRegion
