"""The `aiofabric` command line (design.md §5). `--json` prints exactly one JSON object as the last stdout line."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Awaitable, Callable

import anyio

from . import __version__
from .nic import open_nic

Command = Callable[[argparse.Namespace], Awaitable[dict[str, Any]]]


async def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    async with open_nic(args.nic, ip=args.ip) as nic:
        info = nic.info()
    if not args.json:
        for key in ("nic", "fw_version", "hwrm_version", "mac", "port", "ip", "gid", "gid_index", "hw_retransmit"):
            print(f"{key:<14} {info[key]}")
        print(f"{'caps':<14} " + ", ".join(f"{k}={v}" for k, v in info["caps"].items()))
    return info


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
