"""A fake sysfs tree of one PCI function, for the seams and pre-flight checks that read sysfs: its vendor, device and
config files, and BARs 0 and 2 as plain files that record what the driver writes."""
from pathlib import Path

ADDR, PEER = "0000:41:00.0", "0000:41:00.1"  # the function, and another in its slot
BAR_SIZE = 64 * 1024


def make_tree(root: Path, vendor: str = "0x14e4\n") -> Path:
    """ADDR under `root` (a BCM57508 by default): its directory."""
    dev = root / ADDR
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor)
    (dev / "device").write_text("0x1750\n")
    (dev / "config").write_bytes(bytes(256))
    for n in (0, 2):
        (dev / f"resource{n}").write_bytes(bytes(BAR_SIZE))
    return dev
