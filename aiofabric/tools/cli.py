"""The `aiofabric` command line (docs/command-line.md).

`--json` prints exactly one JSON object as the last line of stdout, with "ok": true|false and the metadata of
result_meta.py, on every outcome (usage errors and signals included), so a script can always parse the last line; on
failure "error" names the innermost cause in one line. Without `--json`, failures print that line on stderr. `serve`
is the exception: its stdout carries the peer protocol (aiofabric/peer/protocol.py), so it has no `--json`; it exits 0
at end of input. Exit codes:

    0    success
    1    runtime failure (a firmware or completion error, a bad value, destination bytes that differ)
    2    usage error (unknown command or flag, bad choice): "error" is "usage: <argparse's message>"
    129  hung up (SIGHUP, 128 + 1): the command was cancelled and every NIC closed first
    130  interrupted by SIGINT (128 + 2); likewise
    143  terminated by SIGTERM (128 + 15); likewise (from the first import on: aiofabric/tools/signals.py)

Here: the parser, and the run of a command under the signal handling above. Each command's flags, checks and body
are in commands/ (bench_lat, perftest_server, collectives, peer, local).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable, Mapping, NoReturn

import anyio
from anyio.abc import TaskStatus

from . import result_meta, signals
from .commands import bench_lat, collectives, compare, local, peer
from .perftest_flags import ShowVersion, VersionAction, typed_flags, usage_message
from .runs import error_text, one_line
from .signals import Signalled
from ..errors import BadOption

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command-line usage error, raised by `Parser.error` instead of argparse's print-and-exit(2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` (so `--json` can report it) and refuses abbreviations (`--nic` is not
    `--nics`). Subparsers are built from this class too (`parser_class`), so both hold on every level."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: Mapping[str, argparse.ArgumentParser] = {}  # the subcommands' parsers, by name

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def innermost(exc: BaseException) -> BaseException:
    """The first leaf of nested exception groups: anyio wraps a task's error in one group per task group it crosses."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    """`TypeName: message` of the innermost error, on one line. `__cause__` is not followed: an error caused by an
    earlier one (a flushed work request) already names that root cause in its own message."""
    return error_text(innermost(exc))


def build_parser() -> Parser:
    parser = Parser(prog="aiofabric", description="Async userspace driver for BNXT RoCEv2 NICs")
    parser.add_argument("--version", action=VersionAction, help="print the version")
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                        help="event loop to run on (default asyncio)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parser.commands = sub.choices
    for add in (local.add_info, local.add_loopback, bench_lat.add_bench, bench_lat.add_lat, collectives.add_collectives,
                peer.add_serve, peer.add_connect, local.add_plot, local.add_doctor, compare.add_compare):
        add(sub)
    return parser


async def _watch_signals(scope: anyio.CancelScope, caught: list[int], stop: anyio.Event | None = None,
                         *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """On the first SIGTERM, SIGINT or SIGHUP, note it and cancel `scope`. Once the receiver is left, a second
    signal stops a clean-up that hangs (aiofabric/tools/signals.py). A command that ends gracefully (`stop`, e.g. bench
    --run-infinitely) gets the first SIGINT as `stop` instead, and finishes normally; a second one cancels."""
    with anyio.open_signal_receiver(*signals.MESSAGES) as received:
        signals.command_started()
        task_status.started()
        async for signum in received:
            if stop is not None and not stop.is_set() and signum == signal.SIGINT:
                stop.set()
                continue
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
            # a --run_infinitely client ends gracefully on Ctrl-C; a server given it (its clients' flag) does not run
            stop = args.stop = anyio.Event() if getattr(args, "run_infinitely", False) and \
                not getattr(args, "server", False) else None
            await tasks.start(_watch_signals, tasks.cancel_scope, caught, stop)
            result = await command(args)
            tasks.cancel_scope.cancel()
    except Exception as exc:  # a clean-up the cancellation broke: logged, the signal stays the outcome
        if not caught:
            raise
        logging.getLogger(__name__).warning("after %s: %s", signals.MESSAGES[signal.Signals(caught[0])],
                                            describe(exc))
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
            return {"error": signals.MESSAGES[signal.SIGINT]}, 128 + signal.SIGINT
        if isinstance(leaf, BadOption):  # a value the NIC cannot hold (its limits are known once it booted)
            return {"error": f"usage: {usage_message(leaf, getattr(args, 'typed', {}))}"}, EXIT_USAGE
        if not isinstance(leaf, Exception):
            raise
        return {"error": describe(leaf)}, EXIT_FAILURE
    return result, EXIT_FAILURE if "error" in result else EXIT_OK


def usage_error(error: UsageError, meta: dict[str, Any] | None) -> int:
    """Report a usage error: as JSON with `--json` (`meta`, the line's metadata), else argparse's usage and message
    on stderr."""
    if meta is not None:
        print(json.dumps(result_meta.stamped(False, meta, {"error": f"usage: {one_line(error.message)}"})))
    else:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error.message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = result_meta.now()
    try:
        parser = build_parser()
        # the first word naming a command is the command (the top-level flags take no such word)
        meta = result_meta.metadata(argv, result_meta.command_of(argv, parser.commands), started)
        try:
            args, unknown = parser.parse_known_args(argv)
            if len(unknown) == 1 and not unknown[0].startswith("-") and getattr(args, "server_host", "") is None:
                args.server_host, unknown = unknown[0], []  # perftest's `-s 4K HOST`: argparse took the positionals
                # ("write", none) before the options and leaves a later host over
            if unknown:  # argparse would name them under the top-level usage: say it under the command's
                parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
            args.typed = typed_flags(parser, argv)
            args.meta = meta  # the --out_json file's too
            if getattr(args, "check", None) is not None:
                args.check(args)
        except UsageError as error:
            return usage_error(error, meta if "--json" in argv else None)
        except ShowVersion as shown:
            version = {**meta, "command": None}  # no command's result (`bench -V` too): the metadata alone
            print(json.dumps(result_meta.stamped(True, version, {})) if "--json" in argv else f"aiofabric {shown}")
            return EXIT_OK
        logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                            format="%(name)s: %(message)s", stream=sys.stderr)
        if args.verbose:  # the emulator processes log at the same level (unless the environment already says)
            os.environ.setdefault("AIOFABRIC_SIM_LOG", ("INFO", "DEBUG")[min(args.verbose, 2) - 1])
    except Signalled as stopped:  # before the command ran (the entry point's handlers)
        return signals.report(stopped, argv)
    result, code = execute(args)
    if args.json:
        print(json.dumps(result_meta.stamped(code == EXIT_OK, args.meta, result)))
    elif code != EXIT_OK:
        print(f"aiofabric {args.command}: {result['error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    signals.install()
    sys.exit(main())
