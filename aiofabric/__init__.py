"""aiofabric: an async-first userspace driver for Broadcom BNXT RoCEv2 NICs, with an emulated NIC.

The names below are imported on first use (PEP 562), so `import aiofabric` stays cheap and the emulator process,
which imports `aiofabric.sim.process`, never loads the driver or anyio.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_HOMES = {
    ".nic": ("NIC", "open_nic", "DmaBudget"),
    ".queues": ("Access", "CompletionQueue", "MemoryRegion", "QPInfo", "QPState", "QueuePair", "RemoteRegion",
                "LocalBuffer"),
    ".completions": ("Completion",),
    ".errors": ("FabricError", "FirmwareError", "FirmwareTimeoutError", "DeviceLostError", "ClosedError", "PCIError",
                "CompletionError", "QPStateError", "OperationTimeoutError", "PeerError"),
    ".peer.ssh": ("connect_peer",),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [*_MODULE_OF, "__version__"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'aiofabric' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from .completions import Completion
    from .errors import (ClosedError, CompletionError, DeviceLostError, FabricError, FirmwareError,
                         FirmwareTimeoutError, OperationTimeoutError, PCIError, PeerError, QPStateError)
    from .nic import NIC, DmaBudget, open_nic
    from .peer.ssh import connect_peer
    from .queues import Access, CompletionQueue, LocalBuffer, MemoryRegion, QPInfo, QPState, QueuePair, RemoteRegion
