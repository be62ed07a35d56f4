"""The `aiofabric` command line (design.md §5). `--json` prints exactly one JSON object as the last stdout line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

import anyio

from . import __version__
from .nic import open_nic
from .perftest import TESTS, BenchConfig, format_table, run_bench, run_loopback

async def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    async with open_nic(args.nic, ip=args.ip) as nic:
        info = nic.info()
    if not args.json:
        for key in ("nic", "fw_version", "hwrm_version", "mac", "port", "ip", "gid", "gid_index", "hw_retransmit"):
            print(f"{key:<14} {info[key]}")
        print(f"{'caps':<14} " + ", ".join(f"{k}={v}" for k, v in info["caps"].items()))
    return info


async def cmd_loopback(args: argparse.Namespace) -> dict[str, Any]:
    result = await run_loopback(args.nic, args.size)
    if not args.json:
        print(f"PHY loopback RDMA WRITE of {result['bytes']} bytes between QPs {result['qpn'][0]:#x} -> "
              f"{result['qpn'][1]:#x}: {'verified' if result['verified'] else 'MISMATCH'} "
              f"({result['seconds'] * 1e6:.0f} us, {result['packets']} packets)")
    return result


async def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    config = BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                            if hasattr(args, f.name)})
    config.progress = not args.json and sys.stderr.isatty()
    result = await run_bench(config)
    if not args.json:
        print(format_table(result, config))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiofabric", description="Async userspace driver for BNXT RoCEv2 NICs")
    parser.add_argument("--version", action="version", version=f"aiofabric {__version__}")
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                        help="event loop to run on (default asyncio)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="boot a NIC and print its firmware version, MAC, port, GID, capabilities")
    info.add_argument("--nic", default="sim", help="'sim', 'sim:NAME' or a PCI address (default sim)")
    info.add_argument("--ip", help="the NIC's IPv4 address; its GID is ::ffff:IP (emulated: a free 127.0.0.x)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=cmd_info)

    loop = sub.add_parser("loopback", help="RDMA WRITE between two QPs of one NIC through its PHY loopback")
    loop.add_argument("--nic", default="sim", help="'sim', 'sim:NAME' or a PCI address (default sim)")
    loop.add_argument("--size", type=int, default=4096, help="bytes to write (default 4096)")
    loop.add_argument("--json", action="store_true", help="print one JSON object")
    loop.set_defaults(run=cmd_loopback)

    bench = sub.add_parser("bench", help="perftest-style RDMA benchmark between emulated NICs, bytes verified")
    bench.add_argument("test", choices=TESTS)
    bench.add_argument("--qps", type=int, default=1, help="queue pairs (default 1)")
    bench.add_argument("--size", type=int, default=65536, help="message size in bytes (default 65536)")
    bench.add_argument("--iters", type=int, default=1000, help="messages per QP (default 1000)")
    bench.add_argument("--depth", type=int, default=32, help="work requests in flight per QP (default 32)")
    bench.add_argument("--nics", type=int, default=2, help="emulated NICs, paired up (default 2)")
    bench.add_argument("--mtu", type=int, default=4096, choices=(256, 512, 1024, 2048, 4096))
    bench.add_argument("--timeout", type=int, default=14, help="QP ACK timeout exponent (default 14: 67 ms)")
    for fault in ("loss", "reorder", "dup", "corrupt"):
        bench.add_argument(f"--{fault}", type=float, default=0.0, metavar="P",
                           help=f"probability of {fault} per packet on the emulated wire")
    bench.add_argument("--seed", type=int, default=0, help="seed of the wire faults (default 0)")
    bench.add_argument("--pcap", metavar="FILE", help="write every packet the first NIC sends and receives")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(name)s: %(message)s", stream=sys.stderr)
    backend, backend_options = ("asyncio", {"use_uvloop": True}) if args.backend == "uvloop" else (args.backend, {})
    try:
        result = anyio.run(args.run, args, backend=backend, backend_options=backend_options)
    except KeyboardInterrupt:
        result = {"error": "interrupted"}
    except Exception as exc:  # every failure becomes a clear message and a non-zero exit
        result = {"error": f"{type(exc).__name__}: {exc}"}
    ok = "error" not in result
    if args.json:
        print(json.dumps({"ok": ok, **result}))
    elif not ok:
        print(f"aiofabric {args.command}: {result['error']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
