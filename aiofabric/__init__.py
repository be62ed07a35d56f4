"""aiofabric: an async-first userspace driver for Broadcom BNXT RoCEv2 NICs, with an emulated NIC."""
__version__ = "0.1.0"

from .errors import DeviceLostError, FabricError, FirmwareError, FirmwareTimeoutError  # noqa: E402
from .nic import NIC, open_nic  # noqa: E402
from .queues import Access, CompletionQueue, MemoryRegion, QPInfo, QPState, QueuePair  # noqa: E402

__all__ = ["NIC", "open_nic", "Access", "CompletionQueue", "MemoryRegion", "QPInfo", "QPState", "QueuePair",
           "FabricError", "FirmwareError", "FirmwareTimeoutError", "DeviceLostError", "__version__"]
