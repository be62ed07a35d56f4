"""Pre-flight checks and `aiofabric doctor` (README: Real NIC): each check passing and failing with its fix on a fake
machine (tests/support/sysfs.py's fake sysfs tree under a fake root), the per-device lock, the open's refusals, and
the command on this machine, which has no BNXT function."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiofabric.autogen import bnxt
from aiofabric.hw.pci import pcie_config
from aiofabric.pci import PCI_COMMAND, PCI_COMMAND_MASTER, PCIError, preflight
from aiofabric.pci.device_lock import DeviceLock, check_lock, claim
from aiofabric.pci.doctor import doctor
from aiofabric.pci.preflight import (CAP_IPC_LOCK, CAP_SYS_ADMIN, PCI_COMMAND_INTX_DISABLE, SUPPORTED_CHIPS, Host, Target,
                                     check_memlock)
from aiofabric.pci.sysfs import SysfsPCIDevice
from tests.support.sysfs import ADDR, PEER, ROOT, make_path, make_tree

ALL_CAPS = (1 << 41) - 1


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def set_command(device: Path, command: int) -> None:
    config = bytearray(device.joinpath("config").read_bytes())
    config[PCI_COMMAND:PCI_COMMAND + 2] = command.to_bytes(2, "little")
    device.joinpath("config").write_bytes(bytes(config))


def bind(device: Path, driver: str) -> None:
    """Bind the fake function to `driver` (a directory under the fake bus's drivers/)."""
    drivers = Path(device).parent.parent / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    device.joinpath("driver").symlink_to(drivers)


def iommu_group(host: Host, device: Path, number: int, kind: str) -> Path:
    """Put the function in IOMMU group `number` of type `kind`."""
    group = Path(host.iommu_groups) / str(number)
    write(group / "type", f"{kind}\n")
    (group / "devices").mkdir()
    (group / "devices" / device.name).symlink_to(device)
    device.joinpath("iommu_group").symlink_to(group)
    return group


@pytest.fixture
def host(tmp_path) -> Host:
    """A machine where a BCM57508 at ADDR passes every check for the sysfs path."""
    host = Host.under(str(tmp_path))
    device = make_path(Path(host.devices), [ROOT])  # below a root port that completes AtomicOps
    write(device / "driver_override", "vfio-pci\n")
    write(device / "power_state", "D0\n")
    write(device / "enable", "0\n")
    set_command(device, PCI_COMMAND_INTX_DISABLE)
    Path(host.iommu_groups).mkdir(parents=True)
    write(Path(host.lockdown), "[none] integrity confidentiality\n")
    write(Path(host.vm) / "nr_hugepages", "64\n")
    write(Path(host.hugepages) / "free_hugepages", "64\n")
    write(Path(host.vm) / "compact_unevictable_allowed", "0\n")
    write(Path(host.status), f"Name:\tpython\nCapEff:\t{ALL_CAPS:016x}\n")
    return host


@pytest.fixture
def device(host) -> Path:
    return Path(host.devices) / ADDR


def findings(host: Host, access: preflight.Access = "sysfs") -> dict[str, preflight.Finding]:
    return {f.name: f for f in doctor(ADDR, host, access).findings}


def test_a_supported_unbound_function_passes_every_check(host):
    report = doctor(ADDR, host, "sysfs")
    assert [f.name for f in report.findings] == [
        "present", "device_id", "driver", "driver_override", "iommu", "iommu_group", "lockdown", "power", "intx",
        "privileges", "memlock", "hugepages", "compaction", "atomic_ops", "lock", "quiesced"]
    assert all(f.ok and f.address == ADDR for f in report.findings), report.format()
    assert report.error == "" and "error" not in report.as_dict()
    assert "Broadcom BCM57508 (Thor)" in report.findings[1].detail


def test_the_allow_list_is_bnxt_en_thor_and_thor2_physical_functions():
    """bnxt_en's bnxt_pci_tbl: BCM5750x (Thor) and BCM5760x (Thor2) PFs; the bindings' chip numbers agree, and the
    emulated NIC (a BCM57608) is on it."""
    assert SUPPORTED_CHIPS == {0x1750: "BCM57508 (Thor)", 0x1751: "BCM57504 (Thor)", 0x1752: "BCM57502 (Thor)",
                               0x1760: "BCM57608 (Thor2)", 0x1761: "BCM57604 (Thor2)", 0x1762: "BCM57602 (Thor2)",
                               0x1763: "BCM57601 (Thor2)"}
    for name in ("57508", "57504", "57502", "57608"):
        assert SUPPORTED_CHIPS[getattr(bnxt, f"CHIP_NUM_{name}")].startswith(f"BCM{name}")


def set_device_id(device: Path, vendor: str, ident: str) -> None:
    write(device / "vendor", f"{vendor}\n")
    write(device / "device", f"{ident}\n")


def peer_with_a_driver(host: Host, device: Path) -> None:
    """Another function in the device's IOMMU group, bound to nvme."""
    peer = Path(host.devices) / PEER
    peer.mkdir()
    bind(peer, "nvme")
    iommu_group(host, device, 7, "identity").joinpath("devices", PEER).symlink_to(peer)


def vfio_group_without_access(host: Host, device: Path) -> None:
    iommu_group(host, device, 7, "DMA")
    bind(device, "vfio-pci")  # and no /dev/vfio files this process may open


def vfio_without_hugepages(host: Host, device: Path) -> None:
    """A function ready for VFIO (group, binding, device files), on a machine with no hugepage free."""
    vfio_group_without_access(host, device)
    for name in ("vfio", "7"):
        write(Path(host.vfio) / name, "")
    write(Path(host.hugepages) / "free_hugepages", "0\n")


def root_port_config(device: Path, config: bytes) -> None:
    """The config space of the root port above the function (make_path's tree): 64 bytes is what Linux lets a
    process without CAP_SYS_ADMIN read."""
    device.resolve().parent.joinpath("config").write_bytes(config)


# (check, how the machine breaks it, access, what the finding says (a regex), its fix, whether the failure blocks)
FAILURES = [
    ("present", lambda host, device: os.rename(device, device.with_name("gone")), "sysfs",
     f"no PCI device {ADDR}", "aiofabric doctor  # without an address", True),
    ("device_id", lambda host, device: set_device_id(device, "0x14e4", "0x165f"), "sysfs",  # an on-board tg3
     "vendor 0x14e4 device 0x165f: Broadcom, but not a BNXT RoCE chip we support", "aiofabric doctor", True),
    ("device_id", lambda host, device: set_device_id(device, "0x8086", "0x1750"), "sysfs",
     "vendor 0x8086 device 0x1750: not Broadcom", "aiofabric doctor", True),
    ("driver", lambda host, device: bind(device, "bnxt_en"), "sysfs",
     f"{ADDR} is bound to bnxt_en .*: unbind it first", f"echo {ADDR} > {{bus}}/drivers/bnxt_en/unbind", True),
    ("driver", lambda host, device: None, "vfio", "no driver bound: VFIO reaches a function through vfio-pci",
     f"modprobe vfio-pci && echo vfio-pci > {{devices}}/{ADDR}/driver_override && echo {ADDR} > {{bus}}/drivers_probe",
     True),
    ("driver_override", lambda host, device: write(device / "driver_override", "(null)\n"), "sysfs",
     "unset: bnxt_en can bind the function mid-run", f"echo vfio-pci > {{devices}}/{ADDR}/driver_override", False),
    ("iommu", lambda host, device: iommu_group(host, device, 7, "DMA-FQ"), "sysfs",
     r"IOMMU translating \(group 7, type DMA-FQ\): the sysfs path gives the NIC physical addresses",
     "echo identity > {iommu_groups}/7/type", True),
    ("iommu", lambda host, device: None, "vfio", r"IOMMU off \(no IOMMU group\): VFIO needs one",
     "add intel_iommu=on", True),
    ("iommu_group", peer_with_a_driver, "vfio", rf"IOMMU group 7 also holds {PEER} \(bound to nvme\)",
     f"echo {PEER} > {{bus}}/drivers/nvme/unbind", True),
    ("iommu_group", peer_with_a_driver, "sysfs", rf"IOMMU group 7 also holds {PEER} \(bound to nvme\)",
     f"echo {PEER} > {{bus}}/drivers/nvme/unbind", False),
    ("lockdown", lambda host, device: write(Path(host.lockdown), "none [integrity] confidentiality\n"), "sysfs",
     r"the kernel is locked down \(integrity\).*even to root, so running as root does not help",
     f"modprobe vfio-pci && echo vfio-pci > {{devices}}/{ADDR}/driver_override", True),
    ("power", lambda host, device: write(device / "power_state", "D3hot\n"), "sysfs",
     "power state D3hot, not enabled by the kernel.*: its BARs read as all ones",
     f"echo on > {{devices}}/{ADDR}/power/control && echo 1 > {{devices}}/{ADDR}/enable", True),
    ("intx", lambda host, device: set_command(device, 0), "sysfs",
     r"INTx enabled \(PCI_COMMAND bit 10 clear\)", f"setpci -s {ADDR} COMMAND=0400:0400", False),
    ("privileges", lambda host, device: write(Path(host.status), f"CapEff:\t{ALL_CAPS & ~(1 << CAP_SYS_ADMIN):x}\n"),
     "sysfs", "no CAP_SYS_ADMIN", "sudo aiofabric", True),
    ("privileges", vfio_group_without_access, "vfio",
     "no read-write access to {vfio}/vfio; no read-write access to {vfio}/7", "chown $USER {vfio}/vfio {vfio}/7",
     True),
    ("hugepages", lambda host, device: write(Path(host.hugepages) / "free_hugepages", "0\n"), "sysfs",
     "no free 2 MiB hugepage .*: a contiguous DMA buffer over 4 KiB needs one", "sysctl -w vm.nr_hugepages=64", False),
    ("hugepages", vfio_without_hugepages, "vfio", "no free 2 MiB hugepage .*: DMA slabs fall back to 4 KiB pages", "sysctl -w vm.nr_hugepages=64", False),
    ("compaction", lambda host, device: write(Path(host.vm) / "compact_unevictable_allowed", "1\n"), "sysfs",
     "compact_unevictable_allowed = 1: compaction may move the mlocked DMA pages",
     "sysctl -w vm.compact_unevictable_allowed=0", True),
    ("atomic_ops", lambda host, device: root_port_config(device, pcie_config(0x1B36, 0xC, ROOT.kind)), "sysfs",
     rf"the NIC will offer no atomics .*: root port {ROOT.address} does not complete 32-bit and 64-bit PCIe AtomicOps",
     "put the NIC in a slot whose root port completes AtomicOps", False),
    ("atomic_ops", lambda host, device: (device / "config").write_bytes((device / "config").read_bytes()[:64]),
     "sysfs", rf"cannot read the config space of {ADDR} past byte 64 .*; run as root", "sudo aiofabric doctor", False),
    ("atomic_ops", lambda host, device: root_port_config(device, pcie_config(0x1B36, 0xC, *ROOT[1:])[:64]), "sysfs",
     rf"cannot read the config space of {ROOT.address} past byte 64 .*; run as root", "sudo aiofabric doctor",
     False),
    ("quiesced", lambda host, device: set_command(device, PCI_COMMAND_INTX_DISABLE | PCI_COMMAND_MASTER), "sysfs",
     "bus mastering is on with no process holding the function", f"echo 1 > {{devices}}/{ADDR}/reset", False),
]


@pytest.mark.parametrize("name, breaks, access, says, fix, blocking", FAILURES,
                         ids=[f"{case[0]}-{case[2]}-{i}" for i, case in enumerate(FAILURES)])
def test_each_check_fails_with_its_fix(host, device, name, breaks, access, says, fix, blocking):
    paths = {"devices": host.devices, "bus": os.path.dirname(host.devices), "iommu_groups": host.iommu_groups,
             "vfio": host.vfio}
    breaks(host, device)
    report = doctor(ADDR, host, access)
    finding = {f.name: f for f in report.findings}[name]
    assert not finding.ok and finding.blocking is blocking and finding.status == ("FAIL" if blocking else "WARN")
    assert re.search(says.format(**paths), finding.detail), finding.detail
    assert fix.format(**paths) in finding.fix
    assert (report.error != "") is blocking  # exit 1 only for a failure that blocks
    assert f"fix: {finding.fix}" in report.format()


def netdev(device: Path, flags: str, operstate: str, carrier: str | None = None, speed: str | None = None) -> None:
    """bnxt_en's netdev of the function, as sysfs shows it (carrier and speed are unreadable while it is down)."""
    bind(device, "bnxt_en")
    for name, value in {"flags": flags, "operstate": operstate, "carrier": carrier, "speed": speed}.items():
        if value is not None:
            write(device / "net" / "enp65s0f0np0" / name, f"{value}\n")


@pytest.mark.parametrize("flags, operstate, carrier, speed, ok, says", [
    ("0x1003", "up", "1", "400000", True, r"enp65s0f0np0 \(bnxt_en\) is up with its link up at 400000 Mb/s "
                                          r"\(operstate up\): unbinding bnxt_en forces the link down "
                                          r"\(bnxt_close\), and the driver's open brings it back up "
                                          r"\(FUNC_DRV_IF_CHANGE, PORT_PHY_CFG\)"),
    ("0x1003", "down", "0", "-1", False, r"enp65s0f0np0 \(bnxt_en\) is up but its link is down \(operstate down, no "
                                         r"carrier\): no link partner answers"),
    ("0x1002", "down", None, None, True, r"enp65s0f0np0 \(bnxt_en\) is administratively down: the link is as the "
                                         r"firmware keeps it"),
], ids=["up", "no-carrier", "admin-down"])
def test_doctor_reports_the_link_bnxt_en_sees(host, device, flags, operstate, carrier, speed, ok, says):
    """Unbinding bnxt_en with its interface up forces the link down (bnxt_close): doctor says what the link is while
    bnxt_en shows it, that the driver brings it back, and warns (never refuses) of one no partner answers."""
    netdev(device, flags, operstate, carrier, speed)
    report = doctor(ADDR, host, "vfio")
    link = {f.name: f for f in report.findings}["link"]
    assert (link.ok, link.blocking, link.status, link.address) == (ok, False, "ok" if ok else "WARN", ADDR)
    assert re.search(says, link.detail), link.detail
    assert link.fix == ("" if ok else "ethtool enp65s0f0np0  # what the PHY sees; check the cable, the transceiver "
                                      "and the switch port")
    assert not {f.name: f for f in report.findings}["driver"].ok  # bound to bnxt_en: that is what blocks
    last = report.as_dict()["findings"][-1]
    assert (last["name"], last["ok"], last["status"]) == ("link", ok, link.status)
    assert ("fix: ethtool" in report.format()) is not ok


@pytest.mark.parametrize("access, kind, ok", [("sysfs", "identity", True), ("sysfs", "DMA", False),
                                              ("vfio", "identity", True), ("vfio", "DMA-FQ", True)])
def test_the_iommu_mode_each_access_needs(host, device, access, kind, ok):
    """Raw sysfs hands out physical addresses (passthrough or off); VFIO maps through any IOMMU domain."""
    iommu_group(host, device, 3, kind)
    assert findings(host, access)["iommu"].ok is ok


@pytest.mark.parametrize("driver", ["vfio-pci", "pci-stub", "pcieport"])
def test_group_peers_that_leave_dma_to_the_owner_are_fine(host, device, driver):
    peer = Path(host.devices) / PEER
    peer.mkdir()
    bind(peer, driver)
    iommu_group(host, device, 7, "DMA").joinpath("devices", PEER).symlink_to(peer)
    assert findings(host, "vfio")["iommu_group"].ok


def test_what_only_the_sysfs_path_needs_is_fine_for_vfio(host, device):
    write(Path(host.lockdown), "none integrity [confidentiality]\n")
    write(Path(host.vm) / "compact_unevictable_allowed", "1\n")
    set_command(device, 0)
    seen = findings(host, "vfio")
    assert seen["lockdown"].ok and seen["compaction"].ok and seen["intx"].ok


def test_a_vfio_ready_function_passes(host, device):
    iommu_group(host, device, 7, "DMA-FQ")
    bind(device, "vfio-pci")
    for name in ("vfio", "7"):
        write(Path(host.vfio) / name, "")
    report = doctor(ADDR, host, "vfio")
    assert report.error == "" and all(f.ok for f in report.findings), report.format()


@pytest.mark.parametrize("limit, caps, ok", [(8 << 20, 0, False), (8 << 20, 1 << CAP_IPC_LOCK, True),
                                             (preflight.resource.RLIM_INFINITY, 0, True)])
def test_memlock(host, limit, caps, ok):
    finding = check_memlock(Target(ADDR, host, "sysfs", caps, limit))
    assert finding.ok is ok and not finding.blocking
    if not ok:
        assert "RLIMIT_MEMLOCK is 8192 KiB" in finding.detail and finding.fix.startswith("ulimit -l unlimited")


# -- the open's pre-flight ---------------------------------------------------------------------------------------------
def test_the_open_refuses_a_broadcom_function_that_is_not_a_supported_chip(tmp_path):
    """An on-board tg3 is Broadcom too: a mistyped address must not get firmware words in its registers."""
    device = make_tree(tmp_path / "devices")
    write(device / "device", "0x165f\n")
    with pytest.raises(PCIError, match="^pre-flight device_id: .*0x165f: Broadcom, but not a BNXT RoCE chip"):
        SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path / "devices"))
    assert device.joinpath("config").read_bytes() == bytes(256)  # untouched


def test_the_open_takes_a_function_bound_to_vfio_pci(tmp_path):
    device = make_tree(tmp_path / "devices")
    bind(device, "vfio-pci")
    SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path / "devices")).close()


def test_claim_refuses_what_must_pass_and_warns_of_the_rest(host, device, caplog):
    set_command(device, 0)
    write(Path(host.vm) / "compact_unevictable_allowed", "1\n")
    claim(ADDR, host, "sysfs").release()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("pre-flight intx: INTx enabled" in m and "setpci" in m for m in warned), warned
    assert any("pre-flight compaction:" in m and "sysctl -w vm.compact_unevictable_allowed=0" in m for m in warned)
    bind(device, "bnxt_en")
    with pytest.raises(PCIError, match=f"^pre-flight driver: {ADDR} is bound to bnxt_en .*; fix: echo {ADDR} > "):
        claim(ADDR, host, "sysfs")


def test_claim_warns_of_a_function_the_last_holder_left_running(host, device, caplog):
    set_command(device, PCI_COMMAND_INTX_DISABLE | PCI_COMMAND_MASTER)
    claim(ADDR, host, "sysfs").release()
    assert any("pre-flight quiesced: bus mastering is on" in r.getMessage() for r in caplog.records)


# -- the lock ----------------------------------------------------------------------------------------------------------
def test_a_second_open_fails_naming_the_holder_and_close_releases_it(tmp_path):
    make_tree(tmp_path / "devices")
    first = SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path / "devices"))
    with pytest.raises(PCIError, match=rf"^pre-flight lock: {ADDR} is in use by pid {os.getpid()} \(.+\) \(lock "
                                       rf".*{ADDR}\.lock\); fix: kill {os.getpid()}"):
        SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path / "devices"))
    first.close()
    SysfsPCIDevice(ADDR, sysfs_root=str(tmp_path / "devices")).close()


HOLD = """
import sys
from aiofabric.pci.device_lock import DeviceLock
lock = DeviceLock(sys.argv[1], sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


def test_another_process_holding_the_lock_is_named_and_its_death_frees_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, ADDR, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(PCIError, match=rf"in use by pid {holder.pid} \(python.*\).*fix: kill {holder.pid}"):
            DeviceLock(ADDR, str(tmp_path))
        seen = check_lock(ADDR, Host(locks=str(tmp_path)))
        assert not seen.ok and f"pid {holder.pid}" in seen.detail
    finally:
        holder.kill()
        holder.wait()
    lock_file = tmp_path / f"{ADDR}.lock"
    assert lock_file.read_text() == f"{holder.pid}\n"  # a dead process's file blocks nobody
    lock = DeviceLock(ADDR, str(tmp_path))
    assert lock_file.read_text() == f"{os.getpid()}\n"
    lock.release()
    lock.release()  # idempotent


@pytest.mark.skipif(os.geteuid() != 0, reason="root's lock directory: a user's goes to $XDG_RUNTIME_DIR")
def test_root_whose_lock_directory_cannot_be_made_is_refused_not_sent_to_a_temp_dir():
    """A shared name under /tmp could be made first by another user (tests/system/test_local_files.py: a user's
    locks)."""
    with pytest.raises(PCIError, match="^" + re.escape(
            "pre-flight lock: the device-lock directory /proc/aiofabric-cannot-be-made cannot be made (No such file "
            "or directory); fix: mkdir -m 755 /proc/aiofabric-cannot-be-made") + "$"):
        DeviceLock("0000:ff:1f.7", "/proc/aiofabric-cannot-be-made")


# -- the bus, and the command on this machine --------------------------------------------------------------------------
def test_a_bus_without_broadcom_lists_what_it_has(tmp_path):
    host = Host.under(str(tmp_path))
    other = make_tree(Path(host.devices), vendor="0x1af4\n")
    write(other / "device", "0x1041\n")
    bind(other, "virtio-pci")
    report = doctor(None, host)
    assert report.error.startswith("no supported BNXT RoCE function on this machine") and "none of them Broadcom" \
        in report.error
    assert f"{ADDR} 1af4:1041 (virtio-pci)" in report.findings[0].detail
    assert report.findings[0].fix.startswith("aiofabric bench write")


def test_a_bus_with_only_a_tg3_says_it_is_not_a_supported_chip(tmp_path):
    host = Host.under(str(tmp_path))
    write(make_tree(Path(host.devices)) / "device", "0x165f\n")
    assert "1 Broadcom, none of them a supported chip" in doctor(None, host).error


def test_a_bus_with_a_supported_function_diagnoses_it(host):
    report = doctor(None, host, "sysfs")
    assert report.findings[0].name == "bus" and report.findings[0].ok and "BCM57508 (Thor)" in \
        report.findings[0].detail
    assert report.error == "" and [f.name for f in report.findings[1:]] == [f.name for f in doctor(ADDR, host, "sysfs").findings]
    write(Path(host.vm) / "compact_unevictable_allowed", "1\n")
    assert doctor(None, host, "sysfs").error.startswith(f"{ADDR} cannot be driven through sysfs: compaction: ")


CLI = [sys.executable, "-m", "aiofabric.tools.cli", "doctor"]
NO_BNXT = not any(f.vendor == preflight.BROADCOM_VENDOR_ID and f.device in SUPPORTED_CHIPS
                  for f in preflight.bus_functions(Host()))


@pytest.mark.skipif(not NO_BNXT, reason="this machine has a BNXT function")
def test_doctor_on_this_machine_explains_there_is_nothing_to_drive():
    done = subprocess.run([*CLI, "--json"], capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and result["ok"] is False
    assert result["error"].startswith("no supported BNXT RoCE function on this machine")
    assert [f["name"] for f in result["findings"]] == ["bus"] and result["findings"][0]["status"] == "FAIL"
    plain = subprocess.run(CLI, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "FAIL  bus" in plain.stdout and "fix: aiofabric bench write" in plain.stdout
    assert plain.stderr.startswith("aiofabric doctor: no supported BNXT RoCE function")


def test_doctor_usage_errors_exit_2():
    done = subprocess.run([*CLI, "41:00.0", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"] == ("usage: argument PCI_ADDRESS: bad PCI address '41:00.0': expected "
                                                "domain:bus:device.function, e.g. 0000:41:00.0")
