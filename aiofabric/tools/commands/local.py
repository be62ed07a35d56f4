"""The commands that need no partner host: `info` and `loopback` (one NIC), `doctor` (a PCI function before the
driver takes it), `plot` (saved bench results)."""
from __future__ import annotations

import argparse
import contextlib
from typing import Any

from .. import plot
from ..arguments import Subcommands, ipv4, pci_address, sized
from ..bench_config import MAX_SIZE
from ..introspect import count_text
from ..perftest import run_loopback
from ...errors import LinkDownError
from ...pci import preflight
from ...pci.doctor import doctor as doctor_report
from ...verbs import open_nic


def add_info(sub: Subcommands) -> None:
    info = _one_nic(sub, "info", "boot a NIC and print its firmware version, MAC, port, GID, capabilities",
                    "the NIC's IPv4 address; its GID is ::ffff:IP (emulated: a free 127.0.0.x)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=cmd_info)


def add_loopback(sub: Subcommands) -> None:
    loop = _one_nic(sub, "loopback", "RDMA WRITE between two QPs of one NIC through its PHY loopback",
                    "the NIC's IPv4 address (emulated: a free 127.0.0.x)")
    loop.add_argument("-s", "--size", type=sized(1, MAX_SIZE), default=4096,
                      help="bytes to write, with an optional K/M/G suffix (default 4096)")
    loop.add_argument("--json", action="store_true", help="print one JSON object")
    loop.set_defaults(run=cmd_loopback)


def _one_nic(sub: Subcommands, name: str, help: str, ip_help: str) -> argparse.ArgumentParser:
    """A command's parser with the NIC it opens (--nic) and that NIC's address (--ip)."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--nic", default="sim", help="'sim', 'sim:NAME' or a PCI address (default sim)")
    parser.add_argument("--ip", type=ipv4, help=ip_help)
    return parser


def add_plot(sub: Subcommands) -> None:
    plotter = sub.add_parser("plot", help="overlay saved bench results (--json-file) in one PNG")
    plotter.add_argument("results", nargs="+", metavar="RESULTS.json")
    plotter.add_argument("-o", "--output", required=True, metavar="PNG")
    plotter.add_argument("--json", action="store_true", help="print one JSON object")
    plotter.set_defaults(run=cmd_plot)


def add_doctor(sub: Subcommands) -> None:
    doctor = sub.add_parser("doctor", help="check a PCI function before the driver takes it over (without an "
                                           "address: the bus): what is wrong, and the command that fixes it")
    doctor.add_argument("address", nargs="?", type=pci_address, metavar="PCI_ADDRESS",
                        help="domain:bus:device.function, e.g. 0000:41:00.0 (default: every supported function)")
    doctor.add_argument("--access", choices=preflight.ACCESSES, default="vfio",
                        help="how the driver will reach it: vfio (what open_nic uses for a PCI address, the default) "
                             "or sysfs (open_nic('sysfs:ADDR'), unsafe)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(run=cmd_doctor)


async def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    async with open_nic(args.nic, ip=args.ip) as nic:
        with contextlib.suppress(LinkDownError):  # then reported down: info says what is, a link down included
            await nic.wait_for_link()  # the open brings the link up without waiting for it to train
        info = nic.info()
    if not args.json:
        for key in ("nic", "fw_version", "hwrm_version", "mac", "port", "ip", "gid", "gid_index", "hw_retransmit",
                    "link", "link_speed_mbps", "port_mtu", "atomic_cap", "atomic_path"):
            print(f"{key:<16} {info[key]}")
        print(f"{'caps':<16} " + ", ".join(f"{k}={v}" for k, v in info["caps"].items()))
    return info


async def cmd_loopback(args: argparse.Namespace) -> dict[str, Any]:
    result = await run_loopback(args.nic, args.size, args.ip)
    if not args.json:
        print(f"PHY loopback RDMA WRITE of {result['bytes']} bytes between QPs {result['qpn'][0]:#x} -> "
              f"{result['qpn'][1]:#x}: {'verified' if result['verified'] else 'MISMATCH'} "
              f"({result['seconds'] * 1e6:.0f} us, {count_text(result['packets'])} packets)")
    return result


async def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    runs = plot.load(args.results)
    plot.plot_runs(runs, args.output)
    if not args.json:
        print(f"wrote {args.output}: {len(runs)} run(s)")
    return {"output": args.output, "runs": len(runs)}


async def cmd_doctor(args: argparse.Namespace) -> dict[str, Any]:
    report = doctor_report(args.address, access=args.access)
    if not args.json:
        print(report.format())
    return report.as_dict()  # with "error" (exit 1) when nothing found can be driven
