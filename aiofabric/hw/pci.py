"""PCI configuration space as both sides of the seam read it (include/uapi/linux/pci_regs.h)."""

PCI_VENDOR_ID, PCI_DEVICE_ID, PCI_COMMAND = 0x00, 0x02, 0x04
PCI_COMMAND_MEMORY, PCI_COMMAND_MASTER = 0x2, 0x4
PCI_COMMAND_INTX_DISABLE = 0x400  # bit 10: no legacy interrupt line
BROADCOM_VENDOR_ID = 0x14E4
