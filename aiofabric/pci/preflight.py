"""Pre-flight checks of a PCI function before the driver takes it over.

Every check reads the machine through a `Host` (sysfs, procfs, /dev/vfio: the real paths, or a fake tree's in tests)
and returns a `Finding`: what it saw, whether that is fine, and the command that fixes it. Opening a function runs
them (`device_lock.claim`, which also takes the per-device lock), and so does `aiofabric doctor` (`doctor`), which
prints them all.

What is fine depends on how the driver reaches the device (`access`). Raw sysfs gives the NIC physical addresses, so
it needs the IOMMU off or in passthrough and DMA pages the kernel never moves; VFIO maps DMA through the IOMMU (the
pages pinned by it), so it needs translation on and the function bound to vfio-pci.
"""
from __future__ import annotations

import dataclasses
import os
import resource
from typing import Callable, Literal

from ..errors import PCIError
from ..hw.pci import BROADCOM_VENDOR_ID, PCI_COMMAND, PCI_COMMAND_INTX_DISABLE, PCI_COMMAND_MASTER


Access = Literal["sysfs", "vfio"]
ACCESSES: tuple[Access, ...] = ("sysfs", "vfio")

# The chips the driver supports, by PCI device ID: the physical functions of Thor (BCM5750x) and Thor2 (BCM5760x),
# from Linux's bnxt_en (drivers/net/ethernet/broadcom/bnxt/bnxt.c, bnxt_pci_tbl). Left out: their NPAR partitions
# (0x1800-0x1805) and virtual functions (0x1806-0x1809, 0x1819): the driver boots a whole physical function (its own
# func_reset and backing store) and has never run on those. The emulated NIC is a BCM57608.
_FAMILIES = {"Thor": {0x1750: "BCM57508", 0x1751: "BCM57504", 0x1752: "BCM57502"},
             "Thor2": {0x1760: "BCM57608", 0x1761: "BCM57604", 0x1762: "BCM57602", 0x1763: "BCM57601"}}
SUPPORTED_CHIPS: dict[int, str] = {device: f"{part} ({family})"
                                   for family, parts in _FAMILIES.items() for device, part in parts.items()}
SUPPORTED_NAMES = "; ".join(f"{family} {', '.join(parts.values())}" for family, parts in _FAMILIES.items())

CAP_IPC_LOCK, CAP_SYS_ADMIN = 14, 21  # include/uapi/linux/capability.h
# Drivers VFIO accepts beside ours in an IOMMU group (they leave DMA to the group's owner), and no driver at all
GROUP_PEER_DRIVERS = frozenset({"vfio-pci", "pci-stub", "pcieport"})
# Checks whose failure leaves the device drivable (a warning), by the accesses that holds for
WARNING_ONLY: dict[str, tuple[Access, ...]] = {
    "driver_override": ACCESSES, "intx": ACCESSES, "memlock": ACCESSES, "hugepages": ACCESSES, "quiesced": ACCESSES,
    "iommu_group": ("sysfs",),  # only VFIO takes the whole group
    "power": ("vfio",),  # VFIO wakes the function when it opens it
}
LOCK_DIR = "/run/aiofabric"


@dataclasses.dataclass(frozen=True)
class Host:
    """Where the checks look: the real machine's paths by default."""

    devices: str = "/sys/bus/pci/devices"
    iommu_groups: str = "/sys/kernel/iommu_groups"
    lockdown: str = "/sys/kernel/security/lockdown"
    vm: str = "/proc/sys/vm"
    hugepages: str = "/sys/kernel/mm/hugepages/hugepages-2048kB"
    status: str = "/proc/self/status"
    vfio: str = "/dev/vfio"
    locks: str = LOCK_DIR

    @classmethod
    def under(cls, root: str) -> Host:
        """Every path inside `root`: a fake tree."""
        return cls(**{f.name: os.path.join(root, str(f.default).lstrip("/")) for f in dataclasses.fields(cls)})

    @classmethod
    def with_devices(cls, devices: str) -> Host:
        """The real machine with its PCI functions read from `devices`. Any other directory than the real one is a
        fake tree, whose locks live beside it: fake trees never share a lock with each other or with a real NIC."""
        real = cls()
        return real if devices == real.devices else dataclasses.replace(real, devices=devices,
                                                                        locks=devices.rstrip("/") + ".locks")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's verdict on one PCI function (`address` "" for the whole machine)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""  # the command that fixes a failure
    blocking: bool = True  # a failure means the device cannot be driven (safely) this way; else it is a warning
    address: str = ""

    @property
    def status(self) -> str:
        return "ok" if self.ok else "FAIL" if self.blocking else "WARN"

    def line(self) -> str:
        """The check, what it saw and, on a failure, the command that fixes it, on one line."""
        return f"{self.name}: {self.detail}" + ("" if self.ok or not self.fix else f"; fix: {self.fix}")


def refusal(finding: Finding) -> PCIError:
    return PCIError(f"pre-flight {finding.line()}")


# ---------------------------------------------------------------------------------------------------------------------
# Reading the tree: a function's files, the functions on the bus


def read_text(path: str) -> str | None:
    """A sysfs or procfs file's text, stripped; None when it is absent or unreadable."""
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_number(text: str | None, base: int = 10) -> int | None:
    try:
        return None if text is None else int(text, base)
    except ValueError:
        return None


def bound_driver(device_dir: str) -> str | None:
    """The driver bound to the function at `device_dir`, or None."""
    link = os.path.join(device_dir, "driver")
    return os.path.basename(os.path.realpath(link)) if os.path.lexists(link) else None


def _unbind(device_dir: str) -> str:
    address = os.path.basename(device_dir)
    return f"echo {address} > {os.path.join(os.path.realpath(os.path.join(device_dir, 'driver')), 'unbind')}"


def _capabilities(host: Host) -> int:
    """This process's effective capabilities (CapEff in /proc/self/status); 0 when unknown."""
    for line in (read_text(host.status) or "").splitlines():
        if line.startswith("CapEff:"):
            return read_number(line.split(":", 1)[1].strip(), 16) or 0
    return 0


@dataclasses.dataclass(frozen=True)
class BusFunction:
    """One PCI function as the bus scan lists it (-1: an ID that could not be read)."""

    address: str
    vendor: int
    device: int
    driver: str | None

    def __str__(self) -> str:
        return f"{self.address} {self.vendor:04x}:{self.device:04x}" + (f" ({self.driver})" if self.driver else "")


def bus_functions(host: Host) -> list[BusFunction]:
    try:
        addresses = sorted(os.listdir(host.devices))
    except OSError:
        addresses = []
    found = []
    for address in addresses:
        device_dir = os.path.join(host.devices, address)
        vendor, device = (read_number(read_text(os.path.join(device_dir, name)), 16) for name in ("vendor", "device"))
        found.append(BusFunction(address, -1 if vendor is None else vendor, -1 if device is None else device,
                                 bound_driver(device_dir)))
    return found


# ---------------------------------------------------------------------------------------------------------------------
# What the checks look at


@dataclasses.dataclass(frozen=True)
class Target:
    """What the checks look at: one function, the machine it is on, how the driver will reach it, and this process's
    capabilities and memlock limit (the privileges it will run with)."""

    address: str
    host: Host
    access: Access
    capabilities: int
    memlock: int

    @classmethod
    def of(cls, address: str, host: Host, access: Access) -> Target:
        return cls(address, host, access, _capabilities(host), resource.getrlimit(resource.RLIMIT_MEMLOCK)[0])

    @property
    def dir(self) -> str:
        return os.path.join(self.host.devices, self.address)

    def read(self, name: str) -> str | None:
        return read_text(os.path.join(self.dir, name))

    def group(self) -> str | None:
        """The function's IOMMU group number, None without an IOMMU."""
        link = os.path.join(self.dir, "iommu_group")
        return os.path.basename(os.path.realpath(link)) if os.path.lexists(link) else None

    def command(self) -> int | None:
        """PCI_COMMAND from config space (within the first 64 bytes, which anyone may read); None if unreadable."""
        try:
            with open(os.path.join(self.dir, "config"), "rb") as f:
                raw = os.pread(f.fileno(), 2, PCI_COMMAND)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 2 else None

    def has(self, capability: int) -> bool:
        return bool(self.capabilities >> capability & 1)

    def bind_vfio(self) -> str:
        """The commands that hand the function to vfio-pci, for good (driver_override: no other driver can take it)."""
        probe = os.path.join(os.path.dirname(self.host.devices), "drivers_probe")
        return (f"modprobe vfio-pci && echo vfio-pci > {self.dir}/driver_override && "
                f"echo {self.address} > {probe}")

    def finding(self, name: str, ok: bool, detail: str, fix: str = "") -> Finding:
        return Finding(name, ok, detail, fix, self.access not in WARNING_ONLY.get(name, ()), self.address)


# ---------------------------------------------------------------------------------------------------------------------
# The checks, in the order they run


def check_present(t: Target) -> Finding:
    ok = os.path.isdir(t.dir)
    return t.finding("present", ok, f"{t.dir} exists" if ok else f"no PCI device {t.address} (no {t.dir})",
                     "aiofabric doctor  # without an address: lists the functions on the bus")


def check_device_id(t: Target) -> Finding:
    vendor, device = read_number(t.read("vendor"), 16), read_number(t.read("device"), 16)
    if vendor is None or device is None:
        return t.finding("device_id", False, f"cannot read the vendor and device IDs of {t.address} "
                                             f"({t.dir}/vendor, device)", "sudo aiofabric doctor  # as root")
    chip = SUPPORTED_CHIPS.get(device) if vendor == BROADCOM_VENDOR_ID else None
    if chip:
        return t.finding("device_id", True, f"Broadcom {chip}, device ID {device:#06x}")
    maker = "Broadcom, but" if vendor == BROADCOM_VENDOR_ID else "not Broadcom and"
    return t.finding("device_id", False,
                     f"{t.address} has vendor {vendor:#06x} device {device:#06x}: {maker} not a BNXT RoCE chip we "
                     f"support ({SUPPORTED_NAMES}); driving it would write firmware commands into another chip's "
                     "registers",
                     "aiofabric doctor  # without an address: lists the supported functions on the bus")


def check_driver(t: Target) -> Finding:
    name = bound_driver(t.dir)
    if name == "vfio-pci" or name is None and t.access == "sysfs":
        return t.finding("driver", True, f"bound to {name}" if name else "no driver bound")
    if name is None:
        return t.finding("driver", False, "no driver bound: VFIO reaches a function through vfio-pci", t.bind_vfio())
    why = " (it would fight us for the function; unbinding also removes its RDMA device, bnxt_re)" \
        if name == "bnxt_en" else ""
    then = f" && {t.bind_vfio()}" if t.access == "vfio" else ""
    return t.finding("driver", False, f"{t.address} is bound to {name}{why}: unbind it first", _unbind(t.dir) + then)


def check_driver_override(t: Target) -> Finding:
    value = t.read("driver_override")
    if value == "vfio-pci":
        return t.finding("driver_override", True, "vfio-pci: no other driver can bind the function")
    seen = "unset" if value in (None, "(null)") else value
    return t.finding("driver_override", False, f"{seen}: bnxt_en can bind the function mid-run (a rescan, a "
                                                "modprobe, a hotplug event)",
                     f"echo vfio-pci > {t.dir}/driver_override")


def check_iommu(t: Target) -> Finding:
    group = t.group()
    kind = read_text(os.path.join(t.host.iommu_groups, group, "type")) if group else None
    if group is None:
        mode = "off (no IOMMU group)"
    elif kind == "identity":
        mode = f"passthrough (group {group}, type identity)"
    else:
        mode = f"translating (group {group}, type {kind or 'unknown'})"
    if t.access == "vfio":
        if group is None:
            return t.finding("iommu", False, f"IOMMU {mode}: VFIO needs one",
                             "add intel_iommu=on (AMD: amd_iommu=on) to the kernel command line and reboot  # or, "
                             "with no isolation: echo 1 > /sys/module/vfio/parameters/enable_unsafe_noiommu_mode")
        return t.finding("iommu", True, f"IOMMU {mode}: VFIO maps the driver's DMA through it")
    if group is None or kind == "identity":
        return t.finding("iommu", True, f"IOMMU {mode}: bus addresses are physical, as the sysfs path needs")
    return t.finding("iommu", False,
                     f"IOMMU {mode}: the sysfs path gives the NIC physical addresses, so its first firmware answer "
                     "never arrives (VFIO works with translation)",
                     f"echo identity > {t.host.iommu_groups}/{group}/type  # with the group's devices unbound; "
                     "or boot with iommu=pt")


def check_iommu_group(t: Target) -> Finding:
    group = t.group()
    if group is None:
        return t.finding("iommu_group", True, "no IOMMU group: nothing shares the function's DMA isolation")
    members = os.path.join(t.host.iommu_groups, group, "devices")
    try:
        peers = sorted(set(os.listdir(members)) - {t.address})
    except OSError:
        peers = []
    busy = [(peer, driver) for peer in peers
            if (driver := bound_driver(os.path.join(members, peer))) not in GROUP_PEER_DRIVERS | {None}]
    if not busy:
        others = f"{len(peers)} other functions, none bound to a driver VFIO refuses" if peers else "alone in it"
        return t.finding("iommu_group", True, f"IOMMU group {group}: {others}")
    listed = ", ".join(f"{peer} (bound to {driver})" for peer, driver in busy)
    return t.finding("iommu_group", False,
                     f"IOMMU group {group} also holds {listed}: VFIO takes a whole group and refuses one with a "
                     "kernel driver in it", " && ".join(_unbind(os.path.join(members, peer)) for peer, _ in busy))


def check_lockdown(t: Target) -> Finding:
    text = read_text(t.host.lockdown)
    chosen = [word[1:-1] for word in (text or "").split() if word.startswith("[")]
    mode = chosen[0] if chosen else "none"
    if mode == "none":
        return t.finding("lockdown", True, "kernel lockdown: none" if text else f"no kernel lockdown (no "
                                                                               f"{t.host.lockdown})")
    if t.access == "vfio":
        return t.finding("lockdown", True, f"kernel lockdown: {mode}; VFIO with an IOMMU is allowed")
    return t.finding("lockdown", False,
                     f"the kernel is locked down ({mode}): it refuses BAR mmaps and config-space writes through "
                     "sysfs even to root, so running as root does not help",
                     f"{t.bind_vfio()}  # then open it through VFIO; or boot with lockdown=none (Secure Boot off)")


def check_power(t: Target) -> Finding:
    state, enabled = t.read("power_state"), t.read("enable") == "1"
    ok = state in (None, "D0")
    detail = (f"power state {state or 'unknown (no power_state file)'}, "
              + ("enabled" if enabled else "not enabled by the kernel (the driver turns on memory decoding itself)"))
    return t.finding("power", ok, detail if ok else f"{detail}: its BARs read as all ones until it is in D0",
                     f"echo on > {t.dir}/power/control && echo 1 > {t.dir}/enable")


def check_intx(t: Target) -> Finding:
    command = t.command()
    if command is None:
        return t.finding("intx", False, f"cannot read {t.dir}/config", "sudo aiofabric doctor  # as root")
    if t.access == "vfio":
        return t.finding("intx", True, "vfio-pci masks INTx itself")
    if command & PCI_COMMAND_INTX_DISABLE:
        return t.finding("intx", True, "INTx disabled (PCI_COMMAND bit 10 set)")
    return t.finding("intx", False,
                     "INTx enabled (PCI_COMMAND bit 10 clear): on the polling sysfs path a legacy interrupt the "
                     "device raises is handled by nobody, and the kernel then disables that IRQ line for every "
                     "device sharing it", f"setpci -s {t.address} COMMAND=0400:0400")


def check_privileges(t: Target) -> Finding:
    if t.access == "vfio":
        group = t.group()
        files = [os.path.join(t.host.vfio, "vfio")] + ([os.path.join(t.host.vfio, group)] if group else [])
        fix = f"chown $USER {' '.join(files)}  # or run as root"
    else:
        files = [os.path.join(t.dir, name) for name in ("config", "resource0")]
        fix = "sudo aiofabric ...  # the sysfs path needs root"
    lacking = [f"no read-write access to {path}" for path in files if not os.access(path, os.R_OK | os.W_OK)]
    if t.access == "sysfs" and not t.has(CAP_SYS_ADMIN):
        lacking.append("no CAP_SYS_ADMIN (without it pagemap shows no physical addresses)")
    if lacking:
        return t.finding("privileges", False, "; ".join(lacking), fix)
    return t.finding("privileges", True, f"read-write access to {', '.join(files)}"
                                          + (" and CAP_SYS_ADMIN" if t.access == "sysfs" else ""))


def check_memlock(t: Target) -> Finding:
    if t.has(CAP_IPC_LOCK) or t.memlock == resource.RLIM_INFINITY:
        why = "CAP_IPC_LOCK" if t.has(CAP_IPC_LOCK) else "RLIMIT_MEMLOCK unlimited"
        return t.finding("memlock", True, f"no limit on pinned memory ({why})")
    return t.finding("memlock", False,
                     f"RLIMIT_MEMLOCK is {t.memlock >> 10} KiB: the driver pins its rings, the firmware's backing "
                     "store and every registered MR, and pinning past the limit fails",
                     "ulimit -l unlimited  # or a memlock line in /etc/security/limits.conf")


def check_hugepages(t: Target) -> Finding:
    free = read_number(read_text(os.path.join(t.host.hugepages, "free_hugepages"))) or 0
    total = read_number(read_text(os.path.join(t.host.vm, "nr_hugepages"))) or 0
    if free:
        return t.finding("hugepages", True, f"{free} of {total} 2 MiB hugepages free")
    why = ("DMA slabs fall back to 4 KiB pages (each an IOTLB entry of its own)" if t.access == "vfio" else
           "a contiguous DMA buffer over 4 KiB needs one")
    return t.finding("hugepages", False, f"no free 2 MiB hugepage (nr_hugepages {total}): {why}",
                     "sysctl -w vm.nr_hugepages=64")


def check_compaction(t: Target) -> Finding:
    value = read_text(os.path.join(t.host.vm, "compact_unevictable_allowed"))
    if t.access == "vfio":
        return t.finding("compaction", True, "VFIO pins DMA pages through the IOMMU; compaction never moves them")
    if value in (None, "0"):
        return t.finding("compaction", True, "no compaction in this kernel" if value is None else
                         "compact_unevictable_allowed = 0: compaction leaves mlocked DMA pages in place")
    return t.finding("compaction", False,
                     f"compact_unevictable_allowed = {value}: compaction may move the mlocked DMA pages while the "
                     "NIC keeps writing to their old physical addresses", "sysctl -w vm.compact_unevictable_allowed=0")


def check_quiesced(t: Target) -> Finding:
    """Run once no other process holds the function: bus mastering still on means the last one never stopped it."""
    command = t.command()
    if command is None or not command & PCI_COMMAND_MASTER:
        return t.finding("quiesced", True, "bus mastering off: the function does no DMA")
    return t.finding("quiesced", False,
                     "bus mastering is on with no process holding the function: the last one ended without closing "
                     "it (a crash or SIGKILL), and the NIC may still write into memory that process no longer owns",
                     f"echo 1 > {t.dir}/reset  # a function-level reset stops its DMA")


IDENTITY: tuple[Callable[[Target], Finding], ...] = (check_present, check_device_id)  # the rest needs these to pass
CHECKS: tuple[Callable[[Target], Finding], ...] = (
    check_driver, check_driver_override, check_iommu, check_iommu_group, check_lockdown, check_power, check_intx,
    check_privileges, check_memlock, check_hugepages, check_compaction)


def check_function(address: str, host: Host, access: Access = "vfio") -> list[Finding]:
    """Every check of the function at `address` but the lock, in order; after a failed identity check (absent, or
    not a supported chip) the rest would describe a function we will not drive, so they do not run."""
    target = Target.of(address, host, access)
    findings = []
    for check in IDENTITY:
        findings.append(check(target))
        if not findings[-1].ok:
            return findings
    return findings + [check(target) for check in CHECKS]
