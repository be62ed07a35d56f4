"""`bench` and `lat`: perftest's ib_*_bw and ib_*_lat on emulated (or PCI) NICs, with perftest's flags. Each runs
here, with the server side on --peer's host over SSH, as perftest's server (--server) or as its client (SERVER_HOST);
what differs between the two commands is in its `Perftest`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Awaitable, Callable

from .perftest_server import add_server_limits, client, serve
from .ssh import SSH_PORT, add_ssh_flags, ssh_options
from .. import lat_plot, plot
from ..arguments import Subcommands, add_wire_flags, ipv4, ipv4_or_ssh, size
from ..bench_config import BenchConfig
from ..bench_report import bandwidth_unit, format_table, perftest_report
from ..lat_config import WARMUP, LatConfig
from ..lat_report import format_latency_table, perftest_latency_report
from ..latency import run_latency
from ..options import ATOMIC_SIZE, TESTS
from ..perftest import run_bench
from ..perftest_defaults import default_inline, default_iters
from ..perftest_flags import BENCH_OUTPUTS, DEFAULT_JSON_FILE, LAT_OUTPUTS, add_perftest_flags, usage_message
from ..result_meta import stamped
from ..units import SWEEP_MAX, SWEEP_MIN, sweep
from ...errors import BadOption
from ...verbs import NIC

SWEEP_SECONDS = 1.0  # bench --min-size/--max-size without -n: each size runs about this long


@dataclasses.dataclass(frozen=True)
class Perftest:
    """What bench or lat brings to the body they share (`_perftest_command`, perftest_server's client and server)."""
    outputs: tuple[str, ...]  # --output's choices
    config: Callable[[argparse.Namespace], BenchConfig | LatConfig]  # the engine's options from the command line
    run: Callable[[Any], Awaitable[dict[str, Any]]]  # here, or with the server side on --peer's host
    run_as_client: Callable[[Any, list[NIC]], Awaitable[dict[str, Any]]]  # SERVER_HOST's client, on the NIC here
    table: Callable[[dict[str, Any], Any], str]  # the whole table (a server prints its client's with it)
    printed: Callable[[dict[str, Any], Any], str]  # what the command prints at the end of its own run
    report: Callable[[dict[str, Any], Any, str | None], dict[str, Any]]  # perftest's --out_json keys
    number: Callable[[dict[str, Any], Any, str], str]  # --output's number
    expect: tuple[str, ...]  # the parameters a --server's clients must match (the server refuses others)


def _bench_number(result: dict[str, Any], config: BenchConfig, output: str) -> str:
    if output == "bandwidth":  # in the table's unit, printed as perftest prints it (%lf)
        return f"{result['bw_MiBps'] * bandwidth_unit(config.report_gbits)[1]:f}"
    return f"{result['msg_rate'] / 1e6:f}"


def _lat_number(result: dict[str, Any], config: LatConfig, output: str) -> str:
    return f"{result['t_avg_us'] * (config.cpu_mhz or 1):f}"  # t_avg, in the table's unit


def _bench_printed(result: dict[str, Any], config: BenchConfig) -> str:
    """--run_infinitely printed perftest's banner and its rows as it ran: the closing dashes and our lines remain."""
    return format_table(result, config, head=not config.run_infinitely)


async def _bench_as_client(config: BenchConfig, nics: list[NIC]) -> dict[str, Any]:
    """bench's client of a --server: the server checks the symmetric parameters against its own first."""
    await config.remote.request("bench_params", params=symmetric(config, BENCH))
    return await run_bench(config, nics)


async def _lat_as_client(config: LatConfig, nics: list[NIC]) -> dict[str, Any]:
    """lat's client of a --server: the server checks these parameters against its own first."""
    await config.remote.request("lat_params", test=config.test, size=config.size, mtu=config.mtu, iters=config.iters,
                                warmup=config.warmup)
    return await run_latency(config, nics[0])


# bench's symmetric parameters: perftest's flags its --help marks SYMMETRIC (-a, -A, -b, -D, -f, -m, -n, -q, -s,
# --run_infinitely), and -t
BENCH = Perftest(BENCH_OUTPUTS, BenchConfig.from_args, run_bench, _bench_as_client, format_table, _bench_printed,
                 perftest_report, _bench_number,
                 ("test", "size", "sizes", "atomic_type", "bidirectional", "duration", "margin", "mtu", "iters", "qps",
                  "depth", "run_infinitely"))
LAT = Perftest(LAT_OUTPUTS, LatConfig.from_args, run_latency, _lat_as_client, format_latency_table,
               format_latency_table, perftest_latency_report, _lat_number, ("test", "size", "mtu"))


def symmetric(config: BenchConfig | LatConfig, tool: Perftest) -> dict[str, Any]:
    """The parameters of `config` both sides of a --server run must share, as JSON values."""
    return {name: getattr(config, name) for name in tool.expect}


def add_bench(sub: Subcommands) -> None:
    bench = sub.add_parser("bench", help="perftest-style RDMA benchmark between emulated NICs, bytes verified "
                                         "(ib_*_bw; perftest's flags work)")
    bench.add_argument("test", choices=TESTS)
    bench.add_argument("server_host", nargs="?", metavar="SERVER_HOST",
                       help="run as perftest's client: the server side is `aiofabric bench --server` on this host")
    add_perftest_flags(bench, "bench")
    group = _add_two_host_flags(bench)
    group.add_argument("--min-size", type=size, help="sweep from this size (default 2; implies a sweep, of about a "
                                                      "second per size without -n)")
    group.add_argument("--max-size", type=size, help="sweep up to this size (default 8M; implies a sweep, of about a "
                                                      "second per size without -n)")
    group.add_argument("--factor", type=int, default=2, help="sweep step: each size is the last times this (2)")
    group.add_argument("--nics", type=int, default=2, help="emulated NICs, paired up (default 2)")
    add_wire_flags(group)
    _add_emulator_flag(group, shared=False)
    group.add_argument("--inject-fault", metavar="KIND[:N[:OFFSET]]",
                       help="make the server NICs misbehave, to see verification fail: skip_placement (ACK the next "
                            "N writes without placing them) or misplace (place them OFFSET bytes off; default 64)")
    _add_peer_flags(group)
    add_server_limits(bench)
    group.add_argument("--json", action="store_true", help="print one JSON object")
    group.add_argument("--plot", metavar="PNG", help="plot bandwidth and message rate against size (a sweep; needs "
                                                     "the plot extra: pip install 'aiofabric[plot]')")
    bench.set_defaults(run=cmd_bench, check=_check_bench(bench))


def add_lat(sub: Subcommands) -> None:
    lat = sub.add_parser("lat", help="perftest-style latency: a ping-pong between two emulated NICs, or on one PCI NIC "
                                     "in PHY loopback (ib_*_lat; perftest's flags work)")
    lat.add_argument("test", choices=TESTS)
    lat.add_argument("server_host", nargs="?", metavar="SERVER_HOST",
                     help="run as perftest's client: the server side is `aiofabric lat --server` on this host (with "
                          "the same test, -s and -m)")
    add_perftest_flags(lat, "lat")
    group = _add_two_host_flags(lat)
    group.add_argument("--warmup", type=int, default=WARMUP,
                       help=f"iterations run first and not measured (default {WARMUP})")
    group.add_argument("--histogram", action="store_true",
                       help="print an ASCII histogram of the samples after the table (perftest's -H lists them)")
    add_wire_flags(group)
    _add_emulator_flag(group, shared=True)
    _add_peer_flags(group)
    add_server_limits(lat)
    group.add_argument("--json", action="store_true", help="print one JSON object")
    group.add_argument("--plot", metavar="PNG", help="plot the latency distribution with perftest's figures marked "
                                                     "(with -a: each figure against size); needs the plot extra: "
                                                     "pip install 'aiofabric[plot]'")
    lat.set_defaults(run=cmd_lat, check=_check_lat(lat))


def _add_two_host_flags(parser: argparse.ArgumentParser) -> Any:
    """bench's and lat's own options group, starting with perftest's server mode and the local NIC's address."""
    group = parser.add_argument_group("aiofabric's options")
    group.add_argument("--server", action="store_true", help="run as perftest's server: wait for a client over TCP")
    group.add_argument("--forever", action="store_true", help="with --server: serve one client after another")
    group.add_argument("--bind", default="0.0.0.0", help="with --server: the address to listen on (default all)")
    group.add_argument("--ip", type=ipv4, help="NIC 0's IPv4 address (emulated: each picks a free 127.0.0.x; "
                                               "SERVER_HOST: the address that reaches the server; --server: the "
                                               "address the client reached)")
    return group


def _add_peer_flags(group: Any) -> None:
    """The server side on another host over SSH (--peer), and how to reach it."""
    group.add_argument("--peer", metavar="HOST", help="run the server side on [user@]HOST[:port], started over SSH "
                                                     "(one NIC here, one there)")
    group.add_argument("--remote-nic", help="with --peer: the NIC there (default sim)")
    group.add_argument("--remote-ip", type=ipv4_or_ssh,
                       help="with --peer: its IPv4 address ('ssh': the address SSH reached)")
    add_ssh_flags(group, short_port=True)


def _add_emulator_flag(group: Any, shared: bool) -> None:
    """Whether this host's emulated NICs share one emulator process (bench: no, for parallel NICs; lat: yes, so a
    packet between them costs no process wake-up; see docs/emulator.md)."""
    group.add_argument("--shared-emulator", action=argparse.BooleanOptionalAction, default=shared,
                       help="run this host's emulated NICs in one emulator process: a packet between them wakes no "
                            "other process, but they share its CPU time (default: "
                            f"{'yes, for latency' if shared else 'no, a process per NIC runs them in parallel'})")


def _check_bench(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        if args.all or args.min_size is not None or args.max_size is not None:
            try:
                args.sizes = sweep(args.min_size or SWEEP_MIN, args.max_size or SWEEP_MAX, args.factor)
            except ValueError as exc:
                parser.error(str(exc))
        _check_modes(parser, args)
        _perftest_common(parser, args, args.min_size is not None or args.max_size is not None, BENCH)
        if args.plot and not getattr(args, "sizes", None):
            parser.error("--plot draws a sweep: add -a or --min-size/--max-size")
        if args.plot and (unplottable := plot.check_path(args.plot)):
            parser.error(unplottable)
        if args.run_infinitely:
            if getattr(args, "sizes", None):
                parser.error("--run-infinitely runs one size: drop the sweep")
            args.duration = args.duration or 5.0
        if args.output is not None and (getattr(args, "sizes", None) or args.run_infinitely):
            parser.error("--output prints one number: it goes with one size, not a sweep or --run-infinitely")
        _checked(parser, args, BENCH.config(args))
    return check


def _check_lat(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        _check_modes(parser, args)
        if args.server_host is not None and not args.nic.startswith("sim") and args.ip is None:
            parser.error(f"--nic {args.nic}: give the NIC's address with --ip (the server's QP talks to it)")
        args.sizes = sweep(SWEEP_MIN, SWEEP_MAX) if args.all else None
        _perftest_common(parser, args, False, LAT)
        if args.output is not None and args.all:
            parser.error("--output prints one number: it goes with one size, not a sweep (-a)")
        unplottable = plot.check_path(args.plot) if args.plot else None
        if unplottable:
            parser.error(unplottable)
        if args.cycles:
            try:
                args.cpu_mhz = cpu_mhz()
            except ValueError as exc:
                parser.error(f"-C/--report-cycles: {exc}")
        _checked(parser, args, LAT.config(args))
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


def _perftest_common(parser: argparse.ArgumentParser, args: argparse.Namespace, timed_sweep: bool, tool: Perftest
                     ) -> None:
    """What bench and lat check alike: -A with the atomic test only, --output's choice, perftest's defaults of -n
    (`timed_sweep`, bench's --min-size/--max-size without -n: about SWEEP_SECONDS per size) and -I, --out_json's
    file."""
    if args.atomic_type is not None and args.test != "atomic":
        parser.error(f"-A/--atomic_type {args.atomic_type}: goes with the atomic test, not {args.test}")
    if args.test == "atomic":  # perftest's ib_atomic_*: FETCH_AND_ADD of 8-byte words unless told otherwise
        args.atomic_type = args.atomic_type or "FETCH_AND_ADD"
        if "size" not in args.typed:
            args.size = ATOMIC_SIZE
    if args.output is not None and args.output not in tool.outputs:
        parser.error(f"--output {args.output}: {args.command} reports {' or '.join(tool.outputs)}")
    if args.output is not None and args.json:
        parser.error("--output prints one number, --json one object: choose one")
    if args.iters is None:
        args.iters = default_iters(args.command, args.test)
        args.sweep_seconds = SWEEP_SECONDS if timed_sweep else None
    if args.inline_size is None:
        args.inline_size = default_inline(args.command, args.test)
    if args.out_json and args.json_file is None:
        args.json_file = DEFAULT_JSON_FILE


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace, config: BenchConfig | LatConfig) -> None:
    """config.check(), its BadOption a usage error under the spelling typed."""
    try:
        config.check()
    except BadOption as exc:
        parser.error(usage_message(exc, args.typed))


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
    result = await _perftest_command(args, BENCH)
    if args.plot:  # (--server refuses --plot)
        plot.plot_runs([result], args.plot, report_gbits=args.report_gbits)
    return result


async def cmd_lat(args: argparse.Namespace) -> dict[str, Any]:
    measured: dict[int, list[float]] = {}  # each size's samples, for --plot (--server refuses it)
    if args.plot:
        plot.require()  # before the run, not after it
        args.sampled = measured.__setitem__  # LatConfig.sampled
    result = await _perftest_command(args, LAT)
    if args.plot and measured:  # a run that failed before a size finished has nothing to draw, and its error stands
        mhz = getattr(args, "cpu_mhz", None)
        lat_plot.draw(lat_plot.distributions(measured, mhz or 1.0), args.plot, "cycles" if mhz else "usec",
                      f"aiofabric lat {args.test}")
    return result


async def _perftest_command(args: argparse.Namespace, tool: Perftest) -> dict[str, Any]:
    """bench's and lat's body: serve (--server), or run where asked, then print --output's one number or the table
    (none with --json) and write --out_json's file with perftest's keys (`report`) besides ours."""
    config = tool.config(args)
    config.progress = not args.json and args.output is None and sys.stderr.isatty()
    if args.server:
        return await serve(args, config, tool.table, symmetric(config, tool))
    result = await _run_where_asked(args, config, tool)
    if args.output is not None and "error" not in result:
        print(tool.number(result, config, args.output))
    elif not args.json:
        print(tool.printed(result, config))
    if args.json_file:
        with open(args.json_file, "w") as file:
            report = {**result, **tool.report(result, config, args.output)}
            json.dump(stamped("error" not in result, args.meta, report), file, indent=1)
    return result


async def _run_where_asked(args: argparse.Namespace, config: BenchConfig | LatConfig, tool: Perftest
                           ) -> dict[str, Any]:
    """The run here, as perftest's client of a SERVER_HOST, or with the server side on --peer's host over SSH."""
    if args.server_host is not None:  # perftest's client: the server side is `aiofabric <command> --server` there
        return await client(args, config, tool.run_as_client)
    if args.peer is None:
        return await tool.run(config)
    from ...peer.client import parse_host
    from ...peer.ssh import connect_peer
    config.check()  # before any SSH connection
    user, host, port = parse_host(args.peer, args.port or SSH_PORT)
    async with connect_peer(host, port, user=user or args.user, **ssh_options(args)) as peer:
        config.remote = peer
        return await tool.run(config)
