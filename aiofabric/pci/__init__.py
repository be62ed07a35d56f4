"""The PCI seam and its three backends: the interface (`seam`), a real NIC through VFIO (`vfio`, the default: over
the kernel's interface `vfio_api`, with DMA windows in the IOMMU, `iommu`) or plain sysfs (`sysfs`), and the emulated
NIC (`emulated`, which talks to the emulator process of `aiofabric.sim`); with what they share: Linux memory
(`linux`), the DMA barriers (before a doorbell, after a valid bit), the DMA pool, the checks before a device is taken
(`preflight`), taking it (`device_lock`: the open's verdict and the per-device lock) and `aiofabric doctor`'s report
(`doctor`). The driver imports the seam's names from here and a backend only where it opens one."""
from .barrier import memory_barrier, read_barrier
from .linux import PAGE_SIZE
from .seam import ADDRESS, Bar, DmaBudget, DmaBuffer, PCIDevice, check_bar_index
from ..errors import PCIError
from ..hw.pci import (BROADCOM_VENDOR_ID, PCI_COMMAND, PCI_COMMAND_INTX_DISABLE, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY,
                      PCI_DEVICE_ID, PCI_VENDOR_ID)

__all__ = ["BROADCOM_VENDOR_ID", "PCI_COMMAND", "PCI_COMMAND_INTX_DISABLE", "PCI_COMMAND_MASTER", "PCI_COMMAND_MEMORY",
           "PCI_DEVICE_ID", "PCI_VENDOR_ID", "ADDRESS", "PAGE_SIZE", "Bar", "DmaBudget", "DmaBuffer", "PCIDevice",
           "PCIError", "check_bar_index", "memory_barrier", "read_barrier"]
