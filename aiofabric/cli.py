"""The `aiofabric` command line (design.md §5).

`--json` prints exactly one JSON object as the last line of stdout, with "ok": true|false, on every outcome (usage
errors and signals included), so a script can always parse the last line; on failure "error" names the innermost
cause in one line. Without `--json`, failures print that line on stderr. Exit codes:

    0    success
    1    runtime failure (a firmware or completion error, a bad value, destination bytes that differ)
    2    usage error (unknown command or flag, bad choice): "error" is "usage: <argparse's message>"
    130  interrupted by SIGINT (128 + 2); the command was cancelled and every NIC closed first
    143  terminated by SIGTERM (128 + 15); likewise
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from typing import Any, Awaitable, Callable, NoReturn

import anyio
from anyio.abc import TaskStatus

from . import __version__
from .nic import open_nic
from .perftest import MTUS, TESTS, BenchConfig, format_table, run_bench, run_loopback

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
SIGNAL_MESSAGES = {signal.SIGTERM: "terminated by SIGTERM", signal.SIGINT: "interrupted by SIGINT"}


class UsageError(Exception):
    """A command-line usage error, raised by `Parser.error` instead of argparse's print-and-exit(2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class Signalled(BaseException):
    """SIGTERM or SIGINT stopped the command. A BaseException, like KeyboardInterrupt: no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(SIGNAL_MESSAGES[signal.Signals(signum)])
        self.signum = signum


class Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` (so `--json` can report it) and refuses abbreviations (`--nic` is not
    `--nics`). Subparsers are built from this class too (`parser_class`), so both hold on every level."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def one_line(text: str) -> str:
    return " ".join(text.split())


def innermost(exc: BaseException) -> BaseException:
    """The first leaf of nested exception groups: anyio wraps a task's error in one group per task group it crosses."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """`TypeName: message` of the innermost error, on one line. `__cause__` is not followed: an error caused by an
    earlier one (a flushed work request) already names that root cause in its own message."""
    leaf = innermost(exc)
    message = one_line(str(leaf))
    return f"{type(leaf).__name__}: {message}" if message else type(leaf).__name__


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
    parser = Parser(prog="aiofabric", description="Async userspace driver for BNXT RoCEv2 NICs")
    parser.add_argument("--version", action="version", version=f"aiofabric {__version__}")
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                        help="event loop to run on (default asyncio)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

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
    bench.add_argument("--mtu", type=int, default=4096, choices=MTUS)
    bench.add_argument("--timeout", type=int, default=14, help="QP ACK timeout exponent (default 14: 67 ms)")
    for fault in ("loss", "reorder", "dup", "corrupt"):
        bench.add_argument(f"--{fault}", type=float, default=0.0, metavar="P",
                           help=f"probability of {fault} per packet on the emulated wire")
    bench.add_argument("--seed", type=int, default=0, help="seed of the wire faults (default 0)")
    bench.add_argument("--pcap", metavar="FILE", help="write every packet NIC 0 sends and receives (NIC N: FILE.N)")
    bench.add_argument("--inject-fault", metavar="KIND[:N[:OFFSET]]",
                       help="make the server NICs misbehave, to see verification fail: skip_placement (ACK the next "
                            "N writes without placing them) or misplace (place them OFFSET bytes off; default 64)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=cmd_bench)
    return parser


async def _watch_signals(scope: anyio.CancelScope, caught: list[int],
                         *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """On the first SIGTERM or SIGINT, note it and cancel `scope`. Leaving the receiver restores the default
    handlers, so a second signal stops a clean-up that hangs."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            caught.append(signum)
            scope.cancel()
            return


async def run_command(command: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
                      args: argparse.Namespace) -> dict[str, Any]:
    """Run `command`; a signal cancels it, so its NICs close and free their firmware objects on the way out
    (their close is shielded), and then raises `Signalled`: the signal, not the cancellation, is the outcome."""
    caught: list[int] = []
    try:
        async with anyio.create_task_group() as tasks:
            await tasks.start(_watch_signals, tasks.cancel_scope, caught)
            result = await command(args)
            tasks.cancel_scope.cancel()
    except Exception as exc:  # a clean-up the cancellation broke: logged, the signal stays the outcome
        if not caught:
            raise
        logging.getLogger(__name__).warning("after %s: %s", SIGNAL_MESSAGES[caught[0]], describe(exc))
    if caught:
        raise Signalled(caught[0])
    return result


def execute(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Run the parsed command on its event loop; the result (with "error" on failure) and the exit code."""
    backend, backend_options = ("asyncio", {"use_uvloop": True}) if args.backend == "uvloop" else (args.backend, {})
    try:
        result = anyio.run(run_command, args.run, args, backend=backend, backend_options=backend_options)
    except BaseException as exc:  # every failure becomes one clear line and a non-zero exit
        leaf = innermost(exc)
        if isinstance(leaf, Signalled):
            return {"error": str(leaf)}, 128 + leaf.signum
        if isinstance(leaf, KeyboardInterrupt):  # SIGINT before the signal receiver was installed
            return {"error": SIGNAL_MESSAGES[signal.SIGINT]}, 128 + signal.SIGINT
        if not isinstance(leaf, Exception):
            raise
        return {"error": describe(leaf)}, EXIT_FAILURE
    return result, EXIT_FAILURE if "error" in result else EXIT_OK


def usage_error(error: UsageError, json_output: bool) -> int:
    """Report a usage error: as JSON with `--json`, else argparse's usage and message on stderr."""
    if json_output:
        print(json.dumps({"ok": False, "error": f"usage: {one_line(error.message)}"}))
    else:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error.message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        return usage_error(error, "--json" in argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(name)s: %(message)s", stream=sys.stderr)
    result, code = execute(args)
    if args.json:
        print(json.dumps({"ok": code == EXIT_OK, **result}))
    elif code != EXIT_OK:
        print(f"aiofabric {args.command}: {result['error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
