"""The `aiofabric` command line (README: Command line).

`--json` prints exactly one JSON object as the last line of stdout, with "ok": true|false, on every outcome (usage
errors and signals included), so a script can always parse the last line; on failure "error" names the innermost
cause in one line. Without `--json`, failures print that line on stderr. `serve` is the exception: its stdout
carries the peer protocol (aiofabric/peer/protocol.py), so it has no `--json`; it exits 0 at end of input. Exit codes:

    0    success
    1    runtime failure (a firmware or completion error, a bad value, destination bytes that differ)
    2    usage error (unknown command or flag, bad choice): "error" is "usage: <argparse's message>"
    129  hung up (SIGHUP, 128 + 1): the command was cancelled and every NIC closed first
    130  interrupted by SIGINT (128 + 2); likewise
    143  terminated by SIGTERM (128 + 15); likewise (from the first import on: aiofabric/tools/signals.py)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any, Awaitable, Callable, Mapping, NoReturn

import anyio
from anyio.abc import TaskStatus

from . import plot, signals
from .latency import LatConfig, format_latency_table, perftest_latency_report, run_latency
from .perftest import (ATOMIC_SIZE, MAX_NICS, MAX_SIZE, TESTS, BenchConfig, bandwidth_unit, count_text, format_table,
                       open_bench_nics, perftest_report, run_bench, run_loopback)
from .perftest_flags import (DEFAULT_JSON_FILE, ShowVersion, VersionAction, add_perftest_flags, integer, ipv4,
                             ipv4_or_ssh, port_number, positive_float, positive_int, probability, readable_file,
                             seconds)
from .perftest_flags import size as size_argument  # "4096", "64K", "1M" (powers of 1024)
from .perftest_flags import sized, typed_flags, usage_message
from .signals import Signalled
from .units import SWEEP_MAX, SWEEP_MIN, sweep
from ..collectives.layout import DTYPE_NAMES, PIECE_BYTES
from ..errors import BadOption
from ..pci import ADDRESS, preflight
from ..pci.doctor import doctor as doctor_report
from ..verbs import open_nic

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
DEFAULT_ITERS = 1000  # bench's and lat's -n
SWEEP_SECONDS = 1.0  # -a without -n: each size runs about this long
# nccl-tests' binaries, without _perf: the collective each runs
COLLECTIVE_COMMANDS = {"allreduce": "allreduce", "reducescatter": "reduce_scatter", "allgather": "allgather",
                       "broadcast": "broadcast"}

SSH_PORT = 22
MAX_REPORT_ROWS = 64  # rows of a client's report a server prints: a sweep of every power of two up to 1 GiB has 31
RANKS_WHY = (": each rank of --ranks is an emulator process (or a PCI function) of this host, as bench's --nics; more "
             "ranks run one per process (torchrun, mpirun, srun) or per host (--hosts)")


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
        for key in ("nic", "fw_version", "hwrm_version", "mac", "port", "ip", "gid", "gid_index", "hw_retransmit",
                    "link", "link_speed_mbps", "port_mtu"):
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


def _perftest_common(parser: argparse.ArgumentParser, args: argparse.Namespace, sweeping: bool) -> None:
    """What bench and lat check alike: -A with the atomic test only, --output's choice, -n's default (with a sweep
    and no -n: about SWEEP_SECONDS per size), --out_json's file."""
    if args.atomic_type is not None and args.test != "atomic":
        parser.error(f"-A/--atomic_type {args.atomic_type}: goes with the atomic test, not {args.test}")
    if args.test == "atomic":  # perftest's ib_atomic_*: FETCH_AND_ADD of 8-byte words unless told otherwise
        args.atomic_type = args.atomic_type or "FETCH_AND_ADD"
        if "size" not in args.typed:
            args.size = ATOMIC_SIZE
    allowed = ("bandwidth", "message_rate") if args.command == "bench" else ("latency",)
    if args.output is not None and args.output not in allowed:
        parser.error(f"--output {args.output}: {args.command} reports {' or '.join(allowed)}")
    if args.output is not None and args.json:
        parser.error("--output prints one number, --json one object: choose one")
    if args.iters is None:
        args.iters = DEFAULT_ITERS
        args.sweep_seconds = SWEEP_SECONDS if sweeping else None
    if args.out_json and args.json_file is None:
        args.json_file = DEFAULT_JSON_FILE


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace, config: Any) -> None:
    """config.check(), its BadOption a usage error under the spelling typed."""
    try:
        config.check()
    except BadOption as exc:
        parser.error(usage_message(exc, args.typed))


def _check_bench(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        if args.all or args.min_size is not None or args.max_size is not None:
            try:
                args.sizes = sweep(args.min_size or SWEEP_MIN, args.max_size or SWEEP_MAX, args.factor)
            except ValueError as exc:
                parser.error(str(exc))
        _check_modes(parser, args)
        _perftest_common(parser, args, bool(getattr(args, "sizes", None)))
        if args.plot and not getattr(args, "sizes", None):
            parser.error("--plot draws a sweep: add -a or --min-size/--max-size")
        if args.run_infinitely:
            if getattr(args, "sizes", None):
                parser.error("--run-infinitely runs one size: drop the sweep")
            args.duration = args.duration or 5.0
        if args.output is not None and (getattr(args, "sizes", None) or args.run_infinitely):
            parser.error("--output prints one number: it goes with one size, not a sweep or --run-infinitely")
        _checked(parser, args, bench_config(args))
    return check


def _check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Where the server side runs (bench, lat): here, at SERVER_HOST, as this --server, or on --peer's host."""
    modes = [name for name, on in (("SERVER_HOST", args.server_host is not None), ("--server", args.server),
                                   ("--peer", args.peer is not None)) if on]
    if len(modes) > 1:
        parser.error(f"choose one of SERVER_HOST, --server and --peer, not {' and '.join(modes)}")
    if args.forever and not args.server:
        parser.error("--forever goes with --server")
    if args.server_host is not None:
        given = [flag for flag, value in (("--remote-nic", args.remote_nic), ("--remote-ip", args.remote_ip))
                 if value is not None]
        if given:
            parser.error(f"{' and '.join(given)}: the server chooses its NIC and address (its own --nic and --ip); "
                         "drop them")
    if args.server and not args.nic.startswith("sim") and args.ip is None:
        parser.error(f"--server --nic {args.nic}: give the NIC's address with --ip")
    if args.server:  # the client measures and reports; the server prints that report and nothing else
        given = [flag for flag, on in (("--output", args.output is not None),
                                       ("--out_json", args.out_json or args.json_file is not None),
                                       ("--plot", getattr(args, "plot", None) is not None)) if on]
        if given:
            parser.error(f"{' and '.join(given)}: the client's options (it measures; the server prints the "
                         "client's report): give them to the client")


def _check_lat(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        _check_modes(parser, args)
        if args.server_host is not None and not args.nic.startswith("sim") and args.ip is None:
            parser.error(f"--nic {args.nic}: give the NIC's address with --ip (the server's QP talks to it)")
        args.sizes = sweep(SWEEP_MIN, SWEEP_MAX) if args.all else None
        _perftest_common(parser, args, args.all)
        if args.output is not None and args.all:
            parser.error("--output prints one number: it goes with one size, not a sweep (-a)")
        if args.cycles:
            try:
                args.cpu_mhz = cpu_mhz()
            except ValueError as exc:
                parser.error(f"-C/--report-cycles: {exc}")
        _checked(parser, args, lat_config(args))
    return check


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                          if hasattr(args, f.name)})


def lat_config(args: argparse.Namespace) -> LatConfig:
    return LatConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LatConfig)
                        if hasattr(args, f.name)})


def cpu_mhz(path: str = "/proc/cpuinfo") -> float:
    """The CPU clock perftest's -C converts with (its get_cpu_mhz reads /proc/cpuinfo's "cpu MHz" too)."""
    try:
        with open(path) as file:
            for line in file:
                name, _, value = line.partition(":")
                if name.strip() in ("cpu MHz", "clock"):
                    return float(value.strip().rstrip("MHz"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CPU clock from {path}: {exc}") from None
    raise ValueError(f"{path} names no CPU clock (cpu MHz)")


async def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.plot:
        plot.require()  # before the run, not after it
    config = bench_config(args)
    _, scale = bandwidth_unit(config.report_gbits)

    def number(result: dict[str, Any]) -> str:  # --output bandwidth | message_rate
        if args.output == "bandwidth":
            return f"{result['bw_MiBps'] * scale:.2f}"
        return f"{result['msg_rate'] / 1e6:.6f}"

    result = await _perftest_command(args, config, run_bench, format_table, perftest_report, number)
    if args.plot:  # (--server refuses --plot)
        plot.plot_runs([result], args.plot, report_gbits=config.report_gbits)
    return result


async def _perftest_command(args: argparse.Namespace, config: Any, run: Callable[..., Awaitable[dict[str, Any]]],
                            table: Callable[[dict[str, Any], Any], str],
                            report: Callable[[dict[str, Any], Any], dict[str, Any]],
                            number: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """bench's and lat's body: serve (--server), or run where asked, then print --output's one number or the table
    (none with --json) and write --out_json's file with perftest's keys (`report`) besides ours."""
    config.progress = not args.json and args.output is None and sys.stderr.isatty()
    if args.server:
        return await _serve(args, config, table)
    result = await _run_where_asked(args, config, run)
    if args.output is not None and "error" not in result:
        print(number(result))
    elif not args.json:
        print(table(result, config))
    if args.json_file:
        with open(args.json_file, "w") as file:
            json.dump({"ok": "error" not in result, **result, **report(result, config)}, file, indent=1)
    return result


async def _run_where_asked(args: argparse.Namespace, config: Any, run: Callable[..., Awaitable[dict[str, Any]]]
                           ) -> dict[str, Any]:
    """`run(config)` (run_bench, run_latency) here, as perftest's client of a SERVER_HOST, or with the server side
    on --peer's host over SSH."""
    if args.server_host is not None:  # perftest's client: the server side is `aiofabric <command> --server` there
        return await _client(args, config, run)
    if args.peer is None:
        return await run(config)
    from ..peer.client import parse_host
    from ..peer.ssh import connect_peer
    config.check()  # before any SSH connection
    user, host, port = parse_host(args.peer, args.port or SSH_PORT)
    async with connect_peer(host, port, user=user or args.user, **_ssh_options(args)) as peer:
        config.remote = peer
        return await run(config)


async def _client(args: argparse.Namespace, config: Any, run: Callable[..., Awaitable[dict[str, Any]]]
                  ) -> dict[str, Any]:
    """perftest's client: open the NIC here, connect to the server from its address (the server's QPs talk only
    to the address a connection comes from), tell it this test's parameters (lat: it refuses others), run the
    test with the server side there, hand it the result."""
    from ..peer import PeerError
    from ..peer.tcp import DEFAULT_PORT, connect_tcp, source_address
    config.check()
    port = DEFAULT_PORT if args.port is None else args.port
    if config.ip is None and config.nic.startswith("sim"):  # the address that reaches the server (None: loopback,
        config.ip = await source_address(args.server_host, port)  # where the emulator picks a free 127.0.0.x)
    local = config.bench_config() if isinstance(config, LatConfig) else config
    async with open_bench_nics(dataclasses.replace(local, server_host=args.server_host)) as nics, \
            connect_tcp(args.server_host, port, local_host=nics[0].ip, connect_timeout=args.connect_timeout,
                        command_timeout=args.command_timeout) as peer:
        config.remote = peer
        if isinstance(config, LatConfig):
            await peer.request("lat_params", test=config.test, size=config.size, mtu=config.mtu, iters=config.iters,
                               warmup=config.warmup)
        result = await run(config, nics[0] if isinstance(config, LatConfig) else nics)
        try:
            await peer.request("report", result=result)  # the server prints the same table
        except PeerError as exc:  # the run itself is done and measured here
            logging.getLogger(__name__).warning("the server did not take the report: %s", exc)
    return result


async def _serve(args: argparse.Namespace, config: Any, format_report: Callable[[dict[str, Any], Any], str]
                 ) -> dict[str, Any]:
    """perftest's server: wait for `aiofabric <command> ... SERVER_HOST` clients over TCP (one at a time; --forever:
    one after another), let each drive the server side through the command's exchange under this server's policy
    (its NIC, address, capture file and limits; lat: its test, size and MTU, which a client must match), and print
    each one's table. Without --forever, a client whose session failed makes the server fail too."""
    from ..peer.policy import Limits, ServerPolicy
    from ..peer.tcp import DEFAULT_PORT, serve_tcp
    limits = Limits(nics=args.max_nics, memory=args.max_memory, in_flight=args.max_requests, line=args.max_line,
                    depth=args.max_depth, idle=args.idle_timeout)
    lat = isinstance(config, LatConfig)
    policy = ServerPolicy(nic=args.nic, ip=args.ip, pcap=args.pcap, allow_peers=tuple(args.allow_peer or ()),
                          pcap_max_bytes=args.pcap_max_bytes, pcap_max_files=args.pcap_max_files,
                          limits=limits, tool=args.command,
                          expect={"test": config.test, "size": config.size, "mtu": config.mtu} if lat else {})

    shown: list[str] = []  # the client whose report was printed last: one table per session (clients come in turn)

    def show(result: dict[str, Any], client: str) -> None:  # `result` is the client's, its text already escaped
        if shown and shown[-1] == client:
            raise ValueError("report: a client reports its run once (its table was printed)")
        rows = result.get("rows")
        if isinstance(rows, list) and len(rows) > MAX_REPORT_ROWS:
            raise ValueError(f"report: {len(rows)} rows; a sweep has at most {MAX_REPORT_ROWS}")
        if args.json:
            shown[:] = [client]
            return
        try:
            first = result.get("rows", [result])[0]
            names = ("test", "qps", "size", "iters", "depth", "mtu", "nics", "warmup")
            fields = {name: first[name] for name in names if name in first and hasattr(config, name)}
            table = format_report(result, dataclasses.replace(config, **fields))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"report: not a {args.command} result ({type(exc).__name__}: {exc})") from None
        shown[:] = [client]
        print(f"aiofabric {args.command} server: the report of client {client} (its own measurements):\n{table}",
              flush=True)

    def listening(port: int) -> None:
        print(f"aiofabric {args.command} server: waiting for a client on {args.bind} TCP port {port}",
              file=sys.stderr, flush=True)

    summary = await serve_tcp(args.bind, DEFAULT_PORT if args.port is None else args.port, forever=args.forever,
                              policy=policy, ready=listening, on_report=show)
    session_error = summary.pop("error", None)
    result = {"server": True, **summary, "client_error": session_error}
    if session_error and not args.forever:
        result["error"] = session_error if summary.get("outcome") == "parameters differ" else \
            f"the client's session failed: {session_error}"
    return result


def _ssh_options(args: argparse.Namespace) -> dict[str, Any]:
    """connect_peer's keywords from the SSH flags (_add_ssh_flags)."""
    from ..peer.ssh import DEFAULT
    known_hosts = DEFAULT if args.known_hosts is None else None if args.known_hosts == "none" else args.known_hosts
    return {"identity": args.identity, "known_hosts": known_hosts, "python": args.python, "push": args.push,
            "connect_timeout": args.connect_timeout, "command_timeout": args.command_timeout}


async def cmd_lat(args: argparse.Namespace) -> dict[str, Any]:
    config = lat_config(args)
    return await _perftest_command(args, config, run_latency, format_latency_table, perftest_latency_report,
                                   lambda result: f"{result['t_avg_us'] * (config.cpu_mhz or 1):.2f}")  # t_avg


async def cmd_collective(args: argparse.Namespace) -> dict[str, Any]:
    from ..collectives import join, local
    from ..collectives.perf import PerfConfig, run_perf
    world, sizes, ranks = args.world, args.sizes, args.rank_count  # _check_collective's
    if args.hosts:
        return await _collective_over_ssh(args, sizes)
    nics = args.nics.split(",") if args.nics else None
    options = {} if nics else {name: getattr(args, name) for name in ("loss", "reorder", "dup", "corrupt", "seed")}
    if args.pcap and not nics:
        options["pcap"] = args.pcap
    leader = world is None or world.rank == 0  # prints the table, as nccl-tests' rank 0 does
    config = PerfConfig(args.kind, sizes, iters=args.iters, warmup=args.warmup_iters, dtype=DTYPE_NAMES[args.datatype],
                        op=args.op, root=args.root, check=bool(args.verify),
                        progress=leader and not args.json and sys.stdout.isatty())
    if world is not None:
        async with join(world, nic=args.nic, ip=args.ip, buffer_bytes=max(sizes), piece_bytes=args.piece,
                        timeout=args.timeout, rendezvous_timeout=args.rendezvous_timeout, **options) as comm:
            result = await run_perf([comm], config)
        result["launcher"] = world.launcher
    else:
        async with local(ranks, nics=nics, buffer_bytes=max(sizes), piece_bytes=args.piece, timeout=args.timeout,
                         **options) as comms:
            result = await run_perf(comms, config)
    if not args.json and leader:
        print(format_collective(result))
    return result


DEFAULT_RANKS = 2
MAX_LOCAL_RANKS = MAX_NICS  # each rank of --ranks is an emulator process with its own DMA arena on this host


def _check_collective(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    """Where the ranks run and how many there are (--ranks, --hosts, or a launcher's variables), and what depends
    on it (-r, --nics), checked before anything starts; the sweep's sizes. Sets args.world, rank_count, sizes,
    host_list."""
    def check(args: argparse.Namespace) -> None:
        from ..collectives.world import from_environment
        args.world, args.host_list = None, None
        if args.hosts is not None and args.ranks is not None:
            parser.error("--ranks and --hosts both say where the ranks run: give one (--hosts: one rank per host)")
        if args.hosts is not None:
            args.host_list = _parsed_hosts(parser, args.hosts, args.port)
            if not args.host_list:
                parser.error(f"--hosts {args.hosts}: names no host")
            args.rank_count = len(args.host_list)
        elif args.ranks is None:
            try:
                args.world = from_environment(os.environ)
            except ValueError as exc:
                parser.error(str(exc))
            if args.world is not None:
                _check_resolvable(parser, args.world.addr, args.world.port)
            args.rank_count = args.world.size if args.world is not None else DEFAULT_RANKS
        else:
            args.rank_count = args.ranks
        if args.nics and len(args.nics.split(",")) != args.rank_count:
            parser.error(f"--nics names {len(args.nics.split(','))} NICs for {args.rank_count} ranks: one per rank")
        if not 0 <= args.root < args.rank_count:
            parser.error(f"-r/--root {args.root}: must be a rank in [0, {args.rank_count - 1}] ({args.rank_count} "
                         "ranks)")
        if args.size is None and args.minbytes > args.maxbytes:
            parser.error(f"-b/--minbytes {args.minbytes} is larger than -e/--maxbytes {args.maxbytes}: a sweep goes up")
        args.sizes = [args.size] if args.size is not None else sweep(args.minbytes, args.maxbytes, args.stepfactor)
    return check


def _check_resolvable(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """MASTER_ADDR names a host: one the resolver does not know is a usage error now, not a rendezvous that
    never answers (a busy resolver, EAI_AGAIN, is left to the rendezvous's retries)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno != socket.EAI_AGAIN:
            parser.error(f"MASTER_ADDR={host}: cannot be resolved ({exc.strerror or exc})")
    except UnicodeError as exc:  # a label too long for IDNA
        parser.error(f"MASTER_ADDR={host!r}: not a host name ({exc})")


def _parsed_hosts(parser: argparse.ArgumentParser, text: str, port: int | None) -> list[tuple[str | None, str, int]]:
    """--hosts' [user@]host[:port] entries (SSH's port by default), a usage error naming a bad one."""
    try:
        return _hosts(text, SSH_PORT if port is None else port)
    except (ValueError, OSError) as exc:
        parser.error(f"--hosts {text}: {exc}")


def format_collective(result: dict[str, Any]) -> str:
    from ..collectives.perf import format_table
    return format_table(result)


# the flags a launcher passes on to every rank (dest, flag)
RANK_FLAGS = (("minbytes", "-b"), ("maxbytes", "-e"), ("stepfactor", "-f"), ("iters", "-n"), ("warmup_iters", "-w"),
              ("datatype", "-d"), ("op", "-o"), ("root", "-r"), ("verify", "-c"), ("piece", "--piece"),
              ("timeout", "--timeout"), ("rendezvous_timeout", "--rendezvous-timeout"), ("size", "--size"),
              ("loss", "--loss"), ("reorder", "--reorder"), ("dup", "--dup"), ("corrupt", "--corrupt"),
              ("seed", "--seed"), ("pcap", "--pcap"))


async def _collective_over_ssh(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """One rank per host: each runs this command over SSH with the launchers' variables, meeting at a rendezvous
    served here and forwarded to each host's 127.0.0.1 over its SSH connection. Rank 0's result is the table."""
    from ..collectives.communicator import CollectiveError
    from ..collectives.rendezvous import RendezvousServer
    from ..peer.remote_run import run_remote
    hosts = args.host_list  # _check_collective's
    ssh = _ssh_options(args)
    ssh.pop("command_timeout")
    flags = [word for dest, flag in RANK_FLAGS if getattr(args, dest) is not None
             for word in (flag, str(getattr(args, dest)))]
    server = RendezvousServer(len(hosts), args.rendezvous_timeout)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    results: list[Any] = [None] * len(hosts)
    failed: list[str] = []
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, listener)

        async def rank(index: int) -> None:
            user, host, ssh_port = hosts[index]
            ip = host if args.remote_ip == "ssh" else args.remote_ip
            run = await run_remote(
                host, ssh_port, user=user or args.user, args=[args.command, *flags, "--nic", args.remote_nic,
                                                              *(["--ip", ip] if ip else []), "--json"],
                env={"RANK": str(index), "WORLD_SIZE": str(len(hosts)), "AIOFABRIC_RENDEZVOUS": "external"},
                tunnel=("127.0.0.1", port), timeout=math.inf, **ssh)
            lines = run.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
            if result is None or not result.get("ok"):
                why = result["error"] if result else (run.stopped or f"exit status {run.exit_status}; stderr: "
                                                      + " | ".join(run.stderr_tail))
                failed.append(f"rank {index} on {run.host} failed: {why}")
                ranks.cancel_scope.cancel()  # the first failure is the cause: the others would only wait for it
            results[index] = result
        async with anyio.create_task_group() as ranks:
            for index in range(len(hosts)):
                ranks.start_soon(rank, index)
        group.cancel_scope.cancel()
    if failed:
        raise CollectiveError(failed[0])
    result = {**results[0], "hosts": [f"{user + '@' if user else ''}{host}:{port}" for user, host, port in hosts]}
    if not args.json:
        print(format_collective(result))
    return result


async def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    runs = plot.load(args.results)
    plot.plot_runs(runs, args.output)
    if not args.json:
        print(f"wrote {args.output}: {len(runs)} run(s)")
    return {"output": args.output, "runs": len(runs)}


def pci_address(text: str) -> str:
    """argparse type for a PCI address (domain:bus:device.function)."""
    if not ADDRESS.fullmatch(text.lower()):
        raise argparse.ArgumentTypeError(f"bad PCI address {text!r}: expected domain:bus:device.function, "
                                         "e.g. 0000:41:00.0")
    return text.lower()


async def cmd_doctor(args: argparse.Namespace) -> dict[str, Any]:
    report = doctor_report(args.address, access=args.access)
    if not args.json:
        print(report.format())
    return report.as_dict()  # with "error" (exit 1) when nothing found can be driven


async def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from ..peer.serve import serve  # the remote endpoint: stdout carries the protocol, so no --json here
    await serve()
    return {}


def _hosts(text: str, port: int) -> list[tuple[str | None, str, int]]:
    """`--hosts`: a file with one `[user@]host[:port]` per line (# comments), or a comma-separated list."""
    from ..peer.client import parse_host
    if "," not in text and os.path.isfile(text):
        with open(text) as file:
            specs = [line.split("#")[0].strip() for line in file]
    else:
        specs = text.split(",")
    return [parse_host(spec, port) for spec in specs if spec.strip()]


async def cmd_connect(args: argparse.Namespace) -> dict[str, Any]:
    from ..peer.connect import open_all, ring, two_hosts
    from ..peer.ssh import connect_peer
    ssh = _ssh_options(args)
    started = time.perf_counter()
    if args.hosts:
        hosts = args.host_list  # _check_connect's
        openers = [functools.partial(connect_peer, host, port, user=user or args.user, **ssh)
                   for user, host, port in hosts]
        async with open_all(openers) as peers:
            options = [{"ip": args.remote_ip}] * len(peers) if args.remote_ip else None
            result = await ring(peers, nic=args.remote_nic, size=args.size, options=options, started=started)
        if not args.json:
            print(f"ring of {len(peers)} hosts ({' -> '.join(result['hosts'])} -> back): RDMA WRITE of {args.size} "
                  f"bytes around it: {'verified' if result['verified'] else 'MISMATCH'} (handshake "
                  f"{result['handshake_ms']:.0f} ms, transfer {result['transfer_ms']:.1f} ms)")
        return result
    user, host, port = args.target  # _check_connect's
    async with connect_peer(host, port, user=user or args.user, **ssh) as peer:
        result = await two_hosts(peer, nic=args.nic, remote_nic=args.remote_nic, local_ip=args.local_ip,
                                 remote_ip=args.remote_ip, size=args.size, started=started)
        result = {**result, "remote_host": peer.host, "pushed": peer.pushed_to is not None}
    if not args.json:
        print(f"{result['local_ip']} -> {peer.host} ({result['remote_ip']}): RDMA WRITE + READ of {args.size} bytes: "
              f"{'verified' if result['verified'] else 'MISMATCH'} (handshake {result['handshake_ms']:.0f} ms, "
              f"transfer {result['transfer_ms']:.1f} ms, write {result['write_MiBps']} MiB/s)")
    return result


def _check_connect(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        from ..peer.client import parse_host
        if (args.host is None) == (args.hosts is None):
            parser.error("give one HOST or --hosts FILE|h1,h2 (not both)")
        if args.hosts is not None:
            args.host_list = _parsed_hosts(parser, args.hosts, args.port)
            if len(args.host_list) < 2:
                parser.error(f"--hosts {args.hosts}: a ring needs at least 2 hosts, not {len(args.host_list)}")
            return
        try:
            args.target = parse_host(args.host, SSH_PORT if args.port is None else args.port)
        except ValueError as exc:
            parser.error(f"HOST: {exc}")
    return check


def build_parser() -> Parser:
    parser = Parser(prog="aiofabric", description="Async userspace driver for BNXT RoCEv2 NICs")
    parser.add_argument("--version", action=VersionAction, help="print the version")
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                        help="event loop to run on (default asyncio)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    parser.commands = sub.choices

    info = sub.add_parser("info", help="boot a NIC and print its firmware version, MAC, port, GID, capabilities")
    info.add_argument("--nic", default="sim", help="'sim', 'sim:NAME' or a PCI address (default sim)")
    info.add_argument("--ip", type=ipv4, help="the NIC's IPv4 address; its GID is ::ffff:IP (emulated: a free 127.0.0.x)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(run=cmd_info)

    loop = sub.add_parser("loopback", help="RDMA WRITE between two QPs of one NIC through its PHY loopback")
    loop.add_argument("--nic", default="sim", help="'sim', 'sim:NAME' or a PCI address (default sim)")
    loop.add_argument("--ip", type=ipv4, help="the NIC's IPv4 address (emulated: a free 127.0.0.x)")
    loop.add_argument("-s", "--size", type=sized(1, MAX_SIZE), default=4096,
                      help="bytes to write, with an optional K/M/G suffix (default 4096)")
    loop.add_argument("--json", action="store_true", help="print one JSON object")
    loop.set_defaults(run=cmd_loopback)

    bench = sub.add_parser("bench", help="perftest-style RDMA benchmark between emulated NICs, bytes verified "
                                         "(ib_*_bw; perftest's flags work)")
    bench.add_argument("test", choices=TESTS)
    bench.add_argument("server_host", nargs="?", metavar="SERVER_HOST",
                       help="run as perftest's client: the server side is `aiofabric bench --server` on this host")
    add_perftest_flags(bench, "bench")
    group = _add_two_host_flags(bench)
    group.add_argument("--min-size", type=size_argument, help="sweep from this size (default 2; implies a sweep)")
    group.add_argument("--max-size", type=size_argument, help="sweep up to this size (default 8M; implies a sweep)")
    group.add_argument("--factor", type=int, default=2, help="sweep step: each size is the last times this (2)")
    group.add_argument("--nics", type=int, default=2, help="emulated NICs, paired up (default 2)")
    _add_wire_flags(group)
    _add_emulator_flag(group, shared=False)
    group.add_argument("--inject-fault", metavar="KIND[:N[:OFFSET]]",
                       help="make the server NICs misbehave, to see verification fail: skip_placement (ACK the next "
                            "N writes without placing them) or misplace (place them OFFSET bytes off; default 64)")
    _add_peer_flags(group)
    _add_server_limits(bench)
    group.add_argument("--json", action="store_true", help="print one JSON object")
    group.add_argument("--plot", metavar="PNG", help="plot bandwidth and message rate against size (a sweep; needs "
                                                     "the plot extra: pip install 'aiofabric[plot]')")
    bench.set_defaults(run=cmd_bench, check=_check_bench(bench))

    lat = sub.add_parser("lat", help="perftest-style latency: a ping-pong between two emulated NICs, or on one PCI NIC "
                                     "in PHY loopback (ib_*_lat; perftest's flags work)")
    lat.add_argument("test", choices=TESTS)
    lat.add_argument("server_host", nargs="?", metavar="SERVER_HOST",
                     help="run as perftest's client: the server side is `aiofabric lat --server` on this host (with "
                          "the same test, -s and -m)")
    add_perftest_flags(lat, "lat")
    group = _add_two_host_flags(lat)
    group.add_argument("--warmup", type=int, default=8, help="iterations run first and not measured (default 8)")
    _add_wire_flags(group)
    _add_emulator_flag(group, shared=True)
    _add_peer_flags(group)
    _add_server_limits(lat)
    group.add_argument("--json", action="store_true", help="print one JSON object")
    lat.set_defaults(run=cmd_lat, check=_check_lat(lat))

    for command, kind in COLLECTIVE_COMMANDS.items():
        coll = sub.add_parser(command, help=f"nccl-tests' {kind}_perf over a ring of emulated (or PCI) NICs in this "
                                            "process: a size sweep, every element checked")
        coll.add_argument("--ranks", type=integer(1, MAX_LOCAL_RANKS, RANKS_WHY), help="ranks in this process, one NIC each (default 2; under torchrun, "
                                                   "mpirun or srun: this process is one rank of their job, "
                                                   "rendezvous at MASTER_ADDR:MASTER_PORT)")
        coll.add_argument("--nic", default="sim", help="with a launcher: this rank's NIC (default sim)")
        coll.add_argument("--ip", type=ipv4, help="with a launcher: this rank's NIC's IPv4 address (emulated: a free 127.0.0.x)")
        coll.add_argument("--nics", metavar="A,B,...", help="PCI NICs, one per rank (default: emulated NICs)")
        coll.add_argument("-b", "--minbytes", type=sized(1), default=32 << 10,
                          help="smallest size (default 32K); K/M/G suffixes are powers of 1024")
        coll.add_argument("-e", "--maxbytes", type=sized(1), default=32 << 20,
                          help="largest size (default 32M)")
        coll.add_argument("-f", "--stepfactor", type=integer(2), default=2, help="multiply the size by this each step (2)")
        coll.add_argument("--size", type=size_argument, help="one size instead of a sweep")
        coll.add_argument("-n", "--iters", type=integer(0), default=20, help="timed iterations per size (default 20)")
        coll.add_argument("-w", "--warmup_iters", type=integer(0), default=5, help="untimed iterations first (default 5)")
        coll.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPE_NAMES),
                          help="element type (default float)")
        coll.add_argument("-o", "--op", default="sum", choices=("sum", "prod", "min", "max"),
                          help="reduction (default sum)")
        coll.add_argument("-r", "--root", type=integer(0), default=0, help="broadcast's root rank (default 0)")
        coll.add_argument("-c", "--check", dest="verify", type=int, default=1, choices=(0, 1),
                          help="check every element of one run per size (default 1)")
        coll.add_argument("--timeout", type=seconds, default=60.0, help="seconds one collective may take before every "
                                                                     "rank fails naming what it waited for (60)")
        coll.add_argument("--rendezvous-timeout", type=seconds, default=60.0,
                          help="with a launcher: seconds for every rank to join (60)")
        coll.add_argument("--piece", type=sized(1, MAX_SIZE), default=PIECE_BYTES,
                          help="bytes per RDMA message (default 512K): pieces pipeline transfers with reductions")
        _add_wire_flags(coll)
        coll.add_argument("--hosts", metavar="FILE|h1,h2", help="one rank per host, started over SSH (`python -m "
                                                              "aiofabric` there); the rendezvous is relayed over SSH")
        coll.add_argument("--remote-nic", default="sim", help="with --hosts: each host's NIC (default sim)")
        coll.add_argument("--remote-ip", type=ipv4_or_ssh, help="with --hosts: each host's NIC address ('ssh': the address SSH reached)")
        _add_ssh_flags(coll)
        coll.add_argument("--json", action="store_true", help="print one JSON object")
        coll.set_defaults(run=cmd_collective, kind=kind, check=_check_collective(coll))

    serve = sub.add_parser("serve", help="the remote endpoint connect_peer starts over SSH: JSON-lines requests on "
                                         "stdin, answers on stdout (protocol: aiofabric/peer/protocol.py)")
    serve.set_defaults(run=cmd_serve, json=False)

    connect = sub.add_parser("connect", help="start an endpoint on HOST over SSH, RDMA WRITE to it and READ back, "
                                             "bytes verified by sha256 on both sides (--hosts: a ring)")
    connect.add_argument("host", nargs="?", metavar="HOST", help="[user@]host[:port] to reach over SSH")
    connect.add_argument("--hosts", metavar="FILE|h1,h2", help="a ring over these hosts (a file with one "
                                                               "[user@]host[:port] per line, or a comma list)")
    connect.add_argument("--nic", default="sim", help="local NIC: 'sim', 'sim:NAME' or a PCI address (default sim)")
    connect.add_argument("--remote-nic", default="sim", help="the remote host's NIC (default sim)")
    connect.add_argument("--local-ip", type=ipv4, help="local NIC's IPv4 address (emulated: a free 127.0.0.x)")
    connect.add_argument("--remote-ip", type=ipv4_or_ssh, help="remote NIC's IPv4 address (emulated: a free 127.0.0.x there); 'ssh': "
                                             "the address the SSH connection reached (with --hosts: on every host)")
    connect.add_argument("--size", type=sized(1), default=1 << 20,
                         help="bytes to write and read back, with an optional K/M/G suffix (default 1M)")
    _add_ssh_flags(connect)
    connect.add_argument("--json", action="store_true", help="print one JSON object")
    connect.set_defaults(run=cmd_connect, check=_check_connect(connect))

    plotter = sub.add_parser("plot", help="overlay saved bench results (--json-file) in one PNG")
    plotter.add_argument("results", nargs="+", metavar="RESULTS.json")
    plotter.add_argument("-o", "--output", required=True, metavar="PNG")
    plotter.add_argument("--json", action="store_true", help="print one JSON object")
    plotter.set_defaults(run=cmd_plot)

    doctor = sub.add_parser("doctor", help="check a PCI function before the driver takes it over (without an "
                                           "address: the bus): what is wrong, and the command that fixes it")
    doctor.add_argument("address", nargs="?", type=pci_address, metavar="PCI_ADDRESS",
                        help="domain:bus:device.function, e.g. 0000:41:00.0 (default: every supported function)")
    doctor.add_argument("--access", choices=preflight.ACCESSES, default="vfio",
                        help="how the driver will reach it: vfio (what open_nic uses for a PCI address, the default) "
                             "or sysfs (open_nic('sysfs:ADDR'), unsafe)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(run=cmd_doctor)
    return parser


def _add_two_host_flags(parser: argparse.ArgumentParser) -> Any:
    """bench's and lat's own options group, starting with perftest's server mode and the local NIC's address."""
    group = parser.add_argument_group("aiofabric's options")
    group.add_argument("--server", action="store_true", help="run as perftest's server: wait for a client over TCP")
    group.add_argument("--forever", action="store_true", help="with --server: serve one client after another")
    group.add_argument("--bind", default="0.0.0.0", help="with --server: the address to listen on (default all)")
    group.add_argument("--ip", type=ipv4, help="NIC 0's IPv4 address (emulated: each picks a free 127.0.0.x; SERVER_HOST: the "
                                    "address that reaches the server; --server: the address the client reached)")
    return group


def _add_peer_flags(group: Any) -> None:
    """The server side on another host over SSH (--peer), and how to reach it."""
    group.add_argument("--peer", metavar="HOST", help="run the server side on [user@]HOST[:port], started over SSH "
                                                     "(one NIC here, one there)")
    group.add_argument("--remote-nic", help="with --peer: the NIC there (default sim)")
    group.add_argument("--remote-ip", type=ipv4_or_ssh, help="with --peer: its IPv4 address ('ssh': the address SSH reached)")
    _add_ssh_flags(group, short_port=True)


def _add_wire_flags(parser: Any) -> None:
    """The emulated wire's faults and capture (bench, lat, the collectives)."""
    for fault in ("loss", "reorder", "dup", "corrupt"):
        parser.add_argument(f"--{fault}", type=probability, default=0.0, metavar="P",
                            help=f"probability of {fault} per packet on the emulated wire")
    parser.add_argument("--seed", type=int, default=0, help="seed of the wire faults (default 0)")
    parser.add_argument("--pcap", metavar="FILE", help="write every packet NIC 0 sends and receives (NIC N: FILE.N)")


def _add_emulator_flag(group: Any, shared: bool) -> None:
    """Whether this host's emulated NICs share one emulator process (bench: no, for parallel NICs; lat: yes, so a
    packet between them costs no process wake-up; see the README)."""
    group.add_argument("--shared-emulator", action=argparse.BooleanOptionalAction, default=shared,
                       help="run this host's emulated NICs in one emulator process: a packet between them wakes no "
                            "other process, but they share its CPU time (default: "
                            f"{'yes, for latency' if shared else 'no, a process per NIC runs them in parallel'})")


def _add_server_limits(parser: argparse.ArgumentParser) -> None:
    """What one client of `bench --server` may hold (aiofabric/peer/policy.py); defaults are Limits'."""
    from ..peer.policy import PCAP_MAX_BYTES, PCAP_MAX_FILES, Limits
    group = parser.add_argument_group("server limits (with --server, per client)")
    defaults = Limits()
    group.add_argument("--max-nics", type=positive_int, default=defaults.nics, metavar="N",
                       help=f"NICs a client may open at once (default {defaults.nics}, as perftest)")
    group.add_argument("--max-memory", type=sized(1), default=defaults.memory, metavar="BYTES",
                       help="DMA memory a client's NICs may hold: registered memory, rings and the NIC's own "
                            f"(default {defaults.memory >> 20}M)")
    group.add_argument("--max-requests", type=positive_int, default=defaults.in_flight, metavar="N",
                       help=f"requests of a client in flight at once (default {defaults.in_flight})")
    group.add_argument("--max-line", type=sized(1), default=defaults.line, metavar="BYTES",
                       help=f"bytes per request line (default {defaults.line >> 10}K)")
    group.add_argument("--max-depth", type=positive_int, default=defaults.depth, metavar="N",
                       help=f"JSON nesting of a request (default {defaults.depth})")
    group.add_argument("--idle-timeout", type=positive_float, default=defaults.idle, metavar="S",
                       help=f"drop a client that sends no request or reads no answer for S seconds (default "
                            f"{defaults.idle:g}; our clients ping while their test runs)")
    group.add_argument("--allow-peer", type=ipaddress.ip_network, action="append", metavar="NETWORK",
                       help="a network the server's QPs may also connect to (default: only the address each "
                            "client connects from); repeatable")
    captures = parser.add_argument_group("server captures (with --server --pcap FILE, for the whole server)")
    captures.add_argument("--pcap-max-bytes", type=pcap_bytes, default=PCAP_MAX_BYTES, metavar="BYTES",
                          help="size limit of each capture file: the packets past it are not recorded (default "
                               f"{PCAP_MAX_BYTES >> 30}G; a default bench run takes about 70M)")
    captures.add_argument("--pcap-max-files", type=positive_int, default=PCAP_MAX_FILES, metavar="N",
                          help="capture files to write, one per client NIC (FILE, FILE.1, ...); later NICs are not "
                               f"captured (default {PCAP_MAX_FILES}; the captures take at most N x BYTES)")


def pcap_bytes(text: str) -> int:
    value = size_argument(text)
    if value < 24:
        raise argparse.ArgumentTypeError(f"must be at least 24 (the pcap file header), not {value}")
    return value


def _add_ssh_flags(parser: Any, short_port: bool = False) -> None:
    """How to reach a host over SSH (connect, bench --peer); `short_port`: -p too, as perftest spells its port."""
    parser.add_argument(*(("-p",) if short_port else ()), "--port", type=port_number,
                        help="SSH port (default 22); for bench --server / SERVER_HOST the TCP port (default 18515; "
                             "--server: 0 picks one)")
    parser.add_argument("--user", help="SSH user (default: the SSH default)")
    parser.add_argument("--identity", type=readable_file, metavar="FILE", help="private key (default: the agent and ~/.ssh keys)")
    parser.add_argument("--known-hosts", metavar="FILE|none",
                        help="known_hosts file (default ~/.ssh/known_hosts); 'none' skips the check (insecure)")
    parser.add_argument("--push", action="store_true",
                        help="copy this aiofabric over SFTP to a private temp dir on the host and run it from there")
    parser.add_argument("--python", default="python3", help="the remote interpreter (default python3)")
    parser.add_argument("--connect-timeout", type=seconds, default=20.0, metavar="S",
                        help="seconds for SSH connect + endpoint start (default 20)")
    parser.add_argument("--command-timeout", type=seconds, default=60.0, metavar="S",
                        help="seconds per remote request (default 60)")


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
            stop = args.stop = anyio.Event() if getattr(args, "run_infinitely", False) else None
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
        try:
            parser = build_parser()
            args, unknown = parser.parse_known_args(argv)
            if len(unknown) == 1 and not unknown[0].startswith("-") and getattr(args, "server_host", "") is None:
                args.server_host, unknown = unknown[0], []  # perftest's `-s 4K HOST`: argparse took the positionals
                # ("write", none) before the options and leaves a later host over
            if unknown:  # argparse would name them under the top-level usage: say it under the command's
                parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
            args.typed = typed_flags(parser, argv)
            if getattr(args, "check", None) is not None:
                args.check(args)
        except UsageError as error:
            return usage_error(error, "--json" in argv)
        except ShowVersion as shown:
            print(json.dumps({"ok": True, "version": str(shown)}) if "--json" in argv else f"aiofabric {shown}")
            return EXIT_OK
        logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                            format="%(name)s: %(message)s", stream=sys.stderr)
        if args.verbose:  # the emulator processes log at the same level (unless the environment already says)
            os.environ.setdefault("AIOFABRIC_SIM_LOG", ("INFO", "DEBUG")[min(args.verbose, 2) - 1])
    except Signalled as stopped:  # before the command ran (the entry point's handlers)
        return signals.report(stopped, argv)
    result, code = execute(args)
    if args.json:
        print(json.dumps({"ok": code == EXIT_OK, **result}))
    elif code != EXIT_OK:
        print(f"aiofabric {args.command}: {result['error']}", file=sys.stderr)
    return code


if __name__ == "__main__":
    signals.install()
    sys.exit(main())
